"""Inputs that share memory: detected by storage, handled as eager would, and part of what a cache hit requires.

Aliasing only matters to a trace that updates an input in place: `f(x, y): x.add_(1); return y * 2` called as
`f(a, a)` must see the update through `y`. Such a trace records which inputs share a storage (`storage_groups`,
compared exactly on every hit), so a trace made without aliasing never runs on aliased inputs, nor the reverse.

When an updated input shares its storage with another input, acquisition runs again with an `AliasPlan`: the
storage becomes one trace input (a 1-D view of the storage from its start, built from the first member on each
call), every member enters the program as an `as_strided` view of it, so functionalization sees each update through
every member, and the write-back goes to the storage once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fulmen.core.errors import TraceError
from fulmen.core.source import SourceLocation

_PLAIN = (torch.Tensor, nn.Parameter)


def storage_groups(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """For each tensor, the position of the first tensor sharing its storage (its own when none does)."""
    first: dict[tuple, int] = {}
    groups = []
    for i, t in enumerate(tensors):
        if type(t) not in _PLAIN or t.device.type == "meta" or t.untyped_storage().nbytes() == 0:
            groups.append(i)  # no memory of its own to share (a subclass answers for itself)
            continue
        groups.append(first.setdefault((t.device, t.untyped_storage().data_ptr()), i))
    return tuple(groups)


def _storage_addresses(tensors: Sequence[torch.Tensor]) -> list[int | None]:
    return [t.untyped_storage().data_ptr() if type(t) in _PLAIN else None for t in tensors]


class StorageGroups:
    """The storage groups a trace was made for, checked on each call. The groups are a function of the storages'
    addresses (CPU and CUDA addresses never coincide: CUDA's unified virtual addressing), so a call whose addresses
    equal the last admitted call's is admitted by comparing them, and only a call where a storage moved computes the
    groups again: a whole training step's parameters and optimizer state are hundreds of tensors, and their groups
    cost several times their addresses. `fresh`: the positions of tensors each call makes anew (a whole step's
    learning rate, the grads it begins with: fulmen.jit.grad_slots), whose addresses change every call; one that
    shared no storage when traced is admitted while it shares none."""

    __slots__ = ("groups", "_fresh", "_seen")

    def __init__(self, tensors: Sequence[torch.Tensor], fresh: Sequence[int] = ()) -> None:
        self.groups = storage_groups(tensors)
        alone = [i for i in fresh if self.groups.count(self.groups[i]) == 1]
        self._fresh = tuple(alone) if len(alone) == len(fresh) else None  # None: compute the groups on every call
        self._seen = self._stable(_storage_addresses(tensors))[0]

    def _stable(self, seen: list[int | None]) -> tuple[list[int | None], list[int | None]]:
        """The addresses at the positions that keep theirs, and those of the fresh tensors."""
        fresh = [seen[i] for i in self._fresh or ()]
        for i in self._fresh or ():
            seen[i] = None
        return seen, fresh

    def admits(self, tensors: Sequence[torch.Tensor]) -> bool:
        if self._fresh is not None:
            seen, fresh = self._stable(_storage_addresses(tensors))
            if seen == self._seen and (not fresh or _apart(fresh, seen)):
                return True
        if storage_groups(tensors) != self.groups:
            return False
        if self._fresh is not None:
            self._seen = seen
        return True


def _apart(fresh: list[int | None], others: list[int | None]) -> bool:
    """Whether the fresh tensors' storages are shared with no other tensor's, nor among themselves."""
    return (len(set(fresh)) == len(fresh) and not set(others).intersection(fresh) and None not in fresh
            and 0 not in fresh)


def storage_offsets(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    return tuple([t.storage_offset() for t in tensors])


@dataclass(frozen=True, slots=True)
class AliasGroup:
    members: tuple[int, ...]  # positions among the trace's inputs (arguments, module tensors, constants)
    extent: int  # elements of the storage the members reach, counted from its start


@dataclass(frozen=True, slots=True)
class AliasPlan:
    groups: tuple[AliasGroup, ...]

    def member_of(self, position: int) -> int | None:
        """The group (its index) that input `position` belongs to."""
        for index, group in enumerate(self.groups):
            if position in group.members:
                return index
        return None

    def bases(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each group's storage as a tensor: what the trace's extra inputs are on this call."""
        return [inputs[g.members[0]].as_strided((g.extent,), (1,), 0) for g in self.groups]


def _extent(t: torch.Tensor) -> int:
    return t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1


def may_overlap(tensor: torch.Tensor) -> bool:
    """Whether two elements of `tensor` may share memory: with its dimensions ordered by stride, each must step past
    all that the smaller ones reach (sufficient for no overlap; a function of sizes and strides, which the cache key
    holds)."""
    if tensor.numel() <= 1:
        return False
    reach = 0
    for stride, size in sorted((st, s) for s, st in zip(tensor.shape, tensor.stride()) if s > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def _addresses(meta: torch.Tensor) -> torch.Tensor | None:
    """The storage position of each element of `meta` (a meta tensor) counted from its base's first element, as a
    real integer tensor of its shape; None when that is too large to hold."""
    base = meta._base if meta._is_view() else meta
    offset = meta.storage_offset() - base.storage_offset()
    extent = offset + sum((size - 1) * stride for size, stride in zip(meta.shape, meta.stride())) + 1
    if extent > _ADDRESSES_CHECKED or offset < 0:
        return None
    return torch.arange(extent).as_strided(meta.shape, meta.stride(), offset)


_ADDRESSES_CHECKED = 1 << 22  # larger views are not compared element by element (memory, time)


def reads_elements_written_elsewhere(target: torch.Tensor, operand: torch.Tensor) -> bool:
    """Whether an in-place update of `target` reading `operand` (the metas of two views of one tensor, each laid out
    from its base as the tensor is) reads at some position an element the update writes at another position
    (`b -= b[:, 1:2]`, `x.add_(x.t())`): eager's result then depends on the order its kernel visits the elements,
    which a functional trace does not reproduce. Reading an element where it is written (`x.mul_(x)`) is exact."""
    if target.numel() == 0:
        return False
    written, read = _addresses(target), _addresses(operand)
    if written is None or read is None:
        return False
    try:
        read = torch.broadcast_to(read, target.shape)
    except RuntimeError:  # the op broadcasts the target instead: eager refuses that update
        return False
    return bool((torch.isin(read.contiguous(), written.contiguous()) & (read != written)).any())


def _refuse_internal_overlap(tensor: torch.Tensor, name: str, where: SourceLocation | None) -> None:
    """An update of a tensor whose elements share memory (`as_strided` with overlapping strides, `expand`): eager's
    result depends on the order its kernel visits the elements (stride 0 eager refuses), which a functional trace
    does not reproduce."""
    if type(tensor) in _PLAIN and may_overlap(tensor):
        raise TraceError(
            f"the program updates in place its input {name}, whose elements may share memory (size "
            f"{tuple(tensor.shape)}, stride {tensor.stride()}): eager's result depends on the order its kernel writes "
            "them; pass a tensor without overlapping elements (x.clone())",
            where,
        )


def plan_aliases(inputs: Sequence[torch.Tensor], written: dict[int, SourceLocation | None], names: Sequence[str],
                 module_range: range) -> AliasPlan | None:
    """The plan for the storage groups that hold an input the program updates in place (None when there are none);
    refuses what it cannot make exact. `written`: the updated inputs' positions, with the line of the update."""
    for i, where in written.items():
        _refuse_internal_overlap(inputs[i], names[i], where)
    members: dict[int, list[int]] = {}
    for i, first in enumerate(storage_groups(inputs)):
        members.setdefault(first, []).append(i)
    groups = []
    for positions in members.values():
        updated = [i for i in positions if i in written]
        if len(positions) < 2 or not updated:
            continue
        where = written[updated[0]]
        tensors = [inputs[i] for i in positions]
        if not any(t.numel() for t in tensors):
            continue
        described = ", ".join(names[i] for i in positions)
        if any(i in module_range for i in positions):
            raise TraceError(f"the program updates in place a module tensor that shares memory with another input "
                             f"({described}); fulmen does not support this", where)
        if len({(t.dtype, t.device) for t in tensors}) > 1:
            raise TraceError(f"inputs {described} share memory with different dtypes or devices and one is updated "
                             "in place; fulmen does not support this", where)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            raise TraceError(f"inputs {described} share memory, one is updated in place and one requires grad; "
                             "fulmen cannot differentiate through shared storage: pass copies (x.clone())", where)
        groups.append(AliasGroup(tuple(positions), max(_extent(t) for t in tensors if t.numel())))
    return AliasPlan(tuple(groups)) if groups else None
