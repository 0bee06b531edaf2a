"""What the acquisition does in place of a call: one table per acquisition, consulted when the call happens.

Nothing of the program is rebound: no module global, class attribute or function object changes, so other threads
(and this one, after acquiring) run the program as written. Three kinds of entries, found three ways:

- a torch callable an executor replaces (`replaces=F.layer_norm`): the interpreter's dispatch table
  (`Interpreter.replaced`), since its torch-function mode sees every torch call;
- a Python function or method an executor replaces (`replaces=apply_rope`, `replaces=NewGELU.forward`),
  `torch.utils.checkpoint.checkpoint` and the wrapper of a function torch.compile made: a *call watch*, keyed by code
  object. The frame tap (frame_tap.py) sees every frame the acquired program starts, however the function was reached (a
  module global, an import by name, a closure, a saved bound method); for a region it calls `enter` as the frame starts
  and `exit` as it returns, and the function's own code runs in between. A replaced function's ops become the parts of
  one call of its operator; a checkpoint call is set to its reentrant form, which autograd_functions.py records as a
  checkpointed region; a `torch.autograd.Function.apply` call hands its `super().apply` to the recording of
  autograd_functions.py; a compiled function runs the function it wraps, traced (compiled_calls.py); a torch.func
  transform
  made gives fulmen's (torch_func_calls.py);
- a method lookaside (`register_lookaside(LLaMAMLP.forward, ...)`): a method that runs *instead of* the original,
  so it must be found before the call: a module's forward where `nn.Module.__call__` looked it up (a region on
  `_call_impl`, `ForwardLookasideWatch`), and any method the program looks up on the jitted module and its
  submodules where their shadow modules (module_inputs.py) resolve it. lookasides.py's built-in lookasides live in
  the shadow classes.

Where several active executors replace one function, the first in priority order does; if its checker declines,
the function's own code runs.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from fulmen.acquisition.autograd_functions import APPLY_CODE, FunctionApplyWatch
from fulmen.acquisition.compiled_calls import COMPILE_WRAPPER_CODE, CompiledCallWatch
from fulmen.acquisition.lookasides import method_lookasides
from fulmen.acquisition.torch_func_calls import WATCHES as FUNC_TRANSFORM_WATCHES
from fulmen.core.source import frame_location
from fulmen.core.symbol import Symbol
from fulmen.observation.frame_tap import CallWatch, QuietWatch, frame_arguments
from fulmen.ops import lookup


def replacement_table(executors: tuple[Any, ...]) -> dict[Callable[..., Any], Symbol | Callable[..., Any]]:
    """Replaced callable -> the operator recorded or the function traced in its place (a lookaside), the first
    executor in priority order winning."""
    table: dict[Callable[..., Any], Symbol | Callable[..., Any]] = {}
    for executor in executors:
        for original, sym in getattr(executor, "replacements", {}).items():
            table.setdefault(original, sym)
        for original, function in getattr(executor, "lookasides", {}).items():
            table.setdefault(original, function)
    return table


class OperatorWatch(QuietWatch):
    """A call of a replaced function, recorded as one call of `sym` whose parts are the function's own ops."""

    def __init__(self, original: types.FunctionType, sym: Symbol, interpreter: Any) -> None:
        self.original = original
        self.sym = sym
        self.interpreter = interpreter

    def enter(self, frame: types.FrameType) -> Any:
        if not _frame_of(frame, self.original):
            return None
        args, kwargs = frame_arguments(frame)
        return self.interpreter.begin_replacement(self.sym, args, kwargs, frame_location(frame.f_back))

    def exit(self, token: Any, value: Any, raised: bool) -> None:
        self.interpreter.end_replacement(token, None if raised else value, raised)


def _frame_of(frame: types.FrameType, function: types.FunctionType) -> bool:
    """Whether `frame` (of `function`'s code) runs `function` itself: closures of one `def` (a decorator's
    wrapper) share their code and differ in the values of their free variables."""
    if not function.__closure__:
        return True
    local = frame.f_locals
    return all(local.get(name, cell) is cell.cell_contents
               for name, cell in zip(frame.f_code.co_freevars, function.__closure__))


class CheckpointWatch(QuietWatch):
    """A call of `torch.utils.checkpoint.checkpoint`, however the program reached it. Its non-reentrant form would
    run torch's saved-tensor machinery (and the program's own saved-tensor hooks) on the proxies; instead, as the
    call starts, its arguments are set to the reentrant form (as a debugger sets locals: the keyword arguments of
    the checkpointed function bound into it), whose `CheckpointFunction` the acquisition records as a checkpointed
    region (autograd_functions.py). Either form computes the same; in a trace the region is recomputed in the backward.
    `context_fn` and `determinism_check` concern torch's own recomputation, which the trace does not use."""

    def enter(self, frame: types.FrameType) -> Any:
        local = frame.f_locals
        kwargs = dict(local["kwargs"])
        preserve = kwargs.pop("preserve_rng_state", True)
        if kwargs:
            local["function"] = functools.partial(local["function"], **kwargs)
        local.update(use_reentrant=True, context_fn=torch.utils.checkpoint.noop_context_fn, debug=False,
                     kwargs={"preserve_rng_state": preserve})
        return self


class ForwardLookasideWatch(QuietWatch):
    """`nn.Module.__call__` of a module whose class's forward has a lookaside: an executor's, or a built-in one
    (lookasides.py). Its `_call_impl` looks the bound forward up into the local `forward_call` and then calls it;
    between the two (at the next line) the local is rebound to the lookaside bound to the same module, as a
    debugger sets a local: the module's class is untouched. This serves modules the program reaches any way (an
    argument of a jitted function included); the shadow modules of a jitted module answer its other methods too
    (module_inputs.py)."""

    def __init__(self, lookasides: dict[Callable[..., Any], Callable[..., Any]]) -> None:
        self.lookasides = lookasides

    def enter(self, frame: types.FrameType) -> Any:
        """The (forward, lookaside) pair of this call's module, or None when its class's forward has no lookaside
        (a shadow module's forward may be the lookaside itself)."""
        cls = type(frame.f_locals.get("self"))
        forward = getattr(cls, "forward", None)
        lookaside = self.lookasides.get(forward) or method_lookasides(cls).get("forward")
        return (forward, lookaside) if lookaside is not None and lookaside is not forward else None

    def line(self, token: Any, frame: types.FrameType) -> None:
        forward, lookaside = token
        call = frame.f_locals.get("forward_call")
        if type(call) is types.MethodType and call.__func__ is forward:  # not a forward set on the instance
            frame.f_locals["forward_call"] = types.MethodType(lookaside, call.__self__)


_CALL_IMPL_CODE = torch.nn.Module._call_impl.__code__
_FORWARD_CALL_LOCAL = "forward_call" in (*_CALL_IMPL_CODE.co_varnames, *_CALL_IMPL_CODE.co_cellvars)
_CHECKPOINT_CODE = inspect.unwrap(torch.utils.checkpoint.checkpoint).__code__  # under torch's dynamo-disable wrapper


@dataclass(frozen=True)
class CallTable:
    """What one acquisition does in place of calls (see the module docstring)."""

    torch: dict[Callable[..., Any], Symbol]  # replaced torch callables, for the interpreter's dispatch
    watches: dict[types.CodeType, CallWatch]  # for the frame tap
    lookasides: dict[Callable[..., Any], Callable[..., Any]]  # method -> the function traced in its place


def call_table(executors: tuple[Any, ...], interpreter: Any) -> CallTable:
    """The table of one acquisition with these executors, recording through `interpreter`."""
    torch_calls: dict[Callable[..., Any], Symbol] = {}
    watches: dict[types.CodeType, CallWatch] = {_CHECKPOINT_CODE: CheckpointWatch(), APPLY_CODE: FunctionApplyWatch()}
    if COMPILE_WRAPPER_CODE is not None:
        watches[COMPILE_WRAPPER_CODE] = CompiledCallWatch()
    watches.update(FUNC_TRANSFORM_WATCHES)
    lookasides: dict[Callable[..., Any], Callable[..., Any]] = {}
    for original, target in replacement_table(executors).items():
        if lookup(original) is not None:
            torch_calls[original] = target
        elif isinstance(target, Symbol):
            watches.setdefault(original.__code__, OperatorWatch(original, target, interpreter))
        else:
            lookasides[original] = target
    if _FORWARD_CALL_LOCAL:  # also for the built-in lookasides of modules the program receives
        watches[_CALL_IMPL_CODE] = ForwardLookasideWatch(lookasides)
    elif lookasides:
        raise RuntimeError(f"fulmen's method lookasides do not know this torch's nn.Module.__call__ "
                           f"(torch {torch.__version__} has no local forward_call in Module._call_impl)")
    return CallTable(torch_calls, watches, lookasides)
