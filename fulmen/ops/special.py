"""Special functions without a prim: polygamma, the Hurwitz zeta, the inverse normal CDF, frexp and ldexp.

Each runs eager's kernel (the torch executor calls the op itself); their rules follow eager's derivatives.yaml
formula for formula, so grads round where eager's do. ldexp is eager's own composite, `input * 2 ** other`, and
decomposes into it, which gives its grad, JVP and batching rules.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fulmen.ops.factories import no_derivative
from fulmen.ops.registry import TorchBinding, bind, lookup, method, methods, torch_symbol
from fulmen.ops.rules.batch import elementwise
from fulmen.ops.rules.grad import get_grad, put_grad, wants_grad
from fulmen.ops.rules.grad_formulas import sum_to
from fulmen.ops.rules.jvp import Dot, as_tangent, by_derivative
from fulmen.ops.rules.tables import RuleKind, register
from fulmen.ops.rules.traits import elementwise_unary

GRAD, JVP, BATCH = RuleKind.GRAD, RuleKind.JVP, RuleKind.BATCH


# --- polygamma(n, x): the symbol takes the tensor first, as the method does (`x.polygamma_(n)` updates x) -------------
def _tensor_first(n: int, input: torch.Tensor) -> tuple[tuple, dict[str, Any]]:  # noqa: A002 - torch's names
    return (input, n), {}


polygamma = torch_symbol(method("polygamma"), inplace=methods("polygamma_"))
for _fn in (torch.polygamma, torch.special.polygamma):
    bind(_fn, TorchBinding(polygamma, normalize=_tensor_first))


@register(GRAD, polygamma)
def polygamma_grad(x, n):
    y = polygamma(x, n)
    put_grad(x, get_grad(y) * polygamma(x, n + 1))  # derivatives.yaml: grad * polygamma(n + 1, self)
    return y


register(JVP, polygamma, by_derivative(polygamma, lambda x, n: polygamma(x, n + 1)))
register(BATCH, polygamma, elementwise(polygamma))

# --- the inverse of the standard normal CDF ----------------------------------------------------------------------
ndtri = torch_symbol(torch.special.ndtri)
# derivatives.yaml: grad * sqrt(2 pi) * exp(result^2 / 2), in that order
elementwise_unary(ndtri, lambda x, y, g: g * math.sqrt(2 * math.pi) * torch.exp(torch.square(y) / 2))

# --- the Hurwitz zeta function zeta(x, q): eager differentiates q only, and has no forward-mode formula ------------
zeta = torch_symbol(torch.special.zeta)


@register(GRAD, zeta)
def zeta_grad(x, q):
    y = zeta(x, q)
    if wants_grad(x):  # derivatives.yaml: not_implemented("zeta"): eager's backward raises when a grad reaches x
        message = "the derivative for 'zeta' is not implemented."
        put_grad(x, no_derivative(get_grad(y), list(x.shape), x.dtype, message, not_implemented=True))
    if wants_grad(q):  # derivatives.yaml: grad * -self * special_zeta(self + 1., other), summed to q's shape
        put_grad(q, sum_to(get_grad(y) * -x * zeta(x + 1.0, q), tuple(q.shape)).to(q.dtype))
    return y


register(BATCH, zeta, elementwise(zeta))  # its JVP is eager's forward-mode AD, which refuses it, as torch.func does

# --- frexp: the mantissa is differentiable, the (int32) exponent is not ----------------------------------------
frexp = torch_symbol(torch.frexp, aliases=methods("frexp"), differentiable_outputs=(True, False))


# derivatives.yaml: grad / exponent.exp2(). exp2 of the int32 exponent is float32 in eager too: a float64 input past
# float32's range gets a zero grad there (2 ** 1000 overflows), and here.
def _over_exponent(t: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    return t / torch.exp2(exponent)


@register(GRAD, frexp)
def frexp_grad(x):
    mantissa, exponent = frexp(x)
    # a half-precision grad is float32 here, as eager's is before its engine casts it to the input's dtype
    put_grad(x, _over_exponent(get_grad(mantissa), exponent).to(x.dtype))
    return mantissa, exponent


@register(JVP, frexp)
def frexp_jvp(dot: Dot, args: tuple, kwargs: dict):
    mantissa, exponent = frexp(*args, **kwargs)
    return (mantissa, exponent), (as_tangent(_over_exponent(dot(args[0]), exponent), mantissa), None)


register(BATCH, frexp, elementwise(frexp))


# --- ldexp: eager computes it as its composite, input * 2.0 ** other (aten/native/BinaryOps.cpp), and differentiates
# it by derivatives.yaml's formula, whose 2 ** other is an integer power for an integer exponent: a negative one gives
# the input a zero grad in eager (2 ** -1 is 0 there), and here.
def ldexp_decomposition(input: Any, other: Any) -> Any:  # noqa: A002 - torch's names
    return lookup(torch.mul).symbol(input, lookup(torch.pow).symbol(2.0, other))


ldexp = torch_symbol(
    torch.ldexp, decomposition=ldexp_decomposition, aliases=methods("ldexp"), inplace=methods("ldexp_")
)


@register(GRAD, ldexp)
def ldexp_grad(x, other):
    y = ldexp(x, other)
    g = get_grad(y)
    # each summed to its operand's shape, then in its dtype, as eager's engine does with a broadcast operand's grad
    if wants_grad(x):  # grad * pow(2, other)
        put_grad(x, sum_to(g * torch.pow(2, other), tuple(x.shape)).to(x.dtype))
    if wants_grad(other):  # grad * result * M_LN2
        put_grad(other, sum_to(g * y * math.log(2.0), tuple(other.shape)).to(other.dtype))
    return y


@register(JVP, ldexp)
def ldexp_jvp(dot: Dot, args: tuple, kwargs: dict):
    x, other = args
    y = ldexp(x, other)
    tx, tother = dot(x), dot(other)
    parts = [] if tx is None else [tx * torch.pow(2, other)]
    if tother is not None:
        parts.append(tother * y * math.log(2.0))
    return y, as_tangent(parts[0] + parts[1] if len(parts) == 2 else parts[0], y)
