"""Activations that may update their input in place (`nn.ReLU6(inplace=True)`, `F.elu_`, `torch.relu_`), the eager
backward kernels their grad rules call, and their rules: grads by eager's backward formula of each (derivatives.yaml),
computed by eager's backward kernel so the grads are eager's bits; JVPs by their derivative; batched elementwise.

A call with `inplace=True`, and each in-place builtin, is an update of its input: acquisition records the op out of
place and writes its value back (`registry.InplaceFlag`), as it does `x.relu_()`, so no trace updates a value in
place. Eager differentiates most of these updates as the op itself (autograd keeps a copy of the input it
overwrites); ELU, CELU, SELU and leaky ReLU in place are differentiated from their result instead (`elu_backward`
with is_result, which rounds otherwise), so their updates record a symbol of their own (`impls.elu_update`, ...)
whose grad rule reads the result.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fulmen.core.errors import TraceError
from fulmen.ops import elementwise, factories, nn  # noqa: F401  (F.relu, F.dropout, F.silu: registered there)
from fulmen.ops.kernels import impls
from fulmen.ops.registry import TorchBinding, bind, impl_symbol, lookup, takes_inplace_flag, torch_symbol
from fulmen.ops.rules.batch import elementwise as batched_elementwise
from fulmen.ops.rules.grad import differentiated_by_eager, differentiated_call, get_grad, put_grad
from fulmen.ops.rules.grad_formulas import kernel_grad
from fulmen.ops.rules.jvp import by_derivative
from fulmen.ops.rules.tables import RuleKind, register

# aten's SELU constants (ATen/native/Activation.cpp), which eager's selu passes to elu
SELU_ALPHA, SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946

for _fn in (F.elu, F.celu, F.selu, F.leaky_relu, F.hardtanh, F.relu6, F.hardswish, F.hardsigmoid, F.mish,
            F.threshold):
    torch_symbol(_fn)
differentiated_by_eager(F.mish, F.threshold)  # the others have grad rules (below)

# the updates whose grads read their result (derivatives.yaml: elu_, celu_, leaky_relu_; selu_ is elu_ in aten)
elu_update = impl_symbol(impls.elu_update)
celu_update = impl_symbol(impls.celu_update)
selu_update = impl_symbol(impls.selu_update)
leaky_relu_update = impl_symbol(impls.leaky_relu_update)
_UPDATES = {F.elu: elu_update, F.celu: celu_update, F.selu: selu_update, F.leaky_relu: leaky_relu_update}

for _fn in (F.relu, F.relu6, F.elu, F.celu, F.selu, F.leaky_relu, F.hardtanh, F.hardswish, F.hardsigmoid, F.silu,
            F.mish, F.threshold, F.dropout):
    takes_inplace_flag(_fn, _UPDATES.get(_fn))

# The in-place builtins, each bound to what its out-of-place form records (F.relu_ is torch.relu_, F.rrelu_
# torch.rrelu_, F.threshold_ torch.threshold_; the dropouts' are what F.alpha_dropout / F.dropout1d call in place).
for _updating, _fns in (
    (lookup(torch.relu).symbol, (torch.relu_,)),
    (elu_update, (F.elu_,)),
    (celu_update, (torch.celu_,)),
    (selu_update, (torch.selu_,)),
    (leaky_relu_update, (F.leaky_relu_,)),
    (lookup(F.hardtanh).symbol, (F.hardtanh_,)),
    (lookup(F.threshold).symbol, (torch.threshold_,)),
    (lookup(torch.rrelu).symbol, (torch.rrelu_,)),
    (lookup(torch.dropout).symbol, (torch.dropout_,)),
    (lookup(torch.alpha_dropout).symbol, (torch.alpha_dropout_,)),
    (lookup(torch.feature_dropout).symbol, (torch.feature_dropout_,)),
    (lookup(torch.feature_alpha_dropout).symbol, (torch.feature_alpha_dropout_,)),
):
    for _fn in _fns:
        bind(_fn, TorchBinding(_updating, inplace=True))

# eager's backward kernels (the torch executor runs them: eager's bits on every device and dtype)
hardswish_backward = impl_symbol(impls.hardswish_backward)
hardsigmoid_backward = impl_symbol(impls.hardsigmoid_backward)
hardtanh_backward = impl_symbol(impls.hardtanh_backward)
leaky_relu_backward = impl_symbol(impls.leaky_relu_backward)
elu_backward = impl_symbol(impls.elu_backward)
# differentiated again (a grad of a grad) by eager's backward of the kernel
differentiated_by_eager(hardswish_backward, hardsigmoid_backward, hardtanh_backward, leaky_relu_backward,
                        elu_backward)


# --- grads: eager's backward kernel of each (derivatives.yaml) ------------------------------------------------------
def _celu_input_scale(alpha: float) -> float:
    """The input scale of eager's celu backward, `1.0 / alpha.toFloat()`: alpha rounded to float32 first (the
    forward divides by the float64 alpha)."""
    return 1.0 / struct.unpack("f", struct.pack("f", alpha))[0]


# op -> its input's grad from (the cotangent, the input, the call's options)
_KERNEL_GRADS: dict[Callable[..., Any], Callable[..., Any]] = {
    F.hardswish: lambda g, x, inplace=False: hardswish_backward(g, x),
    F.hardsigmoid: lambda g, x, inplace=False: hardsigmoid_backward(g, x),
    F.hardtanh: lambda g, x, min_val=-1.0, max_val=1.0, inplace=False: hardtanh_backward(g, x, min_val, max_val),
    F.relu6: lambda g, x, inplace=False: hardtanh_backward(g, x, 0.0, 6.0),  # aten's relu6 is hardtanh(x, 0, 6)
    F.leaky_relu: lambda g, x, negative_slope=0.01, inplace=False: leaky_relu_backward(g, x, negative_slope, False),
    F.elu: lambda g, x, alpha=1.0, inplace=False: elu_backward(g, alpha, 1.0, 1.0, False, x),
    F.celu: lambda g, x, alpha=1.0, inplace=False: elu_backward(g, alpha, 1.0, _celu_input_scale(alpha), False, x),
    # aten's selu is elu(x, SELU_ALPHA, SELU_SCALE)
    F.selu: lambda g, x, inplace=False: elu_backward(g, SELU_ALPHA, SELU_SCALE, 1.0, False, x),
}
# update -> (its forward, its input's grad from (the cotangent, its result, the call's options)): eager's is_result
# kernels
_RESULT_KERNEL_GRADS: dict[Any, tuple[Callable[..., Any], Callable[..., Any]]] = {
    elu_update: (lambda x, alpha=1.0: elu_update(x, alpha),
                 lambda g, y, alpha=1.0: elu_backward(g, alpha, 1.0, 1.0, True, y)),
    celu_update: (lambda x, alpha=1.0: celu_update(x, alpha),
                  lambda g, y, alpha=1.0: elu_backward(g, alpha, 1.0, _celu_input_scale(alpha), True, y)),
    selu_update: (selu_update, lambda g, y: elu_backward(g, SELU_ALPHA, SELU_SCALE, 1.0, True, y)),
}
for _fn, _backward in _KERNEL_GRADS.items():
    register(RuleKind.GRAD, _fn, kernel_grad(_fn, _backward))
for _update, (_forward, _backward) in _RESULT_KERNEL_GRADS.items():
    register(RuleKind.GRAD, _update, kernel_grad(_forward, _backward, of_result=True))


@register(RuleKind.GRAD, leaky_relu_update)
def leaky_relu_update_grad(x, negative_slope=0.01):
    if negative_slope < 0:  # eager's leaky_relu_backward raises this when it runs
        raise TraceError(
            f"in-place leaky_relu with a negative slope ({negative_slope}) cannot be differentiated (as in eager: "
            "'In-place leakyReLu backward calculation is triggered with a negative slope which is not supported'): "
            "its input cannot be told from its result; call the out-of-place version (inplace=False)",
            differentiated_call().source)
    y = leaky_relu_update(x, negative_slope)
    put_grad(x, leaky_relu_backward(get_grad(y), y, negative_slope, True))
    return y


# --- JVPs: fn -> d(output)/d(input), from (x, *the call's other arguments) -----------------------------------------
def _mish_derivative(x: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(F.softplus(x))
    return t + x * torch.sigmoid(x) * (1 - t * t)


DERIVATIVES: dict[Callable[..., Any], Callable[..., Any]] = {
    F.leaky_relu: lambda x, negative_slope=0.01, inplace=False: torch.where(x > 0, 1.0, negative_slope),
    F.hardtanh: lambda x, min_val=-1.0, max_val=1.0, inplace=False: ((x > min_val) & (x < max_val)).to(x.dtype),
    F.relu6: lambda x, inplace=False: ((x > 0) & (x < 6)).to(x.dtype),
    F.threshold: lambda x, threshold, value, inplace=False: (x > threshold).to(x.dtype),
    F.elu: lambda x, alpha=1.0, inplace=False: torch.where(x > 0, 1.0, alpha * torch.exp(x)),
    F.celu: lambda x, alpha=1.0, inplace=False: torch.where(x > 0, 1.0, torch.exp(x / alpha)),
    F.selu: lambda x, inplace=False: SELU_SCALE * torch.where(x > 0, 1.0, SELU_ALPHA * torch.exp(x)),
    F.hardswish: lambda x, inplace=False: torch.where(x < -3, 0.0, torch.where(x <= 3, x / 3 + 0.5, 1.0)),
    F.hardsigmoid: lambda x, inplace=False: ((x > -3) & (x < 3)).to(x.dtype) / 6,
    F.mish: lambda x, inplace=False: _mish_derivative(x),
}
for _fn, _derivative in DERIVATIVES.items():
    register(RuleKind.JVP, _fn, by_derivative(lookup(_fn).symbol, _derivative))
    register(RuleKind.BATCH, _fn, batched_elementwise(lookup(_fn).symbol))
