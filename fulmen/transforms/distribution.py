"""The contract between `fulmen.jit` and a package that distributes a program's inputs (`fulmen.distributed`).

Neither side imports the other: a distributed tensor carries a `DistributedInput` (its logical shape, and how to
build the `DistributionTransform` of a trace that reads it); jit asks it for the full shape acquisition must see and
for the program, whose forward and per-`GradSync` backward passes the pipeline runs and whose gradients held back
under no-sync the autograd bridge passes along. A module that stands for another (jit's `JittedModule`) is a
`ModuleWrapper`, so `ddp` / `fsdp` distribute the module it wraps.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from fulmen.core.trace import Trace

# The attribute a distributed tensor carries its `DistributedInput` in.
DISTRIBUTED_INPUT = "_fulmen_dist"


class GradSync(enum.Enum):
    """How a backward treats the gradients of distributed inputs."""

    SYNC = enum.auto()  # reduce the gradients across ranks
    LOCAL = enum.auto()  # inside no_sync: no communication, full local gradients
    PENDING = enum.auto()  # reduce the gradients plus those accumulated under no_sync


class DistributionTransform(Protocol):
    """What the distribution of one jitted program's inputs contributes to its pipeline and its autograd node."""

    @property
    def sync(self) -> bool:
        """False inside no_sync: the backward of a forward run now keeps its gradients local."""

    def forward(self, trace: Trace, n_outputs: int) -> Trace:
        """`trace` (outputs, then saved values from position `n_outputs`) reading the local inputs."""

    def backward(self, trace: Trace, mode: GradSync) -> Trace:
        """The backward trace for `mode`; PENDING takes the held-back gradients as a last input group."""

    def deliver(self, grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """A synced (or pending) backward's grads as autograd is to take them."""

    def hold_back(self, grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """A LOCAL backward's grads with the distributed inputs' gradients kept for the next synced backward."""

    def take_pending(self) -> list[torch.Tensor] | None:
        """The held-back gradients (a PENDING backward's last input group), released; None when there are none."""


class DistributedInput(Protocol):
    """What a distributed tensor carries."""

    @property
    def full_shape(self) -> torch.Size | None:
        """The shape the program sees when the tensor holds only a shard of it; None: the tensor's own."""

    def program(self, trace: Trace, tensors: Sequence[torch.Tensor]) -> DistributionTransform:
        """The distribution of `trace`, whose inputs are `tensors` (this tensor among them)."""


@runtime_checkable
class ModuleWrapper(Protocol):
    """A module that runs another one: distributing it distributes the wrapped module."""

    @property
    def wrapped_module(self) -> nn.Module: ...

    @property
    def has_run(self) -> bool:
        """Whether the wrapper has compiled a program already (then it is too late to distribute)."""


def distributed_input(tensor: torch.Tensor) -> DistributedInput | None:
    return getattr(tensor, DISTRIBUTED_INPUT, None)


def distributed_program(trace: Trace, tensors: Sequence[torch.Tensor]) -> DistributionTransform | None:
    """The distribution of `trace`'s inputs `tensors`, or None when none of them is distributed."""
    first = next((spec for t in tensors if (spec := distributed_input(t)) is not None), None)
    return first.program(trace, tensors) if first is not None else None


def logical_meta(tensor: torch.Tensor) -> torch.Tensor:
    """The meta tensor a trace input stands for: a sharded tensor's full shape, else the tensor's own."""
    spec = distributed_input(tensor)
    if spec is not None and spec.full_shape is not None:
        return torch.empty(spec.full_shape, dtype=tensor.dtype, device="meta")
    if tensor.storage_offset() == 0:
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    # a view into a larger storage: the program can read its storage offset
    storage = torch.empty(tensor.untyped_storage().nbytes() // tensor.element_size(), dtype=tensor.dtype,
                          device="meta").untyped_storage()
    return torch.empty(0, dtype=tensor.dtype, device="meta").set_(storage, tensor.storage_offset(), tensor.shape,
                                                                  tensor.stride())
