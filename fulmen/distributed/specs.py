"""How a parameter is distributed: replicated (DDP) or sharded on dim 0 (FSDP), and the shard layout.

`ddp` and `fsdp` attach a `ParamSpec` to each parameter (`param._fulmen_dist`, fulmen.transforms.distribution's
`DistributedInput`): acquisition reads it to give a sharded parameter its full (logical) shape in the trace and
builds the program's `DistributedProgram` (fulmen.distributed.transform) through it, whose transforms insert the
collectives. A sharded parameter of `n` rows holds `rows = ceil(n / world)` rows on every rank: rank `r` has the rows
`[r * rows, (r + 1) * rows)` of the full tensor, zero-padded past `n` (torch.chunk's split, so DCP's `Shard(0)`
placement describes the same rows).

This module is what the transform and the checkpoint code read, so it imports neither: the class that builds a
program's transform comes with the `DistributedState` (`programs`, given by fulmen.distributed.setup).

Every gradient that reaches a distributed parameter must come from a jitted program's backward (`watch`,
`deliver_grad`).

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

import copy
import enum
import functools
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fulmen.core.proxies import TensorProxy
from fulmen.core.trace import Namespace, Trace
from fulmen.distributed.prims import make_checker
from fulmen.transforms.distribution import DISTRIBUTED_INPUT, DistributionTransform

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class FSDPType(enum.Enum):
    """ZERO2 keeps the gathered parameters from the forward for the backward; ZERO3 frees them after use and
    gathers them again in the backward."""

    ZERO2 = enum.auto()
    ZERO3 = enum.auto()


class FSDPBucketingStrategy(enum.Enum):
    """How many parameters one collective carries: one (NONE), a module's own (LAYER) or a transformer block's
    (BLOCK: an item of an `nn.ModuleList`, such as LitGPT's `transformer.h.3`)."""

    NONE = enum.auto()
    LAYER = enum.auto()
    BLOCK = enum.auto()


# Builds the distribution of a program's inputs from the trace's inputs, their specs and the trace's namespace:
# fulmen.distributed.transform's DistributedProgram.
ProgramBuilder = Callable[[Sequence[TensorProxy], Sequence["ParamSpec | None"], Namespace], DistributionTransform]


@dataclass(eq=False)
class DistributedState:
    """What one `ddp` / `fsdp` call set up, shared by the parameters it distributed."""

    kind: str  # "ddp" or "fsdp"
    group: dist.ProcessGroup
    group_name: str
    world: int
    rank: int
    programs: ProgramBuilder  # builds the DistributionTransform of each program reading these parameters
    # The group (by its name in prims.GROUPS) whose ranks check they run the same collectives (`dist.check_plan`):
    # `group` itself under gloo, a gloo group of its ranks kept as long as this state under another backend, None where
    # gloo is missing (prims.make_checker).
    checker: str | None = None
    sharding: FSDPType | None = None
    bucketing: FSDPBucketingStrategy | None = None
    bucket_bytes: int = 0  # DDP: gradients per all_reduce
    max_in_flight: int = 2  # FSDP: all-gathers started ahead of their first use
    sync: bool = True  # False inside no_sync(): the backward skips gradient communication
    # Sharded parameters' gradients accumulated under no_sync (full shape), folded into the next synced reduction;
    # shared by every program (cache entry, jitted function) that reads these parameters.
    pending: dict[ParamSpec, torch.Tensor] = field(default_factory=dict)
    # Replicated parameters whose `.grad` has taken local gradients under no_sync since the last synced backward,
    # which reduces `.grad` (what is left of it: zero_grad may have discarded them, as in torch's DDP).
    accumulated: set[ParamSpec] = field(default_factory=set)
    # Parameters read by forwards run outside no_sync whose backward has not run yet: what this round of synced
    # backwards will reduce. Gradients accumulated for any other are left out of it (`DistributedProgram.take_pending`).
    synced_forward: set[ParamSpec] = field(default_factory=set)
    # What the programs' backwards delivered to each parameter, by backward pass (autograd's graph task id) while it
    # runs: the parameters' hooks refuse a gradient computed outside every program (`watch`).
    arrivals: dict[int, dict[ParamSpec, object]] = field(default_factory=dict)
    specs: list[ParamSpec] = field(default_factory=list, repr=False)  # of the parameters this state distributes
    # The device mesh of `group` per device type, for the DTensors of a state dict (fulmen.distributed.checkpoint)
    meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    @property
    def zero3(self) -> bool:
        return self.sharding is FSDPType.ZERO3

    def distribute(self, param: torch.Tensor, name: str, full_shape: torch.Size | None, bucket: str) -> ParamSpec:
        """Marks `param` (this rank's shard, or the whole replicated tensor) as distributed by this state."""
        spec = ParamSpec(self, name, full_shape, bucket, weakref.ref(param))
        setattr(param, DISTRIBUTED_INPUT, spec)
        watch(param, spec)
        self.specs.append(spec)
        return spec

    def __deepcopy__(self, memo: dict[int, Any]) -> DistributedState:
        """`copy.deepcopy` of a distributed module (an EMA or a reference model made after setup) gives a module
        distributed as the original over the same group: this state's settings with nothing pending, and each copied
        parameter (its shard under fsdp, copied by torch) marked with a spec of its own, as torch's
        DistributedDataParallel copies into a module with its own reducer. Every rank copies at the same point (under
        a backend other than gloo the copy makes its own host group for the collective-order checks)."""
        copied = DistributedState(self.kind, self.group, self.group_name, self.world, self.rank, self.programs,
                                  sharding=self.sharding, bucketing=self.bucketing, bucket_bytes=self.bucket_bytes,
                                  max_in_flight=self.max_in_flight)
        copied.checker = make_checker(copied, self.group) if self.checker is not None else None
        memo[id(self)] = copied
        for spec in self.specs:
            param = spec.param() if spec.param is not None else None
            if param is not None:  # the copy torch makes of it, the one the copied module holds
                copied.distribute(copy.deepcopy(param, memo), spec.name, spec.full_shape, spec.bucket)
        return copied


@dataclass(eq=False)
class ParamSpec:
    state: DistributedState
    name: str  # qualified name in the distributed model
    full_shape: torch.Size | None  # None: replicated
    bucket: str  # FSDP: the collective this parameter travels in
    # the parameter itself: a replicated one's `.grad` under no_sync, whether one still requires grad when its held-back
    # gradients are left out of a synced backward
    param: weakref.ref[torch.Tensor] | None = None
    watched: bool = False  # its hook refuses gradients computed outside the programs (`watch`)
    hooked_before: bool = False  # the parameter had hooks of its own before that one (named when it refuses)

    def program(self, trace: Trace, tensors: Sequence[torch.Tensor]) -> DistributionTransform:
        """The distribution of `trace`'s inputs `tensors` (fulmen.transforms.distribution's DistributedInput)."""
        specs = [spec_of(t) for t in tensors]
        for tensor, spec in zip(tensors, specs):
            if spec is not None:  # a parameter made to require grad after ddp / fsdp
                watch(tensor, spec)
        return self.state.programs(trace.inputs, specs, trace.namespace)

    @property
    def sharded(self) -> bool:
        return self.full_shape is not None

    @property
    def rows(self) -> int:
        assert self.full_shape is not None
        return shard_rows(self.full_shape[0], self.state.world)


def shard_rows(n: int, world: int) -> int:
    return math.ceil(n / world)


def local_shard(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s rows of `full`, zero-padded to `ceil(n / world)` rows (a new tensor)."""
    rows = shard_rows(full.shape[0], world)
    piece = full[rank * rows : (rank + 1) * rows]
    shard = full.new_zeros((rows, *full.shape[1:]))
    shard[: piece.shape[0]].copy_(piece)
    return shard


def valid_rows(n: int, rank: int, world: int) -> int:
    """How many of rank `rank`'s shard rows are real (the rest is padding)."""
    rows = shard_rows(n, world)
    return max(0, min(rows, n - rank * rows))


def spec_of(tensor: torch.Tensor) -> ParamSpec | None:
    return getattr(tensor, DISTRIBUTED_INPUT, None)


# --- the gradients that reach a distributed parameter ------------------------------------------------------------
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


def deliver_grad(spec: ParamSpec, grad: torch.Tensor | None, synced: bool) -> torch.Tensor | None:
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
