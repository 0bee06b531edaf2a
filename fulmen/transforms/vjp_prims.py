"""Grad rules of the prims: what every symbol without a rule of its own is differentiated through.

Rules run as torch code on proxies (the acquisition mode records it), so each reads like its formula. Prims
without an entry here and with floating outputs fall back to torch autograd on the prim (`impls.torch_vjp`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fulmen.ops import backward_kernels, prims, shape
from fulmen.transforms.autodiff import get_grad, put_grad, register_grad


def zeros_shaped(x: torch.Tensor) -> torch.Tensor:
    """Zeros of `x`'s shape, dtype and device that do not read `x`, so the backward need not keep `x` alive (nor
    ZeRO-3 gather a parameter again) just for its metadata."""
    return torch.zeros(x.shape, dtype=x.dtype, device=x.device)

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
    register_grad(getattr(prims, _name))(_unary_rule(getattr(prims, _name), _vjp))


def _is_proxy(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


# prim name -> (d(a), d(b)) from (a, b, y, g), grouped as eager's; a or b may be a Python number (its grad is not
# asked for).
BINARY_VJPS: dict[str, Callable[[Any, Any, T, T], tuple[Any, Any]]] = {
    "add": lambda a, b, y, g: (g, g),
    "sub": lambda a, b, y, g: (g, -g),
    "mul": lambda a, b, y, g: (g * b, g * a),
    "div": lambda a, b, y, g: (g / b, -(g * (y / b))),
    # eager's rounded quotients: floor(a / b) differs from them where a / b overflows or b is infinite
    "remainder": lambda a, b, y, g: (g, -g * torch.div(a, b, rounding_mode="floor")),
    "fmod": lambda a, b, y, g: (g, -g * torch.div(a, b, rounding_mode="trunc")),
    "atan2": lambda a, b, y, g: _atan2_grads(a, b, g),
    "hypot": lambda a, b, y, g: (g * a / y, g * b / y),
    "maximum": lambda a, b, y, g: _select_grads(a, b, g, torch.lt),
    "minimum": lambda a, b, y, g: _select_grads(a, b, g, torch.gt),
    "pow": lambda a, b, y, g: _pow_grads(a, b, y, g),
}


def _select_grads(a, b, g, loses):
    """max/min as eager: ties split the cotangent evenly, and an operand gets it unless it `loses`, so both get all
    of it where either is NaN."""
    shared = torch.where(a == b, g / 2, g)
    return torch.where(loses(a, b), 0.0, shared), torch.where(loses(b, a), 0.0, shared)


def _atan2_grads(a, b, g):
    """As eager: no grad at the origin, where the formula reads 0/0."""
    norm = a * a + b * b
    recip = torch.where(norm == 0, 0.0, torch.reciprocal(norm))
    return g * b * recip, g * -a * recip


def _pow_grads(a, b, y, g):
    """eager's pow backward, its products grouped as eager groups them (g * (b * a^(b-1)), not (g * b) * ...): they
    differ where one product overflows and the other underflows."""
    grad_a = grad_b = None
    if _is_proxy(a):
        grad_a = torch.where(b == 0, 0.0, g * (b * torch.pow(a, b - 1))) if _is_proxy(b) else (
            zeros_shaped(a) if b == 0 else g * (b * torch.pow(a, b - 1)))
    if _is_proxy(b):
        # d(a^b)/db = a^b log(a), which eager defines as 0 where a == 0 and b >= 0.
        if _is_proxy(a):
            grad_b = g * torch.where((a == 0) & (b >= 0), 0.0, y * torch.log(a))
        elif a == 0:
            grad_b = g * torch.where(b >= 0, 0.0, y * -math.inf)
        else:
            grad_b = g * (y * (math.log(a) if a > 0 else math.nan))
    return grad_a, grad_b


def _binary_rule(prim, vjp):
    def rule(a, b):
        y = prim(a, b)
        grad_a, grad_b = vjp(a, b, y, get_grad(y))
        for x, grad in ((a, grad_a), (b, grad_b)):
            if _is_proxy(x) and x.requires_grad:
                # A 0-dim CPU tensor may meet a dimensioned operand (it acts as a scalar): sum its grad down.
                put_grad(x, _to(sum_to(grad, tuple(x.shape)) if _is_proxy(grad) else grad, x))
        return y

    return rule


def _to(grad: Any, like: T) -> T:
    if not isinstance(grad, torch.Tensor):
        return torch.full_like(like, grad)
    return grad if grad.dtype == like.dtype else grad.to(like.dtype)


for _name, _vjp in BINARY_VJPS.items():
    register_grad(getattr(prims, _name))(_binary_rule(getattr(prims, _name), _vjp))


# --- the rest, one rule each ---------------------------------------------------------------------------------------
@register_grad(prims.where)
def _where(cond, a, b):
    y = prims.where(cond, a, b)
    g = get_grad(y)
    if _is_proxy(a) and a.requires_grad:
        put_grad(a, torch.where(cond, g, 0.0))
    if _is_proxy(b) and b.requires_grad:
        put_grad(b, torch.where(cond, 0.0, g))
    return y


@register_grad(prims.convert_element_type)
def _convert(x, dtype):
    y = prims.convert_element_type(x, dtype)
    put_grad(x, get_grad(y).to(x.dtype))
    return y


@register_grad(prims.device_put)
def _device_put(x, device):
    y = prims.device_put(x, device)
    put_grad(x, get_grad(y).to(x.device))
    return y


@register_grad(prims.alias)
def _alias(x):
    y = prims.alias(x)
    put_grad(x, get_grad(y))
    return y


@register_grad(prims.clone)
def _clone(x, memory_format=torch.preserve_format):
    y = prims.clone(x, memory_format)
    put_grad(x, get_grad(y))
    return y


def keep_reduced(g: T, x: T, dims) -> T:
    """`g`, reduced over `dims` of `x`, broadcast back to `x`'s shape."""
    shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
    return g.reshape(shape).expand(x.shape)


@register_grad(prims.sum)
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


register_grad(prims.amax)(_extremum(prims.amax))
register_grad(prims.amin)(_extremum(prims.amin))


def var_backward(x: T, dims, correction, g: T) -> T:
    """aten's var backward for `g`, the cotangent with the reduced `dims` kept (the products in eager's order)."""
    n = math.prod(x.shape[d] for d in dims)
    return (2.0 / (n - correction)) * g * (x - x.mean(dims, keepdim=True))


@register_grad(prims.var)
def _var(x, dims, correction):
    if math.prod(x.shape[d] for d in dims) <= correction:
        return NotImplemented  # no degrees of freedom: eager's own backward gives its infinities and NaNs
    y = prims.var(x, dims, correction)
    put_grad(x, var_backward(x, dims, correction, keep_reduced(get_grad(y), x, dims)))
    return y


@register_grad(prims.cumsum)
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


register_grad(prims.topk)(_sorted_values(prims.topk))
register_grad(prims.sort)(_sorted_values(prims.sort))


# --- shapes --------------------------------------------------------------------------------------------------------
def _reshape_like(prim):
    """Rules of the prims that only change the shape: the grad is reshaped back."""

    def rule(x, *args):
        y = prim(x, *args)
        put_grad(x, get_grad(y).reshape(x.shape))
        return y

    return rule


for _prim in (prims.reshape, prims.squeeze, prims.unsqueeze):
    register_grad(_prim)(_reshape_like(_prim))


@register_grad(prims.permute)
def _permute(x, perm):
    y = prims.permute(x, perm)
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    put_grad(x, get_grad(y).permute(inverse))
    return y


@register_grad(prims.expand)
def _expand(x, shape):
    y = prims.expand(x, shape)
    g = get_grad(y)
    lead = len(shape) - x.dim()
    dims = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(x.shape) if s == 1 and shape[lead + i] != 1)
    put_grad(x, (g.sum(dims) if dims else g).reshape(x.shape))
    return y


@register_grad(prims.slice)
def _slice(x, starts, ends, steps):
    y = prims.slice(x, starts, ends, steps)
    index = tuple(slice(s, e, st) for s, e, st in zip(starts, ends, steps))
    put_grad(x, shape.setitem(zeros_shaped(x), index, get_grad(y)))
    return y


@register_grad(prims.select)
def _select(x, dim, index):
    y = prims.select(x, dim, index)
    put_grad(x, torch.select_scatter(zeros_shaped(x), get_grad(y), dim, index))
    return y


@register_grad(prims.cat)
def _cat(tensors, dim):
    y = prims.cat(tensors, dim)
    pieces = torch.split(get_grad(y), [t.shape[dim] for t in tensors], dim)
    for t, piece in zip(tensors, pieces):
        put_grad(t, piece)
    return y


@register_grad(prims.flip)
def _flip(x, dims):
    y = prims.flip(x, dims)
    put_grad(x, torch.flip(get_grad(y), dims))
    return y


@register_grad(prims.pad)
def _pad(x, pad, value):
    y = prims.pad(x, pad, value)
    put_grad(x, torch.nn.functional.pad(get_grad(y), [-p for p in pad]))
    return y


def _along(index: T, dim: int, like: T) -> T:
    """A 1-D `index` placed along `dim` and broadcast to `like`'s shape."""
    shape = [1] * like.dim()
    shape[dim] = index.numel()
    return index.reshape(shape).expand(like.shape)


@register_grad(prims.take)
def _take(x, index, dim):
    y = prims.take(x, index, dim)
    g = get_grad(y)
    put_grad(x, zeros_shaped(x).index_add(dim, index, g))
    return y


@register_grad(prims.take_along_axis)
def _take_along_axis(x, index, dim):
    y = prims.take_along_axis(x, index, dim)
    put_grad(x, zeros_shaped(x).scatter_add(dim, index, get_grad(y)))
    return y


@register_grad(prims.scatter_add)
def _scatter_add(x, dim, index, src):
    y = prims.scatter_add(x, dim, index, src)
    g = get_grad(y)
    put_grad(x, g)
    if _is_proxy(src) and src.requires_grad:
        put_grad(src, torch.gather(g, dim, index))
    return y


@register_grad(prims.slice_scatter)
def _slice_scatter(x, src, dim, start, end, step):
    y = prims.slice_scatter(x, src, dim, start, end, step)
    g = get_grad(y)
    put_grad(x, torch.slice_scatter(g, zeros_shaped(src), dim, start, end, step))
    put_grad(src, g[(slice(None),) * dim + (slice(start, end, step),)])
    return y


@register_grad(prims.select_scatter)
def _select_scatter(x, src, dim, index):
    y = prims.select_scatter(x, src, dim, index)
    g = get_grad(y)
    put_grad(x, torch.select_scatter(g, zeros_shaped(src), dim, index))
    put_grad(src, g.select(dim, index))
    return y


def sum_to(grad: T, shape: tuple[int, ...]) -> T:
    """Sums the broadcast (leading and size-1) dims of `grad` away so it has `shape`."""
    if tuple(grad.shape) == tuple(shape):
        return grad
    lead = grad.dim() - len(shape)
    dims = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and grad.shape[lead + i] != 1)
    return (grad.sum(dims, keepdim=True) if dims else grad).reshape(shape)


def _column_major(m: T) -> bool:
    return m.stride(0) == 1 and m.stride(1) == m.shape[0]


def _mm_grads(a: T, b: T, g: T, want_a: bool, want_b: bool) -> tuple[T | None, T | None]:
    """Grads of the 2-D product `a @ b` as eager's mm backward computes them: a column-major operand gets its
    grad computed transposed (aten's mm_mat1_backward / mm_mat2_backward), which can round differently."""
    grad_a = grad_b = None
    if want_a:
        grad_a = torch.matmul(b, g.mT).mT if _column_major(a) else torch.matmul(g, b.mT)
    if want_b:
        grad_b = torch.matmul(g.mT, a).mT if _column_major(b) else torch.matmul(a.mT, g)
    return grad_a, grad_b


def _folds(a: T, b: T, want_a: bool, want_b: bool) -> bool:
    """Whether eager's matmul folds the batch dims of its larger operand into matrix rows (aten's should_fold):
    one mm instead of a batched one, so the smaller operand's grad is one product accumulated over every row
    (in float32 for low-precision inputs) rather than per-batch products rounded and then summed."""
    big, small, small_wanted = (a, b, want_b) if a.dim() >= b.dim() else (b, a, want_a)
    if big.dim() < 3 or small.dim() > 2:
        return False
    if small_wanted:
        return True
    if a.dim() == 2:
        return False
    if big.numel() == 0:
        return True
    # the larger operand (b transposed when it is b) must fold to rows without a copy
    shape, strides = list(big.shape), list(big.stride())
    if big is b:
        shape[-2:], strides[-2:] = shape[:-3:-1], strides[:-3:-1]
    return all(strides[i] == strides[i + 1] * shape[i + 1] for i in range(len(shape) - 2))


def _rows(t: T) -> T:
    """`t` as a matrix of its last dim's rows (the number of rows explicit: -1 is ambiguous for no elements)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def matmul_grads(a: T, b: T, g: T, want_a: bool, want_b: bool) -> tuple[T | None, T | None]:
    """Grads of `a @ b` for operands of two or more dims (batch dims broadcast), computed as eager's backward
    computes them: through the folded mm where eager folds, else batched products summed over broadcast dims."""
    if a.dim() == 2 and b.dim() == 2:
        return _mm_grads(a, b, g, want_a, want_b)
    if a.dim() == 3 and b.dim() == 3 and a.shape[0] != b.shape[0]:
        # eager drops a batch dim of 1 that is broadcast, from an operand requiring grad, and folds instead
        if a.shape[0] == 1 and want_a:
            grad_a, grad_b = matmul_grads(a.squeeze(0), b, g, want_a, want_b)
            return grad_a.unsqueeze(0), grad_b
        if b.shape[0] == 1 and want_b:
            grad_a, grad_b = matmul_grads(a, b.squeeze(0), g, want_a, want_b)
            return grad_a, grad_b.unsqueeze(0)
    if _folds(a, b, want_a, want_b):
        if a.dim() >= 3:  # (..., m, k) @ (k, n): rows (N*m, k) @ (k, n)
            grad_a, grad_b = _mm_grads(_rows(a), b, _rows(g), want_a, want_b)
            return (None if grad_a is None else grad_a.reshape(a.shape)), grad_b
        # (m, k) @ (..., k, n) is computed transposed: rows (N*n, k) @ (k, m)
        bt = b.mT
        grad_bt, grad_at = _mm_grads(_rows(bt), a.mT, _rows(g.mT), want_b, want_a)
        return (None if grad_at is None else grad_at.mT), (None if grad_bt is None else grad_bt.reshape(bt.shape).mT)
    grad_a = sum_to(torch.matmul(g, b.mT), tuple(a.shape)) if want_a else None
    grad_b = sum_to(torch.matmul(a.mT, g), tuple(b.shape)) if want_b else None
    return grad_a, grad_b


def matmul_rule(matmul):
    """The rule of a matmul (the prim or torch.matmul) for operands of two or more dims."""

    def rule(a, b):
        if a.dim() < 2 or b.dim() < 2:
            return NotImplemented  # vector operands: differentiated through the torch autograd fallback
        y = matmul(a, b)
        grad_a, grad_b = matmul_grads(a, b, get_grad(y), a.requires_grad, b.requires_grad)
        if grad_a is not None:
            put_grad(a, grad_a)
        if grad_b is not None:
            put_grad(b, grad_b)
        return y

    return rule


register_grad(prims.matmul)(matmul_rule(prims.matmul))
