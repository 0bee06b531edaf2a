"""Activations that may update their input in place (`nn.ReLU6(inplace=True)`, `F.elu_`, `torch.relu_`), and the
eager backward kernels their grad rules call (transforms/vjp_activations.py).

A call with `inplace=True`, and each in-place builtin, is an update of its input: acquisition records the op out of
place and writes its value back (`registry.InplaceFlag`), as it does `x.relu_()`, so no trace updates a value in
place. Eager differentiates most of these updates as the op itself (autograd keeps a copy of the input it
overwrites); ELU, CELU, SELU and leaky ReLU in place are differentiated from their result instead (`elu_backward`
with is_result, which rounds otherwise), so their updates record a symbol of their own (`impls.elu_update`, ...)
whose grad rule reads the result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fulmen.ops import elementwise, factories, impls, nn  # noqa: F401  (F.relu, F.dropout, F.silu: registered there)
from fulmen.ops.registry import TorchBinding, bind, impl_symbol, lookup, takes_inplace_flag, torch_symbol
from fulmen.ops.rules.grad import differentiated_by_eager

# aten's SELU constants (ATen/native/Activation.cpp), which eager's selu passes to elu
SELU_ALPHA, SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946

for _fn in (F.elu, F.celu, F.selu, F.leaky_relu, F.hardtanh, F.relu6, F.hardswish, F.hardsigmoid, F.mish,
            F.threshold):
    torch_symbol(_fn)
differentiated_by_eager(F.mish, F.threshold)  # the others have grad rules (transforms/vjp_activations.py)

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
