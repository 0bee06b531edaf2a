"""Branches on a random draw that have one outcome whatever is drawn.

`torch.rand` draws from [0, 1) in float32 and float64 (a lower precision may round a draw up to 1), so comparing a
draw with a number outside that interval (rounded to the draw's dtype first, as torch compares) gives the same
answer for every draw, and an `if` on it reads nothing that
is unknown while tracing. Hugging Face's LayerDrop is written so, `if self.training: p = torch.rand([])` then
`if p < self.layerdrop: continue`, with a layerdrop of 0.0 by default (BART, OPT, Whisper, ... in train mode). The
draw stays in the trace, consuming the generator as eager's does; a comparison whose answer depends on the draw is
still refused as reading tensor values.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import Symbol
from fulmen.ops.registry import lookup


def _to_float32(number: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", number))[0]
    except OverflowError:
        return math.copysign(math.inf, number)


# The dtypes whose draws are known to stay below 1, and how a Python number they are compared with is rounded.
_ROUNDING: dict[torch.dtype, Callable[[float], float]] = {torch.float32: _to_float32, torch.float64: float}
_DRAWS = frozenset({lookup(torch.rand).symbol, lookup(torch.rand_like).symbol})
_COMPARISONS: dict[Symbol, str] = {lookup(f).symbol: f.__name__ for f in (torch.lt, torch.le, torch.gt, torch.ge)}


@dataclass(frozen=True, slots=True)
class Interval:
    """The values a tensor may hold: from `low` (included) to `high` (excluded where `open`)."""

    low: float
    high: float
    open: bool

    def compare(self, name: str, number: float) -> bool | None:
        """`torch.<name>(x, number)` ("lt", "le", "gt" or "ge") for every x in the interval, if that is one answer;
        None otherwise."""
        below = self.high <= number if self.open else self.high < number  # every x < number
        at_most = self.high <= number  # every x <= number
        if name == "lt":
            return True if below else False if self.low >= number else None
        if name == "le":
            return True if at_most else False if self.low > number else None
        if name == "gt":
            return True if self.low > number else False if at_most else None
        return True if self.low >= number else False if below else None


class Bounds:
    """The intervals of the program's draws, and the answers of comparisons of them that are certain."""

    def __init__(self) -> None:
        # id(value) -> (it, what is known of it); the value is kept so that ids stay unique
        self._intervals: dict[int, tuple[TensorProxy, Interval]] = {}
        self._answers: dict[int, tuple[TensorProxy, bool]] = {}

    def record(self, sym: Symbol, args: tuple, output: Any) -> None:
        """Notes what `sym(*args) -> output`, just recorded, makes known."""
        if type(output) is not TensorProxy:
            return
        if sym in _DRAWS and output.dtype in _ROUNDING:
            self._intervals[id(output)] = (output, Interval(0.0, 1.0, open=True))
            return
        name = _COMPARISONS.get(sym)
        if name is None or len(args) != 2 or output.numel() != 1:
            return
        known, number = self._intervals.get(id(args[0])), args[1]
        if known is None or type(number) not in (int, float) or number != number:  # NaN answers False anyway
            return
        answer = known[1].compare(name, _ROUNDING[args[0].dtype](float(number)))  # torch compares in x's dtype
        if answer is not None:
            self._answers[id(output)] = (output, answer)

    def answer(self, value: Any) -> bool | None:
        """`bool(value)` where it is known whatever was drawn; None otherwise."""
        known = self._answers.get(id(value))
        return None if known is None else known[1]
