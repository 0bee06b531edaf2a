"""Autocast during acquisition: the conversions `torch.autocast` would make become explicit ops in the trace.

Which ops autocast runs in lower precision, which in float32 and which it promotes is decided by torch itself:
each op is run once per signature on fake tensors of the real device type under autocast, and again with autocast
off and the conversions it saw made of the inputs (or the float32 dtype argument it gives reductions on CUDA) put
in front. Where both runs compute the same calls on the same dtypes, those conversions are what the trace states,
so it runs the same with autocast off (as fulmen runs it). Where autocast converts a value computed inside an op,
the op is traced as its parts when aten's composite is known (`PARTS`), else refused.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fulmen.core.bounded import LRU
from fulmen.core.errors import TraceError, UnsupportedOpError
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import Symbol, iter_proxies, map_proxies
from fulmen.core.trace import TraceBuilder
from fulmen.ops.registry import SYMBOLS

DEVICE_TYPES = ("cpu", "cuda")
# What autocast does to a call, by its symbol and arguments' dtypes and shapes: shapes that keep changing (dynamic
# shapes, variable lengths) would grow it without end
_PROBES: LRU[Any, AutocastPlan] = LRU(4096)


def active_device_type(values: Any) -> str | None:
    """The device type whose autocast applies to an op on these arguments, if autocast is on for it."""
    for proxy in iter_proxies(values):
        kind = proxy.device.type
        return kind if kind in DEVICE_TYPES and torch.is_autocast_enabled(kind) else None
    return None


aten = torch.ops.aten
# Ops that only move or copy elements and whose backward only moves them back (no sums, unlike expand's): autocast
# converting their result is the same as converting the input they read, in front of the op, forward and backward.
_MOVES = frozenset({
    aten.view, aten._unsafe_view, aten._reshape_alias, aten.reshape, aten.permute, aten.transpose, aten.t,
    aten.unsqueeze, aten.squeeze, aten.select, aten.slice, aten.narrow, aten.diagonal, aten.clone, aten.alias,
    aten.detach, aten.split, aten.split_with_sizes, aten.unbind, aten.chunk, aten.contiguous,
})
# Ops that read a tensor's metadata only.
_METADATA = frozenset({aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.new_empty,
                       aten.new_zeros, aten.new_ones, aten.new_full})


# What an op computes: each computing call, with the dtypes it reads and gives.
Computed = list[tuple[Any, tuple[torch.dtype, ...], tuple[torch.dtype, ...]]]


def _dtypes(tree: Any) -> tuple[torch.dtype, ...]:
    return tuple(t.dtype for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


class _Recorder(TorchDispatchMode):
    """Records, while an op runs on fake tensors, the conversions of its inputs (following each input through
    ops that only move its elements: einsum or an unbatched conv1d convert the views they make of their inputs),
    and what the op computes: each computing call with the dtypes it reads and gives."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.origin = {id(t): i for i, t in enumerate(inputs)}
        self.alive = list(inputs)  # keeps the ids in `origin` from being reused
        self.casts: dict[int, torch.dtype] = {}
        self.conflict: str | None = None
        self.computed: Computed = []
        self.foreign: str | None = None  # the first op outside aten: what it computes inside is not seen here

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        position = self.origin.get(id(source)) if source is not None else None
        dtype = kwargs.get("dtype")
        if packet is aten._to_copy and position is not None and dtype not in (None, source.dtype):
            if self.casts.setdefault(position, dtype) != dtype:
                self.conflict = f"one input is converted to both {self.casts[position]} and {dtype}"
        elif packet in _MOVES:
            if position is not None:
                self.origin.update((id(t), position) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
                self.alive.append(out)
        elif packet not in _METADATA and _dtypes(out):  # not a query (its device, its size)
            self.computed.append((packet, _dtypes((args, kwargs)), _dtypes(out)))
        # (prim: TorchScript's queries, prim.device)
        if getattr(func, "namespace", None) not in ("aten", "prim") and self.foreign is None:
            self.foreign = str(packet)
        return out


@dataclass(frozen=True, slots=True)
class AutocastPlan:
    casts: dict[int, torch.dtype]  # tensor argument (by position among the proxies) -> the dtype it is cast to
    # The dtype autocast gives the output, where the op converts its result only under autocast (rms_norm).
    output: torch.dtype | None = None
    # The dtype argument autocast gives the op (a reduction on CUDA, accumulated and returned in float32).
    dtype: torch.dtype | None = None
    # Why autocast's conversions cannot be stated as conversions of the op's inputs (None: they can).
    unstated: str | None = None
    # The dtypes of the op's tensor outputs under autocast (in pytree order), as eager returns them.
    gives: tuple[torch.dtype, ...] = ()


_NOTHING = AutocastPlan({})


def _probe(sym: Symbol, args: tuple, kwargs: dict[str, Any]) -> AutocastPlan:
    """Runs the op on fake tensors under autocast, then with autocast off: its inputs as they are, then with the
    conversions autocast made of them, then with the dtype argument autocast gives reductions on CUDA. The first
    that computes the same calls on the same dtypes is the plan (a conversion the op makes of its result only
    under autocast is stated after it). Conversions the op makes itself (sdpa's math upcast) happen in every run;
    autocast's are the difference. None matching: the plan says why (`unstated`), and fulmen refuses the op.

    An executor's operator (fulmen.extend) is refused also where its kernel cannot be seen whole: a kernel that
    does not run on fake tensors, or calls an op outside aten (a torch.library op's fake runs in place of the code
    autocast would convert in). Its plan must be exact, since its kernel runs with autocast off."""
    fakes: list[torch.Tensor] = []
    operator = sym.executor is not None

    with torch._C.DisableTorchFunction(), FakeTensorMode(allow_non_fake_inputs=True):
        def fake(p: TensorProxy) -> torch.Tensor:
            fakes.append(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device))
            return fakes[-1]

        fake_args, fake_kwargs = map_proxies(args, fake), map_proxies(kwargs, fake)

        def run(casts: dict[int, torch.dtype] | None, dtype: torch.dtype | None = None,
                ) -> tuple[_Recorder, tuple[torch.dtype, ...]]:
            converted = {id(t): t.to(casts[i]) for i, t in enumerate(fakes) if i in (casts or {})}
            call_args, call_kwargs = pytree.tree_map(lambda x: converted.get(id(x), x), (fake_args, fake_kwargs))
            recorder = _Recorder(fakes)
            with contextlib.nullcontext() if casts is None else _autocast_off(), recorder:
                out = sym.impl(*call_args, **(call_kwargs if dtype is None else {**call_kwargs, "dtype": dtype}))
            return recorder, _dtypes(out)

        try:
            under, gives = run(None)
        except Exception as error:  # noqa: BLE001 - a torch op the probe cannot run is left as it is
            if operator:
                return AutocastPlan({}, unstated=f"its fn does not run on fake tensors ({type(error).__name__}: "
                                                 f"{error}), so what autocast converts inside it is unknown")
            return _NOTHING
        if under.conflict:
            return AutocastPlan({}, unstated=under.conflict)
        if operator and under.foreign is not None:
            return AutocastPlan({}, unstated=f"its fn calls {under.foreign}, inside which autocast's conversions "
                                             "are not seen")
        differs = ""
        # autocast's conversions of the inputs; or the dtype argument it gives a reduction (sum, cumsum, softmax on
        # CUDA: accumulated and returned in float32)
        # (torch's reductions take one; an operator's fn is called with the arguments the program gives it)
        dtype_argument = (gives[0] if len(gives) == 1 and fake_kwargs.get("dtype") is None and not operator
                          else None)
        options: list[tuple[dict[int, torch.dtype], torch.dtype | None]] = [({}, None)]
        if under.casts:
            options.append((under.casts, None))
        if dtype_argument is not None:
            options.append(({}, dtype_argument))
        for casts, dtype in options:
            try:
                with _quiet_fake_tensors():
                    stated, plain_gives = run(casts, dtype)
            except Exception as error:  # noqa: BLE001 - these conversions alone do not even run
                differs = differs or f" (with only its inputs converted it raises {type(error).__name__})"
                continue
            if under.computed == stated.computed and gives == plain_gives:
                return AutocastPlan(casts, dtype=dtype, gives=gives)
            if under.computed == [*stated.computed, (aten._to_copy, plain_gives, gives)] and len(gives) == 1:
                return AutocastPlan(casts, output=gives[0], gives=gives)
            differs = differs or _first_difference(under.computed, stated.computed)
    return AutocastPlan({}, unstated="autocast converts inside it" + differs)


@contextlib.contextmanager
def _quiet_fake_tensors() -> Iterator[None]:
    """Fake tensors log an error for a meta kernel that raises; here that is an answer, not a failure."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _first_difference(under: Computed, stated: Computed) -> str:
    differs = next((u for u, s in itertools.zip_longest(under, stated) if u != s), None)
    return f" ({differs[0]} reads {_named(differs[1])}, gives {_named(differs[2])})" if differs else ""


def _named(dtypes: tuple[torch.dtype, ...]) -> str:
    return "(" + ", ".join(str(d).removeprefix("torch.") for d in dtypes) + ")"


# Composites whose conversions under autocast fall between their parts, traced as those parts (each planned on its
# own), as aten's composite computes them: keyed by the symbol's printed name; a part function returns
# NotImplemented for arguments it does not split. `call(symbol, args, kwargs)` records one part.
Call = Callable[[Symbol, tuple, dict[str, Any]], Any]


def _cross_entropy_parts(call: Call, input: Any, target: Any, weight: Any = None, size_average: Any = None,
                         ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                         label_smoothing: float = 0.0) -> Any:
    """Class indices, no smoothing: aten's log_softmax in the input's dtype, then nll_loss (which autocast runs in
    float32 on CUDA: its input, computed inside cross_entropy, is converted there)."""
    if label_smoothing or size_average is not None or reduce is not None or target.dtype.is_floating_point:
        return NotImplemented
    logp = call(SYMBOLS["torch.log_softmax"], (input, 0 if input.dim() == 1 else 1), {"dtype": input.dtype})
    return call(SYMBOLS["torch.nn.functional.nll_loss"], (logp, target),
                {"weight": weight, "ignore_index": ignore_index, "reduction": reduction})


PARTS: dict[str, Callable[..., Any]] = {"torch.nn.functional.cross_entropy": _cross_entropy_parts}


class _Unkeyed(Exception):
    """An operator's argument that a probe's key cannot describe: its fn may read more of it than its type."""


def _signature(sym: Symbol, args: tuple, kwargs: dict[str, Any], device_type: str) -> Any:
    def describe(obj: Any) -> Any:
        if type(obj) is TensorProxy:
            return (obj.dtype, tuple(obj.shape))  # a composite's path (einsum's) can depend on the shapes
        if isinstance(obj, (tuple, list)):
            return tuple(describe(item) for item in obj)
        if isinstance(obj, dict):
            return tuple((key, describe(value)) for key, value in obj.items())
        if isinstance(obj, (int, float, bool, str, torch.dtype, type(None))):
            return obj
        if sym.executor is not None:
            raise _Unkeyed
        return type(obj)

    return (sym, device_type, torch.get_autocast_dtype(device_type), describe(args), describe(kwargs))


def plan(sym: Symbol, args: tuple, kwargs: dict[str, Any]) -> AutocastPlan:
    """What autocast does to a call of `sym` on these arguments (nothing when autocast is off for them)."""
    device_type = active_device_type((args, kwargs))
    if device_type is None:
        return _NOTHING
    try:
        key = _signature(sym, args, kwargs, device_type)
    except _Unkeyed:
        return _probe(sym, args, kwargs)
    found = _PROBES.get(key)
    if found is None:
        found = _PROBES[key] = _probe(sym, args, kwargs)
    return found


@dataclass
class CastCache:
    """torch.autocast's cache of conversions, for one acquisition. Eager converts a float32 leaf that requires grad (a
    parameter) to autocast's lower precision once and every op that reads it shares that conversion, so the grads of
    those ops are summed in the lower precision before its backward converts them; any other value is converted
    once per op (the grads summed in float32). The cache holds until torch clears it (the outermost autocast
    exits: `clear`), and is used while `torch.is_autocast_cache_enabled()`. The trace states the same conversions.
    `is_leaf` answers as eager for the program's values (fulmen.acquisition.autograd_facts: for a trace input the real
    tensor answers, and the trace holds only for inputs that answer the same)."""

    builder: TraceBuilder
    is_leaf: Callable[[TensorProxy], bool]
    casts: dict[str, TensorProxy] = field(default_factory=dict)  # by the converted value's name, as eager's by tensor

    def clear(self) -> None:
        self.casts.clear()

    def cast(self, p: TensorProxy, dtype: torch.dtype) -> TensorProxy:
        cached = self.casts.get(p.pname)
        if cached is not None and cached.dtype != dtype:
            # eager's cache answers by tensor whatever dtype is asked: the op would mix two lower precisions
            raise TraceError(f"torch.autocast converts {p.pname} ({p.type_string()}) to {dtype} here, but its cache "
                             f"holds the {cached.dtype} conversion an enclosing autocast made, which eager would use "
                             "instead; exit the outer autocast, or disable its cache (cache_enabled=False)",
                             self.builder.source)
        if cached is not None:
            return cached
        converted = SYMBOLS["torch.Tensor.to"](p, dtype=dtype)
        if (torch.is_autocast_cache_enabled() and p.dtype == torch.float32 and p.requires_grad
                and dtype == torch.get_autocast_dtype(p.device.type) and self.is_leaf(p)):
            self.casts[p.pname] = converted
        return converted


def cast_arguments(autocast: AutocastPlan, args: tuple, kwargs: dict[str, Any], cache: CastCache
                   ) -> tuple[tuple, dict[str, Any]]:
    """`args` and `kwargs` with autocast's conversions recorded in front of the op (and its dtype argument)."""
    if autocast.dtype is not None:
        kwargs = {**kwargs, "dtype": autocast.dtype}
    if not autocast.casts:
        return args, kwargs
    position = itertools.count()

    def cast(p: TensorProxy) -> TensorProxy:
        dtype = autocast.casts.get(next(position))
        return cache.cast(p, dtype) if dtype is not None and dtype != p.dtype else p

    return map_proxies(args, cast), map_proxies(kwargs, cast)


def cast_output(autocast: AutocastPlan, output: Any) -> Any:
    """The op's output converted to the dtype autocast gives it, where the op converts it only under autocast."""
    if autocast.output is None or type(output) is not TensorProxy or output.dtype == autocast.output:
        return output
    return SYMBOLS["torch.Tensor.to"](output, dtype=autocast.output)


def operator_refusal(sym: Symbol, why: str, device_type: str) -> str:
    """Why the program's own call of an executor's operator under torch.autocast is refused, and what to do."""
    return (f"operator {sym.name} of executor {sym.executor.name!r} is called under torch.autocast, but {why}; "
            "fulmen runs kernels with autocast off, so it would not compute what eager does. Call it with autocast "
            f"off (`with torch.autocast({device_type!r}, enabled=False):`, converting its inputs to the dtype you "
            "want), or write its fn with torch ops that run on fake tensors (then fulmen states autocast's "
            "conversions of its inputs)")


def bind_operator(builder: TraceBuilder, sym: Symbol, args: tuple, kwargs: dict[str, Any], cache: CastCache,
                  quiet: contextlib.AbstractContextManager) -> Any:
    """The program's own call of an executor's operator (`args` its current values). Its kernel runs with autocast
    off, as the whole trace does: under autocast, the conversions autocast makes inside it are stated in front of
    it, as for a torch op (its like= then sees the converted inputs); where they are not known exactly, or its like=
    declares other dtypes than eager returns, it is refused. Calls from grad rules and execution transforms are
    bound plainly: fulmen's rules state their dtypes."""
    device_type = active_device_type((args, kwargs))
    if device_type is None:
        return builder.bind(sym, args, kwargs)
    with quiet:  # the probe runs the kernel's code on fake tensors: not a step of the program to observe
        autocast = plan(sym, args, kwargs)
    if autocast.unstated:
        raise UnsupportedOpError(operator_refusal(sym, autocast.unstated, device_type), builder.source)
    args, kwargs = cast_arguments(autocast, args, kwargs, cache)
    output = cast_output(autocast, builder.bind(sym, args, kwargs))
    declared = tuple(p.dtype for p in iter_proxies(output))
    if declared != autocast.gives:
        seen = _named(tuple(p.dtype for p in iter_proxies((args, kwargs))))
        raise TraceError(operator_refusal(
            sym, f"eager returns {_named(autocast.gives)} there while its like= says {_named(declared)} (for its "
                 f"inputs as autocast converts them, {seen}); declare in like= the dtype its fn returns for those "
                 "inputs", device_type), builder.source)
    return output


def autocast_enabled() -> bool:
    return any(torch.is_autocast_enabled(device) for device in DEVICE_TYPES)


def _autocast_off() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for device in DEVICE_TYPES:
        stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def without_autocast(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run with autocast off: a trace acquired under autocast already holds its conversions."""

    def run(*args: Any) -> Any:
        with _autocast_off():
            return fn(*args)

    return run
