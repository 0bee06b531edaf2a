"""Every gradient that reaches a distributed parameter must come from a jitted program's backward.

The programs reduce the gradients they compute inside their backward traces, bucketed so that communication overlaps
the rest of the backward. A term computed outside every program (`model(x).sum() + net.head.weight.pow(2).sum()`)
reaches the parameter's AccumulateGrad beside the program's reduced gradient and would be accumulated unreduced, so
the ranks' gradients, then their weights, would drift apart silently, where torch's DDP (hooks on the accumulators)
reduces the total. Reducing that term as well would take one more collective per parameter that some rank may or may
not issue (each rank sees only its own graph), and its value only as the sum minus the program's part; so such a
gradient is refused instead, with the parameter's name.

A hook on each parameter sees the sum autograd is about to accumulate: it must be the very tensor a program delivered
in this backward pass. Several programs delivering to one parameter in one pass (`model(a) + model(b)`) are folded
into the first one's tensor, so that remains true; under no_sync the programs deliver local gradients that the next
synced backward reduces from `.grad`, and a replicated parameter's other terms may join them there.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fulmen.distributed.specs import ParamSpec

# A replicated parameter's program delivered a no_sync (local) gradient in this pass: its `.grad` is reduced later.
_LOCAL = object()
_NOTHING = object()


def _pass_arrivals(spec: ParamSpec) -> dict[ParamSpec, object]:
    """What the programs delivered in the current backward pass (autograd graph task), dropped when it ends.

    Keyed by task, so that a pass nested in another (a reentrant checkpoint's backward, one in another thread) keeps
    the outer pass's records; dropped at the pass's end, so that a delivered gradient whose hook did not fire
    (torch.autograd.grad over some of the parameters) is not kept alive."""
    passes = spec.state.arrivals
    task = torch._C._current_graph_task_id()
    arrivals = passes.get(task)
    if arrivals is None:
        arrivals = passes[task] = {}
        if task != -1:  # (always inside a backward: deliveries come from programs' backwards, checks from hooks)
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(passes.pop, task, None))
    return arrivals


def deliver(spec: ParamSpec, grad: torch.Tensor | None, synced: bool) -> torch.Tensor | None:
    """The gradient a program's backward gives autograd for `spec`'s parameter, recorded for its hook. A second
    synced delivery in the same pass is added into the first (a reduced gradient, a buffer the program made) and
    None is returned instead, so that autograd accumulates one tensor the hook recognises."""
    if grad is None:
        return None
    arrivals = _pass_arrivals(spec)
    earlier = arrivals.get(spec, _NOTHING)
    if not synced or earlier is _LOCAL:
        arrivals[spec] = _LOCAL
        return grad
    if earlier is _NOTHING:
        arrivals[spec] = grad
        return grad
    earlier.add_(grad)  # type: ignore[attr-defined]
    return None


def watch(param: torch.Tensor, spec: ParamSpec) -> None:
    """Puts the check on `param` (once; a parameter that does not require grad gets none)."""
    if not spec.watched and param.requires_grad:
        # Hooks run in registration order: one of the user's registered earlier may hand ours a tensor of its own.
        # (`_backward_hooks` is torch's private record of them; only the error message reads this.)
        spec.hooked_before = bool(getattr(param, "_backward_hooks", None))
        param.register_hook(functools.partial(_check, spec))
        spec.watched = True


def _check(spec: ParamSpec, grad: torch.Tensor | None) -> None:
    if grad is None:  # every contribution undefined (a program that held its gradient back under no_sync)
        return
    arrivals = _pass_arrivals(spec)
    delivered = arrivals.pop(spec, _NOTHING)
    if delivered is grad or (delivered is _LOCAL and not spec.sharded):
        return
    if delivered is not _NOTHING and spec.hooked_before:
        raise RuntimeError(_replaced_message(spec))
    raise RuntimeError(_outside_message(spec, delivered is not _NOTHING))


def _replaced_message(spec: ParamSpec) -> str:
    return (f"the gradient of {spec.name} (distributed by fulmen.distributed.{spec.state.kind}) is not the one the "
            "jitted program delivered: a hook registered on the parameter before "
            f"fulmen.distributed.{spec.state.kind} returned a new gradient (or a part was computed outside the "
            "program). The program delivers a gradient already reduced across ranks, so the hook would change the "
            "reduced gradient, where torch's DDP runs it on each rank's local gradient before reducing. Apply it "
            "inside the jitted function, or to `.grad` after the backward")


def _outside_message(spec: ParamSpec, also_inside: bool) -> str:
    where = "beside the gradient the jitted program computes" if also_inside else "and the jitted program computes none"
    if spec.sharded:
        shard = (spec.rows, *spec.full_shape[1:])
        why = (f"outside the program the parameter holds only this rank's shard (shape {shard} of "
               f"{tuple(spec.full_shape)}), so that computation read part of it and its gradient would stay local to "
               "each rank, where torch's FSDP2 computes with the whole parameter")
    else:
        why = ("fulmen reduces across ranks only what the programs' backwards compute, so that part would stay local "
               "to each rank and the ranks' weights would drift apart silently (torch's DDP reduces the total)")
    return (f"the gradient of {spec.name} (distributed by fulmen.distributed.{spec.state.kind}) has a part computed "
            f"outside the jitted program {where}: {why}. Compute that term inside the jitted function (jit a function "
            "that calls the model and adds it to the loss), or keep the parameter out of the distributed module")
