"""The rules of the elementwise prims, and of the conversions and copies (one tensor in, its values out).

An elementwise prim's derivative is declared once, as the formula of its input's cotangent (UNARY_VJPS here;
BINARY_VJPS in fulmen.ops.rules.grad_formulas, since torch.max / min's rules use it too), and its grad, JVP and
batching rules follow from that trait (fulmen.ops.rules.traits). Rules run as torch code on proxies (the
acquisition mode records it), so each reads like its formula.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fulmen.ops import prims
from fulmen.ops.kernels import backward_kernels
from fulmen.ops.rules.batch import Batch, elementwise, same_call
from fulmen.ops.rules.grad import differentiated_by_eager, get_grad, not_differentiable, put_grad
from fulmen.ops.rules.grad_formulas import BINARY_VJPS, zeros_shaped
from fulmen.ops.rules.jvp import Dot, linear
from fulmen.ops.rules.tables import RuleKind, register
from fulmen.ops.rules.traits import elementwise_binary, elementwise_unary
from fulmen.ops.utils import is_tensor

T = torch.Tensor
GRAD, JVP, BATCH = RuleKind.GRAD, RuleKind.JVP, RuleKind.BATCH

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


for _name, _vjp in UNARY_VJPS.items():
    elementwise_unary(prims.PRIMS[_name], _vjp)
for _name, _vjp in BINARY_VJPS.items():
    elementwise_binary(prims.PRIMS[_name], _vjp)
for _name in (*prims.UNARY, *prims.BINARY):  # those without a formula batch all the same
    if _name not in UNARY_VJPS and _name not in BINARY_VJPS:
        register(BATCH, prims.PRIMS[_name], elementwise(prims.PRIMS[_name]))

# The elementwise prims without a derivative formula: differentiated by eager's backward, or (integer and bool
# results) not at all.
differentiated_by_eager(prims.copysign, prims.digamma, prims.nextafter)
not_differentiable(
    prims.eq, prims.ne, prims.lt, prims.le, prims.gt, prims.ge, prims.isfinite, prims.isinf, prims.isnan,
    prims.signbit, prims.logical_and, prims.logical_or, prims.logical_xor, prims.logical_not, prims.bitwise_and,
    prims.bitwise_or, prims.bitwise_xor, prims.bitwise_not, prims.bitwise_left_shift, prims.bitwise_right_shift)


# --- where ---------------------------------------------------------------------------------------------------------
@register(GRAD, prims.where)
def _where_grad(cond, a, b):
    y = prims.where(cond, a, b)
    g = get_grad(y)
    if is_tensor(a) and a.requires_grad:
        put_grad(a, torch.where(cond, g, 0.0))
    if is_tensor(b) and b.requires_grad:
        put_grad(b, torch.where(cond, 0.0, g))
    return y


@register(JVP, prims.where)
def _where_jvp(dot: Dot, args: tuple, kwargs: dict):
    cond, a, b = args
    y = prims.where(cond, a, b)
    ta, tb = dot(a), dot(b)
    return y, torch.where(cond, ta if ta is not None else 0.0, tb if tb is not None else 0.0).to(y.dtype)


register(BATCH, prims.where, elementwise(prims.where))


# --- conversions and copies: linear in their one tensor ------------------------------------------------------------
def _copy(prim, back: Callable[[T, T], T]) -> None:
    """A conversion or copy: linear in its one tensor, its grad the output's cotangent put `back` to the input's
    dtype or device, and batched by the same call."""

    def rule(x, *args, **kwargs):
        y = prim(x, *args, **kwargs)
        put_grad(x, back(get_grad(y), x))
        return y

    register(GRAD, prim, rule)
    register(JVP, prim, linear(prim, (0,)))
    register(BATCH, prim, same_call(prim))


_copy(prims.convert_element_type, lambda g, x: g.to(x.dtype))
_copy(prims.device_put, lambda g, x: g.to(x.device))
_copy(prims.alias, lambda g, x: g)


@register(GRAD, prims.clone)
def _clone_grad(x, memory_format=torch.preserve_format):
    y = prims.clone(x, memory_format)
    put_grad(x, get_grad(y))
    return y


register(JVP, prims.clone, linear(prims.clone, (0,)))


@register(BATCH, prims.clone)
def _clone_batch(batch: Batch, args: tuple, kwargs: dict):
    # a memory format names the layout of one example's dims: a batch has one more (the values are the same)
    return prims.clone(args[0])
