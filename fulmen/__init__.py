"""fulmen: a source-to-source compiler for PyTorch training programs.

    jitted = fulmen.jit(model_or_function)
    out = jitted(*args)
    print(fulmen.last_traces(jitted)[-1])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

import fulmen.ops  # noqa: F401  (registers the torch-level symbols)
from fulmen import dynamo, extend, torch  # noqa: F401  (public namespaces: fulmen.dynamo, fulmen.extend, fulmen.torch)
from fulmen.core.errors import (
    CacheLimitError,
    CacheLimitWarning,
    DataDependentError,
    FulmenError,
    TraceError,
    UnsupportedOpError,
)
from fulmen.core.proxies import TensorProxy
from fulmen.core.trace import Trace
from fulmen.examine import ExamineReport, examine
from fulmen.executors.base import Executor
from fulmen.executors.registry import get_default_executors, get_executor
from fulmen.executors.registry import resolve as resolve_executors
from fulmen.functional.derivatives import FunctionalTransform, grad, jvp, vjp
from fulmen.functional.vmap import vmap
from fulmen.jit.dynamic_shapes import mark_dynamic
from fulmen.jit.jitted import CacheStats, JittedFunction
from fulmen.jit.jitted_module import JittedModule, pipeline
from fulmen.jit.jitted_module import core as _jitted_core  # not `core`, which would hide the subpackage fulmen.core
from fulmen.jit.rewrite import rewrite
from fulmen.ops.rules.grad import get_grad, put_grad, put_grads, register_grad
from fulmen.options import CacheLimitAction, Float8Options, JitOptions, OffloadOptions
from fulmen.transforms.transform import GradTraces, Stage, TraceKind, Transform, TransformError

__all__ = [
    "CacheLimitAction", "CacheLimitError", "CacheLimitWarning", "CacheStats", "DataDependentError", "ExamineReport",
    "Float8Options", "FulmenError", "FunctionalTransform", "GradTraces", "JitOptions", "JittedFunction", "JittedModule",
    "OffloadOptions", "Stage", "TensorProxy", "Trace", "TraceError", "TraceKind", "Transform", "TransformError",
    "UnsupportedOpError", "cache_hits", "cache_misses", "examine", "extend", "get_default_executors", "get_executor",
    "get_grad", "grad", "jit", "jvp", "last_backward_traces", "last_cache_miss_reasons", "last_traces", "mark_dynamic",
    "put_grad", "pipeline", "put_grads", "register_grad", "rewrite", "torch", "vjp", "vmap",
]


def jit(fn: Callable[..., Any] | nn.Module, executors: Sequence[Executor | str] | None = None,
        options: JitOptions | None = None, *, transforms: Sequence[Transform] = (),
        offload: OffloadOptions | None = None) -> JittedFunction | JittedModule:
    """Acquires `fn` (a function or an `nn.Module`) into traces on its first call and runs them after.

    `executors` is a priority list of executor objects or names (default: `get_default_executors()`, as it is when
    `fulmen.jit` is called); the torch executor always comes last. A registration on one of them after this call
    (`register_implementation`, ...) makes the next call trace again, as a fresh `fulmen.jit` would. `transforms`
    and `offload` set `JitOptions.transforms` and `JitOptions.offload` (give them here or in `options`, not both):
    user trace transforms run at the pipeline's stages (fulmen.jit.pipeline), and CPU offloading of the tensors
    saved for the backward.
    """
    options = options or JitOptions()
    if isinstance(transforms, Transform):
        raise TypeError("fulmen.jit: transforms must be a list of fulmen.Transform, e.g. transforms=[MyTransform()]")
    if transforms:
        if options.transforms:
            raise ValueError("fulmen.jit: give transforms as an argument or in JitOptions.transforms, not both")
        options = dataclasses.replace(options, transforms=tuple(transforms))
    if offload is not None:
        if options.offload is not None:
            raise ValueError("fulmen.jit: give offload as an argument or in JitOptions.offload, not both")
        options = dataclasses.replace(options, offload=offload)
    resolved = resolve_executors(executors)
    if isinstance(fn, FunctionalTransform):  # fulmen.grad(f) / vmap(f): jitted with these executors and options
        return JittedFunction(fn.inline, options, executors=resolved)
    if isinstance(fn, JittedModule | JittedFunction):
        return fn
    if isinstance(fn, nn.Module):
        return JittedModule(fn, options, resolved)
    if not callable(fn):
        raise TypeError(f"fulmen.jit expects a function or an nn.Module, got {type(fn).__name__}")
    return JittedFunction(fn, options, executors=resolved)


def last_traces(fn: JittedFunction | JittedModule | dynamo.FulmenBackend) -> list[Trace]:
    """The traces of the last call, in the order the passes produced them (the last one is what ran). For a
    `fulmen.dynamo` backend: the trace each piece fulmen compiled ran last."""
    if isinstance(fn, dynamo.FulmenBackend):
        return fn.last_traces()
    entry = _jitted_core(fn).last_entry
    if entry is None:
        raise RuntimeError("last_traces: the jitted callable has not been called yet")
    return list(entry.traces)


def last_backward_traces(fn: JittedFunction | JittedModule | dynamo.FulmenBackend) -> list[Trace]:
    """The backward traces of the last call (empty when it built no backward: no input required grad). For a
    `fulmen.dynamo` backend: the backward trace each piece fulmen compiled built last."""
    if isinstance(fn, dynamo.FulmenBackend):
        return fn.last_backward_traces()
    entry = _jitted_core(fn).last_entry
    if entry is None:
        raise RuntimeError("last_backward_traces: the jitted callable has not been called yet")
    return list(entry.backward_traces)


def cache_hits(fn: JittedFunction | JittedModule) -> int:
    return _jitted_core(fn).stats.hits


def cache_misses(fn: JittedFunction | JittedModule) -> int:
    return _jitted_core(fn).stats.misses


def last_cache_miss_reasons(fn: JittedFunction | JittedModule) -> list[str]:
    """Why the last call that missed the cache could not reuse each cached trace: one line per trace, naming the
    first thing that differed (a tensor's shape or strides, a global, an attribute, which inputs share memory...).
    Empty before the first retrace."""
    return list(_jitted_core(fn).last_miss_reasons)
