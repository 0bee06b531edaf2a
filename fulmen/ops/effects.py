"""Symbols a trace runs for their effect, at their place among its ops: torch's global setters, and checks of tensor
values that only raise.

A program that seeds the generator (`torch.manual_seed(0)`) or sets the default dtype, determinism or matmul
precision changes what the ops after the call compute (the draws, factory dtypes, kernels), and eager's program
does it on every call. A trace that ran only its ops would do it on the first call alone (acquisition runs the
setter for real), so the setter is recorded as a call of its own (fulmen.observation.global_setters), printed as the
program wrote it and run by the torch executor.

torch.distributions validates its arguments and samples (`validate_args`, on by default) with
`if not torch._is_all_true(valid): raise ValueError(...)`. A branch on values cannot be traced, but this one has a
single outcome that continues: the trace goes on as if the values were valid, and checks them when it runs, raising
eager's ValueError where they are not. The message is the distribution's, stated while tracing
(`acquisition/distribution_checks.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fulmen.core.symbol import Symbol, Tag
from fulmen.core.trace import TraceBuilder
from fulmen.ops.kernels import impls
from fulmen.ops.registry import add_symbol, impl_symbol


def _no_outputs(builder: TraceBuilder, *args: Any, **kwargs: Any) -> None:
    return None


def _setter(fn: Callable[..., Any], printed: str) -> Symbol:
    # IMPURE: no output, and neither removed, merged nor moved past the draws and ops that follow it
    sym = Symbol(name=printed.rsplit(".", 1)[-1], printed=printed, impl=fn, meta=_no_outputs, tags=Tag.IMPURE)
    return add_symbol(sym)


manual_seed = _setter(torch.random.manual_seed, "torch.manual_seed")
cuda_manual_seed = _setter(torch.cuda.manual_seed, "torch.cuda.manual_seed")
cuda_manual_seed_all = _setter(torch.cuda.manual_seed_all, "torch.cuda.manual_seed_all")
set_default_dtype = _setter(torch.set_default_dtype, "torch.set_default_dtype")
use_deterministic_algorithms = _setter(torch.use_deterministic_algorithms, "torch.use_deterministic_algorithms")
set_deterministic_debug_mode = _setter(torch.set_deterministic_debug_mode, "torch.set_deterministic_debug_mode")
set_float32_matmul_precision = _setter(torch.set_float32_matmul_precision, "torch.set_float32_matmul_precision")
set_printoptions = _setter(torch.set_printoptions, "torch.set_printoptions")
set_warn_always = _setter(torch.set_warn_always, "torch.set_warn_always")
set_switch = impl_symbol(impls.set_switch, tags=Tag.IMPURE, meta=_no_outputs)


# --- Checks of tensor values a program makes only to raise (torch.distributions' validate_args): they run with the
# trace, as eager runs them

def _no_outputs(builder: TraceBuilder, valid: Any, message: str) -> None:
    return None


# IMPURE: it has no output, and must neither be removed nor moved past what it guards
check_all_true = impl_symbol(impls.check_all_true, tags=Tag.IMPURE, meta=_no_outputs)
