"""Grad rules that keep eager's gradients at the edges, where differentiating a decomposition would not.

A decomposition computes the op's values, but its chain rule can disagree with eager's backward at edge values:
a zero deviation (std: sqrt's infinite slope times a zero), a NaN against a clamp bound, a zero divisor under a
rounding division, a NaN maximum. Each rule here states eager's formula for the op, or runs eager's own backward
where eager has none worth restating (it raises, or its degenerate cases are its own).
"""

from __future__ import annotations

import torch

from fulmen.ops.registry import symbol_of
from fulmen.ops.rules.grad import eager_grad_rule, get_grad, put_grad, wants_grad
from fulmen.ops.rules.grad_formulas import sum_to, zeros_shaped
from fulmen.ops.rules.tables import RuleKind, register


def _put(x: torch.Tensor, grad: torch.Tensor) -> None:
    """`grad`, of the broadcast result, summed to `x`'s shape and cast to its dtype, as `x`'s grad."""
    put_grad(x, sum_to(grad, tuple(x.shape)).to(x.dtype))


@register(RuleKind.GRAD, torch.clamp)
def clamp_grad(x, min=None, max=None):
    """aten's clamp backward: `x` gets the cotangent where it lies within the bounds (NaN does not); a tensor bound
    gets it where it binds, the lower one only while it is below the upper one."""
    y = torch.clamp(x, min, max)
    g = get_grad(y)
    if wants_grad(x):
        within = (x >= min) & (x <= max) if min is not None and max is not None else (
            x >= min if min is not None else x <= max)
        _put(x, torch.where(within, g, 0.0))
    if wants_grad(min):
        binds = (x < min) & (min < max) if max is not None else x < min
        _put(min, torch.where(binds, g, 0.0))
    if wants_grad(max):
        binds = (x > max) | (max < min) if min is not None else x > max
        _put(max, torch.where(binds, g, 0.0))
    return y


@register(RuleKind.GRAD, torch.div)
def div_grad(a, b, *, rounding_mode=None):
    """A rounded quotient is piecewise constant: eager gives zeros, where floor(a / b)'s chain rule would give
    NaN at a zero divisor."""
    if rounding_mode is None:
        return NotImplemented
    y = torch.div(a, b, rounding_mode=rounding_mode)
    get_grad(y)  # read, so the backward reaches this rule and gives zeros (not None) as eager does
    for x in (a, b):
        if wants_grad(x):
            put_grad(x, zeros_shaped(x))
    return y


# Eager has no derivative for floor_divide: its backward raises, and so does ours, when a grad reaches it.
register(RuleKind.GRAD, torch.floor_divide, eager_grad_rule(symbol_of(torch.floor_divide, "a grad rule")))

