"""SwiGLU, silu(e) * g (LitGPT's LLaMAMLP between fc_1/fc_2 and proj): Triton kernels for the product and its
gradient, elementwise over the flattened tensors, computed in fp32 and stored in the inputs' dtype.

With s = sigmoid(e): d/dg = silu(e) = e * s and d/de = g * s * (1 + e * (1 - s)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _forward_kernel(e, g, h, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    e_value = tl.load(e + offsets, mask=mask, other=0.0).to(tl.float32)
    g_value = tl.load(g + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(h + offsets, (e_value * tl.sigmoid(e_value) * g_value).to(h.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(dh, e, g, de, dg, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    dh_value = tl.load(dh + offsets, mask=mask, other=0.0).to(tl.float32)
    e_value = tl.load(e + offsets, mask=mask, other=0.0).to(tl.float32)
    g_value = tl.load(g + offsets, mask=mask, other=0.0).to(tl.float32)
    sigmoid = tl.sigmoid(e_value)
    tl.store(dg + offsets, (dh_value * e_value * sigmoid).to(dg.dtype.element_ty), mask=mask)
    de_value = dh_value * g_value * sigmoid * (1.0 + e_value * (1.0 - sigmoid))
    tl.store(de + offsets, de_value.to(de.dtype.element_ty), mask=mask)


def forward(e: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """silu(e) * g for `e` and `g` of one shape and dtype."""
    e, g = e.contiguous(), g.contiguous()
    h = torch.empty_like(e)
    n = e.numel()
    if n:
        _forward_kernel[(triton.cdiv(n, BLOCK),)](e, g, h, n, BLOCK=BLOCK)
    return h


def backward(dh: torch.Tensor, e: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d/de, d/dg) of silu(e) * g given its gradient `dh`, in the dtypes of `e` and `g`."""
    dh, e, g = dh.contiguous(), e.contiguous(), g.contiguous()
    de, dg = torch.empty_like(e), torch.empty_like(g)
    n = e.numel()
    if n:
        _backward_kernel[(triton.cdiv(n, BLOCK),)](dh, e, g, de, dg, n, BLOCK=BLOCK)
    return de, dg
