"""The batching rules of the prims (written with fulmen.ops.rules.batch). Symbols without a rule are batched through
their decomposition, or run once per example. A batched value carries its batch dim first.
"""

from __future__ import annotations

import math

import torch

from fulmen.ops import prims
from fulmen.ops.rules.batch import Batch, batch_matmul, elementwise, example_shape, shift
from fulmen.ops.rules.tables import RuleKind, register

BATCH = RuleKind.BATCH


# --- elementwise ---------------------------------------------------------------------------------------------------
for _name in (*prims.UNARY, *prims.BINARY, "where"):
    register(BATCH, prims.PRIMS[_name], elementwise(prims.PRIMS[_name]))


def _same_call(prim):
    def rule(batch: Batch, args: tuple, kwargs: dict):
        return prim(*args, **kwargs)

    return rule


for _name in ("convert_element_type", "device_put", "alias", "pad"):
    register(BATCH, prims.PRIMS[_name], _same_call(prims.PRIMS[_name]))


@register(BATCH, prims.clone)
def _clone(batch: Batch, args: tuple, kwargs: dict):
    # a memory format names the layout of one example's dims: a batch has one more (the values are the same)
    return prims.clone(args[0])


# --- reductions and scans over explicit dims -----------------------------------------------------------------------
def _over_dims(prim):
    def rule(batch: Batch, args: tuple, kwargs: dict):
        x, dims, *rest = args
        if not dims and prim is not prims.flip:
            # no dims means all of them, which for one example is none (a 0-dim tensor): reduce a size-1 dim
            return prim(prims.unsqueeze(x, 1), (1,), *rest)
        return prim(x, tuple(shift(d) for d in dims), *rest)

    return rule


for _name in ("sum", "amax", "amin", "var", "flip"):
    register(BATCH, prims.PRIMS[_name], _over_dims(prims.PRIMS[_name]))


@register(BATCH, prims.prod)
def _prod(batch: Batch, args: tuple, kwargs: dict):
    x, dims = args
    if len(dims) == 1:
        return prims.prod(x, (shift(dims[0]),))
    kept = [d for d in range(x.dim() - 1) if d not in dims]  # the prim reduces all of an example's dims at once
    moved = prims.permute(x, (0, *(d + 1 for d in kept), *(d + 1 for d in dims)))
    rows = prims.reshape(moved, (batch.size, *(x.shape[d + 1] for d in kept), math.prod(x.shape[d + 1] for d in dims)))
    return prims.prod(rows, (len(kept) + 1,))


def _at_dim(prim, position: int):
    def rule(batch: Batch, args: tuple, kwargs: dict):
        if args[0].dim() == 1 and prim is not prims.unsqueeze:
            return NotImplemented  # one example is 0-dim, where dims 0 and -1 both name the one element
        args = list(args)
        args[position] = shift(args[position])
        return prim(*args)

    return rule


for _name, _position in (("cumsum", 1), ("topk", 2), ("sort", 1), ("argmax", 1), ("argmin", 1), ("select", 1),
                         ("unsqueeze", 1)):
    register(BATCH, prims.PRIMS[_name], _at_dim(prims.PRIMS[_name], _position))


# --- shapes --------------------------------------------------------------------------------------------------------
@register(BATCH, prims.reshape)
def _reshape(batch: Batch, args: tuple, kwargs: dict):
    x, shape = args
    return prims.reshape(x, (batch.size, *shape))


@register(BATCH, prims.permute)
def _permute(batch: Batch, args: tuple, kwargs: dict):
    x, perm = args
    return prims.permute(x, (0, *(p % (x.dim() - 1) + 1 for p in perm)))


@register(BATCH, prims.expand)
def _expand(batch: Batch, args: tuple, kwargs: dict):
    x, shape = args
    return prims.expand(batch.pad_to(x, len(shape)), (batch.size, *shape))


@register(BATCH, prims.squeeze)
def _squeeze(batch: Batch, args: tuple, kwargs: dict):
    x, dims = args
    return prims.squeeze(x, tuple(shift(d) for d in dims))


@register(BATCH, prims.slice)
def _slice(batch: Batch, args: tuple, kwargs: dict):
    x, starts, ends, steps = args
    return prims.slice(x, (0, *starts), (batch.size, *ends), (1, *steps))


@register(BATCH, prims.cat)
def _cat(batch: Batch, args: tuple, kwargs: dict):
    tensors, dim = args
    return prims.cat([batch.materialize(t) for t in tensors], shift(dim))


# --- gathers and scatters ------------------------------------------------------------------------------------------
def _along(index: torch.Tensor, dim: int, like: torch.Tensor) -> torch.Tensor:
    """A batch of 1-D indices (B, n) placed along `dim` of `like` (a batch), broadcast to its other dims."""
    shape = [1] * like.dim()
    shape[0], shape[dim] = index.shape[0], index.shape[1]
    target = list(like.shape)
    target[dim] = index.shape[1]
    return prims.expand(prims.reshape(index, tuple(shape)), tuple(target))


@register(BATCH, prims.take)
def _take(batch: Batch, args: tuple, kwargs: dict):
    x, index, dim = args
    if len(example_shape(batch, x)) == 0:
        return NotImplemented
    if not batch.batched(index):
        return prims.take(x, index, shift(dim))
    x = batch.materialize(x)
    return prims.take_along_axis(x, _along(index, shift(dim), x), shift(dim))


@register(BATCH, prims.take_along_axis)
def _take_along_axis(batch: Batch, args: tuple, kwargs: dict):
    x, index, dim = args
    return prims.take_along_axis(batch.materialize(x), batch.materialize(index), shift(dim))


@register(BATCH, prims.scatter_add)
def _scatter_add(batch: Batch, args: tuple, kwargs: dict):
    x, dim, index, src = args
    return prims.scatter_add(batch.materialize(x), shift(dim), batch.materialize(index), batch.materialize(src))


@register(BATCH, prims.index_copy)
def _index_copy(batch: Batch, args: tuple, kwargs: dict):
    x, dim, index, source = args
    if batch.batched(index):
        return NotImplemented
    return prims.index_copy(batch.materialize(x), shift(dim), index, batch.materialize(source))


@register(BATCH, prims.slice_scatter)
def _slice_scatter(batch: Batch, args: tuple, kwargs: dict):
    x, src, dim, *rest = args
    return prims.slice_scatter(batch.materialize(x), batch.materialize(src), shift(dim), *rest)


@register(BATCH, prims.select_scatter)
def _select_scatter(batch: Batch, args: tuple, kwargs: dict):
    x, src, dim, index = args
    return prims.select_scatter(batch.materialize(x), batch.materialize(src), shift(dim), index)


register(BATCH, prims.matmul, batch_matmul)
