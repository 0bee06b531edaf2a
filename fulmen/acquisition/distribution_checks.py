"""torch.distributions' validation of arguments and samples while tracing (`validate_args`, on by default).

`Distribution.__init__` and `_validate_sample` check values with `if not torch._is_all_true(valid): raise
ValueError(...)`. Acquisition answers true and records the check itself (`fulmen.ops.effects`), which raises eager's
ValueError when the trace runs on invalid values. The message is stated now, from the validating frame's locals,
as eager words it (the distribution's parameters are named by its class: their values are unknown while tracing).
Any other reader of `_is_all_true` branches on the value, and is refused as data-dependent.
"""

from __future__ import annotations

import sys
from types import FrameType

from torch.distributions import Distribution

from fulmen.core.source import is_fulmens

_ARGUMENTS = Distribution.__init__.__code__
_SAMPLE = Distribution._validate_sample.__code__


def caller() -> FrameType | None:
    """The innermost frame outside fulmen: the one that called the torch function being handled."""
    frame = sys._getframe(1)
    while frame is not None and is_fulmens(frame):
        frame = frame.f_back
    return frame


def message(frame: FrameType | None) -> str | None:
    """The ValueError message of the distribution's validation that `frame` runs, or None when it runs none."""
    if frame is None or frame.f_code not in (_ARGUMENTS, _SAMPLE):
        return None
    local = frame.f_locals
    needed = ("self", "value", "param", "constraint") if frame.f_code is _ARGUMENTS else ("self", "value", "support")
    if not all(name in local for name in needed):
        return None  # a torch release that words its checks otherwise: refused as any other read of the value
    shape, name = tuple(local["value"].shape), type(local["self"]).__name__
    if frame.f_code is _ARGUMENTS:
        return (f"Expected parameter {local['param']} (Tensor of shape {shape}) of distribution {name} to satisfy the "
                f"constraint {local['constraint']!r}, but found invalid values")
    return (f"Expected value argument (Tensor of shape {shape}) to be within the support ({local['support']!r}) of "
            f"the distribution {name}, but found invalid values")
