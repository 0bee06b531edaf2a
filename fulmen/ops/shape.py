"""Shape, view, indexing and joining symbols."""

from __future__ import annotations

from typing import Any

import torch

from fulmen.core.symbol import Tag
from fulmen.ops import impls, prims
from fulmen.ops.registry import TorchBinding, bind, impl_symbol, method, torch_symbol
from fulmen.ops.rules.grad import differentiated_by_eager
from fulmen.ops.utils import canonical_dim, convert, expand_to, meta_of


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

# --- slicing -------------------------------------------------------------------------------------------------------


def _normalize_index(index: Any) -> tuple:
    return index if isinstance(index, tuple) else (index,)


def _is_basic(item: Any) -> bool:
    return item is None or item is Ellipsis or isinstance(item, (int, slice)) and not isinstance(item, bool)


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
        if isinstance(item, int):
            start = item % size if size else 0
            starts[dim], ends[dim] = start, start + 1
            squeeze.append(dim)
        else:
            start, stop, step = item.indices(size)
            starts[dim], ends[dim], steps[dim] = start, max(start, stop), step
            position += 1
        dim += 1
    if any(s != 0 for s in starts) or ends != list(x.shape) or any(s != 1 for s in steps):
        out = prims.slice(out, tuple(starts), tuple(ends), tuple(steps))
    if squeeze:
        out = prims.squeeze(out, tuple(squeeze))
    for axis in new_axes:
        out = prims.unsqueeze(out, axis)
    return out if out is not x else prims.alias(x)


getitem = torch_symbol(torch.Tensor.__getitem__, decomposition=getitem_decomposition)


# `aten.index(x, indices)`, which torch's TransformGetItemToIndex makes of `x[i, j]` with 0-dim index tensors (as
# transformers' mask functions index under vmap): `x[i, j]` itself would read them as Python ints.
aten_index = torch_symbol(torch.ops.aten.index.Tensor, aliases=(torch.ops.aten.index,),
                          printed="torch.ops.aten.index.Tensor")
differentiated_by_eager(aten_index)


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
torch_symbol(torch.tensor_split, aliases=(method("tensor_split"),))
torch_symbol(torch.unbind, aliases=(method("unbind"),))
torch_symbol(torch.narrow, aliases=(method("narrow"),))
torch_symbol(torch.select, decomposition=lambda x, dim, index: prims.select(x, canonical_dim(dim, x.dim()), index),
             aliases=(method("select"),))
torch_symbol(torch.diagonal, aliases=(method("diagonal"),))
torch_symbol(torch.as_strided, aliases=(method("as_strided"),))
torch_symbol(method("unfold"))
differentiated_by_eager(torch.tensor_split, torch.unbind, torch.narrow, torch.diagonal, method("unfold"))
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


def stack_decomposition(tensors, dim: int = 0) -> Any:
    dim = canonical_dim(dim, tensors[0].dim() + 1)
    return cat_decomposition([prims.unsqueeze(t, dim) for t in tensors], dim)


torch_symbol(torch.stack, decomposition=stack_decomposition)
torch_symbol(torch.hstack)
torch_symbol(torch.vstack)
differentiated_by_eager(torch.hstack, torch.vstack)
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


def repeat_interleave_decomposition(x, repeats, dim=None, *, output_size=None):
    if not isinstance(repeats, int) or dim is None:
        return NotImplemented
    dim = canonical_dim(dim, x.dim())
    shape = list(x.shape)
    expanded = prims.expand(prims.unsqueeze(x, dim + 1), tuple(shape[: dim + 1] + [repeats] + shape[dim + 1 :]))
    shape[dim] *= repeats
    return prims.reshape(expanded, tuple(shape))


torch_symbol(torch.repeat_interleave, decomposition=repeat_interleave_decomposition,
             aliases=(method("repeat_interleave"),))

# --- gathers and scatters ------------------------------------------------------------------------------------------
torch_symbol(torch.index_select, decomposition=lambda x, dim, index: prims.take(x, index, canonical_dim(dim, x.dim())),
             aliases=(method("index_select"),))
torch_symbol(torch.gather, decomposition=lambda x, dim, index, sparse_grad=False: prims.take_along_axis(
    x, index, canonical_dim(dim, x.dim())), aliases=(method("gather"),))
torch_symbol(torch.take_along_dim, aliases=(method("take_along_dim"),))
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

# Functional forms of in-place updates (see fulmen.ops.impls); programs never call them directly.
setitem = impl_symbol(impls.setitem)
copy = impl_symbol(impls.copy)
fill = impl_symbol(impls.fill)
view_scatter = impl_symbol(impls.view_scatter)
keep_history = impl_symbol(impls.keep_history, meta=lambda builder, old, new: builder.make_proxy(
    torch.empty_strided(new.shape, new.stride(), dtype=new.dtype, device="meta"), new.device, old.requires_grad))
autograd_leaf = impl_symbol(impls.autograd_leaf, meta=lambda builder, x: builder.make_proxy(
    torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta"), x.device, True))


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
