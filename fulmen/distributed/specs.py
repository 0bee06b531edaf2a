"""How a parameter is distributed: replicated (DDP) or sharded on dim 0 (FSDP), and the shard layout.

`ddp` and `fsdp` attach a `ParamSpec` to each parameter (`param._fulmen_dist`); acquisition reads it to give a
sharded parameter its full (logical) shape in the trace, and the distributed transforms read it to insert the
collectives. A sharded parameter of `n` rows holds `rows = ceil(n / world)` rows on every rank: rank `r` has the
rows `[r * rows, (r + 1) * rows)` of the full tensor, zero-padded past `n` (torch.chunk's split, so DCP's
`Shard(0)` placement describes the same rows).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
    sharding: FSDPType | None = None
    bucketing: FSDPBucketingStrategy | None = None
    bucket_bytes: int = 0  # DDP: gradients per all_reduce
    max_in_flight: int = 2  # FSDP: all-gathers started ahead of their first use
    sync: bool = True  # False inside no_sync(): the backward skips gradient communication

    @property
    def zero3(self) -> bool:
        return self.sharding is FSDPType.ZERO3


@dataclass(eq=False)
class ParamSpec:
    state: DistributedState
    name: str  # qualified name in the distributed model
    full_shape: torch.Size | None  # None: replicated
    bucket: str  # FSDP: the collective this parameter travels in
    # Gradients accumulated under no_sync (full shape), folded into the next synced reduction.
    pending: torch.Tensor | None = None

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
    return getattr(tensor, "_fulmen_dist", None)


def logical_meta(tensor: torch.Tensor) -> torch.Tensor:
    """The meta tensor a trace input stands for: a sharded parameter's full shape, else the tensor's own."""
    spec = spec_of(tensor)
    if spec is not None and spec.sharded:
        return torch.empty(spec.full_shape, dtype=tensor.dtype, device="meta")
    if tensor.storage_offset() == 0:
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    # a view into a larger storage: the program can read its storage offset
    storage = torch.empty(tensor.untyped_storage().nbytes() // tensor.element_size(), dtype=tensor.dtype,
                          device="meta").untyped_storage()
    return torch.empty(0, dtype=tensor.dtype, device="meta").set_(storage, tensor.storage_offset(), tensor.shape,
                                                                  tensor.stride())
