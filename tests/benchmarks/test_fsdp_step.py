"""benchmarks/fsdp_step.py on CPU (2 gloo ranks, one-layer pythia-14m): FSDP2, fulmen's FSDP and DDP, directly and
through the Fabric strategies, reach one loss."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_fsdp_step_benchmark_smoke(tmp_path, monkeypatch):
    # imported by name, not from a file location: the spawned ranks unpickle its worker function by module name
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    fsdp_step = importlib.import_module("fsdp_step")
    out = tmp_path / "fsdp_step.json"
    argv = "--device cpu --dtype fp32 --model_name pythia-14m --n_layer 1 --seq_len 32 --micro_batch_size 2"
    rows = "fsdp2,fulmen-fsdp,fulmen-ddp,fabric-ThunderFSDPStrategy,fabric-ThunderDDPStrategy"
    argv += f" --iters 2 --warmup 1 --compilers {rows} --devices 2 --out {out}"
    fsdp_step.main(argv.split())
    report = json.loads(out.read_text())
    results = report["results"]
    assert list(results) == rows.split(",")
    for name, result in results.items():
        assert result["status"] == "ok", (name, result)
        assert result["ms_per_iter"] > 0 and len(result["iter_ms"]) == 2
        assert result["peak_gb"] is None and result["mfu"] is None  # CPU
        assert result["params_with_grad"][0] == result["params_with_grad"][1]
        assert len(result["final_loss_per_rank"]) == 2
    # same init, same per-rank batches, same optimizer: the losses after three AdamW steps agree
    reference = results["fsdp2"]["final_loss"]
    for name in rows.split(",")[1:]:
        assert math.isclose(results[name]["final_loss"], reference, rel_tol=1e-4), (name, results[name], reference)
    assert results["fsdp2"]["final_loss"] < results["fsdp2"]["first_loss"]  # the steps trained
    assert results["fsdp2"]["final_loss_per_rank"][0] != results["fsdp2"]["final_loss_per_rank"][1]  # own batches
    ratios = report["ratios_vs_fsdp2"]
    assert set(ratios) == set(results) and ratios["fsdp2"]["ms_per_iter"] == 1.0
    for name, ratio in ratios.items():  # each row's time over the baseline's
        assert ratio["ms_per_iter"] == results[name]["ms_per_iter"] / results["fsdp2"]["ms_per_iter"] > 0
    assert report["tokens_per_step"] == 2 * 2 * 32
