"""benchmarks/float8.py on CPU (`--tiny`): the step rows run, fulmen's float8 rows convert the linears and reach
eager's loss closely, torchao's rows say why they are skipped without it; the loss-curve mode writes both curves and
a plot."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "float8.py"


def _load():
    spec = importlib.util.spec_from_file_location("benchmarks_float8", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_rows_on_cpu(tmp_path):
    out = tmp_path / "float8.json"
    benchmark = _load()
    benchmark.main(["--tiny", "--compilers", "eager,fulmen,fulmen-tensorwise,fulmen-rowwise", "--out", str(out)])
    report = json.loads(out.read_text())
    results = report["results"]
    assert set(results) == {"eager", "fulmen", "fulmen-tensorwise", "fulmen-rowwise"}
    for name, result in results.items():
        assert result["status"] == "ok", (name, result)
        assert result["ms_per_iter"] > 0 and result["free_running_ms_per_iter"] > 0
    for name in ("fulmen-tensorwise", "fulmen-rowwise"):
        notes = results[name]["float8_matmuls"]
        # pythia-14m's layer: attention qkv and dense, mlp up and down; the head (embed_out) feeds the fused loss
        assert sum(note.startswith("converted transformer.h.0.") for note in notes) == 4, notes
        assert results[name]["final_loss"] != results["eager"]["final_loss"]
        assert math.isclose(results[name]["final_loss"], results["eager"]["final_loss"], rel_tol=1e-2)
    assert report["gpu"] is None and "ratios_vs_fulmen_bf16" in report
    if benchmark.torchao_version() is None:
        skipped = benchmark.benchmark("torchao-tensorwise", None, None, None)
        assert skipped == {"status": "skipped", "reason": "torchao is not installed"}


def test_loss_curves_on_cpu(tmp_path):
    out = tmp_path / "float8_loss.json"
    _load().main(["--tiny", "--steps", "3", "--out", str(out)])
    report = json.loads(out.read_text())
    curves = report["losses"]
    assert list(curves) == ["fulmen without float8", "fulmen float8 tensorwise"]
    assert all(len(losses) == 3 for losses in curves.values())
    assert curves["fulmen without float8"] != curves["fulmen float8 tensorwise"]
    assert abs(report["relative_difference"]) < 0.01
    svg = Path(report["plots"][0]).read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == 2
