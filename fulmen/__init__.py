"""fulmen: a source-to-source compiler for PyTorch training programs.

    jitted = fulmen.jit(model_or_function)
    out = jitted(*args)
    print(fulmen.last_traces(jitted)[-1])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

import fulmen.ops  # noqa: F401  (registers the torch-level symbols)
import fulmen.transforms.vjp_torch  # noqa: F401  (registers the grad rules)
from fulmen.core.errors import DataDependentError, FulmenError, TraceError, UnsupportedOpError
from fulmen.core.trace import Trace
from fulmen.examine import ExamineReport, examine
from fulmen.jit.jitted import CacheStats, JittedFunction, JittedModule, core
from fulmen.options import JitOptions
from fulmen.transforms.autodiff import get_grad, put_grad, put_grads, register_grad

__all__ = [
    "CacheStats", "DataDependentError", "ExamineReport", "FulmenError", "JitOptions", "JittedFunction",
    "JittedModule", "Trace", "TraceError", "UnsupportedOpError", "cache_hits", "cache_misses", "examine", "jit",
    "get_grad", "last_backward_traces", "last_traces", "put_grad", "put_grads", "register_grad",
]


def jit(fn: Callable[..., Any] | nn.Module, options: JitOptions | None = None) -> JittedFunction | JittedModule:
    """Acquires `fn` (a function or an `nn.Module`) into traces on its first call and runs them after."""
    options = options or JitOptions()
    if isinstance(fn, JittedModule | JittedFunction):
        return fn
    if isinstance(fn, nn.Module):
        return JittedModule(fn, options)
    if not callable(fn):
        raise TypeError(f"fulmen.jit expects a function or an nn.Module, got {type(fn).__name__}")
    return JittedFunction(fn, options)


def last_traces(fn: JittedFunction | JittedModule) -> list[Trace]:
    """The traces of the last call, in the order the passes produced them (the last one is what ran)."""
    entry = core(fn).last_entry
    if entry is None:
        raise RuntimeError("last_traces: the jitted callable has not been called yet")
    return list(entry.traces)


def last_backward_traces(fn: JittedFunction | JittedModule) -> list[Trace]:
    """The backward traces of the last call (empty when it built no backward: no input required grad)."""
    entry = core(fn).last_entry
    if entry is None:
        raise RuntimeError("last_backward_traces: the jitted callable has not been called yet")
    return list(entry.backward_traces)


def cache_hits(fn: JittedFunction | JittedModule) -> int:
    return core(fn).stats.hits


def cache_misses(fn: JittedFunction | JittedModule) -> int:
    return core(fn).stats.misses
