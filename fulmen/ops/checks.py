"""Checks of tensor values that a program makes only to raise: they run with the trace, as eager runs them.

torch.distributions validates its arguments and samples (`validate_args`, on by default) with
`if not torch._is_all_true(valid): raise ValueError(...)`. A branch on values cannot be traced, but this one has a
single outcome that continues: the trace goes on as if the values were valid, and checks them when it runs, raising
eager's ValueError where they are not. The message is the distribution's, stated while tracing
(`acquisition/distribution_checks.py`).
"""

from __future__ import annotations

from typing import Any

from fulmen.core.symbol import Tag
from fulmen.core.trace import TraceBuilder
from fulmen.ops import impls
from fulmen.ops.registry import impl_symbol


def _no_outputs(builder: TraceBuilder, valid: Any, message: str) -> None:
    return None


# IMPURE: it has no output, and must neither be removed nor moved past what it guards
check_all_true = impl_symbol(impls.check_all_true, tags=Tag.IMPURE, meta=_no_outputs)
