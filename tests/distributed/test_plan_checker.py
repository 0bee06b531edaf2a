"""The gloo group `dist.check_plan` runs on under a backend other than gloo (NCCL): made with the distributed state,
with the process group's own timeout, and shut down when the state goes away."""

from __future__ import annotations

import gc
import time

import torch

import fulmen
import fulmen.distributed as fd
from fulmen.distributed import prims as dist_prims
from tests.distributed.launch import run_ranks, values


def _host_checked(net: torch.nn.Module) -> torch.nn.Module:
    """`net` under ddp, its plan checked on a gloo group of its own (what a group of another backend gets)."""
    model = fd.ddp(net)
    state = fd.distributed_state(model)
    state.checker = dist_prims.make_checker(state, state.group, host=True)
    return model


def _late_rank(rank: int, world: int) -> dict[str, object]:
    jitted = fulmen.jit(_host_checked(torch.nn.Linear(4, 3)))
    x = torch.randn(2, 4)
    jitted(x).sum().backward()  # compiled, and the checker connected
    loss = jitted(x).sum()
    if rank == 1:
        time.sleep(8)  # longer than the group's timeout (3 s), far shorter than torch's default (30 min)
    start = time.perf_counter()
    try:
        loss.backward()
    except RuntimeError as error:
        return {"error": str(error), "seconds": time.perf_counter() - start}
    return {"error": None, "seconds": time.perf_counter() - start}


def test_the_host_checker_times_out_with_the_group():
    result = run_ranks(_late_rank, 2, pg_timeout=3, timeout=120)[0]
    assert result.error is None, result.traceback
    assert result.value["error"] is not None, result.value  # waited for the late rank: torch's default timeout
    assert result.value["seconds"] < 7, result.value


def _released(rank: int, world: int) -> dict[str, object]:
    model = _host_checked(torch.nn.Linear(4, 3))
    own = fd.distributed_state(fd.ddp(torch.nn.Linear(4, 3)))  # a gloo group checks on itself
    jitted = fulmen.jit(model)
    jitted(torch.randn(2, 4)).sum().backward()
    name = fd.distributed_state(model).checker
    registered = name in dist_prims.GROUPS and name != own.group_name
    del model, jitted
    gc.collect()
    return {"registered": registered, "released": name not in dist_prims.GROUPS,
            "own": own.checker == own.group_name}


def test_the_host_checker_is_released_with_its_state():
    for result in values(run_ranks(_released, 2)):
        assert result == {"registered": True, "released": True, "own": True}
