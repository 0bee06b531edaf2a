"""The rules of the reductions, scans and sorts over explicit dims, and of the matrix product.

Batched, a dim of one example moves past the batch dim (fulmen.ops.rules.batch.over_dims / at_dim).
"""

from __future__ import annotations

import math

import torch

from fulmen.ops import prims
from fulmen.ops.rules.batch import Batch, at_dim, batch_matmul, over_dims, shift
from fulmen.ops.rules.grad import differentiated_by_eager, get_grad, not_differentiable, put_grad
from fulmen.ops.rules.grad_formulas import keep_reduced, matmul_rule, var_backward, zeros_shaped
from fulmen.ops.rules.jvp import Dot, bilinear, linear
from fulmen.ops.rules.tables import RuleKind, register

GRAD, JVP, BATCH = RuleKind.GRAD, RuleKind.JVP, RuleKind.BATCH


# --- sum, prod -----------------------------------------------------------------------------------------------------
@register(GRAD, prims.sum)
def _sum_grad(x, dims):
    y = prims.sum(x, dims)
    put_grad(x, keep_reduced(get_grad(y), x, dims))
    return y


register(JVP, prims.sum, linear(prims.sum, (0,)))
register(BATCH, prims.sum, over_dims(prims.sum))

differentiated_by_eager(prims.prod)


@register(BATCH, prims.prod)
def _prod_batch(batch: Batch, args: tuple, kwargs: dict):
    x, dims = args
    if len(dims) == 1:
        return prims.prod(x, (shift(dims[0]),))
    kept = [d for d in range(x.dim() - 1) if d not in dims]  # the prim reduces all of an example's dims at once
    moved = prims.permute(x, (0, *(d + 1 for d in kept), *(d + 1 for d in dims)))
    rows = prims.reshape(moved, (batch.size, *(x.shape[d + 1] for d in kept), math.prod(x.shape[d + 1] for d in dims)))
    return prims.prod(rows, (len(kept) + 1,))


# --- amax, amin: the cotangent (tangent) shared evenly by the elements that reach the extremum ---------------------
def _extremum_grad(prim):
    def rule(x, dims):
        y = prim(x, dims)
        hit = (x == keep_reduced(y, x, dims)).to(x.dtype)
        count = keep_reduced(hit.sum(dims), x, dims)
        put_grad(x, keep_reduced(get_grad(y), x, dims) * hit / count)
        return y

    return rule


def _extremum_jvp(prim):
    def rule(dot: Dot, args: tuple, kwargs: dict):
        x, dims = args
        y = prim(x, dims)
        hit = (x == keep_reduced(y, x, dims)).to(x.dtype)
        return y, (dot(x) * hit).sum(dims) / hit.sum(dims)

    return rule


for _prim in (prims.amax, prims.amin):
    register(GRAD, _prim, _extremum_grad(_prim))
    register(JVP, _prim, _extremum_jvp(_prim))
    register(BATCH, _prim, over_dims(_prim))


# --- var -----------------------------------------------------------------------------------------------------------
@register(GRAD, prims.var)
def _var_grad(x, dims, correction):
    if math.prod(x.shape[d] for d in dims) <= correction:
        return NotImplemented  # no degrees of freedom: eager's own backward gives its infinities and NaNs
    y = prims.var(x, dims, correction)
    put_grad(x, var_backward(x, dims, correction, keep_reduced(get_grad(y), x, dims)))
    return y


@register(JVP, prims.var)
def _var_jvp(dot: Dot, args: tuple, kwargs: dict):
    x, dims, correction = args
    y = prims.var(x, dims, correction)
    n = 1
    for d in dims:
        n *= x.shape[d]
    centered = x - keep_reduced(x.mean(dims), x, dims)
    # torch's double arithmetic: 2 / 0 is inf (a nan tangent), an empty reduction's tangent is 0
    scale = 0.0 if n == 0 else 2.0 / (n - correction) if n != correction else math.inf
    return y, (centered * dot(x)).sum(dims) * scale


register(BATCH, prims.var, over_dims(prims.var))


# --- argmax, argmin ------------------------------------------------------------------------------------------------
not_differentiable(prims.argmax, prims.argmin)
register(BATCH, prims.argmax, at_dim(prims.argmax, 1))
register(BATCH, prims.argmin, at_dim(prims.argmin, 1))


# --- topk, sort: the values' cotangent (tangent) goes back to (comes from) where the indices point -----------------
def _sorted_values_grad(prim):
    def rule(x, *args):
        values, indices = prim(x, *args)
        dim = args[1] if prim is prims.topk else args[0]
        grad = zeros_shaped(x).scatter_add(dim, indices, get_grad(values))
        put_grad(x, grad)
        return values, indices

    return rule


def _sorted_values_jvp(prim, dim_position: int):
    def rule(dot: Dot, args: tuple, kwargs: dict):
        values, indices = prim(*args)
        dim = args[dim_position]
        return (values, indices), (torch.gather(dot(args[0]), dim, indices), None)

    return rule


for _prim, _dim_position in ((prims.topk, 2), (prims.sort, 1)):
    register(GRAD, _prim, _sorted_values_grad(_prim))
    register(JVP, _prim, _sorted_values_jvp(_prim, _dim_position))
    register(BATCH, _prim, at_dim(_prim, _dim_position))


# --- cumsum --------------------------------------------------------------------------------------------------------
@register(GRAD, prims.cumsum)
def _cumsum_grad(x, dim):
    y = prims.cumsum(x, dim)
    put_grad(x, torch.flip(torch.cumsum(torch.flip(get_grad(y), (dim,)), dim), (dim,)))
    return y


register(JVP, prims.cumsum, linear(prims.cumsum, (0,)))
register(BATCH, prims.cumsum, at_dim(prims.cumsum, 1))


# --- matmul: a sum of products ---------------------------------------------------------------------------------------
register(GRAD, prims.matmul, matmul_rule(prims.matmul))
register(JVP, prims.matmul, bilinear(prims.matmul))
register(BATCH, prims.matmul, batch_matmul)
