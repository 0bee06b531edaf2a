"""Symbolic sizes: a dimension that varies between calls is a symbol of torch's own ShapeEnv (s0, s1, ...).

A trace input whose size is symbolic carries a meta tensor with SymInt sizes, made by the ShapeEnv from the real
tensor (`symbolic_meta`); torch's meta kernels then compute every output's shape as an expression of the symbols
(`f32[4, s0]`), and what the program's Python decides from a size (`if T > block_size`) becomes one of the
ShapeEnv's guards, which the cache checks before it reuses the trace (fulmen.jit.dynamic_shapes). Sizes 0 and 1
specialise, as in torch.compile. Printed traces stay valid Python: a trace binds each symbol its statements use
from the shape of an input (`s0 = idx.shape[1]`, `size_bindings`) and prints expressions with Python's operators.
A trace without symbols prints and runs exactly as before.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch._decomp import meta_table
from torch._dispatch.python import enable_python_dispatcher
from torch._dynamo.source import LocalSource
from torch.fx.experimental import symbolic_shapes
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
    statically_known_true,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.printers import PythonPrinter

from fulmen.core.errors import FulmenError
from fulmen.core.source import SourceLocation, user_location

# a symbolic size's value at this call, without a guard (torch 2.13 renamed hint_int to optimization_hint; the
# project supports the torch of the GPU machines, 2.11, too)
optimization_hint = getattr(symbolic_shapes, "optimization_hint", None) or symbolic_shapes.hint_int

SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class SymbolicSizeError(FulmenError):
    """A choice fulmen makes while tracing would differ between sizes a symbolic trace stands for (a kernel eager
    picks for some lengths only): the callable traces static shapes instead, and its miss reasons say why."""


@dataclass(frozen=True, slots=True)
class Decision:
    """A question about sizes that the traced code answered and that added guards: `s0 > 64` was False."""

    question: sympy.Basic
    answer: Any
    guards: tuple[sympy.Basic, ...]  # what holds for the trace to apply (torch's ShapeGuard expressions)
    where: SourceLocation | None  # the user's line that asked (None: fulmen's or torch's own code)
    why: str | None = None  # what asked, where it was not a line of the program (`Sizes.asking`)


class Sizes(ShapeEnv):
    """torch's ShapeEnv, numbering its symbols in the order they are made (s0, s1, ...), as torch names them by a
    hash of their source, which would make printed traces hard to read; and keeping each question that added
    guards (`decisions`), so that a call that answers one otherwise can say which."""

    def _init(self, **kwargs: Any) -> None:
        super()._init(**kwargs)
        self._ids = itertools.count()
        self.decisions: list[Decision] = []
        self._asking: str | None = None

    def evaluate_expr(self, orig_expr: sympy.Basic, *args: Any, **kwargs: Any) -> sympy.Basic:
        before = len(self.guards)
        answer = super().evaluate_expr(orig_expr, *args, **kwargs)
        if len(self.guards) > before:
            guards = tuple(guard.expr for guard in self.guards[before:])
            where = user_location() if self._asking is None else None
            self.decisions.append(Decision(orig_expr, answer, guards, where, self._asking))
        return answer

    @contextlib.contextmanager
    def asking(self, why: str) -> Iterator[None]:
        """The questions asked inside are fulmen's, for `why` (e.g. "the program returns it")."""
        self._asking = why
        try:
            yield
        finally:
            self._asking = None

    def _generate_unique_id(self, source_name: str) -> int:
        while True:
            attempt = next(self._ids)
            if attempt not in self.unique_ids:
                self.unique_ids.add(attempt)
                return attempt


def is_symbolic(value: Any) -> bool:
    """A SymInt, SymFloat or SymBool whose value is not a known constant."""
    return isinstance(value, SYMBOLIC) and value.node.maybe_as_int() is None and not value.node.is_constant()


def hint(value: Any) -> int:
    """An int, or a symbolic size's value in the call the trace was made for, without a guard: for the choices
    that cost models make (bytes saved, flops recomputed, chunk counts), which stay right for every size and are
    made once per trace."""
    return optimization_hint(value) if isinstance(value, torch.SymInt) else value


def known_true(condition: Any) -> bool:
    """Whether `condition` holds for every size the trace's guards admit, asking no new guard (a symbolic condition
    not known either way is False): for choices where either answer computes the right values (a slice that may be
    the whole tensor is taken anyway)."""
    return statically_known_true(condition)


def slice_indices(item: slice, size: Any) -> tuple[Any, Any, Any]:
    """`item.indices(size)` (Python's rule, for the positive steps tensors take) where the size or a bound is
    symbolic: each comparison a bound needs is one of the trace's guards (`x[:, :5]` of a symbolic s0 asks
    s0 >= 5; LitGPT's `cos[:T]` asks T <= block_size)."""
    step = 1 if item.step is None else item.step

    def clamp(bound: Any, default: Any) -> Any:
        if bound is None:
            return default
        if bound < 0:
            bound = bound + size
            return bound if bound >= 0 else 0
        return bound if bound <= size else size

    return clamp(item.start, 0), clamp(item.stop, size), step


def probes(tensors: Sequence[Any]) -> list[dict[sympy.Symbol, int]]:
    """Values of the symbols in the shapes of `tensors` (proxies) to ask a size-dependent question at: the traced
    sizes, and the smallest and a large size the guards so far admit (one assignment, {}, when there are none). A
    choice that is the same at all of them is taken for every size; one that is not is refused."""
    symbols: set[sympy.Symbol] = set()
    env = None
    for tensor in tensors:
        for value in (*tensor.shape, *tensor.stride()):
            if isinstance(value, torch.SymInt) and not value.node.expr.is_number:
                symbols |= value.node.expr.free_symbols
                env = value.node.shape_env
    if env is None:
        return [{}]
    traced = {s: int(env.backed_var_to_val[s]) for s in symbols}
    low = {s: max(int(env.var_to_range[s].lower), 2) for s in symbols}
    high = {s: _upper(env.var_to_range[s].upper, traced[s]) for s in symbols}
    return [traced, low, high]


def _upper(bound: Any, traced: int) -> int:
    large = 2 * traced + 129  # past the next multiples of 64 and 128, where kernels' constraints tend to sit
    return large if bound == int_oo else min(int(bound), large)


def concrete(value: Any, assignment: dict[sympy.Symbol, int]) -> int:
    """A size at the symbols' values in `assignment`."""
    if not isinstance(value, torch.SymInt):
        return value
    return int(value.node.expr.xreplace(assignment))


_PRINTER = PythonPrinter()


def python(value: Any) -> str:
    """Python source computing `value` from the symbols (`4*s0`, `s0 // 2`); a known constant prints as itself."""
    expr = value.node.expr
    if expr is sympy.true or expr is sympy.false:
        return repr(bool(expr))
    if expr.is_number:
        return repr(int(expr) if expr.is_integer else float(expr))
    return _PRINTER.doprint(expr)


def size_string(size: Any) -> str:
    """A size as a type comment prints it: `s0`, `4*s0`, `12`."""
    return _PRINTER.doprint(size.node.expr) if isinstance(size, torch.SymInt) else str(size)


def has_symbolic_sizes(meta: torch.Tensor) -> bool:
    return meta._has_symbolic_sizes_strides


def free_symbols(obj: Any) -> set[sympy.Symbol]:
    """The symbols the symbolic values inside `obj` (nested tuples, lists, dicts, slices) are expressions of."""
    found: set[sympy.Symbol] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, SYMBOLIC):
            found |= item.node.expr.free_symbols
        elif isinstance(item, (tuple, list, torch.Size)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, slice):
            stack.extend((item.start, item.stop, item.step))
    return found


def involved(obj: Any) -> bool:
    """Whether `obj` (nested tuples, lists, dicts) holds a symbolic value or a tensor of symbolic sizes."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, SYMBOLIC) or isinstance(item, torch.Tensor) and item._has_symbolic_sizes_strides:
            return True
        if isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return False


_FACTORIES: dict[Any, bool] = {}


def _is_factory(func: Any) -> bool:
    """An aten op that makes a tensor from no tensor (it takes a `device`)."""
    found = _FACTORIES.get(func)
    if found is None:
        arguments = func._schema.arguments
        found = _FACTORIES[func] = any(a.name == "device" for a in arguments) and not any(
            isinstance(a.type, (torch.TensorType, torch.ListType)) and "Tensor" in str(a.type) for a in arguments
        )
    return found


class MetaFactories(TorchDispatchMode):
    """While a meta kernel computes symbolic sizes: a tensor torch's Python decompositions make without a device
    (`torch.arange(n)` in nll_loss's) is made on the meta device, where a CPU kernel would need concrete sizes. As
    torch's FakeTensorMode does, an op with a Python meta function or decomposition runs it with this mode on, so
    the tensors it makes are seen too."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _is_factory(func):
            if kwargs.get("device") is None or torch.device(kwargs["device"]).type == "cpu":
                kwargs = {**kwargs, "device": torch.device("meta")}
            return func(*args, **kwargs)
        python = meta_table.get(func)
        if python is None and "prims::" in func._schema.name:
            python = getattr(func, "prim_meta_impl", None)
        if python is not None:
            with self:
                return python(*args, **kwargs)
        with self:
            out = func.decompose(*args, **kwargs)  # a CompositeImplicitAutograd op, as its parts
        return out if out is not NotImplemented else func(*args, **kwargs)


def symbolic_meta(sizes: Sizes, tensor: torch.Tensor, position: int, dims: frozenset[int]) -> torch.Tensor:
    """A meta tensor laid out as `tensor`, with a symbol for each dimension in `dims` (one of size 0 or 1 stays that
    size): duck-sized as torch.compile does, so two dimensions of equal size share a symbol (and a guard checks they
    stay equal). The source `t{position}` names the tensor among the call's arguments (the guards read it there)."""
    context = StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DUCK if d in dims else DimDynamic.STATIC for d in range(tensor.dim())]
    )
    offset = tensor.storage_offset()
    if offset != 0:
        # a view into a larger storage (a rank's rows of a global batch, `x[start:stop]`): its offset stays static
        # (the ShapeEnv would make it a symbol), as in a static trace (distribution.logical_meta), which holds for any
        # offset unless the program reads it (then its cache entry checks the offsets)
        tensor = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    shape, strides, _ = sizes.create_symbolic_sizes_strides_storage_offset(
        tensor, LocalSource(f"t{position}"), symbolic_context=context
    )
    with enable_python_dispatcher():
        if offset == 0:
            return torch.empty_strided(shape, strides, dtype=tensor.dtype, device="meta")
        extent = offset + sum((size - 1) * stride for size, stride in zip(shape, strides)) + 1
        storage = torch.empty(extent, dtype=tensor.dtype, device="meta").untyped_storage()
        return torch.empty(0, dtype=tensor.dtype, device="meta").set_(storage, offset, shape, strides)


@contextlib.contextmanager
def symbolic_dispatch(active: bool) -> Iterator[None]:
    """torch's Python dispatcher, which the meta kernels of views and reshapes need for symbolic sizes (their C++
    kernels take concrete sizes only), while `active`; otherwise nothing changes."""
    if not active:
        yield
        return
    with enable_python_dispatcher():
        yield


def symbolic_trace(trace: Any) -> bool:
    """Whether some input of `trace` has symbolic sizes."""
    return any(has_symbolic_sizes(p.meta) for p in trace.inputs)


def size_bindings(inputs: Sequence[Any], needed: set[sympy.Symbol]) -> list[str]:
    """Statements binding each of `needed` from the shape of one of `inputs` (proxies): `s0 = idx.shape[1]`, or, where
    no input has the symbol as a dimension of its own, `s0 = x.shape[0] // 4` from a dimension `4*s0`."""
    lines, left = _bindings(inputs, needed)
    if left:
        names = ", ".join(sorted(str(s) for s in left))
        raise AssertionError(f"internal error: no input of the trace has a size that gives {names}")
    return lines


def size_carriers(bsyms: Sequence[Any], inputs: Sequence[Any], candidates: Sequence[Any]) -> list[Any]:
    """Of `candidates` (proxies, in order of preference), those a trace of `bsyms` taking `inputs` must take as well
    to bind the symbolic sizes its calls use (a backward whose saved values and cotangents hold no dimension s0,
    where a call divides by s0): the first that gives each such symbol."""
    needed = free_symbols([(b.args, b.kwargs) for b in bsyms])
    _, left = _bindings(inputs, needed)
    carriers: list[Any] = []
    for candidate in candidates:
        if not left:
            break
        _, still = _bindings([candidate], left)
        if still != left:
            carriers.append(candidate)
            left = still
    return carriers


def _bindings(inputs: Sequence[Any], needed: set[sympy.Symbol]) -> tuple[list[str], set[sympy.Symbol]]:
    """The statements binding what of `needed` the shapes of `inputs` give, and the symbols they do not give."""
    lines: list[str] = []
    left = set(needed)
    for linear in (False, True):
        for proxy in inputs:
            for dim, size in enumerate(proxy.shape):
                if not left or not isinstance(size, torch.SymInt):
                    continue
                expr = size.node.expr
                if expr in left:
                    lines.append(f"{expr} = {proxy.pname}.shape[{dim}]")
                    left.discard(expr)
                elif linear and len(expr.free_symbols) == 1 and (symbol := next(iter(expr.free_symbols))) in left:
                    factor, offset = _linear(expr, symbol)
                    if factor is None:
                        continue
                    read = f"{proxy.pname}.shape[{dim}]" + (f" - {offset}" if offset else "")
                    lines.append(f"{symbol} = ({read}) // {factor}" if factor != 1 else f"{symbol} = {read}")
                    left.discard(symbol)
    return lines, left


def _linear(expr: sympy.Expr, symbol: sympy.Symbol) -> tuple[int | None, int]:
    """(a, b) where expr is a*symbol + b with integers a > 0 and b, else (None, 0)."""
    poly = sympy.Poly(expr, symbol) if expr.is_polynomial(symbol) else None
    if poly is None or poly.degree() != 1:
        return None, 0
    a, b = poly.all_coeffs()
    if not (a.is_Integer and b.is_Integer and a > 0):
        return None, 0
    return int(a), int(b)
