"""Typed options for `fulmen.jit`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class JitOptions:
    """Options of one jitted callable.

    Attributes:
        decompose: record each torch-level symbol's decomposition into prims as its subsymbols (the multi-level IR).
            Off makes acquisition faster when no transform needs the prim level.
        cse: merge identical calls in the final trace.
    """

    decompose: bool = True
    cse: bool = True

    def __post_init__(self) -> None:
        for name in ("decompose", "cse"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"JitOptions.{name} must be a bool, got {getattr(self, name)!r}")
