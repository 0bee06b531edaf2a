"""Traces and the builder that records them.

A `Trace` is a straight-line program: flat tensor inputs, a list of bound symbols and flat outputs. Every pass
returns a new trace stamped with its provenance; `Trace.python()` prints it as valid Python.
"""

from __future__ import annotations

import builtins
import itertools
import keyword
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fulmen.core import pytree, templates
from fulmen.core.proxies import TensorProxy, TrackedMetas
from fulmen.core.source import SourceLocation
from fulmen.core.symbol import (
    IMPORTS,
    BoundSymbol,
    Builder,
    Symbol,
    Tag,
    iter_proxies,
    map_proxies,
    pop_builder,
    push_builder,
)
from fulmen.core.symbolic import SYMBOLIC, MetaFactories, has_symbolic_sizes, involved, symbolic_dispatch
from fulmen.core.templates import Template, instantiate, make_template, template_key

# Names a generated trace must not shadow: the roots it imports (a user's argument named `dist` would hide the
# collectives' module) and Python's builtins.
_BUILTINS = frozenset(dir(builtins))


class Namespace:
    """Hands out valid, unique identifiers for proxies."""

    def __init__(self) -> None:
        self._taken: set[str] = set()
        self._counter = 0

    @property
    def counter(self) -> int:
        """The number the next fresh name starts trying from."""
        return self._counter

    def take(self, names: list[str], counter: int) -> bool:
        """Takes `names` and moves the counter to `counter` (a decomposition's parts taken again: templates.py), or
        takes nothing and says False where one of them is taken already."""
        if any(name in self._taken for name in names):
            return False
        self._taken.update(names)
        self._counter = counter
        return True

    def fresh(self) -> str:
        while True:
            name = f"t{self._counter}"
            self._counter += 1
            if name not in self._taken:
                self._taken.add(name)
                return name

    def create(self, hint: str) -> str:
        base = "".join(c if c.isalnum() or c == "_" else "_" for c in hint) or "t"
        if base[0].isdigit():
            base = f"t_{base}"
        if keyword.iskeyword(base) or base in IMPORTS or base in _BUILTINS:
            base = f"{base}_"
        name, suffix = base, 1
        while name in self._taken:
            name = f"{base}_{suffix}"
            suffix += 1
        self._taken.add(name)
        return name


@dataclass(frozen=True, slots=True)
class TracePrinter:
    """Prints a trace as Python (`source(trace, print_depth, include_sources)`) and compiles it (`compile`)."""

    source: Callable[[Trace, int, bool], str]
    compile: Callable[[Trace], Callable[..., Any]]


class Codegen:
    """Where `Trace.python()`, `python_callable()` and `str(trace)` find fulmen.core.codegen. Codegen reads traces, so
    this module cannot import it: codegen registers its printer here when it is imported (fulmen/__init__ imports it
    with the compiler, before any trace exists)."""

    def __init__(self) -> None:
        self._printer: TracePrinter | None = None

    def register(self, printer: TracePrinter) -> None:
        self._printer = printer

    def printer(self) -> TracePrinter:
        if self._printer is None:
            raise RuntimeError("traces print through fulmen.core.codegen, which is not imported: import fulmen")
        return self._printer


CODEGEN = Codegen()


@dataclass
class Trace:
    name: str
    inputs: list[TensorProxy]
    bound_symbols: list[BoundSymbol]
    output: tuple
    provenance: str
    namespace: Namespace = field(default_factory=Namespace, repr=False)
    # When set, the function takes one list per group (name, length) instead of flat inputs, unpacks and clears
    # each, so the caller's list no longer keeps the tensors alive (a backward frees saved tensors as it goes).
    input_groups: tuple[tuple[str, int], ...] = ()

    def from_trace(self, provenance: str, **changes) -> Trace:
        return replace(self, provenance=provenance, **changes)

    def python(self, print_depth: int = 0, include_sources: bool = True) -> str:
        return CODEGEN.printer().source(self, print_depth, include_sources)

    def python_callable(self) -> Callable[..., Any]:
        return CODEGEN.printer().compile(self)

    def __str__(self) -> str:
        return self.python()


def infer_device(args: tuple, kwargs: dict[str, Any]) -> torch.device:
    """The device an op's output lands on, following eager's rule: 0-dim CPU tensors do not decide it."""
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    first = None
    for proxy in iter_proxies((args, kwargs)):
        if first is None:
            first = proxy.device
        if proxy.device.type != "cpu" or proxy.dim() > 0:
            return proxy.device
    return first if first is not None else torch.get_default_device()


def _to_meta(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    meta_args = map_proxies(args, lambda p: p.meta)
    meta_kwargs = map_proxies(kwargs, lambda p: p.meta)
    if "device" in meta_kwargs:
        meta_kwargs["device"] = "meta"
    return meta_args, meta_kwargs


def _is_differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


class _Uncacheable(Exception):
    pass


def _meta_key(obj: Any) -> Any:
    """A hashable description of everything a meta kernel reads from arguments (a tensor's shape, strides, offset
    and dtype; any other value with its type, since 1, 1.0 and True promote differently)."""
    if type(obj) is TensorProxy:
        if has_symbolic_sizes(obj.meta):  # SymInts do not hash: equal expressions are equal sizes
            return (TensorProxy, _meta_key(tuple(obj.shape)), _meta_key(obj.stride()),
                    _meta_key(obj.storage_offset()), obj.dtype)
        return (TensorProxy, tuple(obj.shape), obj.stride(), obj.storage_offset(), obj.dtype)
    if isinstance(obj, SYMBOLIC):
        return (type(obj), obj.node.expr)
    if isinstance(obj, (tuple, list)):
        return (type(obj), tuple(_meta_key(item) for item in obj))
    if type(obj) is slice:  # unhashable before Python 3.12: x[:, :T], and its setitem
        return (slice, _meta_key(obj.start), _meta_key(obj.stop), _meta_key(obj.step))
    if isinstance(obj, dict):
        return (dict, tuple((key, _meta_key(value)) for key, value in obj.items()))
    if isinstance(obj, torch.Tensor):  # a real tensor (a constant): its values may matter
        raise _Uncacheable
    try:
        hash(obj)
    except TypeError:
        raise _Uncacheable from None
    return (type(obj), obj)


_MISSING_KEY: Any = object()  # bind's key, not computed yet


def _call_key(sym: Symbol, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
    """The key of a call's metadata for the meta and template caches (None: a real tensor among the arguments);
    factories and Python numbers take the default dtype, which the program may set (torch.set_default_dtype)."""
    try:
        return (_meta_key((sym, args, kwargs)), torch.get_default_dtype())
    except _Uncacheable:
        return None


def _is_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor)


def _tensors(obj: Any) -> list[torch.Tensor]:
    return list(pytree.leaves(obj, _is_tensor))


def _new_tensors_only(meta_out: Any, meta_args: tuple, meta_kwargs: dict[str, Any]) -> bool:
    """Whether every tensor `meta_out` holds is a new, dense tensor (no view or input: their aliasing is not kept)."""
    inputs = {id(t) for t in _tensors((meta_args, meta_kwargs))}
    for tensor in _tensors(meta_out):
        if tensor._is_view() or id(tensor) in inputs or tensor.storage_offset() != 0:
            return False
    return isinstance(meta_out, (torch.Tensor, tuple, list))


def _view_layout(meta_out: Any, meta_args: tuple, meta_kwargs: dict[str, Any]) -> tuple | None:
    """(position among the arguments' tensors, shape, strides, storage offset) of `meta_out` where it is one tensor,
    a plain view of one of them (as a reshape, slice, expand or permute gives), else None: a call with the same
    metadata gives that view again, which as_strided takes of the same argument (the same base, layout and dtype).
    Position None, with the base: a view of a tensor the call made (a matmul's `mm(...).view`, the attention's
    output), taken again of a detached copy of that base."""
    if type(meta_out) is not torch.Tensor or not meta_out._is_view() or meta_out.is_conj() or meta_out.is_neg():
        return None
    base, tensors = meta_out._base, _tensors((meta_args, meta_kwargs))
    if any(tensor is meta_out for tensor in tensors):  # an input given back as it is
        return None
    for position, tensor in enumerate(tensors):
        root = tensor._base if tensor._is_view() else tensor
        if root is base:
            if tensor.dtype == meta_out.dtype and type(tensor) is torch.Tensor:
                return position, meta_out.shape, meta_out.stride(), meta_out.storage_offset()
            return None
    if base.dtype != meta_out.dtype or type(base) is not torch.Tensor or base._is_view():
        return None
    return None, meta_out.shape, meta_out.stride(), meta_out.storage_offset(), base


def _take_view(layout: tuple, meta_args: tuple, meta_kwargs: dict[str, Any]) -> torch.Tensor:
    """The view `_view_layout` described, taken again of these arguments (or of a copy of the base it made). Below
    torch's Python dispatcher: the C++ kernels of as_strided and detach take symbolic sizes as they are, where the
    Python ones compute with them (a new base's storage size alone ~0.3 ms)."""
    position, shape, strides, offset, *made = layout
    with torch._C._DisablePythonDispatcher():
        base = _tensors((meta_args, meta_kwargs))[position] if position is not None else made[0].detach()
        return base.as_strided(shape, strides, offset)


def _fresh_metas(meta_out: Any) -> Any:
    """New meta tensors laid out as those of `meta_out` (each call gets its own): detached copies, which copy the
    layout as it is (torch.empty_strided would compute the storage size and contiguity again, ~0.6 ms of SymInt
    arithmetic for symbolic sizes). They share the cached one's meta storage, which holds nothing; none is a view.
    Below torch's Python dispatcher, which a symbolic trace runs under: its detach is a Python decomposition (an
    alias, ~0.2 ms for symbolic sizes), where the C++ kernel copies the sizes as they are (~1 us)."""
    with torch._C._DisablePythonDispatcher():
        return pytree.tree_map(torch.Tensor.detach, meta_out, _is_tensor)


# The prim a call's parts use when its result is one of its inputs (fulmen.ops.prims lists it as `prims.alias`).
ALIAS = Symbol(name="alias", printed="prims.alias", impl=lambda x: x, is_prim=True)


class TraceBuilder(Builder):
    """Records bound symbols into nested scopes while the user's program (or a decomposition) runs."""

    def __init__(self, namespace: Namespace | None = None, decompose: bool = True) -> None:
        self.namespace = namespace or Namespace()
        # The repeated blocks of a model ask torch's meta kernels the same question once per block: the answers,
        # by the arguments' metadata (see _meta_key), for calls whose outputs are new tensors.
        self._metas: dict[tuple, Any] = {}
        # With symbolic sizes, a view's meta kernel (reshape's, most of all) costs ~1 ms of SymInt arithmetic: the
        # layout it gave, by the same key, to take again of the same input with as_strided (_view_layout)
        self._views: dict[tuple, tuple] = {}
        # The parts each kind of call's decomposition recorded (None: not to be kept), to take again (templates.py)
        self._templates: dict[tuple, Template | None] = {}
        self.scopes: list[list[BoundSymbol]] = [[]]
        self.source: SourceLocation | None = None
        # > 0 while a grad rule or an execution transform runs (fulmen.transforms.recording): its calls keep the line
        # of the call it stands for
        self.rules_running = 0
        self.decompose = decompose
        self.checkpoint_region = 0  # the torch.utils.checkpoint.checkpoint call being traced (0: none)
        self.checkpoint_regions = 0
        # Records the program's own calls of executors' operators where the program's state applies to them (its
        # in-place updates, torch.autocast): fulmen.acquisition.acquire's interpreter sets it.
        self.operator_calls: Callable[[Symbol, tuple, dict[str, Any]], Any] | None = None

    def __enter__(self) -> TraceBuilder:
        push_builder(self)
        return self

    def __exit__(self, *exc) -> None:
        pop_builder(self)

    @property
    def bound_symbols(self) -> list[BoundSymbol]:
        return self.scopes[0]

    def make_proxy(
        self, meta: torch.Tensor, device: torch.device, requires_grad: bool = False, name: str | None = None
    ) -> TensorProxy:
        pname = self.namespace.create(name) if name is not None else self.namespace.fresh()
        return TensorProxy(pname, meta, device, requires_grad)

    def wrap_outputs(self, meta_out: Any, device: torch.device, requires_grad: bool,
                     differentiable: tuple[bool, ...] | None = None) -> Any:
        position = itertools.count()

        def wrap(tensor: torch.Tensor) -> TensorProxy:
            meta = tensor if tensor.device.type == "meta" else tensor.to("meta")
            marked = differentiable is None or differentiable[next(position)]
            return self.make_proxy(meta, device, requires_grad and marked and _is_differentiable(meta.dtype))

        return pytree.tree_map(wrap, meta_out, _is_tensor)

    def bind(self, sym: Symbol, args: tuple, kwargs: dict[str, Any]) -> Any:
        with torch._C.DisableTorchFunction():
            key = _MISSING_KEY
            if sym.meta is not None:
                with TrackedMetas():
                    output = sym.meta(self, *args, **kwargs)
            else:
                device = infer_device(args, kwargs)
                key = _call_key(sym, args, kwargs)
                with TrackedMetas():  # the proxies themselves are made in the caller's mode (Tensor.is_inference)
                    meta_out = self._meta_outputs(sym, args, kwargs, key)
                requires_grad = (torch.is_grad_enabled() and not sym.tags & Tag.NO_GRAD
                                 and any(p.requires_grad for p in iter_proxies((args, kwargs))))
                output = self.wrap_outputs(meta_out, device, requires_grad, sym.differentiable_outputs)
            subsymbols: list[BoundSymbol] = []
            if sym.decomposition is not None and self.decompose:
                if key is _MISSING_KEY:
                    key = _call_key(sym, args, kwargs)
                subsymbols = self._decompose(sym, args, kwargs, output, key)
            self.scopes[-1].append(
                BoundSymbol(sym, args, kwargs, output, subsymbols, self.source, self.checkpoint_region))
        return output

    def bind_operator(self, sym: Symbol, args: tuple, kwargs: dict[str, Any]) -> Any:
        return (self.operator_calls or self.bind)(sym, args, kwargs)

    def _meta_outputs(self, sym: Symbol, args: tuple, kwargs: dict[str, Any], key: tuple | None) -> Any:
        cached = self._metas.get(key) if key is not None else None
        if cached is not None:
            return _fresh_metas(cached)
        meta_args, meta_kwargs = _to_meta(args, kwargs)
        if involved((meta_args, meta_kwargs)):  # symbolic sizes (fulmen.core.symbolic)
            with symbolic_dispatch(True):
                view = self._views.get(key) if key is not None else None
                if view is not None:
                    return _take_view(view, meta_args, meta_kwargs)
                with MetaFactories():
                    meta_out = sym.impl(*meta_args, **meta_kwargs)
            if key is not None and (view := _view_layout(meta_out, meta_args, meta_kwargs)) is not None:
                self._views[key] = view
        else:
            meta_out = sym.impl(*meta_args, **meta_kwargs)
        if key is not None and _new_tensors_only(meta_out, meta_args, meta_kwargs):
            self._metas[key] = meta_out
        return meta_out

    def cached_meta(self, sym: Symbol, args: tuple, kwargs: dict[str, Any], compute: Callable[[], Any]) -> Any:
        """`compute()`, a meta function's new dense tensors for these arguments, from the meta cache where the same
        kind of call asked before (a symbol whose `meta` makes its outputs itself, as get_grad's placeholder)."""
        key = _call_key(sym, args, kwargs)
        cached = self._metas.get(key) if key is not None else None
        if cached is not None:
            return _fresh_metas(cached)
        meta_out = compute()
        if key is not None and _new_tensors_only(meta_out, (), {}):
            self._metas[key] = meta_out
        return meta_out

    def bind_meta(self, sym: Symbol, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The outputs `sym`'s meta function gives for these arguments, without recording a call."""
        with torch._C.DisableTorchFunction(), TrackedMetas():
            return sym.meta(self, *args, **kwargs)

    def _decompose(self, sym: Symbol, args: tuple, kwargs: dict[str, Any], output: Any,
                   key: tuple | None) -> list[BoundSymbol]:
        if key is not None:  # the parts of the same kind of call, taken again (templates.py)
            key = template_key(key, args, kwargs, output, self.checkpoint_region)
            template = self._templates.get(key)
            if template is not None:
                parts = instantiate(template, self.namespace, args, kwargs, output, self.source)
                if parts is not None:
                    return parts
        start = self.namespace.counter
        self.scopes.append([])
        try:
            result = sym.decomposition(*args, **kwargs)
        finally:
            subsymbols = self.scopes.pop()
        if result is NotImplemented:  # no decomposition for these arguments: the symbol stays a leaf
            subsymbols = []
        else:
            results, outputs = list(iter_proxies(result)), list(iter_proxies(output))
            differs = mismatch(results, outputs)
            if differs is not None:
                raise AssertionError(f"decomposition of {sym.name} gives {differs[0]}, torch gives {differs[1]}")
            self.adopt_results(subsymbols, results, outputs, self.source)
        if key is not None and templates.ENABLED and key not in self._templates:
            self._templates[key] = make_template(subsymbols, args, kwargs, output, start, self.namespace.counter,
                                                 self.source, self.checkpoint_region)
        return subsymbols

    def adopt_results(self, parts: list[BoundSymbol], results: list[TensorProxy], outputs: list[TensorProxy],
                      source: SourceLocation | None) -> None:
        """Makes `parts` compute `outputs`: a result the parts computed takes its output's name; one they did not
        (an input given back as it is) gets an alias call."""
        produced = {name for bsym in parts for name in bsym.output_names()}
        for res, out in zip(results, outputs):
            if res is out:
                continue
            if res.pname in produced:
                _rename(parts, res.pname, out.pname)
                res.pname = out.pname
            else:
                parts.append(BoundSymbol(ALIAS, (res,), {}, out, [], source))


def mismatch(results: list[TensorProxy], outputs: list[TensorProxy]) -> tuple[str, str] | None:
    """Where the tensors a function returned differ from those its call must give, in number, shape or dtype:
    (what it returned, what was due), e.g. ("2 tensors", "1") or ("f32[3]", "f32[4]"); None when they match."""
    if len(results) != len(outputs):
        return f"{len(results)} tensors", f"{len(outputs)}"
    for res, out in zip(results, outputs):
        if tuple(res.shape) != tuple(out.shape) or res.dtype != out.dtype:
            return res.type_string(), out.type_string()
    return None


def _rename(bsyms: list[BoundSymbol], old: str, new: str) -> None:
    """Renames `old` to `new` in the decompositions of `bsyms`, whose parts named a result as the call then did."""
    for bsym in bsyms:
        for sub in bsym.subsymbols:
            for proxy in iter_proxies((sub.args, sub.kwargs, sub.output)):
                if proxy.pname == old:
                    proxy.pname = new
        _rename(bsym.subsymbols, old, new)
