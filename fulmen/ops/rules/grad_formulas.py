"""Formulas grad rules share: sums and broadcasts of cotangents, eager's matmul backward, the binary prims'
derivatives (also the JVP rules' source). Torch code on proxies, as the rules themselves; imports only fulmen.core
and the leaves of fulmen.ops (see fulmen/ops/rules/grad.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fulmen.ops.rules.grad import get_grad, put_grad
from fulmen.ops.utils import is_tensor

T = torch.Tensor


def zeros_shaped(x: torch.Tensor) -> torch.Tensor:
    """Zeros of `x`'s shape, dtype and device that do not read `x`, so the backward need not keep `x` alive (nor
    ZeRO-3 gather a parameter again) just for its metadata."""
    return torch.zeros(x.shape, dtype=x.dtype, device=x.device)




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
    if is_tensor(a):
        grad_a = torch.where(b == 0, 0.0, g * (b * torch.pow(a, b - 1))) if is_tensor(b) else (
            zeros_shaped(a) if b == 0 else g * (b * torch.pow(a, b - 1)))
    if is_tensor(b):
        # d(a^b)/db = a^b log(a), which eager defines as 0 where a == 0 and b >= 0.
        if is_tensor(a):
            grad_b = g * torch.where((a == 0) & (b >= 0), 0.0, y * torch.log(a))
        elif a == 0:
            grad_b = g * torch.where(b >= 0, 0.0, y * -math.inf)
        else:
            grad_b = g * (y * (math.log(a) if a > 0 else math.nan))
    return grad_a, grad_b


def keep_reduced(g: T, x: T, dims) -> T:
    """`g`, reduced over `dims` of `x`, broadcast back to `x`'s shape."""
    shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
    return g.reshape(shape).expand(x.shape)


def var_backward(x: T, dims, correction, g: T) -> T:
    """aten's var backward for `g`, the cotangent with the reduced `dims` kept (the products in eager's order)."""
    n = math.prod(x.shape[d] for d in dims)
    return (2.0 / (n - correction)) * g * (x - x.mean(dims, keepdim=True))


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


def kernel_grad(forward: Callable[..., Any], backward: Callable[..., Any], *, of_result: bool = False
                ) -> Callable[..., Any]:
    """The grad rule of an op of one tensor that eager differentiates with one backward kernel (its bits, not a
    formula's): records `forward(x, *options)` and gives x `backward(grad, x, *options)`, the options being the call's
    other arguments; `of_result`: the kernel reads the op's result instead of x (an in-place update's)."""

    def rule(x, *args, **kwargs):
        y = forward(x, *args, **kwargs)
        put_grad(x, backward(get_grad(y), y if of_result else x, *args, **kwargs))
        return y

    return rule
