"""Grad rules of the torch-level composites executors want to claim whole.

Each keeps the one torch call eager makes in the forward and writes the backward with torch ops, so a forward
trace reads like the program and an executor can replace the forward and backward of a composite together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fulmen.core.symbol import Tag
from fulmen.ops.registry import torch_symbol
from fulmen.ops.rules.grad import get_grad, put_grad
from fulmen.ops.rules.tables import RuleKind, register

native_dropout = torch_symbol(torch.native_dropout, tags=Tag.RANDOM)



# where eager's dropout runs the fused kernel, native_dropout (ATen's is_fused_kernel_acceptable)
FUSED_DROPOUT_DEVICES = frozenset({"cuda", "xpu", "lazy", "privateuseone"})


@register(RuleKind.GRAD, F.dropout)
def dropout_grad(x, p=0.5, training=True, inplace=False):
    if not training or p == 0.0:
        y = F.dropout(x, p, training)  # the identity
        put_grad(x, get_grad(y))
        return y
    y, mask = native_dropout(x, p, True)
    if x.device.type in FUSED_DROPOUT_DEVICES:  # native_dropout_backward: grad * mask * scale, rounded once
        put_grad(x, get_grad(y) * mask.to(x.dtype) * (1.0 / (1.0 - p)))
    else:  # eager multiplies by its noise, the mask divided by 1 - p in x's dtype (rounded there in half precision)
        put_grad(x, get_grad(y) * mask.to(x.dtype).div(1.0 - p))
    return y
