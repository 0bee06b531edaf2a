"""Typed options for `fulmen.jit`."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CacheLimitAction(str, enum.Enum):
    """What a call does when it misses the cache and the cache already holds `JitOptions.cache_limit` traces."""

    EAGER = "eager"  # run the function eagerly, uncompiled (a warning says why the calls keep missing, once)
    ERROR = "error"  # raise fulmen.CacheLimitError, saying why


@dataclass(frozen=True, slots=True)
class JitOptions:
    """Options of one jitted callable.

    Attributes:
        decompose: record each torch-level symbol's decomposition into prims as its subsymbols (the multi-level IR).
            Off makes acquisition faster when no transform needs the prim level.
        cse: merge identical calls in the final trace.
        cache_limit: how many traces one jitted callable keeps (torch.compile's default recompile limit is 8 too);
            each holds its compiled code and, for a training step, its saved-for-backward plan.
        cache_limit_action: what a call that needs one more trace does then: "eager" (run uncompiled, with a warning
            naming what keeps changing) or "error" (raise fulmen.CacheLimitError).
    """

    decompose: bool = True
    cse: bool = True
    cache_limit: int = 8
    cache_limit_action: CacheLimitAction | str = CacheLimitAction.EAGER

    def __post_init__(self) -> None:
        for name in ("decompose", "cse"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"JitOptions.{name} must be a bool, got {getattr(self, name)!r}")
        if type(self.cache_limit) is not int or self.cache_limit < 1:
            raise ValueError(f"JitOptions.cache_limit must be a positive int, got {self.cache_limit!r}")
        try:
            action = CacheLimitAction(self.cache_limit_action)
        except ValueError:
            choices = ", ".join(repr(a.value) for a in CacheLimitAction)
            raise ValueError(f"JitOptions.cache_limit_action must be one of {choices}, got "
                             f"{self.cache_limit_action!r}") from None
        object.__setattr__(self, "cache_limit_action", action)
