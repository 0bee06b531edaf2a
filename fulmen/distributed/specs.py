"""How a parameter is distributed: replicated (DDP) or sharded on dim 0 (FSDP), and the shard layout.

`ddp` and `fsdp` attach a `ParamSpec` to each parameter (`param._fulmen_dist`, fulmen.transforms.distribution's
`DistributedInput`): acquisition reads it to give a sharded parameter its full (logical) shape in the trace and
builds the program's `DistributedProgram` through it, whose transforms insert the collectives. A sharded
parameter of `n` rows holds `rows = ceil(n / world)` rows on every rank: rank `r` has the rows
`[r * rows, (r + 1) * rows)` of the full tensor, zero-padded past `n` (torch.chunk's split, so DCP's `Shard(0)`
placement describes the same rows).
"""

from __future__ import annotations

import copy
import enum
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fulmen.core.trace import Trace
from fulmen.distributed import arrivals
from fulmen.distributed.prims import make_checker
from fulmen.distributed.transform import DistributedProgram
from fulmen.transforms.distribution import DISTRIBUTED_INPUT


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


@dataclass(eq=False)
class DistributedState:
    """What one `ddp` / `fsdp` call set up, shared by the parameters it distributed."""

    kind: str  # "ddp" or "fsdp"
    group: dist.ProcessGroup
    group_name: str
    world: int
    rank: int
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
    # runs: the parameters' hooks refuse a gradient computed outside every program (distributed.arrivals).
    arrivals: dict[int, dict[ParamSpec, object]] = field(default_factory=dict)
    specs: list[ParamSpec] = field(default_factory=list, repr=False)  # of the parameters this state distributes

    @property
    def zero3(self) -> bool:
        return self.sharding is FSDPType.ZERO3

    def distribute(self, param: torch.Tensor, name: str, full_shape: torch.Size | None, bucket: str) -> ParamSpec:
        """Marks `param` (this rank's shard, or the whole replicated tensor) as distributed by this state."""
        spec = ParamSpec(self, name, full_shape, bucket, weakref.ref(param))
        setattr(param, DISTRIBUTED_INPUT, spec)
        arrivals.watch(param, spec)
        self.specs.append(spec)
        return spec

    def __deepcopy__(self, memo: dict[int, Any]) -> DistributedState:
        """`copy.deepcopy` of a distributed module (an EMA or a reference model made after setup) gives a module
        distributed as the original over the same group: this state's settings with nothing pending, and each copied
        parameter (its shard under fsdp, copied by torch) marked with a spec of its own, as torch's
        DistributedDataParallel copies into a module with its own reducer. Every rank copies at the same point (under
        a backend other than gloo the copy makes its own host group for the collective-order checks)."""
        copied = DistributedState(self.kind, self.group, self.group_name, self.world, self.rank,
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
    watched: bool = False  # its hook refuses gradients computed outside the programs (fulmen.distributed.arrivals)
    hooked_before: bool = False  # the parameter had hooks of its own before that one (named when it refuses)

    def program(self, trace: Trace, tensors: Sequence[torch.Tensor]) -> DistributedProgram:
        """The distribution of `trace`'s inputs `tensors` (fulmen.transforms.distribution's DistributedInput)."""
        specs = [spec_of(t) for t in tensors]
        for tensor, spec in zip(tensors, specs):
            if spec is not None:  # a parameter made to require grad after ddp / fsdp
                arrivals.watch(tensor, spec)
        return DistributedProgram(trace.inputs, specs, trace.namespace)

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
