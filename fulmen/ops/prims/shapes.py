"""The rules of the prims that move values without changing them: views, concatenation, flips and pads.

Each is linear in its tensor, so its JVP is the prim applied to the tangent; its grad moves the cotangent back.
"""

from __future__ import annotations

import torch

from fulmen.ops import prims
from fulmen.ops.rules.batch import Batch, at_dim, over_dims, same_call, shift
from fulmen.ops.rules.grad import get_grad, put_grad
from fulmen.ops.rules.grad_formulas import zeros_shaped
from fulmen.ops.rules.jvp import linear
from fulmen.ops.rules.tables import RuleKind, register
from fulmen.ops.shape import setitem

GRAD, JVP, BATCH = RuleKind.GRAD, RuleKind.JVP, RuleKind.BATCH


# --- reshape, squeeze, unsqueeze: only the shape changes, so the grad is reshaped back ----------------------------
def _reshape_like_grad(prim):
    def rule(x, *args):
        y = prim(x, *args)
        put_grad(x, get_grad(y).reshape(x.shape))
        return y

    return rule


for _prim in (prims.reshape, prims.squeeze, prims.unsqueeze):
    register(GRAD, _prim, _reshape_like_grad(_prim))
    register(JVP, _prim, linear(_prim, (0,)))


@register(BATCH, prims.reshape)
def _reshape_batch(batch: Batch, args: tuple, kwargs: dict):
    x, shape = args
    return prims.reshape(x, (batch.size, *shape))


@register(BATCH, prims.squeeze)
def _squeeze_batch(batch: Batch, args: tuple, kwargs: dict):
    x, dims = args
    return prims.squeeze(x, tuple(shift(d) for d in dims))


register(BATCH, prims.unsqueeze, at_dim(prims.unsqueeze, 1, zero_dim_examples=True))


# --- permute -------------------------------------------------------------------------------------------------------
@register(GRAD, prims.permute)
def _permute_grad(x, perm):
    y = prims.permute(x, perm)
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    put_grad(x, get_grad(y).permute(inverse))
    return y


register(JVP, prims.permute, linear(prims.permute, (0,)))


@register(BATCH, prims.permute)
def _permute_batch(batch: Batch, args: tuple, kwargs: dict):
    x, perm = args
    return prims.permute(x, (0, *(p % (x.dim() - 1) + 1 for p in perm)))


# --- expand --------------------------------------------------------------------------------------------------------
@register(GRAD, prims.expand)
def _expand_grad(x, shape):
    y = prims.expand(x, shape)
    g = get_grad(y)
    lead = len(shape) - x.dim()
    dims = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(x.shape) if s == 1 and shape[lead + i] != 1)
    put_grad(x, (g.sum(dims) if dims else g).reshape(x.shape))
    return y


register(JVP, prims.expand, linear(prims.expand, (0,)))


@register(BATCH, prims.expand)
def _expand_batch(batch: Batch, args: tuple, kwargs: dict):
    x, shape = args
    return prims.expand(batch.pad_to(x, len(shape)), (batch.size, *shape))


# --- slice, select -------------------------------------------------------------------------------------------------
@register(GRAD, prims.slice)
def _slice_grad(x, starts, ends, steps):
    y = prims.slice(x, starts, ends, steps)
    index = tuple(slice(s, e, st) for s, e, st in zip(starts, ends, steps))
    put_grad(x, setitem(zeros_shaped(x), index, get_grad(y)))
    return y


register(JVP, prims.slice, linear(prims.slice, (0,)))


@register(BATCH, prims.slice)
def _slice_batch(batch: Batch, args: tuple, kwargs: dict):
    x, starts, ends, steps = args
    return prims.slice(x, (0, *starts), (batch.size, *ends), (1, *steps))


@register(GRAD, prims.select)
def _select_grad(x, dim, index):
    y = prims.select(x, dim, index)
    put_grad(x, torch.select_scatter(zeros_shaped(x), get_grad(y), dim, index))
    return y


register(JVP, prims.select, linear(prims.select, (0,)))
register(BATCH, prims.select, at_dim(prims.select, 1))


# --- cat -----------------------------------------------------------------------------------------------------------
@register(GRAD, prims.cat)
def _cat_grad(tensors, dim):
    y = prims.cat(tensors, dim)
    pieces = torch.split(get_grad(y), [t.shape[dim] for t in tensors], dim)
    for t, piece in zip(tensors, pieces):
        put_grad(t, piece)
    return y


register(JVP, prims.cat, linear(prims.cat, (0,)))


@register(BATCH, prims.cat)
def _cat_batch(batch: Batch, args: tuple, kwargs: dict):
    tensors, dim = args
    return prims.cat([batch.materialize(t) for t in tensors], shift(dim))


# --- flip, pad -----------------------------------------------------------------------------------------------------
@register(GRAD, prims.flip)
def _flip_grad(x, dims):
    y = prims.flip(x, dims)
    put_grad(x, torch.flip(get_grad(y), dims))
    return y


register(JVP, prims.flip, linear(prims.flip, (0,)))
register(BATCH, prims.flip, over_dims(prims.flip, empty_means_all=False))  # no dims flips none


@register(GRAD, prims.pad)
def _pad_grad(x, pad, value):
    y = prims.pad(x, pad, value)
    put_grad(x, torch.nn.functional.pad(get_grad(y), [-p for p in pad]))
    return y


register(JVP, prims.pad, linear(prims.pad, (0, 2)))  # the padding value is the output's where it pads
register(BATCH, prims.pad, same_call(prims.pad))
