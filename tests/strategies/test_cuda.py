"""ThunderDDPStrategy and ThunderFSDPStrategy in `L.Fabric(accelerator="cuda", devices=2)` with NCCL and bf16
(bf16-true and bf16-mixed), against single-GPU eager on the same global batches; and save / resume on GPU."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_ranks, values
from tests.strategies import workers
from tests.strategies.workers import Case

pytestmark = pytest.mark.cuda

CASES = [
    Case("ddp-bf16-true", "ddp", precision="bf16-true", accelerator="cuda"),
    Case("fsdp-zero3-block-bf16-true", "fsdp", precision="bf16-true", accelerator="cuda",
         options=(("sharding_strategy", "ZERO3"), ("bucketing_strategy", "BLOCK"))),
    Case("ddp-bf16-mixed-value", "ddp", precision="bf16-mixed", accelerator="cuda", clip="value"),
    Case("fsdp-zero2-bf16-mixed", "fsdp", precision="bf16-mixed", accelerator="cuda",
         options=(("sharding_strategy", "ZERO2"), ("bucketing_strategy", "BLOCK"))),
]
RESUME = [
    Case("fsdp-full-cuda", "fsdp", precision="bf16-true", accelerator="cuda", options=(("state_dict_type", "full"),)),
    Case("fsdp-sharded-cuda", "fsdp", precision="bf16-true", accelerator="cuda",
         options=(("state_dict_type", "sharded"),)),
]


def _needs_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> dict:
    _needs_two_gpus()
    directory = str(tmp_path_factory.mktemp("fabric-cuda"))
    return values(run_ranks(workers.training_suite, 2, CASES, directory, backend=None, timeout=900))[0]


def _relative_norm_diff(got: dict, want: dict) -> float:
    diff_sq = sum((got[k].float() - v.float()).square().sum().item() for k, v in want.items())
    norm_sq = sum(v.float().square().sum().item() for v in want.values())
    return (diff_sq / norm_sq) ** 0.5


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_nccl_bf16_training_matches_eager(suite, case):
    got = suite[case.name]
    want = workers.eager_training(case.accumulate, case.clip, device="cuda", precision=case.precision)
    # The yardstick for parameters is eager itself, summing the batch in 4 chunks (another order, as the ranks do).
    floor = _relative_norm_diff(workers.eager_training(case.accumulate, case.clip, device="cuda",
                                                       precision=case.precision, chunks=4)["params"], want["params"])
    diff = _relative_norm_diff(got["params"], want["params"])
    print(f"\n{case.name}: losses {[round(v, 4) for v in got['losses']]} vs eager "
          f"{[round(v, 4) for v in want['losses']]}; params: relative norm diff {diff:.2e} (eager reordered "
          f"{floor:.2e}); clip norms {[round(v, 4) for v in got['norms']]} vs {[round(v, 4) for v in want['norms']]}")
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-2, atol=0)
    assert diff <= 3 * max(floor, 1e-4)
    if case.clip == "norm":
        torch.testing.assert_close(got["norms"], want["norms"], rtol=2e-2, atol=0)
    kind = torch.bfloat16 if case.precision == "bf16-true" else torch.float32
    assert all(value.dtype == kind for value in got["params"].values() if value.is_floating_point())
    assert got["collectives"]["all_gather"] == [[0, 0], [1, 10]] and got["collectives"]["all_reduce_sum"] == 3.0
    if case.strategy == "ddp":
        assert got["backward"]["all_reduce"] >= 1 and got["forward"]["all_gather"] == 0
    else:
        assert got["forward"]["all_gather"] >= 1 and got["backward"]["reduce_scatter"] >= 1


def test_save_and_resume_on_gpu(tmp_path):
    _needs_two_gpus()
    got = values(run_ranks(workers.resume_suite, 2, RESUME, str(tmp_path), backend=None, timeout=900))[0]
    for case in RESUME:
        # not bitwise as on CPU: CUDA's attention backward may accumulate in a different order from run to run
        torch.testing.assert_close(got[case.name]["losses"], got[case.name]["uninterrupted"], rtol=1e-4, atol=0)
        assert got[case.name]["step"] == workers.RESUME_AT
