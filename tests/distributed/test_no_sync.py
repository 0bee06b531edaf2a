"""Gradient accumulation under no_sync against torch's DDP and single-process eager on the same data: the local
gradients of replicated parameters are in `.grad` as torch's DDP keeps them, so `zero_grad()` between micro-batches
discards them; uneven micro-batches accumulate to the single-process gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import fulmen
import fulmen.distributed as fd
from fulmen.distributed import checkpoint
from tests.distributed.launch import run_ranks, values


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _batch(rank: int, micro: int, rows: int = 3) -> torch.Tensor:
    return torch.randn(rows, 5, generator=torch.Generator().manual_seed(10 * rank + micro))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def _discarded_accumulation(rank: int, world: int) -> dict[str, dict]:
    """A no_sync micro-batch, then zero_grad (a skipped step), then a synced one: with fulmen and torch's DDP."""
    torch_ddp = DistributedDataParallel(_model())
    model = fd.ddp(_model())
    jitted = fulmen.jit(model)
    with torch_ddp.no_sync():
        torch_ddp(_batch(rank, 0)).sum().backward()
    with fd.no_sync(jitted):
        jitted(_batch(rank, 0)).sum().backward()
    local = {"torch": _grads(torch_ddp.module), "fulmen": _grads(model)}
    torch_ddp.zero_grad()
    model.zero_grad()
    torch_ddp(_batch(rank, 1)).sum().backward()
    jitted(_batch(rank, 1)).sum().backward()
    return {"local": local, "synced": {"torch": _grads(torch_ddp.module), "fulmen": _grads(model)}}


def test_zero_grad_after_no_sync_discards_the_local_gradients_as_torch_ddp():
    single = _model()  # the oracle: the synced micro-batch alone, averaged over the ranks
    for rank in range(2):
        (single(_batch(rank, 1)).sum() / 2).backward()
    for result in values(run_ranks(_discarded_accumulation, 2)):
        for name, want in _grads(single).items():
            torch.testing.assert_close(result["local"]["fulmen"][name], result["local"]["torch"][name], msg=name)
            torch.testing.assert_close(result["synced"]["torch"][name], want, msg=name)
            torch.testing.assert_close(result["synced"]["fulmen"][name], want, msg=name)


def _uneven_accumulation(rank: int, world: int, mode: str) -> dict[str, torch.Tensor]:
    """3 micro-batches per step of 2, 3, 4 rows (plus the rank): each micro-batch's mean loss over 3, for 3 SGD
    steps with momentum."""
    model = _model()
    if mode == "ddp":
        fd.ddp(model)
    else:
        fd.fsdp(model, sharding_strategy=mode)
    jitted = fulmen.jit(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        for micro in range(3):
            with fd.no_sync(jitted) if micro < 2 else torch.enable_grad():
                (jitted(_batch(rank, 3 * step + micro, 2 + micro + rank)).square().mean() / 3).backward()
        optimizer.step()
        optimizer.zero_grad()
    return checkpoint.get_model_state_dict(jitted, checkpoint.FULL)


@pytest.mark.parametrize("mode", ["ddp", "zero2", "zero3"])
def test_uneven_micro_batches_accumulate_to_the_single_process_training(mode):
    single = _model()
    optimizer = torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        for rank in range(2):
            for micro in range(3):
                (single(_batch(rank, 3 * step + micro, 2 + micro + rank)).square().mean() / 6).backward()
        optimizer.step()
        optimizer.zero_grad()
    got = values(run_ranks(_uneven_accumulation, 2, mode))[0]
    for name, want in copy.deepcopy(single).state_dict().items():
        torch.testing.assert_close(got[name], want, msg=name)
