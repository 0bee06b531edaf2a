"""fabric.save / fabric.load with the fulmen strategies: model, optimizer, a step count and a stateful object.

Saving after 3 of 5 steps and resuming into a fresh model and optimizer (other weights) gives the uninterrupted
run's next losses exactly, for DDP, FSDP full and FSDP sharded checkpoints. The FSDP checkpoints load at another
world size, and a full one is the checkpoint plain PyTorch reads (`torch.load`, `load_state_dict`). A save that
fails midway leaves the previous checkpoint whole (and nothing partial beside it).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_ranks, values
from tests.distributed.workers import make_model
from tests.strategies import workers
from tests.strategies.workers import RESUME_AT, STEPS, Case

CASES = [
    Case("ddp", "ddp"),
    Case("fsdp-full", "fsdp", options=(("state_dict_type", "full"), ("bucketing_strategy", "block"))),
    Case("fsdp-sharded", "fsdp", options=(("state_dict_type", "sharded"), ("sharding_strategy", "zero2"))),
    Case("fsdp-full-groups", "fsdp", groups=True, options=(("state_dict_type", "full"),)),
    Case("fsdp-sharded-groups", "fsdp", groups=True, options=(("state_dict_type", "sharded"),)),
]


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def resumed(directory) -> dict:
    return values(run_ranks(workers.resume_suite, 2, CASES, str(directory), backend=None, timeout=900))[0]


@pytest.fixture(scope="module")
def uninterrupted() -> list[float]:
    return workers.eager_training(2, "norm")["losses"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_resume_gives_the_uninterrupted_losses(resumed, uninterrupted, case):
    got = resumed[case.name]
    if not case.groups:  # (with param groups and a frozen embedding the training is another one)
        torch.testing.assert_close(got["losses"], uninterrupted, rtol=1e-5, atol=0)
    assert got["step"] == RESUME_AT and got["counter"] == RESUME_AT * 10 and got["remainder"] == {}
    assert got["is_dir"] == ("sharded" in case.name)
    assert got["leftovers"] == []  # nothing partial next to the checkpoint
    # fabric.save(..., filter=) keeps the model entries the filter accepts; fabric.load(path) returns it all
    assert got["filtered"] == {"model": ["lm_head.weight"], "step": STEPS}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_resume_is_bitwise_the_uninterrupted_distributed_run(resumed, case):
    assert resumed[case.name]["losses"] == resumed[case.name]["uninterrupted"]


def test_a_full_checkpoint_is_plain_pytorch(resumed, directory, uninterrupted):
    saved = torch.load(directory / "fsdp-full", weights_only=True)
    model = make_model()
    assert {k: v.shape for k, v in saved["model"].items()} == {k: v.shape for k, v in model.state_dict().items()}
    params = list(model.parameters())
    for index, state in saved["optimizer"]["state"].items():  # whole (gathered) moments, torch's layout
        assert state["exp_avg"].shape == params[index].shape and state["step"].item() == RESUME_AT
    torch.testing.assert_close(workers.eager_resume(directory / "fsdp-full", 2, "norm"), uninterrupted[RESUME_AT:],
                               rtol=1e-5, atol=0)


def test_fsdp_checkpoints_load_at_another_world_size(resumed, directory, uninterrupted):
    fsdp = [case for case in CASES if case.strategy == "fsdp" and not case.groups]
    got = values(run_ranks(workers.load_elsewhere, 1, fsdp, str(directory), backend=None, timeout=600))[0]
    for case in fsdp:
        torch.testing.assert_close(got[case.name]["losses"], uninterrupted[RESUME_AT:STEPS], rtol=1e-5, atol=0)
        assert got[case.name]["step"] == RESUME_AT


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path):
    ranks = values(run_ranks(workers.crash_while_saving, 2, str(tmp_path), backend=None, timeout=600))
    for kind in ("full", "sharded"):
        got = ranks[0][kind]
        for name, value in got["before"].items():
            assert torch.equal(got["after"][name], value), name
        # every rank raises (none is left waiting for the others), naming what went wrong
        assert "disk full (on purpose)" in got["error"]
        assert "disk full (on purpose)" in ranks[1][kind]["error"]
        assert got["beside"] == [kind, f"{kind}.manifest.json"]  # nothing partial left next to it
