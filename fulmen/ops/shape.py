"""Shape, view, indexing and joining symbols, each with its rules."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fulmen.core import symbolic
from fulmen.core.errors import DataDependentError
from fulmen.core.symbol import Tag, iter_proxies, map_proxies
from fulmen.core.trace import TraceBuilder, infer_device
from fulmen.ops import prims
from fulmen.ops.kernels import impls
from fulmen.ops.registry import TorchBinding, bind, impl_symbol, lookup, method, methods, torch_symbol
from fulmen.ops.rules.batch import Batch, elementwise, shift, with_dim
from fulmen.ops.rules.eager import eager_op
from fulmen.ops.rules.grad import differentiated_by_eager, get_grad, not_differentiable, put_grad, torch_vjp, wants_grad
from fulmen.ops.rules.grad_formulas import zeros_shaped
from fulmen.ops.rules.jvp import Dot, linear
from fulmen.ops.rules.tables import RuleKind, register
from fulmen.ops.utils import canonical_dim, convert, expand_to, is_tensor, meta_of

JVP, BATCH = RuleKind.JVP, RuleKind.BATCH


def _linear_in(operands: dict[Callable[..., Any], tuple[int | str, ...]]) -> None:
    """The JVP rules of torch-level leaves linear in the arguments at these positions or keywords (taken together):
    the op applied to the tangents."""
    for fn, positions in operands.items():
        register(JVP, fn, linear(lookup(fn).symbol, positions))


def _dim_arguments(dims: dict[Callable[..., Any], tuple[int, str, int | None]]) -> None:
    """The batching rules of ops of one tensor with a dim argument at (position, keyword, default): the dim moved
    past the batch dim."""
    for fn, (position, keyword, default) in dims.items():
        register(BATCH, fn, with_dim(lookup(fn).symbol, position, keyword, default))


def _meta_shape(fn, x, *args, **kwargs) -> tuple[int, ...]:
    return tuple(fn(x.meta, *args, **kwargs).shape)


# --- reshapes ------------------------------------------------------------------------------------------------------
def _reshape_to(fn):
    def decomposition(x, *args, **kwargs):
        if args and isinstance(args[0], torch.dtype) or "dtype" in kwargs:
            return NotImplemented  # a bitcast, not a reshape
        args = tuple(meta_of(a) for a in args)
        shape = _meta_shape(fn, x, *args, **kwargs)
        return prims.reshape(x, shape) if shape != tuple(x.shape) else prims.alias(x)

    return decomposition


reshape = torch_symbol(torch.reshape, decomposition=_reshape_to(torch.reshape))
for _fn in (method("reshape"), method("view"), method("view_as"), method("reshape_as"), torch.flatten,
            method("flatten"), torch.unflatten, method("unflatten"), torch.squeeze, method("squeeze"),
            torch.unsqueeze, method("unsqueeze"), torch.ravel, method("ravel")):
    torch_symbol(_fn, decomposition=_reshape_to(_fn))


def _permute_like(fn):
    def decomposition(x, *args, **kwargs):
        # Give each axis a distinct stride; the permutation is read off the strides of the meta result.
        strides = tuple(2 ** (x.dim() - 1 - i) for i in range(x.dim()))
        axis_of = {stride: axis for axis, stride in enumerate(strides)}
        probe = torch.empty(0, device="meta").as_strided(x.shape, strides)
        out = fn(probe, *args, **kwargs)
        return prims.permute(x, tuple(axis_of[stride] for stride in out.stride()))

    return decomposition


for _fn in (torch.permute, method("permute"), torch.transpose, method("transpose"), torch.swapaxes,
            method("swapaxes"), torch.swapdims, method("swapdims"), torch.t, method("t"), torch.movedim,
            method("movedim"), torch.moveaxis, method("moveaxis"), torch.Tensor.mT.__get__, torch.Tensor.T.__get__):
    torch_symbol(_fn, decomposition=_permute_like(_fn))


def _real_permute_like(fn):
    """The conjugate transposes: a permutation of a real tensor; a complex one's is conjugated too, left to torch."""
    permute = _permute_like(fn)

    def decomposition(x, *args, **kwargs):
        return NotImplemented if x.dtype.is_complex else permute(x, *args, **kwargs)

    return decomposition


for _fn in (torch.Tensor.mH.__get__, torch.adjoint, method("adjoint")):
    torch_symbol(_fn, decomposition=_real_permute_like(_fn))


def _expand_decomposition(fn):
    def decomposition(x, *args, **kwargs):
        args = tuple(meta_of(a) for a in args)
        return expand_to(x, _meta_shape(fn, x, *args, **kwargs))

    return decomposition


for _fn in (method("expand"), method("expand_as"), torch.broadcast_to, method("broadcast_to")):
    torch_symbol(_fn, decomposition=_expand_decomposition(_fn))
torch_symbol(torch.broadcast_tensors)
torch_symbol(torch.atleast_1d)
torch_symbol(torch.atleast_2d)
torch_symbol(torch.atleast_3d)
differentiated_by_eager(torch.broadcast_tensors, torch.atleast_1d, torch.atleast_2d, torch.atleast_3d)
_EVERY_POSITIONAL = tuple(range(64))  # ops of any number of tensors (torch.broadcast_tensors(*tensors))
_linear_in(dict.fromkeys((torch.broadcast_tensors, torch.atleast_1d, torch.atleast_2d, torch.atleast_3d),
                         _EVERY_POSITIONAL))


def _by_example_shape(fn):
    """atleast_1d/2d/3d: each tensor reshaped as the op reshapes one example."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        if kwargs or any(not is_tensor(a) for a in args):
            return NotImplemented
        outs = []
        for x in args:
            x = batch.materialize(x)
            with torch._C.DisableTorchFunction():  # the op on a meta example, not a call of the program
                example = tuple(fn.impl(torch.empty(x.shape[1:], device="meta")).shape)
            outs.append(prims.reshape(x, (batch.size, *example)))
        return outs[0] if len(outs) == 1 else tuple(outs)

    return rule


for _fn in (torch.atleast_1d, torch.atleast_2d, torch.atleast_3d):
    register(BATCH, _fn, _by_example_shape(lookup(_fn).symbol))

# --- slicing -------------------------------------------------------------------------------------------------------


def _normalize_index(index: Any) -> tuple:
    return index if isinstance(index, tuple) else (index,)


def _is_basic(item: Any) -> bool:
    return item is None or item is Ellipsis or isinstance(item, (int, slice, torch.SymInt)) and \
        not isinstance(item, bool)


def _later(start: Any, stop: Any) -> Any:
    """max(start, stop), where either may be symbolic (a guard decides which, as Python's max would)."""
    return stop if stop >= start else start


def _whole(starts: list, ends: list, steps: list, shape: torch.Size) -> bool:
    """Whether the slice takes every element: for symbolic sizes, only where the guards so far say it does (taking a
    slice that happens to be whole costs a view, never a wrong value)."""
    if all(type(v) is int for v in (*starts, *ends, *shape)):
        return not (any(s != 0 for s in starts) or ends != list(shape) or any(s != 1 for s in steps))
    return all(symbolic.known_true(s == 0) for s in starts) and all(s == 1 for s in steps) and \
        all(symbolic.known_true(e == n) for e, n in zip(ends, shape))


def getitem_decomposition(x: torch.Tensor, index: Any) -> Any:
    items = _normalize_index(index)
    if not all(_is_basic(i) for i in items):
        return NotImplemented  # advanced indexing stays one torch-level op
    n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + (slice(None),) * (x.dim() - n_real) + items[at + 1 :]
    dim, out, squeeze = 0, x, []
    starts, ends, steps = [0] * x.dim(), list(x.shape), [1] * x.dim()
    new_axes: list[int] = []
    position = 0
    for item in items:
        if item is None:
            new_axes.append(position)
            position += 1
            continue
        size = x.shape[dim]
        if isinstance(item, (int, torch.SymInt)):
            start = item % size if size else 0
            starts[dim], ends[dim] = start, start + 1
            squeeze.append(dim)
        else:
            plain = type(size) is int and all(type(b) is not torch.SymInt for b in (item.start, item.stop, item.step))
            start, stop, step = item.indices(size) if plain else symbolic.slice_indices(item, size)
            starts[dim], ends[dim], steps[dim] = start, max(start, stop) if plain else _later(start, stop), step
            position += 1
        dim += 1
    if not _whole(starts, ends, steps, x.shape):
        out = prims.slice(out, tuple(starts), tuple(ends), tuple(steps))
    if squeeze:
        out = prims.squeeze(out, tuple(squeeze))
    for axis in new_axes:
        out = prims.unsqueeze(out, axis)
    return out if out is not x else prims.alias(x)


getitem = torch_symbol(torch.Tensor.__getitem__, decomposition=getitem_decomposition)


@register(RuleKind.GRAD, getitem)
def getitem_grad(x, index):
    if not _basic_index(index):
        return NotImplemented
    y = x[index]
    put_grad(x, setitem(zeros_shaped(x), index, get_grad(y)))
    return y


def _basic_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(item is None or item is Ellipsis or isinstance(item, (int, slice)) for item in items)


_linear_in({torch.Tensor.__getitem__: (0,)})


# `aten.index(x, indices)`, which torch's TransformGetItemToIndex makes of `x[i, j]` with 0-dim index tensors (as
# transformers' mask functions index under vmap): `x[i, j]` itself would read them as Python ints.
aten_index = torch_symbol(torch.ops.aten.index.Tensor, aliases=(torch.ops.aten.index,),
                          printed="torch.ops.aten.index.Tensor")
differentiated_by_eager(aten_index)


@register(BATCH, aten_index)
def aten_index_batch(batch: Batch, args: tuple, kwargs: dict):
    """`x[i, j, ...]` with index tensors for its first dims: the batch becomes one more index (the first, an
    arange over x's batch dim) or stays the first dim of the broadcast indices."""
    x, indices = args
    if kwargs or not indices or any(i is None for i in indices):
        return NotImplemented  # a full slice between indices moves the indexed dims: once per example
    example = max(i.dim() - batch.batched(i) for i in indices)
    lifted = [batch.pad_to(batch.materialize(i), example) for i in indices]
    if batch.batched(x):
        rows = torch.arange(batch.size, device=x.device)
        lifted.insert(0, prims.reshape(rows, (batch.size, *(1,) * example)))
    return torch.ops.aten.index.Tensor(x, lifted)


def _select_at_decomposition(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    size = x.shape[dim]
    position = prims.where(prims.lt(index, 0), prims.add(index, size), index)  # select's negative positions
    return prims.squeeze(prims.take(x, prims.reshape(position, (1,)), dim), (dim,))


select_at = impl_symbol(impls.select_at, decomposition=_select_at_decomposition)


def _pieces_decomposition(fn):
    def decomposition(x, *args, **kwargs):
        outs = fn(x.meta, *args, **kwargs)
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        dim = canonical_dim(dim, x.dim())
        pieces, start = [], 0
        for out in outs:
            length = out.shape[dim]
            starts, ends = [0] * x.dim(), list(x.shape)
            starts[dim], ends[dim] = start, start + length
            pieces.append(prims.slice(x, tuple(starts), tuple(ends), (1,) * x.dim()))
            start += length
        return tuple(pieces)

    return decomposition


split = torch_symbol(torch.split, decomposition=_pieces_decomposition(torch.split))
for _fn in (method("split"), method("split_with_sizes"), torch.split_with_sizes, torch.chunk, method("chunk")):
    torch_symbol(_fn, decomposition=_pieces_decomposition(_fn))


def _pieces_grad(fn):
    def rule(x, *args, **kwargs):
        pieces = fn(x, *args, **kwargs)
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0) % x.dim()
        grads = [get_grad(p) for p in pieces]
        put_grad(x, torch.cat(grads, dim))
        return pieces

    return rule


for _fn in (torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk):
    register(RuleKind.GRAD, _fn, _pieces_grad(_fn))


def _by_values(fn: Callable[..., Any], refuse: Callable[..., str | None]) -> Callable[..., Any]:
    """The meta of `fn`, refusing (naming the line) the calls whose output shapes depend on a tensor argument's
    values, which eager's kernel reads (`refuse` says why); torch's meta kernel on the others."""

    def meta(builder: TraceBuilder, *args: Any, **kwargs: Any) -> Any:
        reason = refuse(*args, **kwargs)
        if reason is not None:
            raise DataDependentError(reason, builder.source)
        requires_grad = torch.is_grad_enabled() and any(p.requires_grad for p in iter_proxies((args, kwargs)))
        out = fn(*map_proxies(args, lambda p: p.meta), **map_proxies(kwargs, lambda p: p.meta))
        return builder.wrap_outputs(out, infer_device(args, kwargs), requires_grad)

    return meta


def _tensor_split_by_values(input, indices_or_sections=None, dim=0, **kwargs) -> str | None:  # noqa: A002
    if is_tensor(indices_or_sections):
        return ("fulmen cannot trace torch.tensor_split with its indices or sections given as a tensor: eager reads "
                "their values, which set the pieces' shapes and are unknown while tracing; pass them as Python ints")
    return None


def narrow_meta(builder: TraceBuilder, input: Any, dim: int, start: Any, length: int) -> Any:  # noqa: A002
    """narrow's view. A start given as a 0-dim integer tensor (eager's kernel reads it when the call runs) leaves
    the shape known, length along dim: the view is taken at 0 on meta tensors (its offset is the runtime's)."""
    if is_tensor(start) and (start.dim() != 0 or start.dtype.is_floating_point or start.dtype.is_complex):
        raise RuntimeError("start must be an 0-dim integral Tensor.")  # eager's
    out = input.meta.narrow(dim, 0 if is_tensor(start) else start, length)
    return builder.wrap_outputs(out, input.device, torch.is_grad_enabled() and input.requires_grad)


torch_symbol(torch.tensor_split, aliases=(method("tensor_split"),),
             meta=_by_values(torch.tensor_split, _tensor_split_by_values))
torch_symbol(torch.unbind, aliases=(method("unbind"),))
torch_symbol(torch.narrow, aliases=(method("narrow"),), meta=narrow_meta)
torch_symbol(torch.select, decomposition=lambda x, dim, index: prims.select(x, canonical_dim(dim, x.dim()), index),
             aliases=(method("select"),))
torch_symbol(torch.diagonal, aliases=(method("diagonal"),))
torch_symbol(torch.as_strided, aliases=(method("as_strided"),))
torch_symbol(method("unfold"))
differentiated_by_eager(torch.tensor_split, torch.unbind, torch.narrow, torch.diagonal, method("unfold"))
_linear_in(dict.fromkeys((torch.narrow, torch.diagonal, method("unfold"), torch.unbind, torch.tensor_split), (0,)))
_dim_arguments({torch.narrow: (1, "dim", None), method("unfold"): (1, "dimension", None), torch.unbind: (1, "dim", 0),
                torch.tensor_split: (2, "dim", 0)})


@register(BATCH, torch.diagonal)
def diagonal_batch(batch: Batch, args: tuple, kwargs: dict):
    x, offset, dim1, dim2 = _diagonal_args(args, kwargs)
    return lookup(torch.diagonal).symbol(x, offset, shift(dim1), shift(dim2))


def _diagonal_args(args: tuple, kwargs: dict) -> tuple:
    names = ("offset", "dim1", "dim2")
    defaults = dict(zip(names, (0, 0, 1)))
    values = dict(zip(names, args[1:]))
    return (args[0], *(values.get(n, kwargs.get(n, defaults[n])) for n in names))
torch_symbol(torch.detach, decomposition=lambda x: prims.alias(x), aliases=(method("detach"),), tags=Tag.NO_GRAD)
def _clone_decomposition(x, memory_format=torch.preserve_format):
    return prims.clone(x) if memory_format is torch.preserve_format else prims.clone(x, memory_format)


torch_symbol(torch.clone, decomposition=_clone_decomposition, aliases=(method("clone"),))
# recorded only where `x` is not in `memory_format` already (eager returns `x` itself there)
torch_symbol(method("contiguous"), decomposition=lambda x, memory_format=torch.contiguous_format: prims.clone(
    x, memory_format))

# --- joining -------------------------------------------------------------------------------------------------------


def cat_decomposition(tensors, dim: int = 0) -> Any:
    tensors = [t for t in tensors if not (t.dim() == 1 and t.shape[0] == 0)]  # legacy: empty 1-D tensors are skipped
    if not tensors:
        return NotImplemented
    dtype = torch.result_type(tensors[0].meta, tensors[0].meta)
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return prims.cat([convert(t, dtype) for t in tensors], canonical_dim(dim, tensors[0].dim()))


torch_symbol(torch.cat, decomposition=cat_decomposition, aliases=(torch.concat, torch.concatenate))


@register(RuleKind.GRAD, torch.cat)
def cat_grad(tensors, dim=0):
    y = torch.cat(tensors, dim)
    dim = dim % y.dim()
    # torch.cat skips 1-D empty tensors of any other rank (a legacy rule); they get no cotangent.
    joined = [t for t in tensors if t.dim() == y.dim()]
    pieces = torch.split(get_grad(y), [t.shape[dim] for t in joined], dim)
    for t, piece in zip(joined, pieces):
        if wants_grad(t):
            # cat promotes mixed dtypes (float32 and float64 give float64): each grad has its own tensor's dtype
            put_grad(t, piece if piece.dtype == t.dtype else piece.to(t.dtype))
    return y


def stack_decomposition(tensors, dim: int = 0) -> Any:
    dim = canonical_dim(dim, tensors[0].dim() + 1)
    return cat_decomposition([prims.unsqueeze(t, dim) for t in tensors], dim)


torch_symbol(torch.stack, decomposition=stack_decomposition)
torch_symbol(torch.hstack)
torch_symbol(torch.vstack)
differentiated_by_eager(torch.hstack, torch.vstack)
_linear_in(dict.fromkeys((torch.hstack, torch.vstack), (0,)))
def _varargs_dims(x, *dims, **kwargs) -> tuple[tuple, dict[str, Any]]:
    """`x.flip(0, 1)` or `x.flip(0)` as `torch.flip(x, (0, 1))`: the methods take their dims as varargs too, the
    functions as one sequence only."""
    if len(dims) > 1 or (dims and isinstance(dims[0], int)):
        dims = (tuple(dims),)
    return (x, *dims), kwargs


_flip = torch_symbol(torch.flip,
                     decomposition=lambda x, dims: prims.flip(x, tuple(canonical_dim(d, x.dim()) for d in dims)))
torch_symbol(torch.roll, aliases=(method("roll"),))
torch_symbol(method("repeat"))
_tile = torch_symbol(torch.tile)
for _method, _sym in ((method("flip"), _flip), (method("tile"), _tile)):
    bind(_method, TorchBinding(_sym, normalize=_varargs_dims))
differentiated_by_eager(torch.roll, method("repeat"), _tile)
_linear_in(dict.fromkeys((torch.roll, method("repeat"), torch.tile), (0,)))


@register(BATCH, torch.tile)
def tile_batch(batch: Batch, args: tuple, kwargs: dict):
    x, dims = args[0], tuple(args[1] if len(args) > 1 else kwargs["dims"])
    x = batch.pad_to(x, len(dims))
    return _tile(x, (1, *(1,) * (x.dim() - 1 - len(dims)), *dims))


@register(BATCH, torch.roll)
def roll_batch(batch: Batch, args: tuple, kwargs: dict):
    x, shifts = args[0], args[1] if len(args) > 1 else kwargs["shifts"]
    dims = args[2] if len(args) > 2 else kwargs.get("dims")
    roll = lookup(torch.roll).symbol
    if dims is None:  # over each flattened example
        flat = roll(prims.reshape(x, (batch.size, math.prod(x.shape[1:]))), shifts, 1)
        return prims.reshape(flat, tuple(x.shape))
    dims = tuple(shift(d) for d in dims) if isinstance(dims, (tuple, list)) else shift(dims)
    return roll(x, shifts, dims)


def repeat_interleave_decomposition(x, repeats, dim=None, *, output_size=None):
    if not isinstance(repeats, int) or dim is None:
        return NotImplemented
    dim = canonical_dim(dim, x.dim())
    shape = list(x.shape)
    expanded = prims.expand(prims.unsqueeze(x, dim + 1), tuple(shape[: dim + 1] + [repeats] + shape[dim + 1 :]))
    shape[dim] *= repeats
    return prims.reshape(expanded, tuple(shape))


def _repeat_interleave_by_values(input, repeats=None, dim=None, *, output_size=None) -> str | None:  # noqa: A002
    if output_size is None and (repeats is None or is_tensor(repeats)):
        return ("fulmen cannot trace torch.repeat_interleave with repeats given as a tensor and no output_size: the "
                "result's length is their sum, which eager reads and which is unknown while tracing; pass "
                "output_size=")
    return None


torch_symbol(torch.repeat_interleave, decomposition=repeat_interleave_decomposition,
             aliases=(method("repeat_interleave"),),
             meta=_by_values(torch.repeat_interleave, _repeat_interleave_by_values))
_linear_in({torch.repeat_interleave: (0,)})

# --- gathers and scatters ------------------------------------------------------------------------------------------
torch_symbol(torch.index_select, decomposition=lambda x, dim, index: prims.take(x, index, canonical_dim(dim, x.dim())),
             aliases=(method("index_select"),))
torch_symbol(torch.gather, decomposition=lambda x, dim, index, sparse_grad=False: prims.take_along_axis(
    x, index, canonical_dim(dim, x.dim())), aliases=(method("gather"),))
torch_symbol(torch.take_along_dim, aliases=(method("take_along_dim"),))


def take_decomposition(x, index):
    """`x` read as if flattened (in its logical order, whatever its strides), at `index`; negative positions count
    from the end, as eager's take does."""
    numel = x.numel()
    position = prims.where(prims.lt(index, 0), prims.add(index, numel), index)
    picked = prims.take(prims.reshape(x, (numel,)), prims.reshape(position, (index.numel(),)), 0)
    return prims.reshape(picked, tuple(index.shape))


torch_symbol(torch.take, decomposition=take_decomposition, aliases=(method("take"),))
torch_symbol(torch.scatter, aliases=(method("scatter"),), inplace=(method("scatter_"),))
torch_symbol(torch.scatter_add, aliases=(method("scatter_add"),), inplace=(method("scatter_add_"),))
torch_symbol(torch.scatter_reduce, aliases=(method("scatter_reduce"),), inplace=(method("scatter_reduce_"),))
torch_symbol(torch.index_add, aliases=(method("index_add"),), inplace=(method("index_add_"),))
torch_symbol(torch.index_fill, aliases=(method("index_fill"),), inplace=(method("index_fill_"),))
torch_symbol(torch.index_put, aliases=(method("index_put"),), inplace=(method("index_put_"),))
torch_symbol(
    torch.index_copy,
    decomposition=lambda x, dim, index, source: prims.index_copy(x, canonical_dim(dim, x.dim()), index, source),
    aliases=(method("index_copy"),),
    inplace=(method("index_copy_"),),
)
torch_symbol(torch.masked_scatter, aliases=(method("masked_scatter"),))
torch_symbol(torch.slice_scatter)
torch_symbol(torch.select_scatter)
torch_symbol(torch.diagonal_scatter)
differentiated_by_eager(torch.take_along_dim, torch.scatter, torch.scatter_add, torch.scatter_reduce, torch.index_add,
                        torch.index_fill, torch.index_put, torch.masked_scatter, torch.slice_scatter,
                        torch.select_scatter, torch.diagonal_scatter)
torch_symbol(torch.as_strided_scatter)
_linear_in({
    torch.take_along_dim: (0,), torch.index_add: (0, 3, "source"), torch.scatter_add: (0, 3, "src"),
    torch.index_fill: (0, 3, "value"), torch.index_put: (0, 2, "values"), torch.masked_scatter: (0, 2),
    torch.slice_scatter: (0, 1, "src"), torch.select_scatter: (0, 1, "src"), torch.diagonal_scatter: (0, 1, "src"),
})


@register(JVP, torch.scatter)
def scatter_jvp(dot: Dot, args: tuple, kwargs: dict):
    if "reduce" in kwargs:
        return NotImplemented
    return linear(lookup(torch.scatter).symbol, (0, 3, "src", "value"))(dot, args, kwargs)


@register(BATCH, torch.index_add)
def index_add_batch(batch: Batch, args: tuple, kwargs: dict):
    x, dim, index, source = args
    if batch.batched(index):
        return NotImplemented  # each example its own indices: once per example
    return lookup(torch.index_add).symbol(batch.materialize(x), shift(dim), index, batch.materialize(source),
                                          **kwargs)


@register(BATCH, torch.index_fill)
def index_fill_batch(batch: Batch, args: tuple, kwargs: dict):
    x, dim, index, value = args
    if batch.batched(index) or batch.batched(value):
        return NotImplemented
    return lookup(torch.index_fill).symbol(batch.materialize(x), shift(dim), index, value)


def _scatter_like_batch(fn: Callable[..., Any]):
    """scatter / scatter_add (x, dim, index, src): every tensor batched, the dim moved."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        x, dim, *rest = args
        rest = [batch.materialize(a) for a in rest]
        kwargs = {key: batch.materialize(value) for key, value in kwargs.items()}
        return fn(batch.materialize(x), shift(dim), *rest, **kwargs)

    return rule


for _fn in (torch.scatter, torch.scatter_add):
    register(BATCH, _fn, _scatter_like_batch(lookup(_fn).symbol))


def _scatter_into_batch(fn, dim_position: int, dim_default: int):
    """select_scatter / slice_scatter (x, src, dim, ...): both batched, the dim moved."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        args, kwargs = list(args), dict(kwargs)
        if len(args) > dim_position:
            args[dim_position] = shift(args[dim_position])
        else:
            kwargs["dim"] = shift(kwargs.get("dim", dim_default))
        x, src = args[0], args[1] if len(args) > 1 else kwargs.pop("src")
        return fn(batch.materialize(x), batch.materialize(src), *args[2:], **kwargs)

    return rule


register(BATCH, torch.select_scatter, _scatter_into_batch(lookup(torch.select_scatter).symbol, 2, 0))
register(BATCH, torch.slice_scatter, _scatter_into_batch(lookup(torch.slice_scatter).symbol, 2, 0))


def _tri_decomposition(lower: bool):
    def decomposition(x, diagonal: int = 0):
        rows, cols = x.shape[-2], x.shape[-1]
        row = prims.reshape(prims.iota(rows, 0, 1, dtype=torch.int64, device=x.device), (rows, 1))
        col = prims.reshape(prims.iota(cols, 0, 1, dtype=torch.int64, device=x.device), (1, cols))
        offset = prims.sub(expand_to(col, (rows, cols)), expand_to(row, (rows, cols)))
        keep = prims.le(offset, diagonal) if lower else prims.ge(offset, diagonal)
        zero = expand_to(prims.full((), 0, dtype=x.dtype, device=x.device), x.shape)
        return prims.where(expand_to(keep, x.shape), x, zero)

    return decomposition


torch_symbol(torch.triu, decomposition=_tri_decomposition(False), aliases=(method("triu"),), inplace=(method("triu_"),))
torch_symbol(torch.tril, decomposition=_tri_decomposition(True), aliases=(method("tril"),), inplace=(method("tril_"),))

# Functional forms of in-place updates (see fulmen.ops.kernels.impls); programs never call them directly.
setitem = impl_symbol(impls.setitem)
copy = impl_symbol(impls.copy)
fill = impl_symbol(impls.fill)
view_scatter = impl_symbol(impls.view_scatter)
keep_history = impl_symbol(impls.keep_history, meta=lambda builder, old, new: builder.make_proxy(
    torch.empty_strided(new.shape, new.stride(), dtype=new.dtype, device="meta"), new.device, old.requires_grad))
autograd_leaf = impl_symbol(impls.autograd_leaf, meta=lambda builder, x: builder.make_proxy(
    torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta"), x.device, True))


def _overwrite_grad(sym, value: int):
    """The grad rule of a functional in-place update (`setitem`, ...): its grads never depend on the values of the
    tensor it overwrites nor of the value written (argument `value`: the grads are the cotangent's elements at the
    written places, and the rest), so eager's backward runs on zeros of their shapes, and the backward does not read
    a program input the forward overwrites (its write-back), nor keep the written value alive: `x[0].copy_(c)` then
    `c.add_(1)` failed the backward's version check of c, which eager's copy_ never saves."""

    def rule(x, *args, **kwargs):
        y = sym(x, *args, **kwargs)
        flat = list(iter_proxies(((x, *args), kwargs)))
        wrt = tuple(i for i, p in enumerate(flat) if p.requires_grad)
        shaped = [zeros_shaped(x), *args]
        if is_tensor(shaped[value]):
            shaped[value] = zeros_shaped(shaped[value])
        grads = torch_vjp(sym, tuple(shaped), kwargs, wrt, (get_grad(y),))
        for i, grad in zip(wrt, grads):
            put_grad(flat[i], grad)
        return y

    return rule


# update -> (the argument holding the value written, the arguments its value is linear in)
_UPDATES = {setitem: (2, (0, 2)), view_scatter: (1, (0, 1)), copy: (1, (1,)), fill: (1, (1,))}
for _update, (_value, _operands) in _UPDATES.items():
    register(RuleKind.GRAD, _update, _overwrite_grad(_update, _value))
    register(JVP, _update, linear(_update, _operands))


@register(BATCH, setitem)
def setitem_batch(batch: Batch, args: tuple, kwargs: dict):
    x, index, value = args
    items = index if isinstance(index, tuple) else (index,)
    if any(is_tensor(item) for item in items):
        return NotImplemented  # advanced indexing: once per example
    x = batch.materialize(x)
    if batch.batched(value):
        with torch._C.DisableTorchFunction():  # a meta tensor, not a call of the program
            region = torch.empty(x.shape[1:], device="meta")[index].dim()
        value = batch.pad_to(value, region)
    return setitem(x, (slice(None), *items), value)


@register(RuleKind.GRAD, keep_history)
def keep_history_grad(old, new):
    y = keep_history(old, new)
    put_grad(old, get_grad(y))  # the update is invisible to autograd: nothing flows to `new`
    return y


@register(JVP, keep_history)
def keep_history_jvp(dot: Dot, args: tuple, kwargs: dict):
    old, new = args
    return keep_history(old, new), dot(old)  # an update autograd does not see keeps old's tangent


register(BATCH, keep_history, elementwise(keep_history))  # its value is the new one


@register(RuleKind.GRAD, autograd_leaf)
def autograd_leaf_grad(x):
    return autograd_leaf(x)  # a leaf: the grad that reaches it goes no further (x requires none)


def to_decomposition(x, device=None, dtype=None, non_blocking=False, copy=False,
                     memory_format=torch.preserve_format) -> Any:
    if isinstance(device, torch.dtype):  # to(dtype) positionally
        device, dtype = None, device
    out = x
    if dtype is not None and dtype != x.dtype:
        out = prims.convert_element_type(out, dtype)
    if device is not None and torch.device(device) != x.device:
        out = prims.device_put(out, torch.device(device))
    if memory_format is not torch.preserve_format:
        return prims.clone(out, memory_format)
    return out if out is not x else prims.clone(x)


to = torch_symbol(method("to"), decomposition=to_decomposition)


# --- Tensors built by placing the elements of others (diag, diag_embed, rot90, block_diag, vander,
# cartesian_prod, combinations) and index factories (triu_indices, tril_indices); eager's kernels and grads.
# block_diag and cartesian_prod are torch's Python (run inline): their builtins are what is bound

_VF = torch._C._VariableFunctions

for _name in ("diag", "diag_embed", "diagflat", "rot90", "vander"):
    torch_symbol(getattr(torch, _name), aliases=methods(_name))
torch_symbol(torch.linalg.vander)
torch_symbol(torch.triu_indices)
torch_symbol(torch.tril_indices)
torch_symbol(_VF.block_diag, printed="torch._C._VariableFunctions.block_diag")
torch_symbol(_VF.cartesian_prod, printed="torch._C._VariableFunctions.cartesian_prod")
differentiated_by_eager(torch.diag, torch.diag_embed, torch.diagflat, torch.rot90, torch.vander, torch.linalg.vander,
                        _VF.block_diag, _VF.cartesian_prod)
not_differentiable(torch.triu_indices, torch.tril_indices)  # factories of indices


def _combinations_like(x: torch.Tensor, r: int = 2, with_replacement: bool = False) -> torch.Tensor:
    """torch's kernel selects the combinations with a mask (no meta kernel); their number follows from len(x)."""
    if x.dim() != 1:
        raise RuntimeError(f"Expect a 1D vector, but got shape {list(x.shape)}")
    if r < 0:
        raise RuntimeError(f"Expect a non-negative number, but got {r}")
    if r == 0:
        return x.new_empty((0,))
    n = x.shape[0]
    return x.new_empty((math.comb(n + r - 1, r) if with_replacement else math.comb(n, r), r))


eager_op(torch.combinations, like=_combinations_like)
