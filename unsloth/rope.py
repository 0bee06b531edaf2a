"""Rotary position embedding as LitGPT's `apply_rope(x, cos, sin)`: Triton kernels for it and its gradient.

With h = n // 2 and x = [x1, x2] split at h (the same for cos and sin):
    out1 = x1 * cos1 - x2 * sin1        out2 = x2 * cos2 + x1 * sin2
and, being linear in x, its gradient given g = [g1, g2]:
    dx1 = g1 * cos1 + g2 * sin2         dx2 = g2 * cos2 - g1 * sin1
`x` is (B, H, T, n) with any strides (LitGPT passes a transposed, sliced view of q or k, whatever the number of
heads: query heads and GQA's fewer key heads are separate calls) or (B, T, n); cos and sin are (1 or B, T, n).
Computed in fp32; the result, always contiguous, has the dtype of `x`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(out, x, cos, sin, n_heads, seq_len, half,
                 x_sb, x_sh, x_st, x_sd, c_sb, c_st, c_sd, s_sb, s_st, s_sd,
                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr):
    batch_head = tl.program_id(0).to(tl.int64)
    batch, head = batch_head // n_heads, batch_head % n_heads
    t = (tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None].to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :].to(tl.int64)
    mask = (t < seq_len) & (d < half)
    x_row = x + batch * x_sb + head * x_sh + t * x_st
    x1 = tl.load(x_row + d * x_sd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + (d + half) * x_sd, mask=mask, other=0.0).to(tl.float32)
    cos_row = cos + batch * c_sb + t * c_st
    sin_row = sin + batch * s_sb + t * s_st
    cos1 = tl.load(cos_row + d * c_sd, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + (d + half) * c_sd, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row + d * s_sd, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + (d + half) * s_sd, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        out1 = x1 * cos1 + x2 * sin2
        out2 = x2 * cos2 - x1 * sin1
    else:
        out1 = x1 * cos1 - x2 * sin1
        out2 = x2 * cos2 + x1 * sin2
    out_row = out + (batch_head * seq_len + t) * (2 * half)
    tl.store(out_row + d, out1.to(out.dtype.element_ty), mask=mask)
    tl.store(out_row + d + half, out2.to(out.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    four_d = x if x.dim() == 4 else x.unsqueeze(1)  # (B, T, n) as one head
    batch, n_heads, seq_len, n = four_d.shape
    out = torch.empty((batch, n_heads, seq_len, n), dtype=x.dtype, device=x.device)
    if out.numel():
        half = n // 2
        block_d = triton.next_power_of_2(half)
        block_t = max(1, min(triton.next_power_of_2(seq_len), 2048 // block_d))
        # a cos/sin batch of 1 serves every sequence
        batch_stride = (lambda t: 0 if t.shape[0] == 1 else t.stride(0))
        _rope_kernel[(batch * n_heads, triton.cdiv(seq_len, block_t))](
            out, four_d, cos, sin, n_heads, seq_len, half, *four_d.stride(),
            batch_stride(cos), cos.stride(1), cos.stride(2), batch_stride(sin), sin.stride(1), sin.stride(2),
            BLOCK_T=block_t, BLOCK_D=block_d, BACKWARD=backward,
        )
    return out if x.dim() == 4 else out.squeeze(1)


def forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _launch(x, cos, sin, backward=False)


def backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """d apply_rope(x, cos, sin) / dx given the output's gradient (which has the shape and dtype of x)."""
    return _launch(grad, cos, sin, backward=True)
