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


def _jitted(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """`model` distributed by "ddp", or by fsdp with that sharding strategy, and jitted."""
    if mode == "ddp":
        fd.ddp(model)
    else:
        fd.fsdp(model, sharding_strategy=mode)
    return fulmen.jit(model)


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
    jitted = _jitted(model, mode)
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


class _TwoBranches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(5, 4)
        self.b = torch.nn.Linear(5, 4)
        self.c = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, use_b: bool, keep_a: bool = False) -> torch.Tensor:
        out = self.c(torch.tanh(self.b(x) if use_b else self.a(x))).sum()
        return out + 0 * (self.a.weight.sum() + self.a.bias.sum()) if keep_a else out


def _left_out_of_the_synced_micro_batch(rank: int, world: int, mode: str, use_a: bool) -> object:
    """The no_sync micro-batch uses `a`, the synced one `b` (`use_a`: and `a` as `0 * a.sum()`, in the program)."""
    model = _TwoBranches()
    jitted = _jitted(model, mode)
    with fd.no_sync(jitted):
        jitted(_batch(rank, 0), False).backward()
    try:
        jitted(_batch(rank, 1), True, use_a).backward()
    except RuntimeError as error:
        return str(error)
    return {name: checkpoint._gather(p.grad, spec) if (spec := checkpoint._sharded_spec(p)) else p.grad
            for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["ddp", "zero2", "zero3"])
def test_gradients_the_synced_micro_batch_leaves_out_are_refused_not_lost(mode):
    for error in values(run_ranks(_left_out_of_the_synced_micro_batch, 2, mode, False)):
        assert isinstance(error, str) and error.startswith(
            "the gradients of a.bias, a.weight were accumulated under no_sync, but the forward run outside no_sync "
            "does not use these parameters, so no synced backward reduces them and they would be lost"), error
    single = _TwoBranches()  # what the workaround the error names gives: single-process eager's gradients
    for rank in range(2):
        for micro, use_b in ((0, False), (1, True)):
            (single(_batch(rank, micro), use_b) / 2).backward()
    for grads in values(run_ranks(_left_out_of_the_synced_micro_batch, 2, mode, True)):
        for name, p in single.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=name)


def _older_gradient_left_alone(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Gradients never zeroed: `b` has one from a synced step, then micro-batches through `a` only."""
    model = fd.ddp(_TwoBranches())
    jitted = fulmen.jit(model)
    jitted(_batch(rank, 0), True).backward()
    with fd.no_sync(jitted):
        jitted(_batch(rank, 1), False).backward()
    jitted(_batch(rank, 2), False).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_an_older_gradient_of_a_parameter_the_micro_batches_leave_out_is_not_refused():
    single = _TwoBranches()
    for rank in range(2):
        for micro, use_b in ((0, True), (1, False), (2, False)):
            (single(_batch(rank, micro), use_b) / 2).backward()
    for grads in values(run_ranks(_older_gradient_left_alone, 2)):
        for name, p in single.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=name)
