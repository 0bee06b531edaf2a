"""Acquiring `torch.autograd.Function.apply` calls as `autograd_function` watches (fulmen.transforms.function_grad).

torch calls a Function's `forward` from C++ (`_FunctionBase.apply`) with grad mode off and builds the autograd node
there, so a torch-function mode sees the forward's ops but neither the call nor the backward: the Function's grad
would be lost without a word. No dispatch hook reaches that call, so the acquisition does it where torch's Python
`Function.apply` hands over to C++, `super().apply(...)`: as the frame of `Function.apply` starts (a call watch of
the frame tap, replacements.py), its `cls` is set to a subclass of the program's Function whose method resolution
puts `_Recorded.apply` between `Function` and its C++ base, so that `super().apply` records the call instead.
Nothing of torch or the program changes: other threads, and calls outside acquisition, run torch's own `apply`.

The Function's backward is traced when its grad rule runs, after acquisition; it runs under the acquisition's frame
tap all the same (`_ObservedBackward`), so the Python state it reads is guarded as the forward's is. Known limit: it
is read when the forward is traced, so a change made between a forward and its backward (eager would see it) is not.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.utils.checkpoint
from torch.autograd.function import Function, _is_setup_context_defined, _SingleLevelFunction

from fulmen.acquisition.lookasides import checkpoint_region
from fulmen.core.bounded import LRU
from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.source import user_location
from fulmen.core.symbol import BoundSymbol, iter_proxies
from fulmen.observation.frame_tap import QuietWatch
from fulmen.transforms.function_grad import AUTOGRAD_FUNCTION, FunctionCall, FunctionContext

APPLY_CODE = Function.apply.__func__.__code__
_RECORDING: ContextVar[Any] = ContextVar("fulmen_function_apply", default=None)


class _Recorded(_SingleLevelFunction):
    """The base the acquisition adds to a Function class (after `Function` in its MRO): where torch's
    `Function.apply` calls `super().apply(...)`, this records the call."""

    _fulmen_function: type = Function  # the program's Function class, set on each subclass

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        original, interpreter = cls._fulmen_function, _RECORDING.get()
        if original is torch.utils.checkpoint.CheckpointFunction:  # checkpoint(use_reentrant=True)
            function, preserve_rng_state, *inputs = args
            recorded = interpreter.builder.scopes[-1]
            start = len(recorded)
            with checkpoint_region(interpreter.builder):
                out = function(*inputs)
            if not preserve_rng_state and any(bsym.draws_random() for bsym in recorded[start:]):
                raise TraceError("fulmen cannot trace checkpoint(preserve_rng_state=False) around random draws: eager "
                                 "draws them anew when it recomputes the function in the backward (its grads are "
                                 "for other draws than its forward's), fulmen replays the forward's draws; use "
                                 "preserve_rng_state=True", user_location())
            return out
        return record_function(interpreter, original, args, kwargs)


# The program's Function class -> its recording subclass. Bounded, not weak: the subclass holds its base, so a weak
# key would never die; a class made per call (a Function defined in a loop) would grow it without end
_RECORDED: LRU[type, type] = LRU(1024)


def _recording_class(cls: type) -> type:
    recorded = _RECORDED.get(cls)
    if recorded is None:
        recorded = type(cls)(cls.__name__, (cls, _Recorded), {"_fulmen_function": cls, "__module__": cls.__module__})
        _RECORDED[cls] = recorded
    return recorded


class FunctionApplyWatch(QuietWatch):
    """The call watch of `Function.apply` (see above)."""

    def enter(self, frame: types.FrameType) -> Any:
        local = frame.f_locals
        cls = local.get("cls")
        if (_RECORDING.get() is None or not isinstance(cls, type) or not issubclass(cls, Function)
                or issubclass(cls, _Recorded)):
            return None
        local["cls"] = _recording_class(cls)
        return self


@contextlib.contextmanager
def function_apply_recorded(interpreter: Any) -> Iterator[None]:
    """While acquiring with `interpreter` on this thread, the Function calls that `FunctionApplyWatch` sees
    record `autograd_function` watches."""
    token = _RECORDING.set(interpreter)
    try:
        yield
    finally:
        _RECORDING.reset(token)


class _ObservedBackward:
    """A Function's `backward` run with the frame tap of the acquisition that recorded its forward: the grad rule
    traces it after acquisition, where nothing else would see the Python state it reads (a global scale, a config
    the forward kept in `ctx`), which is then guarded as the forward's is (the cache entry's guards are collected
    after the grads are traced)."""

    __slots__ = ("backward", "tap")

    def __init__(self, backward: Callable[..., Any], tap: Callable[..., Any]) -> None:
        self.backward = backward
        self.tap = tap

    @property
    def __code__(self) -> types.CodeType | None:  # where the user's backward is, for errors
        return getattr(self.backward, "__code__", None)

    def __call__(self, *args: Any) -> Any:
        previous = sys.gettrace()
        sys.settrace(self.tap)
        try:
            return self.backward(*args)
        finally:
            sys.settrace(previous)


def _observed_backward(cls: type, tap: Callable[..., Any] | None) -> type:
    """`cls`, or where a frame tap watches the acquisition, a subclass of it whose backward that tap watches."""
    if tap is None:
        return cls
    namespace = {"backward": staticmethod(_ObservedBackward(cls.backward, tap)), "__module__": cls.__module__,
                 "__qualname__": cls.__qualname__}
    return type(cls)(cls.__name__, (cls,), namespace)


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
    call = FunctionCall(_observed_backward(cls, sys.gettrace()), ctx, tuple(iter_proxies((captured, values))),
                        tuple(isinstance(o, torch.Tensor) for o in outs))
    builder.scopes[-1].append(BoundSymbol(AUTOGRAD_FUNCTION, (call, captured, *values), {}, tuple(outputs), parts,
                                          location, builder.checkpoint_region))
    builder.source = location
    given = iter(outputs)
    rebuilt = tuple(next(given) if isinstance(o, torch.Tensor) else o for o in outs)
    return rebuilt if isinstance(out, tuple) else rebuilt[0]
