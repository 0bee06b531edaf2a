"""benchmarks/offload.py on CPU with a one-layer pythia-14m: every row runs and agrees with eager (offloading is a
no-op on CPU tensors, and the memory-cap search needs CUDA)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "offload.py"


def test_offload_benchmark_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("benchmarks_offload", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("benchmarks_offload", module)
    spec.loader.exec_module(module)
    out = tmp_path / "offload.json"
    argv = "--device cpu --dtype fp32 --model_name pythia-14m --n_layer 1 --seq_len 16 --micro_batch_size 2"
    module.main((argv + f" --iters 1 --warmup 0 --fractions 1.0 --out {out}").split())
    report = json.loads(out.read_text())
    results = report["results"]
    assert set(results) == {"eager", "fulmen", "fulmen+offload=1"}
    assert all(r["status"] == "ok" for r in results.values()), results
    assert results["fulmen+offload=1"]["max_abs_loss_diff_vs_fulmen"] == 0.0
    assert results["fulmen+offload=1"]["offloaded_gb"] == 0.0 < results["fulmen"]["saved_gb"]  # CPU: nothing moves
    for row in ("fulmen", "fulmen+offload=1"):
        assert math.isclose(results[row]["losses"][-1], results["eager"]["losses"][-1], rel_tol=1e-4)
    assert report["memory_cap"] == {"skipped": "the memory cap needs a CUDA device"}
