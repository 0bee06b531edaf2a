"""Liger-Kernel's Triton kernels behind functional signatures, as the "liger" executor's operators run them.

Liger's autograd functions overwrite their inputs (the logits with their gradient, RoPE's q and k, SwiGLU's saved
inputs with their gradients, RMSNorm's output gradient), which is sound inside one autograd node but not in a trace,
where a tensor may have other readers. These wrappers give each kernel a buffer of its own (a copy where Liger would
write into a tensor it was handed) and compute gradients in separate calls, so every operator is a pure function.
Importing this module imports liger_kernel and Triton: the executor imports it at the first kernel call.
"""

from __future__ import annotations

import torch
from liger_kernel.ops import cross_entropy as liger_ce
from liger_kernel.ops import fused_linear_cross_entropy as liger_flce
from liger_kernel.ops import rms_norm as liger_rms
from liger_kernel.ops import rope as liger_rope
from liger_kernel.ops import swiglu as liger_swiglu
from liger_kernel.ops.utils import calculate_settings

HALF = (torch.float16, torch.bfloat16)


def interpreted() -> bool:
    """Whether Triton's interpreter runs Liger's kernels (TRITON_INTERPRET=1 when they were imported)."""
    return type(liger_rope._triton_rope).__name__ == "InterpretedFunction"


def _nan_if_all_ignored(loss: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    # Liger divides by the number of rows not ignored only where there are some; torch's mean over none is NaN.
    if reduction != "mean":
        return loss
    return torch.where((target != ignore_index).any(), loss, torch.nan)


def fused_linear_cross_entropy(h, weight, bias, target, *, ignore_index: int, reduction: str, label_smoothing: float,
                               dtype: torch.dtype, wants: tuple[bool, bool, bool]) -> tuple[torch.Tensor, ...]:
    """The loss of `cross_entropy(linear(h, weight, bias), target)` in `dtype` and the gradients for the `wants`."""
    h2 = h.reshape(-1, h.shape[-1])
    compute = any(wants)
    loss, _, _, _, grad_h, grad_w, grad_b = liger_flce.fused_linear_cross_entropy_forward(
        h2, weight, target, bias=bias, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction,
        accum_dtype=torch.float32 if weight.dtype in HALF else None, compute_gradients=compute,
        weight_requires_grad=wants[1])
    loss = _nan_if_all_ignored(loss, target, ignore_index, reduction).to(dtype)
    grads = (grad_h.view(h.shape) if compute else None, grad_w, grad_b)
    return (loss, *(grad for grad, wanted in zip(grads, wants) if wanted))


def cross_entropy(logits, target, *, ignore_index: int, reduction: str, label_smoothing: float,
                  want_grad: bool) -> tuple[torch.Tensor, ...]:
    """The loss and, when `want_grad`, its gradient for `logits` (written by the kernel into a copy of them)."""
    work = logits.detach().clone().requires_grad_(True) if want_grad else logits.detach()
    loss, _, _, _, grad = liger_ce.cross_entropy_forward(work, target, None, ignore_index, 0.0, label_smoothing,
                                                         reduction, None, False)
    loss = _nan_if_all_ignored(loss, target, ignore_index, reduction).to(logits.dtype)
    return (loss, grad.detach()) if want_grad else (loss,)


def cross_entropy_backward(g: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The forward's logits gradient scaled by the loss's cotangent; scales `grad`, which only this call reads,
    in place (as Liger does)."""
    return liger_ce.cross_entropy_backward(grad, g)


def _heads_last(x: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous (B, T, heads, dim) copy of `x` (B, heads, T, dim), returned as a (B, heads, T, dim) view:
    Liger's RoPE rotates that layout in place."""
    return x.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2)


def _rope(x, cos, sin, backward: bool) -> torch.Tensor:
    # Liger rotates q and k in one launch; a one-head k stands in for the k LitGPT rotates in a call of its own.
    work = _heads_last(x)
    spare = work.new_zeros((x.shape[0], 1, x.shape[2], x.shape[3]))
    if backward:
        return liger_rope.rope_backward(work, spare, cos, sin)[0]
    return liger_rope.rope_forward(work, spare, cos, sin)[0]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """LitGPT's `apply_rope` for x (B, heads, T, dim) and cos, sin (1 or B, T, dim) whose two halves repeat.

    Liger's kernel reads the first half of cos and sin only, which is all of LitGPT's rope cache (`build_rope_cache`
    repeats the angles). Other values would give other results, so they stop the program: on CUDA without a
    synchronisation (a device-side assertion), on CPU with a RuntimeError."""
    half = cos.shape[-1] // 2
    repeats = torch.logical_and((cos[..., :half] == cos[..., half:]).all(), (sin[..., :half] == sin[..., half:]).all())
    torch._assert_async(repeats, "fulmen.liger: LitGPT's apply_rope got cos/sin whose two halves differ; Liger's "
                                 "RoPE kernel assumes they repeat (as LitGPT's rope cache does): leave out liger")
    return _rope(x, cos, sin, backward=False)


def apply_rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _rope(grad, cos, sin, backward=True)


def swiglu(e: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return liger_swiglu.swiglu_forward(e.contiguous(), g.contiguous())[2]


def swiglu_backward(grad: torch.Tensor, e: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Liger writes the gradients into its copies of e and g
    own = [t.clone(memory_format=torch.contiguous_format) for t in (e, g)]
    return liger_swiglu.swiglu_backward(*own, grad.contiguous())


# LitGPT's RMSNorm computes in float32 and rounds once at the end: Liger's "gemma" casting
_GEMMA = liger_rms._str_to_casting_mode["gemma"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """LitGPT's RMSNorm over the last dim: the output and the float32 reciprocal RMS of each row."""
    y, _, rstd, _, _, _ = liger_rms.rms_norm_forward(x.contiguous(), weight, eps, offset, _GEMMA, None)
    return y, rstd


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float,
                      want_weight: bool) -> tuple[torch.Tensor, ...]:
    block, warps = calculate_settings(x.shape[-1])
    dx, dw = liger_rms.rms_norm_backward(grad.contiguous(), x.contiguous().view(-1, x.shape[-1]), weight, rstd,
                                         offset, _GEMMA, block, warps, False, None, needs_dw=want_weight)
    return (dx.view(x.shape), dw) if want_weight else (dx.view(x.shape),)
