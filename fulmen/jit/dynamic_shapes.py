"""Which dimensions of a jitted callable's tensor arguments a trace makes symbolic (`JitOptions.dynamic`).

torch.compile's rule: the first trace is static; a dimension whose size differs at a later trace becomes symbolic
from then on (`dynamic=None`, the default). `dynamic=True` makes every dimension of every tensor argument symbolic
from the first trace, `dynamic=False` none. `fulmen.mark_dynamic(tensor, dim)` marks a dimension ahead, for
traces made with that tensor as an argument. Parameters, buffers and captured tensors stay static. A dimension of
size 0 or 1 stays static in a trace (torch's rule), so a batch of one is traced apart.

What a symbolic trace cannot do yet falls back to a trace of static shapes (`give_up`), and the cache's miss
reasons say why. A dimension whose size the program uses as a Python int (`for i in range(T)`, a size it returns or
stores) makes the trace hold for that size only (its guards say so); that dimension stays static from then on
(`pin`). Sizes the call hands back in views it takes again of its outputs are read from its own arguments
(`SizeOf`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import sympy
import torch
from torch.utils.weak import WeakIdKeyDictionary

from fulmen.core import pytree
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbolic import SYMBOLIC, Sizes, is_symbolic, symbolic_dispatch, symbolic_meta
from fulmen.observation.shape_guards import ShapeGuards, symbolic_position
from fulmen.transforms.distribution import distributed_input, logical_meta

_MARKED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> the dims fulmen.mark_dynamic marked


def mark_dynamic(tensor: torch.Tensor, dim: int | Sequence[int]) -> None:
    """Makes dimension `dim` (or each of several) of `tensor` symbolic in the traces made with it as an argument
    of a jitted callable, from the first; the callable keeps it symbolic for later arguments at that place."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"fulmen.mark_dynamic expects a tensor, got {type(tensor).__name__}")
    dims = [dim] if isinstance(dim, int) else list(dim)
    marked = set(_MARKED.get(tensor, ()))
    for d in dims:
        if type(d) is not int or not -tensor.dim() <= d < max(tensor.dim(), 1):
            raise IndexError(
                f"fulmen.mark_dynamic: dimension {d!r} is out of range for a tensor of {tensor.dim()} dimensions"
            )
        marked.add(d % tensor.dim())
    _MARKED[tensor] = frozenset(marked)


def _eligible(tensor: torch.Tensor) -> bool:
    """A tensor whose trace input can carry symbols: a plain strided tensor, not a distributed module tensor. A view
    into a larger storage (`x[start:stop]`, each rank's rows of a global batch) keeps its storage offset, as in a
    static trace (symbolic.symbolic_meta)."""
    return tensor.layout is torch.strided and tensor.dim() > 0 and not tensor.is_nested and (
        distributed_input(tensor) is None)


class DynamicDims:
    """The symbolic dimensions of one jitted callable's arguments, by argument position."""

    def __init__(self, dynamic: bool | None) -> None:
        self.dynamic = dynamic
        self._first: dict[int, tuple[int, ...]] = {}  # position -> the sizes of the first traced call
        self.dims: dict[int, frozenset[int]] = {}  # position -> its symbolic dims
        self.given_up: str | None = None  # why symbolic traces are off for this callable
        self.pinned: dict[tuple[int, int], str] = {}  # (position, dim) -> why it stays static (`pin`)
        self.traced: dict[tuple[int, ...], None] = {}  # the symbolic arguments of each cached symbolic trace's key

    @property
    def active(self) -> bool:
        """Whether a symbolic trace is cached (it stays usable after `give_up` and `pin`)."""
        return bool(self.traced)

    def keys(self, tensors: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
        """The symbolic arguments of the cached symbolic traces' keys that this call can match."""
        return [ps for ps in self.traced if all(p < len(tensors) and _eligible(tensors[p]) for p in ps)]

    def observe(self, tensors: Sequence[torch.Tensor]) -> None:
        """A call that traces anew: the dims it changes (or that are marked) become symbolic."""
        if self.dynamic is False:
            return
        for position, tensor in enumerate(tensors):
            marked = _MARKED.get(tensor) if _MARKED else None
            dims = set(self.dims.get(position, ()))
            if self.dynamic is True:
                dims.update(range(tensor.dim()))
            else:
                first = self._first.setdefault(position, tuple(tensor.shape))
                if len(first) == tensor.dim():
                    dims.update(d for d, (a, b) in enumerate(zip(first, tensor.shape)) if a != b)
            if marked:
                dims.update(d for d in marked if d < tensor.dim())
            dims.difference_update(d for p, d in self.pinned if p == position)
            if dims:
                self.dims[position] = frozenset(dims)

    def declare(self, dims: dict[int, frozenset[int]]) -> None:
        """Makes these dims (by argument position) symbolic, as marking them would (none under dynamic=False)."""
        if self.dynamic is False:
            return
        for position, marked in dims.items():
            left = marked - {d for p, d in self.pinned if p == position}
            if left:
                self.dims[position] = self.dims.get(position, frozenset()) | left

    def positions(self, tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
        """The arguments of this call that carry symbols in a symbolic trace (whose key leaves their sizes to its
        guards)."""
        return tuple(p for p in self.dims if p < len(tensors) and _eligible(tensors[p]))

    def to_trace(self, tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
        """The arguments a new trace of this call gives symbols (none once symbolic traces were given up)."""
        return self.positions(tensors) if self.given_up is None else ()

    def give_up(self, reason: str) -> None:
        self.given_up = reason

    def pin(self, position: int, dim: int, reason: str) -> None:
        """Dimension `dim` of the argument at `position` stays static from now on: the program uses its size as a
        Python int (`range(T)`), so a trace holds for one size of it anyway, and a static one is traced faster."""
        self.pinned[position, dim] = reason
        left = self.dims.get(position, frozenset()) - {dim}
        if left:
            self.dims[position] = left
        else:
            self.dims.pop(position, None)

    def notes(self, names: Sequence[str]) -> list[str]:
        """What the miss reasons say of symbolic sizes beyond the traces' own reasons."""
        notes = [f"symbolic sizes are off for this callable: {self.given_up}"] if self.given_up is not None else []
        for (position, dim), reason in self.pinned.items():
            name = names[position] if position < len(names) else f"argument #{position}"
            notes.append(f"{name}.shape[{dim}] stays static: {reason}")
        return notes


class SymbolicInputs:
    """One trace's symbolic dimensions (argument position -> dims) and the ShapeEnv its sizes are symbols of."""

    def __init__(self, dims: dict[int, frozenset[int]]) -> None:
        self.dims = dims
        self.sizes = Sizes()

    def meta(self, tensor: torch.Tensor, position: int) -> torch.Tensor:
        """The meta tensor the trace input for the argument at `position` carries."""
        dims = self.dims.get(position)
        if dims is None:
            return logical_meta(tensor)
        return symbolic_meta(self.sizes, tensor, position, dims)

    def dispatch(self) -> contextlib.AbstractContextManager:
        return symbolic_dispatch(True)

    def guards(self, inputs: Sequence[TensorProxy]) -> ShapeGuards:
        """The shape guards of the finished trace; the ShapeEnv takes no guard after them (a question asked later
        would have been answered for the traced sizes only), and refuses one."""
        shapes = ShapeGuards.build(self.sizes, {p: inputs[p].meta for p in self.dims})
        self.sizes._error_on_new_guards = True
        return shapes

    def specialised(self) -> list[tuple[int, int, str]]:
        """(position, dim, why) of each symbolic dimension the finished trace holds for one size only: the traced
        code used it as a Python int (`for i in range(T)`), which made its symbol that int."""
        found = []
        for symbol, value in self.sizes.replacements.items():
            if not value.is_number:
                continue
            decision = next(
                (
                    d
                    for d in self.sizes.decisions
                    if symbol in d.question.free_symbols
                    and not isinstance(d.answer, (bool, sympy.logic.boolalg.BooleanAtom))
                ),
                None,
            )
            where = (
                f" at {decision.where.short()}: {decision.where.line}"
                if decision is not None and decision.where is not None
                else f" ({decision.why})"
                if decision is not None and decision.why
                else ""
            )
            for source in self.sizes.var_to_sources.get(symbol, ()):
                place = symbolic_position(source)
                if place is not None and place[1] == "size":
                    found.append((place[0], place[2], f"its size is used as a Python int{where}"))
        return found

    @staticmethod
    def failure(error: Exception) -> str:
        """Why a trace with symbolic sizes failed, for the miss reasons."""
        text = str(error).splitlines()[0] if str(error) else ""
        return f"tracing with symbolic sizes failed ({type(error).__name__}: {text[:300]}); traced with static shapes"


def _concrete(value: Any, why: str) -> Any:
    kind = int if isinstance(value, torch.SymInt) else float if isinstance(value, torch.SymFloat) else bool
    if not is_symbolic(value):
        return kind(value)
    with value.node.shape_env.asking(why):
        return kind(value)


def settled(obj: Any, why: str = "the program returns it") -> Any:
    """`obj` (what the program returns, or a value it stores in Python state) with the sizes in it as the ints the
    traced call had: a trace returns and stores again only values fixed by its guards, so the trace then holds for
    those sizes only (their guards say so: "s0 was 12 (the program returns it)")."""
    if not symbolic_values_in(obj):
        return obj
    return pytree.tree_map(lambda value: _concrete(value, why), obj, _is_symbolic)


def _is_symbolic(item: Any) -> bool:
    return isinstance(item, SYMBOLIC)


def symbolic_values_in(obj: Any) -> bool:
    return any(True for _ in pytree.leaves(obj, _is_symbolic))


def settled_writes(writes: tuple) -> tuple:
    """The program's stores of Python state (state_writes.py, container_writes.py) with their sizes settled."""
    return tuple(_settled_write(write) for write in writes)


def _settled_write(write: Any) -> Any:
    for field in ("value", "content"):
        if hasattr(write, field) and symbolic_values_in(getattr(write, field)):
            return dataclasses.replace(write, **{field: settled(getattr(write, field), "the program stores it")})
    return write


@dataclasses.dataclass(frozen=True, slots=True)
class SizeOf:
    """A symbolic size kept for a later call (the view ops it takes again of its outputs): the expression, read
    from that call's argument shapes (`thawed`)."""

    expr: Any

    def value(self, values: dict) -> int:
        return int(self.expr.xreplace(values))


def frozen(obj: Any) -> Any:
    """`obj` (a cache entry's views to take again) with its symbolic sizes as `SizeOf`s, which outlive the trace."""
    return pytree.tree_map(lambda size: SizeOf(size.node.expr), obj, _is_symbolic)


def has_sizes(obj: Any) -> bool:
    return any(True for _ in pytree.leaves(obj, lambda item: type(item) is SizeOf))


def thawed(obj: Any, values: dict) -> Any:
    """`obj` with each `SizeOf` as the int it is for a call whose symbols have `values` (ShapeGuards.values)."""
    return pytree.tree_map(lambda size: size.value(values), obj, lambda item: type(item) is SizeOf)
