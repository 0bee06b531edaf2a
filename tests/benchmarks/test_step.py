"""benchmarks/step.py on CPU with a one-layer pythia-14m: eager and fulmen both run and reach the same loss."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

STEP = Path(__file__).resolve().parents[2] / "benchmarks" / "step.py"


def _load_step():
    spec = importlib.util.spec_from_file_location("benchmarks_step", STEP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_benchmark_smoke(tmp_path):
    out = tmp_path / "step.json"
    argv = "--device cpu --dtype fp32 --model_name pythia-14m --n_layer 1 --seq_len 32 --micro_batch_size 2"
    argv += f" --iters 2 --warmup 1 --compilers eager,fulmen,fulmen+unsloth --out {out}"
    _load_step().main(argv.split())
    report = json.loads(out.read_text())
    results = report["results"]
    assert set(results) == {"eager", "fulmen", "fulmen+unsloth"}
    for name, result in results.items():
        assert result["status"] == "ok", (name, result)
        assert result["ms_per_iter"] > 0 and len(result["iter_ms"]) == 2
        assert result["peak_gb"] is None and result["mfu"] is None  # CPU
        assert result["params_with_grad"][0] == result["params_with_grad"][1]
    assert results["fulmen"]["mode"] == "function"  # the cross-entropy was in fulmen's trace
    # same init, same batch, same optimizer: the losses after four AdamW steps agree
    for name in ("fulmen", "fulmen+unsloth"):  # the unsloth kernels run under Triton's interpreter without a GPU
        assert math.isclose(results[name]["final_loss"], results["eager"]["final_loss"], rel_tol=1e-4), name
    assert results["eager"]["final_loss"] < results["eager"]["first_loss"]  # the steps trained
    ratios = report["ratios_vs_eager"]
    assert set(ratios) == set(results) and ratios["eager"]["ms_per_iter"] == 1.0
    for name, ratio in ratios.items():  # each row's time over the baseline's
        assert ratio["ms_per_iter"] == results[name]["ms_per_iter"] / results["eager"]["ms_per_iter"] > 0
