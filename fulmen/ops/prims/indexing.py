"""The rules of the gathers and scatters: prims that read or write a tensor where an index points.

Each is linear in its tensors taken together (not in its indices), so its JVP is the prim applied to the tangents.
"""

from __future__ import annotations

import torch

from fulmen.ops import prims
from fulmen.ops.rules.batch import Batch, example_shape, shift
from fulmen.ops.rules.grad import differentiated_by_eager, get_grad, put_grad
from fulmen.ops.rules.grad_formulas import zeros_shaped
from fulmen.ops.rules.jvp import linear
from fulmen.ops.rules.tables import RuleKind, register
from fulmen.ops.utils import is_tensor

GRAD, JVP, BATCH = RuleKind.GRAD, RuleKind.JVP, RuleKind.BATCH


# --- take, take_along_axis -----------------------------------------------------------------------------------------
@register(GRAD, prims.take)
def _take_grad(x, index, dim):
    y = prims.take(x, index, dim)
    g = get_grad(y)
    put_grad(x, zeros_shaped(x).index_add(dim, index, g))
    return y


register(JVP, prims.take, linear(prims.take, (0,)))


def _along(index: torch.Tensor, dim: int, like: torch.Tensor) -> torch.Tensor:
    """A batch of 1-D indices (B, n) placed along `dim` of `like` (a batch), broadcast to its other dims."""
    shape = [1] * like.dim()
    shape[0], shape[dim] = index.shape[0], index.shape[1]
    target = list(like.shape)
    target[dim] = index.shape[1]
    return prims.expand(prims.reshape(index, tuple(shape)), tuple(target))


@register(BATCH, prims.take)
def _take_batch(batch: Batch, args: tuple, kwargs: dict):
    x, index, dim = args
    if len(example_shape(batch, x)) == 0:
        return NotImplemented
    if not batch.batched(index):
        return prims.take(x, index, shift(dim))
    x = batch.materialize(x)
    return prims.take_along_axis(x, _along(index, shift(dim), x), shift(dim))


@register(GRAD, prims.take_along_axis)
def _take_along_axis_grad(x, index, dim):
    y = prims.take_along_axis(x, index, dim)
    put_grad(x, zeros_shaped(x).scatter_add(dim, index, get_grad(y)))
    return y


register(JVP, prims.take_along_axis, linear(prims.take_along_axis, (0,)))


@register(BATCH, prims.take_along_axis)
def _take_along_axis_batch(batch: Batch, args: tuple, kwargs: dict):
    x, index, dim = args
    return prims.take_along_axis(batch.materialize(x), batch.materialize(index), shift(dim))


# --- index_put, index_copy: differentiated by eager's backward -----------------------------------------------------
differentiated_by_eager(prims.index_put, prims.index_copy)
register(JVP, prims.index_put, linear(prims.index_put, (0, 2)))
register(JVP, prims.index_copy, linear(prims.index_copy, (0, 3)))


@register(BATCH, prims.index_copy)
def _index_copy_batch(batch: Batch, args: tuple, kwargs: dict):
    x, dim, index, source = args
    if batch.batched(index):
        return NotImplemented
    return prims.index_copy(batch.materialize(x), shift(dim), index, batch.materialize(source))


# --- scatter_add ---------------------------------------------------------------------------------------------------
@register(GRAD, prims.scatter_add)
def _scatter_add_grad(x, dim, index, src):
    y = prims.scatter_add(x, dim, index, src)
    g = get_grad(y)
    put_grad(x, g)
    if is_tensor(src) and src.requires_grad:
        put_grad(src, torch.gather(g, dim, index))
    return y


register(JVP, prims.scatter_add, linear(prims.scatter_add, (0, 3)))


@register(BATCH, prims.scatter_add)
def _scatter_add_batch(batch: Batch, args: tuple, kwargs: dict):
    x, dim, index, src = args
    return prims.scatter_add(batch.materialize(x), shift(dim), batch.materialize(index), batch.materialize(src))


# --- slice_scatter, select_scatter ---------------------------------------------------------------------------------
@register(GRAD, prims.slice_scatter)
def _slice_scatter_grad(x, src, dim, start, end, step):
    y = prims.slice_scatter(x, src, dim, start, end, step)
    g = get_grad(y)
    put_grad(x, torch.slice_scatter(g, zeros_shaped(src), dim, start, end, step))
    put_grad(src, g[(slice(None),) * dim + (slice(start, end, step),)])
    return y


register(JVP, prims.slice_scatter, linear(prims.slice_scatter, (0, 1)))


@register(BATCH, prims.slice_scatter)
def _slice_scatter_batch(batch: Batch, args: tuple, kwargs: dict):
    x, src, dim, *rest = args
    return prims.slice_scatter(batch.materialize(x), batch.materialize(src), shift(dim), *rest)


@register(GRAD, prims.select_scatter)
def _select_scatter_grad(x, src, dim, index):
    y = prims.select_scatter(x, src, dim, index)
    g = get_grad(y)
    put_grad(x, torch.select_scatter(g, zeros_shaped(src), dim, index))
    put_grad(src, g.select(dim, index))
    return y


register(JVP, prims.select_scatter, linear(prims.select_scatter, (0, 1)))


@register(BATCH, prims.select_scatter)
def _select_scatter_batch(batch: Batch, args: tuple, kwargs: dict):
    x, src, dim, index = args
    return prims.select_scatter(batch.materialize(x), batch.materialize(src), shift(dim), index)
