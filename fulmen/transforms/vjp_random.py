"""Grad rules of the random draws eager's autograd records (derivatives.yaml): each gives the tensors it reads a
zero grad. There is no reparameterisation: `torch.normal(mean, std)` gives `mean` and `std` zeros, as eager does.
The other draws (`rand_like`, `randn_like`, `randint_like`, `multinomial`...) give outputs that never require grad
(`fulmen.ops.factories`), so they need no rule. The in-place fills (`x.exponential_()`...) give `x` (and a tensor
`p`) zeros, as eager does. `bernoulli(input, p)` with a float p is recorded without a
derivative: its backward raises eager's error when a grad reaches it. Each rule draws once, in the forward.
"""

from __future__ import annotations

import torch

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import iter_proxies
from fulmen.core.trace import TraceBuilder
from fulmen.ops import impls
from fulmen.ops.factories import RANDOM_FILL
from fulmen.ops.registry import impl_symbol
from fulmen.ops.rules.grad import differentiated_by_eager, differentiated_call, get_grad, put_grad, wants_grad
from fulmen.ops.rules.tables import RuleKind, register


def _zero_grads(out: torch.Tensor, args: tuple, kwargs: dict) -> None:
    # made from the cotangent (as eager's zeros_like(grad)): backward work, run only when a grad reaches `out`
    grad = get_grad(out)
    for t in iter_proxies((args, kwargs)):
        if wants_grad(t):
            put_grad(t, grad.new_zeros(t.shape, dtype=t.dtype))


@register(RuleKind.GRAD, torch.normal)
def normal_grad(*args, **kwargs):
    out = torch.normal(*args, **kwargs)
    _zero_grads(out, args, kwargs)
    return out


def _no_derivative_meta(builder: TraceBuilder, grad, shape, dtype, message) -> TensorProxy:
    return builder.make_proxy(torch.empty(shape, dtype=dtype, device="meta"), grad.device)


no_derivative = impl_symbol(impls.no_derivative, meta=_no_derivative_meta)
differentiated_by_eager(no_derivative)  # it raises when it runs: its eager backward, run again, raises the same


@register(RuleKind.GRAD, torch.bernoulli)
def bernoulli_grad(x, *args, **kwargs):
    out = torch.bernoulli(x, *args, **kwargs)
    if args or "p" in kwargs:
        # `bernoulli(input, p)` with a float p: eager records it, and its backward raises when a grad reaches it
        grad = get_grad(out)
        source = differentiated_call().source
        where = f" (at {source.describe()})" if source is not None else ""
        put_grad(x, no_derivative(grad, list(x.shape), x.dtype,
                                  f"derivative for aten::bernoulli is not implemented: torch.bernoulli(input, p) "
                                  f"with a float p{where} has no grad in eager either; draw from input.detach()"))
    else:
        _zero_grads(out, (x,), kwargs)
    return out


@register(RuleKind.GRAD, RANDOM_FILL)
def random_fill_grad(x, method_name, *args, **kwargs):
    out = RANDOM_FILL(x, method_name, *args, **kwargs)
    _zero_grads(out, (x, *args), kwargs)
    return out
