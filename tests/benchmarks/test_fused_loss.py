"""benchmarks/fused_loss.py on CPU with a one-layer pythia-14m: its rows run and reach eager's loss; fulmen's row
fuses the lm_head with the loss and the unfused row does not."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fused_loss.py"


def test_fused_loss_benchmark_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("benchmarks_fused_loss", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    on_path = str(SCRIPT.parent) in sys.path
    spec.loader.exec_module(module)
    out = tmp_path / "fused_loss.json"
    argv = "--device cpu --dtype fp32 --model_name pythia-14m --n_layer 1 --seq_len 32 --micro_batch_size 2"
    argv += f" --iters 2 --warmup 1 --cap_gb 0 --compilers eager,fulmen,fulmen-unfused,fulmen-budget-0.5 --out {out}"
    try:
        module.main(argv.split())
    finally:
        if not on_path:  # the script puts benchmarks/ on the path to import step.py
            sys.path.remove(str(SCRIPT.parent))
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"eager", "fulmen", "fulmen-unfused", "fulmen-budget-0.5"}
    for name, result in results.items():
        assert result["status"] == "ok", (name, result)
        assert math.isclose(result["final_loss"], results["eager"]["final_loss"], rel_tol=1e-4), name
    assert any(t.startswith("Fused linear + cross-entropy: fused at step.py") for t in results["fulmen"]["traces"])
    assert not any(t.startswith("Fused linear") for t in results["fulmen-unfused"]["traces"])
