"""A distributed parameter whose gradient gets a term computed outside the jitted program: torch's DDP reduces the
total gradient (its hooks sit on the parameters' accumulators), fulmen reduces inside the program's backward only, so
the outside term would stay local to each rank and the ranks' weights would drift apart. It is refused, naming the
parameter; the same term computed inside a jitted function gives torch's gradients. Programs that legitimately share
a parameter in one backward (two calls of the model, no_sync micro-batches) are not refused."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import fulmen
import fulmen.distributed as fd
from fulmen.distributed import checkpoint, transform
from tests.distributed.launch import run_ranks, values


class _Net(torch.nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(5, 4)
        self.head = torch.nn.Linear(4, 3)
        if extra:  # never read by forward
            self.extra = torch.nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.a(x)))


def _batch(rank: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(3, 5, generator=torch.Generator().manual_seed(10 * rank + micro))


def _outside(net: torch.nn.Module, which: str, rank: int) -> torch.Tensor:
    """A rank-dependent regulariser of one parameter (rank-dependent so that an unreduced gradient shows)."""
    param = net.extra if which == "extra" else net.head.weight
    return param.pow(2).sum() * (rank + 1)


def _distribute(net: torch.nn.Module, mode: str) -> torch.nn.Module:
    return fd.ddp(net) if mode == "ddp" else fd.fsdp(net, sharding_strategy=mode)


def _full_grads(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (checkpoint._gather(p.grad, spec) if (spec := checkpoint._sharded_spec(p)) else p.grad).clone()
            for name, p in net.named_parameters() if p.grad is not None}


def _refused(net: torch.nn.Module, which: str, rank: int) -> str | None:
    """The error of a backward through the jitted `net` plus a term `_outside` it."""
    jitted = fulmen.jit(net)
    try:
        (jitted(_batch(rank)).sum() + _outside(net, which, rank)).backward()
    except RuntimeError as error:
        return str(error)
    return None


def _outside_terms(rank: int, world: int, mode: str) -> dict[str, object]:
    results: dict[str, object] = {}
    for which in ("head", "extra"):
        results[f"{which} outside"] = _refused(_distribute(_Net(which == "extra"), mode), which, rank)
    # the workaround the error names: the term inside a jitted function
    net = _distribute(_Net(), mode)
    loss = fulmen.jit(lambda x: net(x).sum() + _outside(net, "head", rank))
    loss(_batch(rank)).backward()
    results["inside"] = _full_grads(net)
    if mode == "ddp":  # the oracle itself, where the term is outside
        torch_ddp = DistributedDataParallel(_Net())
        (torch_ddp(_batch(rank)).sum() + _outside(torch_ddp.module, "head", rank)).backward()
        results["torch"] = _full_grads(torch_ddp.module)
    return results


@pytest.mark.parametrize("mode", ["ddp", "zero2", "zero3"])
def test_a_gradient_computed_outside_the_program_is_refused(mode):
    single = _Net()  # single-process eager on the ranks' losses, averaged: what torch's DDP gives
    for rank in range(2):
        ((single(_batch(rank)).sum() + _outside(single, "head", rank)) / 2).backward()
    kind = "ddp" if mode == "ddp" else "fsdp"
    for result in values(run_ranks(_outside_terms, 2, mode)):
        assert result["head outside"] is not None and result["head outside"].startswith(
            f"the gradient of head.weight (distributed by fulmen.distributed.{kind}) has a part computed outside the "
            "jitted program beside the gradient the jitted program computes"), result["head outside"]
        assert result["extra outside"] is not None and result["extra outside"].startswith(
            f"the gradient of extra (distributed by fulmen.distributed.{kind}) has a part computed outside the jitted "
            "program and the jitted program computes none"), result["extra outside"]
        if mode != "ddp":
            assert "holds only this rank's shard (shape (2, 4) of (3, 4))" in result["head outside"]
        for name, p in single.named_parameters():
            torch.testing.assert_close(result["inside"][name], p.grad, msg=name)
            if mode == "ddp":
                torch.testing.assert_close(result["torch"][name], p.grad, msg=name)


def _shared_in_one_backward(rank: int, world: int, mode: str) -> dict[str, dict[str, torch.Tensor]]:
    """Two calls of the model in one backward, then a no_sync micro-batch with a term outside (replicated
    parameters accumulate it locally and the synced backward reduces it from .grad, as torch's DDP does)."""
    net = _distribute(_Net(), mode)
    jitted = fulmen.jit(net)
    (jitted(_batch(rank, 0)).sum() + jitted(_batch(rank, 1)).square().sum()).backward()
    results = {"twice": _full_grads(net)}
    if mode == "ddp":
        net.zero_grad()
        torch_ddp = DistributedDataParallel(_Net())
        for model, sync in ((jitted, fd.no_sync(jitted)), (torch_ddp, torch_ddp.no_sync())):
            with sync:
                (model(_batch(rank, 2)).sum() + _outside(net if model is jitted else torch_ddp.module, "head",
                                                         rank)).backward()
            model(_batch(rank, 3)).sum().backward()
        results["no_sync"] = _full_grads(net)
        results["torch no_sync"] = _full_grads(torch_ddp.module)
    return results


@pytest.mark.parametrize("mode", ["ddp", "zero2", "zero3"])
def test_programs_sharing_a_parameter_in_one_backward_are_not_refused(mode):
    single = _Net()
    for rank in range(2):
        ((single(_batch(rank, 0)).sum() + single(_batch(rank, 1)).square().sum()) / 2).backward()
    for result in values(run_ranks(_shared_in_one_backward, 2, mode)):
        for name, p in single.named_parameters():
            torch.testing.assert_close(result["twice"][name], p.grad, msg=name)
        if mode == "ddp":
            for name, want in result["torch no_sync"].items():
                torch.testing.assert_close(result["no_sync"][name], want, msg=name)


def _grad_of_some(rank: int, world: int) -> dict[str, bool]:
    """torch.autograd.grad over one parameter: the program still delivers every gradient, and the hooks of those not
    asked for do not fire; what was delivered must not outlive the pass."""
    net = fd.ddp(_Net())
    jitted = fulmen.jit(net)
    delivered: list[weakref.ref] = []
    deliver = transform.deliver_grad

    def recording(spec, grad, synced):
        if grad is not None:
            delivered.append(weakref.ref(grad))
        return deliver(spec, grad, synced)

    transform.deliver_grad = recording
    try:
        (grad,) = torch.autograd.grad(jitted(_batch(rank)).sum(), [net.a.weight])
    finally:
        transform.deliver_grad = deliver
    gc.collect()
    return {"delivered": len(delivered) > 1, "released": all(ref() is None or ref() is grad for ref in delivered)}


def test_gradients_delivered_in_a_pass_are_released_at_its_end():
    for result in values(run_ranks(_grad_of_some, 2)):
        assert result == {"delivered": True, "released": True}


def _nested_pass(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Three calls of the model in one backward, the middle one under a reentrant checkpoint: its backward is a
    pass of its own, run between the outer calls' (autograd runs the latest node first)."""
    net = fd.ddp(_Net())
    jitted = fulmen.jit(net)
    later = jitted(_batch(rank, 0)).sum()
    middle = torch.utils.checkpoint.checkpoint(jitted, _batch(rank, 1).requires_grad_(), use_reentrant=True).sum()
    first = jitted(_batch(rank, 2)).sum()
    (first + middle + later).backward()
    return _full_grads(net)


def test_a_nested_backward_pass_keeps_the_outer_passs_deliveries():
    single = _Net()
    for rank in range(2):
        (sum(single(_batch(rank, micro)).sum() for micro in range(3)) / 2).backward()
    for grads in values(run_ranks(_nested_pass, 2)):
        for name, p in single.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=name)


def _clamping_hook(rank: int, world: int, mode: str) -> str | None:
    net = _Net()
    net.head.weight.register_hook(lambda g: g.clamp(-0.1, 0.1))
    jitted = fulmen.jit(_distribute(net, mode))
    try:
        jitted(_batch(rank)).sum().backward()
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize("mode", ["ddp", "zero3"])
def test_a_hook_replacing_the_delivered_gradient_is_named(mode):
    kind = "ddp" if mode == "ddp" else "fsdp"
    for message in values(run_ranks(_clamping_hook, 2, mode)):
        assert message is not None and message.startswith(
            f"the gradient of head.weight (distributed by fulmen.distributed.{kind}) is not the one the jitted program "
            f"delivered: a hook registered on the parameter before fulmen.distributed.{kind} returned a new gradient"
        ), message
