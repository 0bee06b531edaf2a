"""Acquisition: running the user's Python with proxies under a torch-function mode that records a trace.

Every torch call the program makes (functions, methods, operators, `torch.nn.functional`, property reads) reaches
`Interpreter.__torch_function__`. Metadata reads answer from the proxy; reads of tensor values raise
`DataDependentError`; supported ops record their symbol; in-place ops are functionalized; anything else raises
`UnsupportedOpError`. Python control flow on shapes and Python values simply runs, so the trace is specialised on
them (and the guards check them).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch._prims_common import suggest_memory_format
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack, resolve_name

from fulmen.acquisition import distribution_checks, known_values, numpy_inputs, torch_python
from fulmen.acquisition.aliasing import reads_elements_written_elsewhere
from fulmen.acquisition.autograd_facts import AutogradFacts, leaf_flag_error
from fulmen.acquisition.functionalize import Functionalizer
from fulmen.acquisition.lookasides import is_fabric_backward_check
from fulmen.acquisition.random_bounds import Bounds
from fulmen.core import pytree
from fulmen.core.errors import DataDependentError, TraceError, UnsupportedOpError
from fulmen.core.proxies import TensorProxy, unproxyable
from fulmen.core.source import SourceLocation, library_location, user_location
from fulmen.core.symbol import BoundSymbol, Symbol, iter_proxies, map_proxies
from fulmen.core.trace import TraceBuilder, mismatch
from fulmen.ops import lookup, recurrent, shape
from fulmen.ops.effects import check_all_true
from fulmen.ops.nn import batch_norm_update
from fulmen.ops.registry import SYMBOLS
from fulmen.transforms.autocast import PARTS as AUTOCAST_PARTS
from fulmen.transforms.autocast import CastCache, bind_operator, cast_arguments, cast_output
from fulmen.transforms.autocast import plan as autocast_plan
from fulmen.transforms.distribution import logical_meta

T = torch.Tensor

# Reads of metadata: answered by the proxy itself (it carries the real shape, dtype, device, strides).
METADATA: frozenset = frozenset(
    {
        T.shape.__get__, T.dtype.__get__, T.device.__get__, T.ndim.__get__,
        T.is_cuda.__get__, T.is_cpu.__get__, T.is_meta.__get__, T.layout.__get__, T.is_sparse.__get__,
        T.is_quantized.__get__, T.is_nested.__get__, T.is_mkldnn.__get__,
        T.itemsize.__get__, T.nbytes.__get__, T.is_xpu.__get__, T.is_mps.__get__,
        T.size, T.dim, T.ndimension, T.numel, T.nelement, T.element_size, T.stride, T.is_contiguous,
        T.is_floating_point, T.is_complex, T.is_signed, T.get_device, T.__len__, T.__hash__,
        T.dim_order, T.is_conj, T.is_neg, torch.is_conj, torch.is_neg,
        torch.is_tensor, torch.is_floating_point, torch.is_complex, torch.numel, torch.result_type, torch.can_cast,
        torch.promote_types, torch.is_grad_enabled, torch.get_default_dtype, torch.is_autocast_enabled,
        torch.get_autocast_dtype, torch.is_inference_mode_enabled, torch.device,
    }
)

# Changes of global state the program makes (`with torch.no_grad():`, `with torch.autocast(...):`): applied for
# real while tracing, so the ops after them are recorded under that state.
STATE: frozenset = frozenset(
    {
        torch._C._set_grad_enabled, torch.set_autocast_enabled, torch.set_autocast_dtype,
        torch.autocast_increment_nesting, torch.autocast_decrement_nesting, torch.set_autocast_cache_enabled,
        torch.clear_autocast_cache, torch.is_autocast_cache_enabled,
    }
)

# Reads of tensor values: unknown while tracing.
DATA_DEPENDENT: frozenset = frozenset(
    {
        T.item, T.tolist, T.__bool__, T.__int__, T.__float__, T.__index__, T.__complex__, T.numpy, T.__array__,
        T.__contains__, T.nonzero, torch.nonzero, T.argwhere, torch.argwhere, torch.masked_select, T.masked_select,
        torch.unique, T.unique, torch.unique_consecutive, torch.equal, T.equal, torch.allclose, T.allclose,
        torch.is_nonzero, T.is_nonzero, torch.bincount, T.bincount, T.data_ptr, T.untyped_storage, T.__dlpack__,
    }
)


# Updates of a tensor's shape or strides in place: a trace value's metadata is fixed, and the tensor's other users
# (the caller, its views) would see the change.
SHAPE_UPDATES: frozenset = frozenset({T.unsqueeze_, T.squeeze_, T.transpose_, T.t_, T.swapdims_, T.swapaxes_,
                                      T.as_strided_, T.resize_, T.resize_as_})


# Factories whose leading arguments are sizes (all of them, or the first: torch.full's): eager reads a 0-dim integer
# tensor there as a Python int (nn.LSTM sizes its zero states by a packed sequence's batch_sizes[0]).
SIZED_FACTORIES: dict[Callable[..., Any], bool] = {torch.zeros: True, torch.ones: True, torch.empty: True,
                                                   torch.rand: True, torch.randn: True, torch.full: False}


def _is_basic_index(index: Any) -> bool:
    """Whether eager's `x[index] = v` copies into the view `x[index]` (ints, slices, None and an Ellipsis among
    them), so x's grad_fn becomes CopySlices; an index of tensors or lists (or `x[...]` alone) writes x itself."""
    items = index if isinstance(index, tuple) else (index,)
    return any(item is not Ellipsis for item in items) and all(
        item is None or item is Ellipsis or isinstance(item, slice) or type(item) is int for item in items)


def _is_tensor_scalar(item: Any) -> bool:
    """A 0-dim integer tensor, which eager's indexing reads as a Python int (not a mask: bool and uint8 are)."""
    return (isinstance(item, torch.Tensor) and item.dim() == 0 and item.dtype not in (torch.bool, torch.uint8)
            and not item.dtype.is_floating_point and not item.dtype.is_complex)


def _indexed_dims(items: tuple, ndim: int) -> list[int]:
    """The dim of the indexed tensor each index item stands at (None and `...` take none themselves)."""
    consumed = [0 if item is None or item is Ellipsis or isinstance(item, bool) else
                item.dim() if isinstance(item, torch.Tensor) and item.dtype in (torch.bool, torch.uint8) else 1
                for item in items]
    if Ellipsis in items:
        consumed[items.index(Ellipsis)] = ndim - sum(consumed)
    dims, dim = [], 0
    for taken in consumed:
        dims.append(dim)
        dim += taken
    return dims


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


def _describe(func: Callable[..., Any]) -> str:
    return resolve_name(func) or getattr(func, "__qualname__", repr(func))


class Interpreter(TorchFunctionMode):
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

    # --- special cases -------------------------------------------------------------------------------------------
    def _setitem(self, x: TensorProxy, index: Any, value: Any) -> None:
        self._check_index(index, masks=True)  # a write through a mask keeps x's shape: nothing depends on values
        x, index = self._select_at_scalars(self._proxy(x), index)
        if index == ():  # `x[i] = v`: eager copies into the selected view
            self.functional.write(x, shape.copy(self.functional.resolve(x), self._values(value)))
            return
        items = index if isinstance(index, tuple) else (index,)
        if torch.is_grad_enabled() and not any(isinstance(item, torch.Tensor) for item in items):
            self.functional.refuse_leaf_update(x, through_view=True)  # eager copies into a view, as above
        current = self.functional.resolve(x)
        new = shape.setitem(current, self._values(index), self._values(value))
        self.functional.write(x, new, through_view=_is_basic_index(index))

    def _is_all_true(self, valid: Any) -> bool:
        """torch.distributions' validation: true now, checked when the trace runs (distribution_checks.py)."""
        location = self.builder.source
        text = distribution_checks.message(distribution_checks.caller())
        if text is None:
            raise DataDependentError("fulmen cannot trace torch._is_all_true: it reads tensor values, which are "
                                     "unknown while tracing", location)
        where = f"\n  (validated by fulmen's trace, for {location.describe()})" if location is not None else ""
        self._record(check_all_true, (valid, text + where), {})
        return True

    def _detach(self, x: Any, data: bool = False) -> Any:
        detach = lookup(torch.detach).symbol
        out = self._record(detach, (x,), {})
        self.functional.record_detached(detach, self._proxy(x), out, data)
        return out

    def _getitem(self, x: TensorProxy, index: Any) -> Any:
        self._check_index(index)
        x, index = self._select_at_scalars(x, index)
        return x if index == () else self._record(shape.getitem, (x, index), {})

    def _select_at_scalars(self, x: TensorProxy, index: Any) -> tuple[TensorProxy, Any]:
        """Eager reads the value of a 0-dim integer tensor in an index and selects with it before anything else (so
        `x[i]` is a view of `x`, and `z[i, :, j]` puts j's dims where `z[1, :, j]` does): `x` after those selects,
        and the rest of the index."""
        items = index if isinstance(index, tuple) else (index,)
        scalars = [p for p, item in enumerate(items) if _is_tensor_scalar(item)]
        if not scalars:
            return x, index
        dims = _indexed_dims(items, x.dim())
        for p in sorted(scalars, key=lambda p: -dims[p]):  # the highest dim first keeps the others' numbers
            x = self._record(shape.select_at, (x, dims[p], items[p]), {})
        return x, tuple(item for p, item in enumerate(items) if p not in scalars)

    def _check_index(self, index: Any, masks: bool = False) -> None:
        items = index if isinstance(index, tuple) else (index,)
        for item in items:
            if isinstance(item, slice) and any(isinstance(b, torch.Tensor) for b in (item.start, item.stop, item.step)):
                raise DataDependentError(
                    "fulmen cannot trace slicing with tensor bounds: the result's shape depends on tensor values",
                    self.builder.source,
                )
            if not masks and isinstance(item, torch.Tensor) and item.dtype in (torch.bool, torch.uint8):
                raise DataDependentError(
                    "fulmen cannot trace indexing with a boolean mask: the result's shape depends on tensor "
                    "values. Use torch.where(mask, x, other) or multiply by the mask instead.",
                    self.builder.source,
                )

    def _where(self, condition: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs:
            raise DataDependentError(
                "fulmen cannot trace torch.where(condition) with one argument: the result's shape depends on tensor "
                "values. Use the three-argument torch.where(condition, x, y).",
                self.builder.source,
            )
        return self._record(lookup(torch.where).symbol, (condition, *args), kwargs)

    def _requires_grad(self, x: torch.Tensor) -> bool:
        """What the tensor holds now answers: an in-place update may have given it a history."""
        if type(x) is TensorProxy:
            return self.functional.resolve(x).requires_grad
        with torch._C.DisableTorchFunction():
            return x.requires_grad

    def _refuse_read(self, what: str, why: str) -> None:
        raise UnsupportedOpError(f"fulmen cannot trace reading {what} inside a jitted function: {why}; read it outside "
                                 "the jitted function (and pass what you need as an argument)", self.builder.source)

    def _requires_grad_(self, x: Any, requires_grad: bool = True) -> Any:
        if self._requires_grad(x) == requires_grad or self.autograd.set_requires_grad(x, requires_grad):
            return x
        raise UnsupportedOpError(
            f"fulmen cannot trace requires_grad_({requires_grad}) on an input of the program (whose flag is the "
            "caller's), a view or a tensor with views: it would make (or unmake) a leaf of autograd inside the "
            "program, which a trace cannot represent; do it outside the jitted function", self.builder.source)

    def _set_requires_grad(self, x: Any, requires_grad: bool) -> None:
        """`x.requires_grad = flag`: unlike requires_grad_(True), eager's setter refuses any tensor not a leaf."""
        if not self.autograd.is_leaf(x):
            raise RuntimeError(leaf_flag_error(bool(requires_grad)))  # eager's
        self._requires_grad_(x, requires_grad)

    def _sizes_read(self, func: Callable[..., Any], args: tuple) -> tuple:
        """`args` of a factory with each 0-dim integer tensor among its sizes read as eager reads it (`__index__`):
        answered where its value is known while tracing, refused naming the line otherwise."""

        def read(size: Any) -> Any:
            if isinstance(size, (tuple, list)) and not isinstance(size, torch.Size):
                return type(size)(read(item) for item in size)
            if type(size) is TensorProxy and size.dim() == 0 and not size.dtype.is_floating_point:
                found, value = self.known.read(T.__index__, self.functional.resolve(size))
                if not found:
                    raise DataDependentError(f"fulmen cannot trace {_describe(func)} with a size given as a tensor: "
                                             "eager reads its value, unknown while tracing; pass a Python int",
                                             self.builder.source)
                return value
            return size

        every = SIZED_FACTORIES[func]
        return tuple(read(a) if every or i == 0 else a for i, a in enumerate(args))

    def _known_ints(self, x: Any, what: str) -> list:
        """The values of the integer tensor `x` where they are known while tracing (known_values.py)."""
        if type(x) is not TensorProxy:  # a captured tensor, read as eager reads it
            with torch._C.DisableTorchFunction():
                return x.tolist()
        found, values = self.known.read(T.tolist, self.functional.resolve(x))
        if not found:
            raise DataDependentError(
                f"fulmen cannot trace {what}: the packed sequence's shape depends on the lengths' values, unknown "
                f"while tracing (a tensor of shape {tuple(x.shape)}); pass the lengths as a Python list (a trace for "
                "each list of lengths), or pack outside the jitted function", self.builder.source)
        return values

    def _pack_padded_sequence(self, input: Any, lengths: Any, batch_first: bool) -> Any:
        values = self._known_ints(lengths, "pack_padded_sequence")
        with self:
            return recurrent.pack_padded(input, values, batch_first)

    def _pad_packed_sequence(self, data: Any, batch_sizes: Any, batch_first: bool, padding_value: float,
                             total_length: int) -> Any:
        values = self._known_ints(batch_sizes, "pad_packed_sequence")
        with self:
            return recurrent.pad_packed(data, values, batch_first, padding_value, total_length)

    def _retain_grad(self, x: torch.Tensor) -> None:
        """Eager keeps the grad of `x` after backward: the call does it on the tensor it returns for `x`, if any (one
        that does not leave the program cannot be looked at)."""
        if type(x) is not TensorProxy:  # a real tensor the program captured: its own, as eager's call
            with torch._C.DisableTorchFunction():
                T.retain_grad(x)
            return
        if not self._requires_grad(x):
            raise RuntimeError("can't retain_grad on Tensor that has requires_grad=False")  # eager's error
        self.retained[id(x)] = x

    def _register_hook(self, x: torch.Tensor, hook: Callable[..., Any]) -> Any:
        if not is_fabric_backward_check(hook):
            raise UnsupportedOpError("fulmen cannot trace Tensor.register_hook (a hook has no place in a trace); "
                                     "register it on the jitted function's output instead", self.builder.source)
        return None

    def _storage_offset(self, x: torch.Tensor) -> int:
        # a real tensor's offset (a captured tensor's, which its guard reads itself: value_checks.tensor_meta) leaves
        # the inputs' offsets free
        if isinstance(x, TensorProxy):
            self.reads_storage_offset = True
        with torch._C.DisableTorchFunction():
            return T.storage_offset(x)

    def _batch_norm(self, x: Any, running_mean: Any, running_var: Any, weight: Any = None, bias: Any = None,
                    training: bool = False, momentum: float | None = 0.1, eps: float = 1e-5) -> Any:
        """In training mode the running statistics are an in-place update: recorded functionally and written back
        once, so a backward that recomputes batch_norm leaves the buffers alone."""
        if not training or running_mean is None or running_var is None:
            return self._record(lookup(F.batch_norm).symbol,
                                (x, running_mean, running_var, weight, bias, training, momentum, eps), {})
        out, mean, var = self._record(batch_norm_update, (x, running_mean, running_var, weight, bias, momentum, eps),
                                      {})
        detach = lookup(torch.detach).symbol
        for stat, new in ((running_mean, mean), (running_var, var)):
            self._assign(self._proxy(stat), self._record(detach, (new,), {}), "batch_norm's running statistics")
        return out

    def _into(self, func: Callable[..., Any], out: Any, compute: Callable[[], Any]) -> Any:
        """`func(..., out=out)`: the result, computed out of place, copied into `out` (spectral_norm's power
        iteration writes its buffers so). Only where eager writes it as it stands: an `out` of the result's shape
        and dtype (eager would resize or convert it otherwise), outside autograd (where eager raises)."""
        what = f"the out= argument of {_describe(func)}"
        if not isinstance(out, torch.Tensor):
            raise UnsupportedOpError(f"fulmen supports {what} for a single tensor only", self.builder.source)
        result, target = compute(), self._proxy(out)
        if type(result) is not TensorProxy or result.requires_grad or target.requires_grad:
            raise UnsupportedOpError(f"fulmen supports {what} only for one result without grad (eager refuses "
                                     "out= under autograd); assign the result instead", self.builder.source)
        if tuple(result.shape) != tuple(target.shape) or result.dtype != target.dtype:
            raise UnsupportedOpError(f"fulmen supports {what} only where out has the result's shape and dtype "
                                     f"({result.type_string()}; out is {target.type_string()}): eager would resize "
                                     "or convert it; assign the result instead", self.builder.source)
        return self._copy_(out, result)

    def _copy_(self, dst: torch.Tensor, src: Any, non_blocking: bool = False) -> torch.Tensor:
        target = self._proxy(dst)
        self._refuse_order_dependent(target, src, "copy_")
        self.functional.write(target, shape.copy(self.functional.resolve(target), self._values(src)))
        return dst

    def _fill_(self, x: torch.Tensor, value: Any) -> torch.Tensor:
        target = self._proxy(x)
        self.functional.write(target, shape.fill(self.functional.resolve(target), self._values(value)))
        return x

    def _zero_(self, x: TensorProxy) -> TensorProxy:
        return self._fill_(x, 0)

    def _contiguous(self, x: TensorProxy, memory_format: torch.memory_format = torch.contiguous_format) -> Any:
        if self._values(x).meta.is_contiguous(memory_format=memory_format):
            return x  # eager returns the tensor itself
        kwargs = {} if memory_format is torch.contiguous_format else {"memory_format": memory_format}
        return self._record(lookup(T.contiguous).symbol, (x,), kwargs)

    def _flatten(self, x: TensorProxy, start_dim: Any = 0, end_dim: Any = -1) -> Any:
        if isinstance(start_dim, int) and isinstance(end_dim, int) and x.dim() > 0 and \
                start_dim % x.dim() == end_dim % x.dim():
            return x  # eager returns the tensor itself (a 1-D tensor's flatten()), so an update through it reaches x
        return self._record(lookup(torch.flatten).symbol, (x, start_dim, end_dim), {})

    def _to(self, x: TensorProxy, *args: Any, **kwargs: Any) -> Any:
        copy = kwargs.pop("copy", False)
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        return self._convert(x, device=device, dtype=dtype, copy=copy, memory_format=memory_format)

    def _type(self, x: TensorProxy, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None:  # the type's name: "torch.DoubleTensor", "torch.cuda.DoubleTensor"
            with torch._C.DisableTorchFunction():
                name = T.type(torch.empty(0, dtype=x.dtype))
            return name if x.device.type == "cpu" else name.replace("torch.", f"torch.{x.device.type}.", 1)
        if isinstance(dtype, torch.dtype):
            return self._convert(x, dtype=dtype)
        # A type's name ("torch.cuda.DoubleTensor") or class (torch.DoubleTensor): torch's parser reads it off an
        # empty tensor (its errors are eager's), and eager moves to the type's device only where the kind differs.
        with torch._C.DisableTorchFunction():
            typed = T.type(torch.empty(0), dtype)
        if typed.layout != torch.strided:
            raise UnsupportedOpError(f"fulmen cannot trace Tensor.type({dtype!r}): it makes a {typed.layout} tensor, "
                                     "and fulmen traces dense (strided) tensors only", self.builder.source)
        device = None if typed.device.type == x.device.type else torch.device(typed.device.type)
        return self._convert(x, device=device, dtype=typed.dtype)

    def _convert(
        self, x: TensorProxy, device: torch.device | None = None, dtype: torch.dtype | None = None, copy: bool = False,
        memory_format: torch.memory_format | None = None
    ) -> Any:
        current = self._values(x)  # a captured real tensor becomes a constant
        same_device = device is None or _same_device(torch.device(device), current.device)
        same_dtype = dtype is None or dtype == current.dtype
        if memory_format is torch.preserve_format:
            memory_format = None
        # eager's rule (aten's to_will_alias): the layout torch suggests for the tensor, not is_contiguous
        same_format = memory_format is None or suggest_memory_format(current.meta) == memory_format
        if same_device and same_dtype and same_format and not copy:
            return x  # eager returns the tensor itself, so later in-place updates alias it
        kwargs: dict[str, Any] = {}
        if not same_device:
            kwargs["device"] = torch.device(device)
        if not same_dtype:
            kwargs["dtype"] = dtype
        if copy:
            kwargs["copy"] = True
        if memory_format is not None:
            kwargs["memory_format"] = memory_format
        return SYMBOLS["torch.Tensor.to"](current, **kwargs)


def _strides(t: TensorProxy) -> tuple[int, ...]:
    """The strides a layout is told by: a dimension of size 1 is never stepped along."""
    return tuple(stride if size > 1 else 0 for size, stride in zip(t.shape, t.stride()))


def _same_device(wanted: torch.device, have: torch.device) -> bool:
    return wanted.type == have.type and (wanted.index is None or wanted.index == have.index)


def current_interpreter() -> Interpreter | None:
    """The acquisition running now, if any (its torch-function mode is on torch's mode stack)."""
    if not torch._C._len_torch_function_stack():  # the common case, without building the stack's list
        return None
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, Interpreter):
            return mode
    return None
