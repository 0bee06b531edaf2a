"""Torch-level symbols by name, to write execution and grad transforms with (`fulmen.torch.reshape`, `softmax`).

`fulmen.torch.NAME` is the symbol fulmen records for `torch.NAME`, else `torch.nn.functional.NAME`, else the
tensor method `torch.Tensor.NAME`. Calling it inside a transform records it; outside a trace it runs eagerly.
"""

from __future__ import annotations

from fulmen.core.symbol import Symbol
from fulmen.ops.registry import SYMBOLS

_PREFIXES = ("torch.", "torch.nn.functional.", "torch.Tensor.")


def __getattr__(name: str) -> Symbol:
    for prefix in _PREFIXES:
        sym = SYMBOLS.get(prefix + name)
        if sym is not None:
            return sym
    raise AttributeError(f"fulmen.torch has no symbol {name!r} (looked for torch.{name}, torch.nn.functional.{name} "
                         f"and torch.Tensor.{name})")
