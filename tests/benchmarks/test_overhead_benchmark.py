"""benchmarks/overhead.py's deep, thin rows (issue 50) at 2 layers: every candidate runs, fulmen's outputs and grads
equal eager's, the breakdown and call counts are filled in, and the variable-length benchmark runs on CPU too."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(f"benchmarks_{name}", module)
    spec.loader.exec_module(module)
    return module


def test_deep_rows_run_and_fulmen_agrees_with_eager():
    report = _load("overhead").deep_rows(2, ("eager", "fulmen"), number=1, repeats=1, profiled=1)
    assert report["agrees_with_eager"] == {"fulmen": {"output_equal": True, "grads_equal": True}}
    assert set(report["ms_per_call"]) == {"forward", "forward+backward"}
    assert all(set(r) == {"eager", "fulmen"} for r in report["ms_per_call"].values())
    assert sum(report["fulmen_host_breakdown_ms"].values()) > 0
    calls = report["python_calls"]
    assert calls["fulmen backward"]["python_frames"] > 0 and report["fulmen_trace_calls"]["backward"] > 0


def test_variable_lengths_rows_on_cpu(tmp_path):
    out = tmp_path / "vl.json"
    argv = ("--device cpu --dtype fp32 --model_name pythia-14m --n_layer 1 --micro_batch_size 2 --lengths 16:40:3 "
            f"--compilers eager,fulmen,fulmen-static --out {out}")
    _load("variable_lengths").main(argv.split())
    report = json.loads(out.read_text())
    results = report["results"]
    assert all(r["status"] == "ok" for r in results.values()), results
    assert results["fulmen"]["traces"] == 2 and results["fulmen-static"]["traces"] == 3
    assert len(report["schedule"]) == 6 and sorted(set(report["schedule"])) == report["lengths"] == [16, 32, 40]
    for name in ("fulmen", "fulmen-static"):  # the same batches: losses agree with eager's to rounding
        for got, want in zip(results[name]["losses"], results["eager"]["losses"]):
            assert abs(got - want) <= 1e-4 * abs(want)
