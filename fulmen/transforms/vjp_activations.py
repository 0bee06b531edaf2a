"""Grad rules of the activations that may update their input in place (fulmen/ops/activations.py): eager's
backward formula of each (derivatives.yaml), computed by eager's backward kernel, so the grads are eager's bits.

An update made with `inplace=True` records the op out of place; where eager differentiates such an update from its
result (ELU, CELU, SELU, leaky ReLU), it records an `*_update` symbol, whose rule here reads the result as eager's.
"""

from __future__ import annotations

import struct

import torch.nn.functional as F

from fulmen.core.errors import TraceError
from fulmen.ops import activations as act
from fulmen.ops.rules.grad import differentiated_call, get_grad, put_grad
from fulmen.ops.rules.tables import RuleKind, register


def _celu_input_scale(alpha: float) -> float:
    """The input scale of eager's celu backward, `1.0 / alpha.toFloat()`: alpha rounded to float32 first (the
    forward divides by the float64 alpha)."""
    return 1.0 / struct.unpack("f", struct.pack("f", alpha))[0]


@register(RuleKind.GRAD, F.hardswish)
def hardswish_grad(x, inplace=False):
    y = F.hardswish(x)
    put_grad(x, act.hardswish_backward(get_grad(y), x))
    return y


@register(RuleKind.GRAD, F.hardsigmoid)
def hardsigmoid_grad(x, inplace=False):
    y = F.hardsigmoid(x)
    put_grad(x, act.hardsigmoid_backward(get_grad(y), x))
    return y


@register(RuleKind.GRAD, F.hardtanh)
def hardtanh_grad(x, min_val=-1.0, max_val=1.0, inplace=False):
    y = F.hardtanh(x, min_val, max_val)
    put_grad(x, act.hardtanh_backward(get_grad(y), x, min_val, max_val))
    return y


@register(RuleKind.GRAD, F.relu6)
def relu6_grad(x, inplace=False):
    y = F.relu6(x)  # aten's relu6 is hardtanh(x, 0, 6)
    put_grad(x, act.hardtanh_backward(get_grad(y), x, 0.0, 6.0))
    return y


@register(RuleKind.GRAD, F.leaky_relu)
def leaky_relu_grad(x, negative_slope=0.01, inplace=False):
    y = F.leaky_relu(x, negative_slope)
    put_grad(x, act.leaky_relu_backward(get_grad(y), x, negative_slope, False))
    return y


@register(RuleKind.GRAD, act.leaky_relu_update)
def leaky_relu_update_grad(x, negative_slope=0.01):
    if negative_slope < 0:  # eager's leaky_relu_backward raises this when it runs
        raise TraceError(
            f"in-place leaky_relu with a negative slope ({negative_slope}) cannot be differentiated (as in eager: "
            "'In-place leakyReLu backward calculation is triggered with a negative slope which is not supported'): "
            "its input cannot be told from its result; call the out-of-place version (inplace=False)",
            differentiated_call().source)
    y = act.leaky_relu_update(x, negative_slope)
    put_grad(x, act.leaky_relu_backward(get_grad(y), y, negative_slope, True))
    return y


@register(RuleKind.GRAD, F.elu)
def elu_grad(x, alpha=1.0, inplace=False):
    y = F.elu(x, alpha)
    put_grad(x, act.elu_backward(get_grad(y), alpha, 1.0, 1.0, False, x))
    return y


@register(RuleKind.GRAD, act.elu_update)
def elu_update_grad(x, alpha=1.0):
    y = act.elu_update(x, alpha)
    put_grad(x, act.elu_backward(get_grad(y), alpha, 1.0, 1.0, True, y))
    return y


@register(RuleKind.GRAD, F.celu)
def celu_grad(x, alpha=1.0, inplace=False):
    y = F.celu(x, alpha)
    put_grad(x, act.elu_backward(get_grad(y), alpha, 1.0, _celu_input_scale(alpha), False, x))
    return y


@register(RuleKind.GRAD, act.celu_update)
def celu_update_grad(x, alpha=1.0):
    y = act.celu_update(x, alpha)
    put_grad(x, act.elu_backward(get_grad(y), alpha, 1.0, _celu_input_scale(alpha), True, y))
    return y


@register(RuleKind.GRAD, F.selu)
def selu_grad(x, inplace=False):
    y = F.selu(x)  # aten's selu is elu(x, SELU_ALPHA, SELU_SCALE)
    put_grad(x, act.elu_backward(get_grad(y), act.SELU_ALPHA, act.SELU_SCALE, 1.0, False, x))
    return y


@register(RuleKind.GRAD, act.selu_update)
def selu_update_grad(x):
    y = act.selu_update(x)
    put_grad(x, act.elu_backward(get_grad(y), act.SELU_ALPHA, act.SELU_SCALE, 1.0, True, y))
    return y
