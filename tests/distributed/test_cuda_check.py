"""`dist.check_plan` under NCCL does not wait for the device: its digests meet on the host (a gloo group of the same
ranks), so a jitted step returns while the GPU still works through what was queued before it, as eager's does. Read
back from a device all_reduce (what it did before, and what it still does when gloo is missing), every forward and
backward waited for the whole queue."""

from __future__ import annotations

import time

import pytest
import torch

import fulmen
import fulmen.distributed as fd
from tests.distributed import workers
from tests.distributed.launch import run_ranks, values

pytestmark = pytest.mark.cuda

BUSY_CYCLES = 2_000_000_000  # about a second of one GPU's clock


def _host_seconds(jitted: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """How long the host takes to issue a forward and a backward behind a second of queued device work, and how long
    until the device is done."""
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    start = time.perf_counter()
    loss = workers.loss_fn(jitted, x, y)
    forward = time.perf_counter() - start
    loss.backward()
    backward = time.perf_counter() - start
    torch.cuda.synchronize()
    return {"forward": forward, "backward": backward, "device": time.perf_counter() - start}


def _issue_times(rank: int, world: int, mode: str) -> dict[str, dict[str, float]]:
    device = torch.device("cuda", rank)
    x, y = workers.global_batches(world, 1)[0]
    rows = slice(rank * workers.MICRO, (rank + 1) * workers.MICRO)
    x, y = x[rows].to(device), y[rows].to(device)
    results = {}
    for where in ("host", "device"):
        model = workers.distribute(workers.make_model(device=device), mode)
        if where == "device":  # the check on the device, read back on the host (what runs where gloo is missing)
            fd.distributed_state(model).checker = None
        jitted = fulmen.jit(model)
        for _ in range(2):  # compiled and warm
            workers.loss_fn(jitted, x, y).backward()
        results[where] = _host_seconds(jitted, x, y)
    return results


@pytest.mark.parametrize("mode", ["ddp", "zero3-block"])
def test_the_plan_check_does_not_wait_for_the_device(mode):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    world = min(2, torch.cuda.device_count())
    for result in values(run_ranks(_issue_times, world, mode, backend="nccl", timeout=600)):
        host, device = result["host"], result["device"]
        print(f"{mode}: host check {host}, device check {device}")
        assert host["device"] > 0.3  # the queued work really was long
        assert host["backward"] < host["device"] / 3, host  # the host ran ahead through forward and backward
        assert device["backward"] > device["device"] * 0.9, device  # (what the test tells apart: the old check waited)
