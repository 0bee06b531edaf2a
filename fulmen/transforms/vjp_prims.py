"""Grad rules of the prims: what every symbol without a rule of its own is differentiated through.

Rules run as torch code on proxies (the acquisition mode records it), so each reads like its formula. The prims
without a rule are declared at the end: differentiated by eager's backward (torch autograd on the prim,
`impls.torch_vjp`), or not differentiable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fulmen.ops import backward_kernels, prims, shape
from fulmen.ops.rules.grad import differentiated_by_eager, get_grad, not_differentiable, put_grad
from fulmen.ops.rules.grad_formulas import BINARY_VJPS, keep_reduced, matmul_rule, sum_to, var_backward, zeros_shaped
from fulmen.ops.rules.tables import RuleKind, register
from fulmen.ops.utils import is_tensor

T = torch.Tensor

# prim name -> d(input) from (x, y, g): the input, the output and the output's cotangent. Each formula groups its
# steps as eager's (derivatives.yaml) does, and ops eager differentiates with one kernel call it, so half-precision
# grads round where eager's do.
UNARY_VJPS: dict[str, Callable[[T, T, T], T]] = {
    "abs": lambda x, y, g: g * torch.sign(x),
    "neg": lambda x, y, g: -g,
    "exp": lambda x, y, g: g * y,
    "exp2": lambda x, y, g: g * y * math.log(2.0),
    "expm1": lambda x, y, g: g * (y + 1),
    "log": lambda x, y, g: g / x,
    "log1p": lambda x, y, g: g / (x + 1),
    "log2": lambda x, y, g: g / (x * math.log(2.0)),
    "log10": lambda x, y, g: g / (x * math.log(10.0)),
    "sqrt": lambda x, y, g: g / (2 * y),
    "rsqrt": lambda x, y, g: -0.5 * g * torch.pow(y, 3),
    "sin": lambda x, y, g: g * torch.cos(x),
    "cos": lambda x, y, g: -g * torch.sin(x),
    "tan": lambda x, y, g: g * (1 + y * y),
    "asin": lambda x, y, g: g * torch.rsqrt(1 - x * x),
    "acos": lambda x, y, g: -g * torch.rsqrt(1 - x * x),
    "atan": lambda x, y, g: g / (1 + x * x),
    "sinh": lambda x, y, g: g * torch.cosh(x),
    "cosh": lambda x, y, g: g * torch.sinh(x),
    "tanh": lambda x, y, g: backward_kernels.tanh_backward(g, y),
    "asinh": lambda x, y, g: g * torch.rsqrt(x * x + 1),
    "acosh": lambda x, y, g: g * torch.rsqrt(x * x - 1),  # eager's form: +inf, not -inf, at x = -1
    "atanh": lambda x, y, g: g / (1 - x * x),
    "erf": lambda x, y, g: 2 / math.sqrt(math.pi) * torch.exp(-(x * x)) * g,
    "erfc": lambda x, y, g: -2 / math.sqrt(math.pi) * torch.exp(-(x * x)) * g,
    "erfinv": lambda x, y, g: math.sqrt(math.pi) / 2 * torch.exp(y * y) * g,
    "sigmoid": lambda x, y, g: backward_kernels.sigmoid_backward(g, y),
    "reciprocal": lambda x, y, g: -g * (y * y),  # eager squares first: 0 * inf is NaN where 1/x overflows
    "lgamma": lambda x, y, g: g * torch.digamma(x),
    "frac": lambda x, y, g: g,
    # Piecewise constant: eager's backward gives zeros, and so does ours (not "no grad").
    **dict.fromkeys("sign floor ceil round trunc".split(), lambda x, y, g: zeros_shaped(x)),
}


def _unary_rule(prim, vjp: Callable[[T, T, T], T]):
    def rule(x):
        y = prim(x)
        put_grad(x, vjp(x, y, get_grad(y)))
        return y

    return rule


for _name, _vjp in UNARY_VJPS.items():
    register(RuleKind.GRAD, getattr(prims, _name), _unary_rule(getattr(prims, _name), _vjp))


def _binary_rule(prim, vjp):
    def rule(a, b):
        y = prim(a, b)
        grad_a, grad_b = vjp(a, b, y, get_grad(y))
        for x, grad in ((a, grad_a), (b, grad_b)):
            if is_tensor(x) and x.requires_grad:
                # A 0-dim CPU tensor may meet a dimensioned operand (it acts as a scalar): sum its grad down.
                put_grad(x, _to(sum_to(grad, tuple(x.shape)) if is_tensor(grad) else grad, x))
        return y

    return rule


def _to(grad: Any, like: T) -> T:
    if not isinstance(grad, torch.Tensor):
        return torch.full_like(like, grad)
    return grad if grad.dtype == like.dtype else grad.to(like.dtype)


for _name, _vjp in BINARY_VJPS.items():
    register(RuleKind.GRAD, getattr(prims, _name), _binary_rule(getattr(prims, _name), _vjp))


# --- the rest, one rule each ---------------------------------------------------------------------------------------
@register(RuleKind.GRAD, prims.where)
def _where(cond, a, b):
    y = prims.where(cond, a, b)
    g = get_grad(y)
    if is_tensor(a) and a.requires_grad:
        put_grad(a, torch.where(cond, g, 0.0))
    if is_tensor(b) and b.requires_grad:
        put_grad(b, torch.where(cond, 0.0, g))
    return y


@register(RuleKind.GRAD, prims.convert_element_type)
def _convert(x, dtype):
    y = prims.convert_element_type(x, dtype)
    put_grad(x, get_grad(y).to(x.dtype))
    return y


@register(RuleKind.GRAD, prims.device_put)
def _device_put(x, device):
    y = prims.device_put(x, device)
    put_grad(x, get_grad(y).to(x.device))
    return y


@register(RuleKind.GRAD, prims.alias)
def _alias(x):
    y = prims.alias(x)
    put_grad(x, get_grad(y))
    return y


@register(RuleKind.GRAD, prims.clone)
def _clone(x, memory_format=torch.preserve_format):
    y = prims.clone(x, memory_format)
    put_grad(x, get_grad(y))
    return y


@register(RuleKind.GRAD, prims.sum)
def _sum(x, dims):
    y = prims.sum(x, dims)
    put_grad(x, keep_reduced(get_grad(y), x, dims))
    return y


def _extremum(prim):
    def rule(x, dims):
        y = prim(x, dims)
        hit = (x == keep_reduced(y, x, dims)).to(x.dtype)
        count = keep_reduced(hit.sum(dims), x, dims)
        put_grad(x, keep_reduced(get_grad(y), x, dims) * hit / count)
        return y

    return rule


register(RuleKind.GRAD, prims.amax, _extremum(prims.amax))
register(RuleKind.GRAD, prims.amin, _extremum(prims.amin))


@register(RuleKind.GRAD, prims.var)
def _var(x, dims, correction):
    if math.prod(x.shape[d] for d in dims) <= correction:
        return NotImplemented  # no degrees of freedom: eager's own backward gives its infinities and NaNs
    y = prims.var(x, dims, correction)
    put_grad(x, var_backward(x, dims, correction, keep_reduced(get_grad(y), x, dims)))
    return y


@register(RuleKind.GRAD, prims.cumsum)
def _cumsum(x, dim):
    y = prims.cumsum(x, dim)
    put_grad(x, torch.flip(torch.cumsum(torch.flip(get_grad(y), (dim,)), dim), (dim,)))
    return y


def _sorted_values(prim):
    def rule(x, *args):
        values, indices = prim(x, *args)
        dim = args[1] if prim is prims.topk else args[0]
        grad = zeros_shaped(x).scatter_add(dim, indices, get_grad(values))
        put_grad(x, grad)
        return values, indices

    return rule


register(RuleKind.GRAD, prims.topk, _sorted_values(prims.topk))
register(RuleKind.GRAD, prims.sort, _sorted_values(prims.sort))


# --- shapes --------------------------------------------------------------------------------------------------------
def _reshape_like(prim):
    """Rules of the prims that only change the shape: the grad is reshaped back."""

    def rule(x, *args):
        y = prim(x, *args)
        put_grad(x, get_grad(y).reshape(x.shape))
        return y

    return rule


for _prim in (prims.reshape, prims.squeeze, prims.unsqueeze):
    register(RuleKind.GRAD, _prim, _reshape_like(_prim))


@register(RuleKind.GRAD, prims.permute)
def _permute(x, perm):
    y = prims.permute(x, perm)
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    put_grad(x, get_grad(y).permute(inverse))
    return y


@register(RuleKind.GRAD, prims.expand)
def _expand(x, shape):
    y = prims.expand(x, shape)
    g = get_grad(y)
    lead = len(shape) - x.dim()
    dims = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(x.shape) if s == 1 and shape[lead + i] != 1)
    put_grad(x, (g.sum(dims) if dims else g).reshape(x.shape))
    return y


@register(RuleKind.GRAD, prims.slice)
def _slice(x, starts, ends, steps):
    y = prims.slice(x, starts, ends, steps)
    index = tuple(slice(s, e, st) for s, e, st in zip(starts, ends, steps))
    put_grad(x, shape.setitem(zeros_shaped(x), index, get_grad(y)))
    return y


@register(RuleKind.GRAD, prims.select)
def _select(x, dim, index):
    y = prims.select(x, dim, index)
    put_grad(x, torch.select_scatter(zeros_shaped(x), get_grad(y), dim, index))
    return y


@register(RuleKind.GRAD, prims.cat)
def _cat(tensors, dim):
    y = prims.cat(tensors, dim)
    pieces = torch.split(get_grad(y), [t.shape[dim] for t in tensors], dim)
    for t, piece in zip(tensors, pieces):
        put_grad(t, piece)
    return y


@register(RuleKind.GRAD, prims.flip)
def _flip(x, dims):
    y = prims.flip(x, dims)
    put_grad(x, torch.flip(get_grad(y), dims))
    return y


@register(RuleKind.GRAD, prims.pad)
def _pad(x, pad, value):
    y = prims.pad(x, pad, value)
    put_grad(x, torch.nn.functional.pad(get_grad(y), [-p for p in pad]))
    return y


def _along(index: T, dim: int, like: T) -> T:
    """A 1-D `index` placed along `dim` and broadcast to `like`'s shape."""
    shape = [1] * like.dim()
    shape[dim] = index.numel()
    return index.reshape(shape).expand(like.shape)


@register(RuleKind.GRAD, prims.take)
def _take(x, index, dim):
    y = prims.take(x, index, dim)
    g = get_grad(y)
    put_grad(x, zeros_shaped(x).index_add(dim, index, g))
    return y


@register(RuleKind.GRAD, prims.take_along_axis)
def _take_along_axis(x, index, dim):
    y = prims.take_along_axis(x, index, dim)
    put_grad(x, zeros_shaped(x).scatter_add(dim, index, get_grad(y)))
    return y


@register(RuleKind.GRAD, prims.scatter_add)
def _scatter_add(x, dim, index, src):
    y = prims.scatter_add(x, dim, index, src)
    g = get_grad(y)
    put_grad(x, g)
    if is_tensor(src) and src.requires_grad:
        put_grad(src, torch.gather(g, dim, index))
    return y


@register(RuleKind.GRAD, prims.slice_scatter)
def _slice_scatter(x, src, dim, start, end, step):
    y = prims.slice_scatter(x, src, dim, start, end, step)
    g = get_grad(y)
    put_grad(x, torch.slice_scatter(g, zeros_shaped(src), dim, start, end, step))
    put_grad(src, g[(slice(None),) * dim + (slice(start, end, step),)])
    return y


@register(RuleKind.GRAD, prims.select_scatter)
def _select_scatter(x, src, dim, index):
    y = prims.select_scatter(x, src, dim, index)
    g = get_grad(y)
    put_grad(x, torch.select_scatter(g, zeros_shaped(src), dim, index))
    put_grad(src, g.select(dim, index))
    return y


register(RuleKind.GRAD, prims.matmul, matmul_rule(prims.matmul))


# --- the prims without a rule --------------------------------------------------------------------------------------
differentiated_by_eager(prims.copysign, prims.digamma, prims.nextafter, prims.prod, prims.index_copy,
                        prims.index_put)
# integer and bool results, and factories (prims.full's value is a Python number)
not_differentiable(
    prims.argmax, prims.argmin, prims.eq, prims.ne, prims.lt, prims.le, prims.gt, prims.ge, prims.isfinite,
    prims.isinf, prims.isnan, prims.signbit, prims.logical_and, prims.logical_or, prims.logical_xor,
    prims.logical_not, prims.bitwise_and, prims.bitwise_or, prims.bitwise_xor, prims.bitwise_not,
    prims.bitwise_left_shift, prims.bitwise_right_shift, prims.full, prims.iota)
