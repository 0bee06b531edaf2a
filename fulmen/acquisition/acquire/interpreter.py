"""The interpreter: the torch-function mode that records the torch calls of one run of the user's program into a
trace (see the package's docstring), the replaced calls it records as operators, and its recording of values,
constants and in-place updates."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from fulmen.acquisition import known_values, numpy_inputs, torch_python
from fulmen.acquisition.acquire.call_kinds import (
    DATA_DEPENDENT,
    METADATA,
    SHAPE_UPDATES,
    SIZED_FACTORIES,
    STATE,
    _describe,
)
from fulmen.acquisition.acquire.tensor_calls import TensorCalls
from fulmen.acquisition.aliasing import reads_elements_written_elsewhere
from fulmen.acquisition.autograd_facts import AutogradFacts
from fulmen.acquisition.functionalize import Functionalizer
from fulmen.acquisition.random_bounds import Bounds
from fulmen.core import pytree
from fulmen.core.errors import DataDependentError, TraceError, UnsupportedOpError
from fulmen.core.proxies import TensorProxy, unproxyable
from fulmen.core.source import SourceLocation, library_location, user_location
from fulmen.core.symbol import BoundSymbol, Symbol, iter_proxies, map_proxies
from fulmen.core.trace import TraceBuilder, mismatch
from fulmen.ops import lookup, shape
from fulmen.ops.registry import SYMBOLS
from fulmen.transforms.autocast import PARTS as AUTOCAST_PARTS
from fulmen.transforms.autocast import CastCache, bind_operator, cast_arguments, cast_output
from fulmen.transforms.autocast import plan as autocast_plan
from fulmen.transforms.distribution import logical_meta

T = torch.Tensor


def _is_value(obj: Any) -> bool:
    """A tensor, or a NumPy scalar (read as the Python number it holds)."""
    return isinstance(obj, torch.Tensor) or (type(obj).__module__ == "numpy" and hasattr(obj, "item"))


def _captured(tensor: torch.Tensor) -> str:
    """The refusal of an in-place update of a real tensor the program read (a global's, an object's attribute) that
    is a leaf requiring grad."""
    with torch._C.DisableTorchFunction():  # this mode would see the shape read
        what = f"a captured {tensor.dtype} tensor of shape {tuple(tensor.shape)}"
    return (f"in-place update of {what}, a leaf of autograd that requires grad, created outside the program (not "
            "an argument, nor a parameter or buffer of the jitted module): eager refuses it. Update it under "
            "torch.no_grad(), outside the jitted function")


class Interpreter(TensorCalls, TorchFunctionMode):
    """Records the torch calls of one run of the user's program into `builder`."""

    def __init__(self, builder: TraceBuilder) -> None:
        super().__init__()
        self.builder = builder
        self.functional = Functionalizer(lambda: self.builder.source, lambda: self.builder.bound_symbols)
        self.autograd = AutogradFacts(self.functional)
        self.bounds = Bounds()
        self.known = known_values.KnownValues()
        self.constants: list[tuple[torch.Tensor, TensorProxy]] = []  # real tensors the program captured
        self._constant_ids: dict[int, TensorProxy] = {}
        self.arrays = numpy_inputs.Arrays()  # the NumPy arrays it converted, the memory torch does not own it read
        self.ops_seen: list[str] = []
        self._inlining: set[Callable[..., Any]] = set()  # torch's Python functions running inline (torch_python.py)
        self._pinned: list[Any] = []  # while a grad rule runs, its ops carry the differentiated op's source line
        self.replaced: dict[Callable[..., Any], Symbol] = {}  # torch callables an active executor replaces
        self.quiet: contextlib.AbstractContextManager = contextlib.nullcontext()  # see observer.Observer.quiet
        self.reads_storage_offset = False  # then the trace holds only for inputs at the same storage offsets
        # id -> the proxies the program called retain_grad() on: each call retains the grad of those it returns
        self.retained: dict[int, TensorProxy] = {}
        self.autocast_casts = CastCache(builder, self.autograd.is_leaf)
        builder.operator_calls = self._operator
        self.special: dict[Callable[..., Any], Callable[..., Any]] = {
            T.__setitem__: lambda x, index, value: self._setitem(x, self._arrays_in(index), value),
            T.copy_: self._copy_,
            T.fill_: self._fill_,
            T.zero_: self._zero_,
            T.contiguous: self._contiguous,
            T.flatten: self._flatten,
            torch.flatten: self._flatten,
            T.to: self._to,
            T.type: self._type,
            T.cuda: lambda x, device=None, non_blocking=False, **kw: self._convert(
                x, device=torch.device("cuda") if device is None else torch.device("cuda", device)
                if isinstance(device, int) else torch.device(device)),
            T.cpu: lambda x, **kw: self._convert(x, device=torch.device("cpu")),
            T.type_as: lambda x, other: self._convert(x, dtype=other.dtype),
            T.requires_grad.__get__: self._requires_grad,
            T.requires_grad_: self._requires_grad_,
            T.requires_grad.__set__: self._set_requires_grad,
            T.retain_grad: self._retain_grad,
            T.is_leaf.__get__: self.autograd.is_leaf,
            T.grad_fn.__get__: self.autograd.grad_fn,
            T.is_inference: self.autograd.is_inference,
            torch.is_inference: self.autograd.is_inference,
            T.grad.__get__: lambda x: self._refuse_read("Tensor.grad", "the grad of one call would be a constant of "
                                                        "the trace, where eager reads it anew on every call"),
            T.retains_grad.__get__: lambda x: self._refuse_read("Tensor.retains_grad", "it is autograd state of "
                                                                "one call, which a trace cannot follow"),
            T._version.__get__: lambda x: self._refuse_read("Tensor._version", "the version counter of one call "
                                                            "would be a constant of the trace"),
            T.data.__get__: lambda x: self._detach(x, data=True),
            T.detach: self._detach,
            torch.detach: self._detach,
            T.__repr__: lambda x, **kw: repr(x),
            T.__str__: lambda x: repr(x),
            T.__format__: lambda x, spec: repr(x),
            T.__getitem__: lambda x, index: self._getitem(x, self._arrays_in(index)),
            torch.where: self._where,
            F.batch_norm: self._batch_norm,
            T.storage_offset: self._storage_offset,
            T.register_hook: self._register_hook,
            torch._is_all_true: self._is_all_true,
            torch._C._VariableFunctions._pack_padded_sequence: self._pack_padded_sequence,
            torch._C._VariableFunctions._pad_packed_sequence: self._pad_packed_sequence,
        }
        for func in (torch.tensor, torch.as_tensor, T.new_tensor):
            self.special[func] = functools.partial(self._from_data, func)
        for name, dtype in (("float", torch.float32), ("double", torch.float64), ("half", torch.float16),
                            ("bfloat16", torch.bfloat16), ("int", torch.int32), ("long", torch.int64),
                            ("short", torch.int16), ("char", torch.int8), ("byte", torch.uint8),
                            ("bool", torch.bool)):
            self.special[getattr(T, name)] = lambda x, memory_format=None, dtype=dtype: self._convert(
                x, dtype=dtype, memory_format=memory_format)

    # --- the entry point -----------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in METADATA or func in STATE:
            if func is torch.clear_autocast_cache:
                self.autocast_casts.clear()
            with torch._C.DisableTorchFunction():
                return func(*args, **kwargs)
        self.builder.source = location = self._pinned[-1] if self._pinned else user_location()
        self.ops_seen.append(_describe(func))
        if func in known_values.READS and type(args[0]) is TensorProxy:
            value = self.functional.resolve(args[0])
            answer = self.bounds.answer(value) if func is T.__bool__ else None
            # a comparison of a random draw that has one answer whatever is drawn (random_bounds.py)
            if answer is not None:
                return answer
            found, answer = self.known.read(func, value)
            if found:  # contents computed from Python numbers alone (known_values.py)
                return answer
        if func in DATA_DEPENDENT:
            reader = library_location()
            inside = f" (read in {reader.describe()})" if reader is not None else ""
            raise DataDependentError(
                f"fulmen cannot trace {_describe(func)}: it reads tensor values, which are unknown while tracing"
                f"{inside}. Keep the computation in tensors (e.g. torch.where instead of an `if` on a tensor), or "
                "move it out of the jitted function.",
                location,
            )
        special = self.special.get(func)
        if special is not None:
            return special(*args, **kwargs)
        return self._call(func, args, kwargs)

    def _call(self, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        binding = lookup(func)
        if binding is not None and binding.flag is not None:  # `F.elu(x, inplace=True)` updates x, as `F.elu_(x)`
            binding, args, kwargs = binding.flag.resolve(binding, args, kwargs)
        if binding is None and torch_python.inlinable(func):  # torch's Python: trace the calls it makes
            return self._inline(func, args, kwargs)
        replacement = self.replaced.get(func)
        if replacement is not None and binding is not None and not binding.inplace:
            return self.record_replacement(replacement, lambda: self._dispatch(func, binding, args, kwargs),
                                           args, kwargs)
        return self._dispatch(func, binding, args, kwargs)

    def _dispatch(self, func: Callable[..., Any], binding: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        location = self.builder.source
        if binding is None and func in SHAPE_UPDATES:
            raise UnsupportedOpError(
                f"fulmen cannot trace {_describe(func)}: it changes a tensor's shape in place, which a traced value "
                f"cannot; use its out-of-place form, x = x.{func.__name__[:-1]}(...) (nn.Dropout1d(inplace=True) "
                "does this on an unbatched input: use inplace=False)", location)
        if binding is None:
            raise UnsupportedOpError(f"fulmen does not support {_describe(func)} (no symbol for it)", location)
        if func in SIZED_FACTORIES:
            args = self._sizes_read(func, args)
        if kwargs.get("requires_grad"):
            raise UnsupportedOpError(f"fulmen cannot trace {_describe(func)}(..., requires_grad=True): a tensor the "
                                     "program creates as a leaf of autograd has no place in a trace; create it "
                                     "outside the jitted function and pass it in", location)
        out = kwargs.pop("out", None)
        if out is not None:
            return self._into(func, out, lambda: self._dispatch(func, binding, args, kwargs))
        if binding.normalize is not None:
            args, kwargs = binding.normalize(*args, **kwargs)
        if binding.inplace:
            return self._inplace(binding.symbol, args, kwargs)
        if binding.returns_input is not None and binding.returns_input(*self._values(args), **kwargs):
            return args[0]  # eager's result is the tensor itself (torch.real of a real tensor)
        return self._record(binding.symbol, args, kwargs)

    def _inline(self, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        inner = torch_python.target(func, args, kwargs)
        if inner in self._inlining:  # handed back by a function of its own body: none of them has a symbol
            raise UnsupportedOpError(f"fulmen does not support {_describe(func)} (no symbol for it)",
                                     self.builder.source)
        self._inlining.add(inner)
        try:
            with self:
                return torch_python.body(inner)(*args, **kwargs)
        finally:
            self._inlining.discard(inner)

    def record_replacement(self, sym: Symbol, call_original: Callable[[], Any], args: tuple,
                           kwargs: dict[str, Any]) -> Any:
        """Records a call of a replaced torch callable as `sym`, keeping the original's ops as its parts."""
        started = self.begin_replacement(sym, args, kwargs, user_location())
        try:
            result = call_original()
        except BaseException:
            self.end_replacement(started, None, raised=True)
            raise
        return self.end_replacement(started, result)

    def begin_replacement(self, sym: Symbol, args: tuple, kwargs: dict[str, Any],
                          location: SourceLocation | None) -> tuple:
        """A call of a replaced function starts: the ops recorded until `end_replacement` are its parts."""
        started = sym, self._values(args), self._values(kwargs), location  # (resolving a view may record its replay)
        self.builder.scopes.append([])
        return started

    def end_replacement(self, started: tuple, result: Any, raised: bool = False) -> Any:
        """The replaced call returned `result`: records it as one call of its operator (checked against the
        operator's like=/meta=). A returned input is also the output of an alias of it, which the result
        names instead."""
        sym, values, kwvalues, location = started
        builder = self.builder
        parts = builder.scopes.pop()
        if raised:
            return None
        got = list(iter_proxies(result))
        if sym.meta is not None:
            differs = mismatch(got, list(iter_proxies(builder.bind_meta(sym, values, kwvalues))))
            if differs is not None:
                raise TraceError(f"operator {sym.name} replaces a function that returned {differs[0]}, but its "
                                 f"like= function says {differs[1]}", location)
        # A returned input: the operator's output is a new value aliasing it.
        produced = {name for bsym in parts for name in bsym.output_names()}
        outputs = [p if p.pname in produced else builder.make_proxy(p.meta, p.device, p.requires_grad) for p in got]
        builder.adopt_results(parts, got, outputs, location)
        renamed = {id(p): out for p, out in zip(got, outputs)}
        result = map_proxies(result, lambda p: renamed.get(id(p), p))
        builder.scopes[-1].append(BoundSymbol(sym, tuple(values), kwvalues, result, parts, location,
                                              builder.checkpoint_region))
        builder.source = location
        return result

    @contextlib.contextmanager
    def replacing(self, table: dict[Callable[..., Any], Symbol]) -> Iterator[None]:
        """Calls of these torch callables are recorded as these operators (replacements.py), inside the block."""
        self.replaced = table
        try:
            yield
        finally:
            self.replaced = {}

    @contextlib.contextmanager
    def rule_mode(self, source: Any) -> Iterator[None]:
        """Runs a grad rule: torch calls on proxies record symbols, attributed to `source`."""
        self._pinned.append(source)
        try:
            with self:
                yield
        finally:
            self._pinned.pop()

    # --- recording -----------------------------------------------------------------------------------------------
    def current_values(self, obj: Any) -> Any:
        """The values the tensors in `obj` hold now, after in-place updates (what a grad rule returns and puts):
        the object a rule updated in place still names its first value."""
        return self._values(obj)

    def _values(self, obj: Any) -> Any:
        """Current values of the proxies in `obj`; real tensors become captured constants; NumPy scalars the Python
        numbers they hold."""
        return pytree.tree_map(self._value, obj, _is_value)

    def _value(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.functional.resolve(obj if type(obj) is TensorProxy else self._constant(obj))
        # eager takes one as data (_from_data) or an index (_arrays_in) only
        if numpy_inputs.is_array(obj) and obj.ndim:
            raise UnsupportedOpError(f"fulmen cannot pass a NumPy array to {self.ops_seen[-1]}: convert it first "
                                     "(torch.from_numpy(array), torch.tensor(array))", self.builder.source)
        return obj.item()

    def _from_data(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`torch.tensor`, `torch.as_tensor` or `Tensor.new_tensor` of NumPy data (numpy_inputs.py); of other data, the
        call itself."""
        asked = numpy_inputs.conversion(func, args, kwargs)
        if asked is None:
            return self._call(func, args, kwargs)
        if numpy_inputs.is_numpy_scalar(asked.data):  # a number of its dtype
            placed = {} if asked.device is None else {"device": asked.device}
            return self._call(torch.tensor, (asked.data.item(),),
                              {"dtype": asked.dtype or numpy_inputs.scalar_dtype(asked.data), **placed})
        return self._convert(self._arrays_in(asked.data), device=asked.device, dtype=asked.dtype, copy=asked.copy,
                             memory_format=torch.contiguous_format if asked.copy else None)

    def _arrays_in(self, obj: Any) -> Any:
        """`obj` (an index, a value) with its NumPy arrays as the trace's inputs sharing their memory
        (numpy_inputs.py)."""
        if numpy_inputs.is_array(obj):
            return self._constant(self.arrays.tensor(obj))
        return tuple(self._arrays_in(item) for item in obj) if type(obj) is tuple else obj

    def _constant(self, tensor: torch.Tensor) -> TensorProxy:
        proxy = self._constant_ids.get(id(tensor))
        if proxy is None:
            if torch._C._functorch.is_functorch_wrapped_tensor(tensor):
                raise UnsupportedOpError("fulmen cannot trace torch.vmap and the other torch.func transforms (a "
                                         "batched tensor reached it)", self.builder.source)
            if (why := unproxyable(tensor)) is not None:
                raise UnsupportedOpError(f"fulmen cannot trace a {tensor.dtype} tensor of shape {tuple(tensor.shape)} "
                                         f"the program reads: {why}", self.builder.source)
            # Outside __torch_function__ (a replaced function's arguments) this mode would see the meta's creation.
            with torch._C.DisableTorchFunction():
                meta = logical_meta(tensor)
            proxy = self.builder.make_proxy(meta, tensor.device, tensor.requires_grad, name=f"c{len(self.constants)}")
            self.constants.append((tensor, proxy))
            self._constant_ids[id(tensor)] = proxy
            self.arrays.read(tensor, proxy, self.builder.source)
        return proxy

    def captured_inputs(self) -> list[TensorProxy]:
        """The inputs standing for the real tensors the program captured, whose in-place updates are written back as
        an argument's are (a KV cache held by an object, a counter in a global)."""
        for tensor, proxy in self.constants:
            # eager refuses an in-place update of a leaf that requires grad; a tensor with a history takes a new one
            if self.functional.was_written(proxy) and tensor.requires_grad and tensor.is_leaf:
                raise TraceError(_captured(tensor), self.functional.written_at(proxy))
        self.arrays.refuse_changes(self.functional.was_written, self.functional.written_at)
        return [proxy for _, proxy in self.constants]

    def _proxy(self, obj: torch.Tensor) -> TensorProxy:
        """The proxy standing for `obj`: itself, or the input of a real tensor the program captured (a global's, an
        object's attribute), whose in-place updates are copied back into it as an argument's are."""
        return obj if type(obj) is TensorProxy else self._constant(obj)

    def seed_constant(self, tensor: torch.Tensor, value: TensorProxy) -> None:
        """The program reads the captured `tensor` as `value` (a view of a storage it shares with an updated input,
        see aliasing.py); the tensor stays a trace input of its own."""
        self._constant(tensor)
        self._constant_ids[id(tensor)] = value

    def _record(self, sym: Symbol, args: tuple, kwargs: dict[str, Any]) -> Any:
        values, kwvalues = self._values(args), self._values(kwargs)
        try:
            # Grad rules state their dtypes; autocast applies to the user's program only.
            autocast = autocast_plan(sym, values, kwvalues) if not self._pinned else None
            if autocast is not None and autocast.unstated:
                parts = AUTOCAST_PARTS.get(sym.printed)
                output = NotImplemented if parts is None else parts(self._record, *values, **kwvalues)
                if output is not NotImplemented:
                    return output
                raise UnsupportedOpError(
                    f"{sym.printed} under torch.autocast: {autocast.unstated}, which the trace cannot state as a "
                    "conversion of its inputs; convert the inputs yourself or call it outside autocast",
                    self.builder.source)
            if autocast is not None:
                values, kwvalues = cast_arguments(autocast, values, kwvalues, self.autocast_casts)
            with self.quiet:  # a symbol's meta and decomposition are fulmen's and torch's code, never the program's
                output = sym(*values, **kwvalues)
            if autocast is not None:
                output = cast_output(autocast, output)
        except TraceError:
            raise
        except Exception as error:
            raise TraceError(f"{sym.printed} failed while tracing: {type(error).__name__}: {error}",
                             self.builder.source) from error
        if args and isinstance(args[0], torch.Tensor):
            self.functional.record_views(sym, self._proxy(args[0]), kwvalues, values, output)
        self.bounds.record(sym, values, output)
        self.known.record(sym, values, kwvalues, output)
        return output

    def _operator(self, sym: Symbol, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The program calls an executor's operator itself: it reads its arguments' current values (after in-place
        updates), and torch.autocast applies to it as eager's call would see it."""
        return bind_operator(self.builder, sym, self._values(args), self._values(kwargs), self.autocast_casts,
                             self.quiet)

    def _inplace(self, sym: Symbol, args: tuple, kwargs: dict[str, Any]) -> Any:
        self._refuse_order_dependent(args[0], (args[1:], kwargs), sym.printed)
        out = self._record(sym, args, kwargs)
        self._assign(self._proxy(args[0]), out, sym.printed)
        return args[0]  # eager returns the updated tensor itself: `holder.steps += 1` stores it back unchanged

    def _refuse_order_dependent(self, target: Any, operands: Any, what: str) -> None:
        """An update reading its own memory elsewhere than it writes (aliasing.reads_elements_written_elsewhere): the
        operands that are views of the same tensor as `target` (or it), whatever values they hold now."""
        if type(target) is not TensorProxy:
            return
        root = self.functional.root(target)
        for operand in iter_proxies(operands):
            if self.functional.root(operand) is root and reads_elements_written_elsewhere(target.meta, operand.meta):
                raise TraceError(
                    f"in-place {what} of a tensor (size {tuple(target.shape)}, stride {target.stride()}) reads "
                    f"elements of the same memory that it writes at other positions (an operand of size "
                    f"{tuple(operand.shape)}, stride {operand.stride()}): eager's result depends on the order its "
                    "kernel visits them, which fulmen cannot reproduce; update from a clone of the operand",
                    self.builder.source)

    def _assign(self, target: TensorProxy, value: TensorProxy, what: str) -> TensorProxy:
        if value.shape != target.shape:
            raise TraceError(
                f"in-place {what}: the result's shape {tuple(value.shape)} does not match the updated tensor's "
                f"shape {tuple(target.shape)}",
                self.builder.source,
            )
        if value.dtype != target.dtype:
            if not torch.can_cast(value.dtype, target.dtype):
                raise TraceError(f"in-place {what}: result type {value.dtype} can't be cast to {target.dtype}",
                                 self.builder.source)
            value = SYMBOLS["torch.Tensor.to"](value, target.dtype)
        if _strides(value) != _strides(target):  # eager's update keeps the tensor's layout (a masked_fill_ too)
            value = shape.copy(self.functional.resolve(target), value)
        self.functional.write(target, value)
        return target



def _strides(t: TensorProxy) -> tuple[int, ...]:
    """The strides a layout is told by: a dimension of size 1 is never stepped along."""
    return tuple(stride if size > 1 else 0 for size, stride in zip(t.shape, t.stride()))


def current_interpreter() -> Interpreter | None:
    """The acquisition running now, if any (its torch-function mode is on torch's mode stack)."""
    if not torch._C._len_torch_function_stack():  # the common case, without building the stack's list
        return None
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, Interpreter):
            return mode
    return None
