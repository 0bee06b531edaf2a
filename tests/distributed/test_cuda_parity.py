"""DDP and FSDP ZeRO-3 BLOCK with NCCL on 2 GPUs, bf16, against single-GPU eager on the same global batch."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import workers
from tests.distributed.launch import run_ranks, values
from tests.distributed.workers import Setup

pytestmark = pytest.mark.cuda

SETUPS = [Setup(mode, accumulate, clip, device="cuda", dtype=torch.bfloat16)
          for mode in ("ddp", "zero3-block") for accumulate, clip in ((1, False), (2, False), (1, True))]


def _suite(rank: int, world: int, setups: list[Setup]) -> dict:
    return {setup.name: workers.train(rank, world, setup) for setup in setups}


@pytest.fixture(scope="module")
def suite() -> dict:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    return values(run_ranks(_suite, 2, SETUPS, backend="nccl", timeout=900))[0]


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: s.name)
def test_nccl_bf16_training_matches_eager(suite, setup):
    got, want = suite[setup.name], workers.eager_training(setup)
    # bf16 (8 bits of mantissa): ranks sum the batch in another order than one GPU does, so values agree to a
    # few bf16 ulps, not bitwise
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-2, atol=0)
    worst = 0.0
    for name, value in want["params"].items():
        assert got["params"][name].dtype == torch.bfloat16
        diff = (got["params"][name].float() - value.float()).abs().max().item()
        worst = max(worst, diff / max(value.float().abs().max().item(), 1e-3))
    print(f"{setup.name}: losses {got['losses']} vs {want['losses']}, worst param diff / max |param| {worst:.2e}")
    assert worst < 2e-2
    if setup.clip:
        torch.testing.assert_close(got["norms"], want["norms"], rtol=2e-2, atol=0)
    counts = got["traces"]["backward"]
    if setup.mode == "ddp":
        assert counts == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 1}
    else:
        assert counts["reduce_scatter"] == workers.CONFIG["n_layer"] + 3 and counts["all_gather"] > 0
