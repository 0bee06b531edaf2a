"""Torch's global setters a program calls: set again by every call of the trace, at their place among its ops, or
refused naming the user's line.

Eager's program sets them on every call: `torch.manual_seed(0)` before a draw makes every call draw the same
numbers, `torch.set_default_dtype(torch.float16)` makes every call's later factories half precision. A trace runs
only its ops, and acquisition ran the setter for real once, so from the second call on (or on the first, for the
ops before the call) fulmen computed otherwise. Two taps:

- the setters written in Python (`torch.manual_seed`, `torch.set_default_dtype`, `torch.use_deterministic_algorithms`,
  `torch.set_float32_matmul_precision`, ...; and the backend flags, `torch.backends.cudnn.deterministic = True`,
  whose module properties are Python) are call watches of the frame tap (frame_tap.py): as the call starts, it is
  recorded as a call of the setter's symbol (fulmen.ops.effects) with the arguments it got; then it runs for real, so
  the ops after it are acquired under the state it sets. Once the program is acquired, that state is set back
  (GlobalState.restore_replayed; the generators by `Setters.put_back`, to their state before the program's first
  seed, only where it seeded: acquisition draws nothing from them, and draws another thread makes meanwhile must
  stay made): the trace's first run, as every later one, sets it where the program did. The setters a setter calls
  (torch.manual_seed seeds CUDA's generators through torch.cuda.manual_seed_all) are its own.
- the others are refused by the observer when the program reads them (`refusal`, observer.Observer._special), as it
  refuses clocks: C functions whose calls the frame tap cannot see (`torch.set_num_threads`), the default
  generators' methods, the generator's state read or set whole (a trace would hold the state of the call that
  traced it), a new seed on every call (`torch.seed`), the default device (a torch-function mode of its own).
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.backends.cuda
import torch.backends.cudnn
import torch.backends.mkldnn

from fulmen.core.errors import TraceError
from fulmen.core.source import SourceLocation, frame_location
from fulmen.core.symbol import Symbol
from fulmen.observation.frame_tap import QuietWatch, frame_arguments
from fulmen.observation.global_state import Generators
from fulmen.ops import effects as ops

# the Python setters replayed, each by its symbol (by the function itself: torch.manual_seed is wrapped once Dynamo is
# imported, in a wrapper whose code every such wrapper shares, torch.utils.checkpoint's too)
_REPLAYED: dict[Callable[..., Any], Symbol] = {
    torch.manual_seed: ops.manual_seed,
    torch.cuda.manual_seed: ops.cuda_manual_seed,
    torch.cuda.manual_seed_all: ops.cuda_manual_seed_all,
    torch.set_default_dtype: ops.set_default_dtype,
    torch.use_deterministic_algorithms: ops.use_deterministic_algorithms,
    torch.set_deterministic_debug_mode: ops.set_deterministic_debug_mode,
    torch.set_float32_matmul_precision: ops.set_float32_matmul_precision,
    torch.set_printoptions: ops.set_printoptions,
    torch.set_warn_always: ops.set_warn_always,
}
# How torch's backend modules store a flag: a property of the module's class (cudnn, mkldnn), the cuBLAS settings'
# __setattr__, and the fp32_precision objects' __setattr__.
_CONTEXT_PROP_SET = torch.backends.ContextProp.__set__.__code__
_CUBLAS_SETATTR = type(torch.backends.cuda.matmul).__setattr__.__code__
_FP32_SETATTR = torch.backends._FP32Precision.__setattr__.__code__

_CONSTANT = (bool, int, float, str, type(None), torch.dtype)
_SEEDS = frozenset({ops.manual_seed, ops.cuda_manual_seed, ops.cuda_manual_seed_all})  # set the generators' state


class Setters:
    """The setter watches of one acquisition, recording through `interpreter`'s builder."""

    def __init__(self, interpreter: Any) -> None:
        self.interpreter = interpreter
        self.depth = 0  # setters running now: the setters they call are theirs
        self.refused: TraceError | None = None  # raised once the program ran (a region cannot raise into it)
        self.generators: Generators | None = None  # their states before the program first changed them for real
        self.device_context = _device_context()  # torch.set_default_device's mode (refused, it ran for real)
        self.watches: dict[types.CodeType, _SetterWatch] = {
            inspect.unwrap(fn).__code__: _SetterWatch(self, sym, _function_call) for fn, sym in _REPLAYED.items()}
        self.watches[_CONTEXT_PROP_SET] = _SetterWatch(self, ops.set_switch, _context_prop_call)
        self.watches[_CUBLAS_SETATTR] = _SetterWatch(self, ops.set_switch, _cublas_call)
        self.watches[_FP32_SETATTR] = _SetterWatch(self, ops.set_switch, _fp32_precision_call)

    def check(self) -> None:
        if self.refused is not None:
            raise self.refused

    def keep_generators(self) -> None:
        """The program is about to change the generators for real (a seed it sets, or one of the refused functions
        that change them, read by the observer: `changes_generators`): their states now, put back once it ran."""
        if self.generators is None:
            self.generators = Generators.current()

    def put_back(self) -> None:
        """Once the program ran (acquired or refused): the generators as they were before it first changed them
        (the trace seeds them again where the program did). Draws another thread made before that stay made; those it
        made after it, while the program was acquired, are drawn again (the program's seed would have moved them in
        eager too). A program that changes none leaves them alone: acquisition draws nothing."""
        if self.generators is not None:
            self.generators.restore()
            self.generators = None
        if _device_context() is not self.device_context:
            _restore_device_context(self.device_context)

    def record(self, sym: Symbol, args: tuple, kwargs: dict[str, Any], location: SourceLocation | None) -> None:
        builder = self.interpreter.builder
        if self.refused is not None:
            return
        where = f" ({location.short()})" if location is not None else ""
        if builder.checkpoint_region:
            self.refused = TraceError(
                f"fulmen cannot compile a program that calls {sym.printed}{where} inside torch.utils.checkpoint: the "
                "backward recomputes the checkpointed function, which would set it again there. Call it before the "
                "checkpointed function", location)
            return
        odd = next((value for value in (*args, *kwargs.values()) if not isinstance(value, _CONSTANT)), None)
        if odd is not None:
            self.refused = TraceError(
                f"fulmen cannot compile a program that calls {sym.printed}{where} with a {type(odd).__name__}: every "
                "call of the trace sets it again, with the numbers, strings or dtypes it was given while tracing. "
                "Pass a Python value", location)
            return
        builder.source = location
        builder.bind(sym, args, kwargs)


class _SetterWatch(QuietWatch):
    """A call of one setter: `call` gives its symbol's arguments from the frame as it starts (None: a call not
    replayed, such as an fp32_precision object storing its own fields)."""

    def __init__(self, setters: Setters, sym: Symbol,
                 call: Callable[[types.FrameType], tuple[tuple, dict[str, Any]] | str | None]) -> None:
        self.setters = setters
        self.sym = sym
        self.call = call

    def enter(self, frame: types.FrameType) -> Any:
        if self.setters.depth:
            return None
        call = self.call(frame)
        if call is None:
            return None
        self.setters.depth += 1
        if self.sym in _SEEDS:  # it runs for real once this returns
            self.setters.keep_generators()
        location = frame_location(frame.f_back)
        if isinstance(call, str):
            where = f" ({location.short()})" if location is not None else ""
            self.setters.refused = self.setters.refused or TraceError(
                f"fulmen cannot compile a program that sets {call}{where}: it cannot name that flag in a trace, "
                "which sets the program's flags again on every call. Set it outside the jitted function", location)
        else:
            self.setters.record(self.sym, *call, location)
        return self

    def exit(self, token: Any, value: Any, raised: bool) -> None:
        self.setters.depth -= 1


def _function_call(frame: types.FrameType) -> tuple[tuple, dict[str, Any]]:
    return frame_arguments(frame)


def _context_prop_call(frame: types.FrameType) -> tuple[tuple, dict[str, Any]] | str:
    """`module.name = value` for a flag property of one of torch's backend modules."""
    local = frame.f_locals
    prop, module, value = local["self"], local["obj"], local["val"]
    name = next((key for key, item in vars(type(module)).items() if item is prop), None)
    owner = getattr(module, "__name__", None)
    if name is None or not isinstance(owner, str) or sys.modules.get(owner) is not module:
        return f"a flag of {owner or type(module).__qualname__}"
    return (owner, name, value), {}


def _cublas_call(frame: types.FrameType) -> tuple[tuple, dict[str, Any]] | str:
    local = frame.f_locals
    if local["self"] is not torch.backends.cuda.matmul:
        return f"{local['name']} of a {type(local['self']).__qualname__}"
    return ("torch.backends.cuda.matmul", local["name"], local["value"]), {}


def _fp32_precision_call(frame: types.FrameType) -> tuple[tuple, dict[str, Any]] | str | None:
    local = frame.f_locals
    if local["name"] != "fp32_precision":
        return None  # its own fields, as it is made
    owner = _path_of(local["self"])
    if owner is None:
        return f"fp32_precision of torch.backends ({local['self'].backend}, {local['self'].op})"
    return (owner, "fp32_precision", local["value"]), {}


def _path_of(obj: Any) -> str | None:
    """The dotted path from `torch` to one of the objects torch's backend modules hold (`torch.backends.cudnn.conv`,
    a class attribute of the module's class)."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.backends") or module is None:
            continue
        for namespace in (vars(type(module)), vars(module)):
            found = next((key for key, value in namespace.items() if value is obj), None)
            if found is not None:
                return f"{name}.{found}"
    return None


_RNG_STATE = ("it reads or sets the generator's state whole, which a trace would keep as it was on the call that "
              "traced it", "Seed with torch.manual_seed(n), which every call of the trace does again, or save and "
              "restore the state outside the jitted function")
_NOT_SEEN = ("a global setter written in C, whose calls fulmen cannot see to make them again on every call as "
             "eager's program does", "Call it outside the jitted function")
# The setters refused where the program reads them: their name, why, and the fix.
_REFUSED: dict[Any, tuple[str, tuple[str, str]]] = {inspect.unwrap(fn): refused for fn, refused in {
    torch.seed: ("torch.seed", ("it seeds the generator with a new number on every call and returns it, which a "
                                "trace would repeat", "Seed with torch.manual_seed(n), which every call of the trace "
                                "does again")),
    torch.cuda.seed: ("torch.cuda.seed", ("it seeds with a new number on every call", "Seed with torch.manual_seed(n)"
                                          ", which every call of the trace does again")),
    torch.cuda.seed_all: ("torch.cuda.seed_all", ("it seeds with a new number on every call", "Seed with "
                                                  "torch.manual_seed(n), which every call of the trace does again")),
    torch.get_rng_state: ("torch.get_rng_state", _RNG_STATE),
    torch.set_rng_state: ("torch.set_rng_state", _RNG_STATE),
    torch.random.fork_rng: ("torch.random.fork_rng", _RNG_STATE),
    torch.cuda.get_rng_state: ("torch.cuda.get_rng_state", _RNG_STATE),
    torch.cuda.get_rng_state_all: ("torch.cuda.get_rng_state_all", _RNG_STATE),
    torch.cuda.set_rng_state: ("torch.cuda.set_rng_state", _RNG_STATE),
    torch.cuda.set_rng_state_all: ("torch.cuda.set_rng_state_all", _RNG_STATE),
    torch.set_default_device: ("torch.set_default_device", (
        "it sets the default device through a torch-function mode of its own, which a trace cannot set again",
        "Set it outside the jitted function, or pass device= to the factory calls")),
    torch.set_default_tensor_type: ("torch.set_default_tensor_type", (
        "it may set the default device, which a trace cannot set again", "Call torch.set_default_dtype, or set it "
        "outside the jitted function")),
    torch.set_num_threads: ("torch.set_num_threads", _NOT_SEEN),
    torch.set_num_interop_threads: ("torch.set_num_interop_threads", _NOT_SEEN),
    torch.set_flush_denormal: ("torch.set_flush_denormal", _NOT_SEEN),
    torch.set_anomaly_enabled: ("torch.set_anomaly_enabled", _NOT_SEEN),
    torch.autograd.set_detect_anomaly: ("torch.autograd.set_detect_anomaly", (
        "anomaly mode checks eager's backward op by op, which a trace's backward is not", "Set it outside the jitted "
        "function")),
    torch.autograd.detect_anomaly: ("torch.autograd.detect_anomaly", (
        "anomaly mode checks eager's backward op by op, which a trace's backward is not", "Set it outside the jitted "
        "function")),
    torch.backends.cudnn.flags: ("torch.backends.cudnn.flags", (
        "it sets backend flags for the block it guards through C functions fulmen cannot see called", "Set them "
        "outside the jitted function, or assign torch.backends.cudnn's flags (every call sets them again)")),
    torch.backends.mkldnn.flags: ("torch.backends.mkldnn.flags", (
        "it sets backend flags for the block it guards through C functions fulmen cannot see called", "Set them "
        "outside the jitted function, or assign torch.backends.mkldnn's flags (every call sets them again)")),
}.items()}
_GENERATOR_SETTERS = frozenset({"manual_seed", "seed", "set_state", "get_state", "set_offset", "graphsafe_set_state",
                                "graphsafe_get_state", "clone_state"})
_READABLE = frozenset({types.FunctionType, types.BuiltinFunctionType, type})
# What changes the default generators' states (the refused ones run for real before the refusal is raised)
_CHANGING = frozenset(inspect.unwrap(fn) for fn in (
    torch.manual_seed, torch.seed, torch.set_rng_state, torch.cuda.manual_seed, torch.cuda.manual_seed_all,
    torch.cuda.seed, torch.cuda.seed_all, torch.cuda.set_rng_state, torch.cuda.set_rng_state_all))
_CHANGING_METHODS = frozenset({"manual_seed", "seed", "set_state", "set_offset", "graphsafe_set_state"})


def changes_generators(value: Any) -> bool:
    """Whether `value`, which the program read, is a function that changes the default generators' states."""
    kind = type(value)
    if kind is types.BuiltinMethodType:  # a default generator's method, got once (seed = torch.default_generator.seed)
        return method_changes_generators(getattr(value, "__self__", None), value.__name__)
    if kind is not types.FunctionType:
        return False
    return value in _CHANGING or (hasattr(value, "__wrapped__") and inspect.unwrap(value) in _CHANGING)


def method_changes_generators(receiver: Any, name: str) -> bool:
    """Whether `receiver.name`, which the program read, is a method changing a default generator's state."""
    return type(receiver) is torch.Generator and name in _CHANGING_METHODS and _is_default(receiver)


def refusal(value: Any, frame: types.FrameType) -> TraceError | None:
    """The refusal of a program that read `value` in `frame`, if it is one of the setters fulmen cannot set again on
    every call (or a reader whose answer the trace would keep)."""
    if type(value) not in _READABLE:
        return None
    try:
        found = _REFUSED.get(value)
    except TypeError:  # an unhashable class
        return None
    if found is None and hasattr(value, "__wrapped__"):  # as Dynamo wraps some of torch's functions
        found = _REFUSED.get(inspect.unwrap(value))
    if found is None:
        return None
    name, (why, fix) = found
    return _refused(name, why, fix, frame)


def attribute_refusal(receiver: Any, name: str, frame: types.FrameType) -> TraceError | None:
    """The refusal of a program that read `receiver.name` where the observer cannot tell the value without running
    code: a method of a default generator (C code, whose calls the frame tap cannot see), a function of a backend
    module with flag properties (`torch.backends.cudnn.flags`, found through the module's `__getattr__`)."""
    if isinstance(receiver, torch.backends.PropModule):
        return refusal(vars(receiver.m).get(name), frame)
    if type(receiver) is not torch.Generator or name not in _GENERATOR_SETTERS or not _is_default(receiver):
        return None
    owner = "torch.default_generator" if receiver is torch.default_generator else "a default generator"
    return _refused(f"{owner}.{name}", "a generator's method written in C, whose calls fulmen cannot see to make them "
                    "again on every call as eager's program does", "Seed with torch.manual_seed(n), which every call "
                    "of the trace does again", frame)


def _device_context() -> Any:
    """The torch-function mode torch.set_default_device left entered (None when the default device was never set)."""
    return getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)


def _restore_device_context(previous: Any) -> None:
    """The default device as it was before the program's refused torch.set_default_device call ran: its mode left,
    the earlier one (if any) entered again, as torch.set_default_device itself swaps them."""
    current = _device_context()
    if current is not None:
        current.__exit__(None, None, None)
    if previous is not None:
        previous.__enter__()
    torch._GLOBAL_DEVICE_CONTEXT.device_context = previous


def _refused(name: str, why: str, fix: str, frame: types.FrameType) -> TraceError:
    location = frame_location(frame)
    where = f" ({location.short()})" if location is not None else ""
    return TraceError(f"fulmen cannot compile a program that calls {name}{where}: {why}. {fix}.", location)


def _is_default(generator: torch.Generator) -> bool:
    if generator is torch.default_generator:
        return True
    return torch.cuda.is_initialized() and any(generator is g for g in torch.cuda.default_generators)


# Torch's global switches read through a function (those a trace depends on anyway are in the cache key).
SWITCHES = frozenset({torch.are_deterministic_algorithms_enabled, torch.is_deterministic_algorithms_warn_only_enabled,
                       torch.get_float32_matmul_precision, torch.get_num_threads, torch.get_num_interop_threads,
                       torch.is_anomaly_enabled, torch.is_anomaly_check_nan_enabled, torch.is_inference_mode_enabled,
                       torch.is_warn_always_enabled, torch.get_default_device})
# What holds setters the observer cannot see as values: a generator's C methods, a backend module's functions
SETTER_OWNERS = (torch.Generator, torch.backends.PropModule)
