"""Guards on symbolic sizes: what a trace with symbols (fulmen.core.symbolic) assumes about its arguments' shapes.

torch's ShapeEnv produces them (`produce_guards`): the static sizes and strides of the arguments that carry
symbols, the equalities duck sizing assumed (two dimensions of equal size share a symbol), and every relation the
traced code decided (`T > block_size`, `x.shape[1] > 64`, what `view` and slicing assumed). They read the call's
argument tensors (`a[3].size()[1]`), compiled into one function per cache entry. A call they refuse says which
question it answers otherwise: "s0 > 64 was False, now s0 = 80 (x.shape[1]), asked at prog.py:5".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch._dynamo.source import LocalSource, TensorProperty, TensorPropertySource
from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

from fulmen.core.symbolic import Decision, Sizes

_ARGUMENT = re.compile(r"L\['t(\d+)'\]")
_STATIC_SIZE = re.compile(r"a\[(\d+)\]\.size\(\)\[(\d+)\] == (\d+)")
# torch guards a static storage offset, which a trace holds for whatever it is, as a static trace does (a trace whose
# program reads an offset checks the inputs' offsets: trace_cache.CacheEntry.offsets)
_OFFSET = re.compile(r"a\[\d+\]\.storage_offset\(\) == \d+")


def symbolic_position(source: Any) -> tuple[int, str, int] | None:
    """(argument position, "size" or "stride", dim) of a symbol's source, as symbolic_meta names it."""
    if not isinstance(source, TensorPropertySource) or not isinstance(source.base, LocalSource):
        return None
    if source.prop not in (TensorProperty.SIZE, TensorProperty.STRIDE):
        return None
    kind = "size" if source.prop is TensorProperty.SIZE else "stride"
    return int(source.base.local_name[1:]), kind, source.idx


@dataclass(frozen=True, slots=True)
class ShapeGuards:
    """The guards on the symbolic sizes of one trace, over the call's argument tensors."""

    sources: tuple[str, ...]  # one Python expression per guard over `a`, the argument tensors
    check: Callable[[Sequence[torch.Tensor]], bool]
    decisions: tuple[Decision, ...]
    symbols: dict[sympy.Symbol, tuple[int, str, int]]  # symbol -> where it is read: (position, kind, dim)
    # symbol -> every place it stood for when traced (duck sizing: dimensions of equal size share a symbol)
    places: dict[sympy.Symbol, tuple[tuple[int, str, int], ...]]

    @staticmethod
    def build(sizes: Sizes, metas: dict[int, torch.Tensor]) -> ShapeGuards:
        positions = sorted(metas)
        produced = sizes.produce_guards(
            [metas[p] for p in positions], [LocalSource(f"t{p}") for p in positions], ignore_static=False
        )
        sources = tuple(source for guard in produced if not _OFFSET.fullmatch(source := _ARGUMENT.sub(r"a[\1]", guard)))
        body = " and ".join(f"({source})" for source in sources) or "True"
        check = eval(f"lambda a: {body}", dict(SYMPY_INTERP))  # noqa: S307  (fulmen's own generated source)
        symbols, places = {}, {}
        for symbol, found in sizes.var_to_sources.items():
            where = tuple(w for w in map(symbolic_position, found) if w is not None)
            if where:
                symbols[symbol], places[symbol] = where[0], where
        return ShapeGuards(sources, check, tuple(sizes.decisions), symbols, places)

    def values(self, tensors: Sequence[torch.Tensor]) -> dict[sympy.Symbol, sympy.Integer]:
        """Each symbol's value for a call these guards admit."""
        return {symbol: sympy.Integer(_value(tensors, place)) for symbol, place in self.symbols.items()}

    def explain(self, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> str | None:
        """Why these arguments fail the guards, in words (None when they pass): the first question the traced code
        would answer otherwise, else the first guard that fails."""
        values = {}
        for symbol, places in self.places.items():
            read = [_value(tensors, place) for place in places]
            if None in read:
                continue
            if len(set(read)) > 1:
                said = " and ".join(self._place(place, names) for place in places)
                return f"{said} were equal when traced (the symbol {symbol}), now {' and '.join(map(str, read))}"
            if read[0] < 2 and self.places[symbol][0][1] == "size":
                return (
                    f"{self._place(places[0], names)} is {read[0]}: a symbolic size stands for sizes of 2 and "
                    f"more ({symbol}); sizes 0 and 1 are traced apart, as torch.compile does"
                )
            values[symbol] = sympy.Integer(read[0])
        for decision in self.decisions:
            if all(_holds(guard, values) for guard in decision.guards):
                continue
            return self._decision(decision, values, names)
        for source in self.sources:
            try:
                holds = bool(eval(source, dict(SYMPY_INTERP), {"a": tensors}))  # noqa: S307
            except (IndexError, TypeError):
                holds = False
            if not holds:
                static = _STATIC_SIZE.fullmatch(source)
                if static is not None:  # a dimension of an argument with symbols that had not changed before
                    position, dim, traced = map(int, static.groups())
                    now = _value(tensors, (position, "size", dim))
                    return (
                        f"{self._place((position, 'size', dim), names)} is {now}; the trace holds it at {traced} "
                        "(a size becomes symbolic once it changes)"
                    )
                return f"{_readable(source, names)} held when traced, not now"
        return None

    def _decision(self, decision: Decision, values: dict[sympy.Symbol, sympy.Integer], names: Sequence[str]) -> str:
        symbols = sorted(decision.question.free_symbols, key=str)
        now = ", ".join(f"{s} = {values[s]} ({self._read(s, names)})" for s in symbols if s in values)
        answer = decision.answer
        if isinstance(answer, (bool, sympy.logic.boolalg.BooleanAtom)):
            said = f"{decision.question} was {bool(answer)}"
        else:  # an int() of a size: the trace holds for that value only
            said = f"{decision.question} was {answer}, used as a Python int"
        why = f" ({decision.why})" if decision.why else ""
        where = f"; asked at {decision.where.short()}: {decision.where.line}" if decision.where is not None else ""
        return f"{said}{why}, now {now}{where}"

    def _read(self, symbol: sympy.Symbol, names: Sequence[str]) -> str:
        return self._place(self.symbols[symbol], names)

    @staticmethod
    def _place(place: tuple[int, str, int], names: Sequence[str]) -> str:
        position, kind, dim = place
        name = names[position] if position < len(names) else f"argument #{position}"
        return f"{name}.shape[{dim}]" if kind == "size" else f"{name}.stride({dim})"


def _value(tensors: Sequence[torch.Tensor], place: tuple[int, str, int]) -> int | None:
    position, kind, dim = place
    if position >= len(tensors) or dim >= tensors[position].dim():
        return None
    tensor = tensors[position]
    return (tensor.shape if kind == "size" else tensor.stride())[dim]


def _holds(guard: sympy.Basic, values: dict[sympy.Symbol, sympy.Integer]) -> bool:
    if not guard.free_symbols <= values.keys():
        return True  # a symbol read elsewhere than these arguments: the compiled check decides
    try:
        return bool(guard.xreplace(values))
    except TypeError:
        return True


def _readable(source: str, names: Sequence[str]) -> str:
    """A guard's source with the arguments' names: `x.shape[1] == y.shape[1]`."""

    def name(match: re.Match) -> str:
        position = int(match.group(1))
        return names[position] if position < len(names) else f"argument #{position}"

    text = re.sub(r"a\[(\d+)\]\.size\(\)\[(\d+)\]", lambda m: f"{name(m)}.shape[{m.group(2)}]", source)
    text = re.sub(r"a\[(\d+)\]\.stride\(\)\[(\d+)\]", lambda m: f"{name(m)}.stride({m.group(2)})", text)
    return re.sub(r"a\[(\d+)\]", name, text)
