"""Acquiring `torch.autograd.Function.apply` calls as `autograd_function` regions (fulmen.transforms.function_grad).

torch calls a Function's `forward` from C++ (`_FunctionBase.apply`) with grad mode off and builds the autograd node
there, so a torch-function mode sees the forward's ops but neither the call nor the backward: the Function's grad
would be lost without a word. No dispatch hook reaches that call, so while a thread acquires a program,
`torch.autograd.Function.apply` is routed here for that thread (a ContextVar holds its interpreter); other threads
and code outside acquisition run torch's own `apply`, and the original is back once the last acquisition ends.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.utils.checkpoint
from torch.autograd.function import Function, _is_setup_context_defined

from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.source import user_location
from fulmen.core.symbol import BoundSymbol, iter_proxies
from fulmen.jit.lookasides import checkpoint_region
from fulmen.transforms.function_grad import AUTOGRAD_FUNCTION, FunctionCall, FunctionContext

_ORIGINAL_APPLY = Function.__dict__["apply"]  # a classmethod
_RECORDING: ContextVar[Any] = ContextVar("fulmen_function_apply", default=None)


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    interpreter = _RECORDING.get()
    if interpreter is None:
        return _ORIGINAL_APPLY.__func__(cls, *args, **kwargs)
    if cls is torch.utils.checkpoint.CheckpointFunction:  # checkpoint(use_reentrant=True): a checkpointed region
        function, _, *inputs = args
        with checkpoint_region(interpreter.builder):
            return function(*inputs)
    return record_function(interpreter, cls, args, kwargs)


class _Installed:
    """`Function.apply` routed to `_apply` while at least one acquisition runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0

    def __enter__(self) -> None:
        with self._lock:
            if self._users == 0:
                Function.apply = classmethod(_apply)
            self._users += 1

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                Function.apply = _ORIGINAL_APPLY


_INSTALLED = _Installed()


@contextlib.contextmanager
def function_apply_recorded(interpreter: Any) -> Iterator[None]:
    """While acquiring with `interpreter` on this thread, Function calls record `autograd_function` regions."""
    token = _RECORDING.set(interpreter)
    try:
        with _INSTALLED:
            yield
    finally:
        _RECORDING.reset(token)


def _run_forward(cls: type, ctx: FunctionContext, values: tuple) -> Any:
    with torch.no_grad():  # as eager runs it
        if _is_setup_context_defined(cls.setup_context):
            out = cls.forward(*values)
            cls.setup_context(ctx, values, out)
            return out
        return cls.forward(ctx, *values)


def _captured(parts: list[BoundSymbol], given: set[str]) -> tuple[TensorProxy, ...]:
    """Proxies the parts read that they did not compute and the call was not given (closures, module tensors)."""
    produced: set[str] = set()
    reads: dict[str, TensorProxy] = {}
    for part in parts:
        for proxy in part.proxy_args():
            if proxy.pname not in produced and proxy.pname not in given:
                reads.setdefault(proxy.pname, proxy)
        produced.update(part.output_names())
    return tuple(reads.values())


def record_function(interpreter: Any, cls: type, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Records `cls.apply(*args)`: its forward's ops as the parts of one `autograd_function` call."""
    if _is_setup_context_defined(cls.setup_context):
        bound = inspect.signature(cls.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        args, kwargs = bound.args, bound.kwargs
    if kwargs:
        raise TypeError(f"{cls.__qualname__}.apply() takes no keyword arguments")
    builder = interpreter.builder
    location = user_location()
    values = tuple(interpreter._values(list(args)))
    grad_enabled = torch.is_grad_enabled()
    ctx = FunctionContext(tuple(grad_enabled and type(v) is TensorProxy and v.requires_grad for v in values))
    builder.scopes.append([])
    try:
        out = _run_forward(cls, ctx, values)
    except TraceError as error:
        message = str(error).split("\n  at ", 1)[0]
        raise type(error)(f"in the forward of autograd.Function {cls.__qualname__}: {message}",
                          error.location) from error
    finally:
        parts = builder.scopes.pop()
    if ctx.dirty:
        raise TraceError(f"fulmen does not support autograd.Function {cls.__qualname__}: its forward modifies inputs "
                         "in place (ctx.mark_dirty); return new tensors instead", location)
    outs = out if isinstance(out, tuple) else (out,)
    tensors = [o for o in outs if isinstance(o, torch.Tensor)]
    non_differentiable = {id(t) for t in ctx.non_differentiable}
    differentiable = grad_enabled and any(ctx.needs_input_grad)
    results = [interpreter._values(t) for t in tensors]
    outputs = [builder.make_proxy(r.meta, r.device, differentiable and id(t) not in non_differentiable
                                  and (r.dtype.is_floating_point or r.dtype.is_complex))
               for t, r in zip(tensors, results)]
    builder.adopt_results(parts, results, outputs, location)
    captured = _captured(parts, {p.pname for p in iter_proxies(values)})
    call = FunctionCall(cls, ctx, tuple(iter_proxies((captured, values))),
                        tuple(isinstance(o, torch.Tensor) for o in outs))
    builder.scopes[-1].append(BoundSymbol(AUTOGRAD_FUNCTION, (call, captured, *values), {}, tuple(outputs), parts,
                                          location, builder.checkpoint_region))
    builder.source = location
    given = iter(outputs)
    rebuilt = tuple(next(given) if isinstance(o, torch.Tensor) else o for o in outs)
    return rebuilt if isinstance(out, tuple) else rebuilt[0]
