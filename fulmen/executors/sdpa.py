"""The `sdpa` executor: `scaled_dot_product_attention` by torch's fused kernels (cuDNN, flash or memory-efficient on
CUDA, flash on the CPU), with their own backward kernels.

Without it, the torch executor runs `F.scaled_dot_product_attention` (torch picks a kernel) and the backward
recomputes attention through torch autograd. With it, the forward calls the fused kernel once, saves its
output and log-sum-exp, and the backward calls the matching fused backward: no attention matrix is ever stored
or recomputed (unless an activation memory budget below 1 asks the backward to rerun the forward: each forward
declares its flops to the rematerialisation's cost model). The kernel is the one eager would pick for the same
inputs: torch's own selector (`torch._fused_sdp_choice`, which follows `torch.nn.attention.sdpa_kernel` and prefers
cuDNN on Hopper) is asked with stand-in tensors of the call's shapes, strides and dtypes. Calls torch would run with
its math kernel are declined (the torch executor runs them).

Attention masks: the kernels that take one (cuDNN, the CPU's flash) get it as eager hands it to them, an additive
bias in q's dtype. A boolean mask becomes `where(mask, 0, fill)`, with the fill eager's conversion uses for that
kernel (PyTorch converts in C++, with its own value per kernel and version: `sdpa_kernels.boolean_mask_fill` reads
it off a small call of eager's). The conversion is a call of its own in the trace, so a mask shared by every layer
is converted once per step where common-subexpression elimination applies (the backward), and it fuses with the
mask's construction. A float mask that requires grad (a learned position bias) is declined: those kernels give
it no gradient.

Dropout: the fused forward kernels draw their mask inside themselves from the default CUDA generator and return the
generator's seed and offset they used, which their backward takes to draw the same mask again, as eager's autograd
does. With `dropout_p > 0` the forward is a random operator of its own (`sdpa_*_forward_dropout`): it is never
recomputed, so its backward gets the seed and offset of the draw the loss saw, and it draws where eager's call does,
so a program seeded as eager's gets eager's masks. Grouped-query calls
(`enable_gqa=True`, fewer key/value heads than query heads) go to the kernels as they are: cuDNN's and flash's
kernels share the key/value heads themselves (fulmen.transforms.grouped_attention makes such calls from a model's
repeated heads).

cuDNN and eager's gradients: PyTorch caches one built cuDNN backward graph per thread, keyed by the shapes and
strides of q, k and v only (aten/src/ATen/native/cudnn/MHA.cpp, `mhagraphbackwardcache`), while the graph also
bakes in the strides of the output, its cotangent and the log-sum-exp. Two callers that pass the same q, k, v
layouts but another cotangent layout share a graph built for the first one's layout and the second gets wrong
gradients, silently. fulmen used to copy the cotangent into the output's layout (as PyTorch did before cuDNN
9.5.1), eager passes it as it comes, so whichever of the two ran second in a process got wrong LitGPT gradients.
So the backward passes everything as eager does: the cotangent as it comes (the aten op itself fixes a
non-unit innermost stride), and an output laid out as the forward would have laid it out for these q strides.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import SDPBackend

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import Symbol
from fulmen.executors.base import OperatorExecutor
from fulmen.executors.registry import register_executor
from fulmen.ops.kernels.sdpa_kernels import boolean_mask_fill, eager_choice
from fulmen.ops.rules.grad import get_grad, put_grads

aten = torch.ops.aten

# Every kernel takes (q, k, v, bias, ...): `bias` is the additive mask (None without one); only the kernels of
# `Kernels.takes_bias` are ever given one.


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: None, dropout_p: float, is_causal: bool,
                  scale: float | None):
    out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, is_causal, False, scale=scale)
    return out, lse, seed, offset


def flash_backward(g, q, k, v, bias: None, out, lse, seed, offset, dropout_p: float, is_causal: bool,
                   scale: float | None):
    return aten._scaled_dot_product_flash_attention_backward(
        g, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], dropout_p, is_causal, seed, offset, scale=scale)


def cudnn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, dropout_p: float,
                  is_causal: bool, scale: float | None):
    out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, bias, True, dropout_p, is_causal, False, scale=scale)
    return out, lse, seed, offset


def cudnn_inference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, dropout_p: float,
                    is_causal: bool, scale: float | None):
    # eager asks for no log-sum-exp when nothing needs a gradient (another cached cuDNN graph, less work)
    return aten._scaled_dot_product_cudnn_attention(q, k, v, bias, False, dropout_p, is_causal, False,
                                                    scale=scale)[0]


def forward_output_strides(q_shape: tuple[int, ...], q_strides: tuple[int, ...],
                           shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of the output cuDNN's forward allocates for a q of this layout (MHA.cpp's
    `alloc_with_matching_layout`): `empty_like(q)` when the shapes agree, else q's dimension order. Cached for
    static sizes; symbolic ones (a trace's meta run of the backward) are computed each time, as SymInts do not
    hash."""
    if all(type(n) is int for n in (*q_shape, *q_strides, *shape)):
        return _static_output_strides(q_shape, q_strides, shape)
    return _output_strides(q_shape, q_strides, shape)


def _output_strides(q_shape: tuple, q_strides: tuple, shape: tuple) -> tuple:
    if q_shape == shape:
        return torch.empty_like(torch.empty_strided(q_shape, q_strides, device="meta")).stride()
    order = sorted(range(len(q_shape)), key=lambda d: q_strides[d])  # stable, as its std::stable_sort
    strides, step = [0] * len(shape), 1
    for d in order:
        strides[d], step = step, step * shape[d]
    return tuple(strides)


_static_output_strides = functools.lru_cache(maxsize=256)(_output_strides)


def cudnn_backward(g, q, k, v, bias, out, lse, seed, offset, dropout_p: float, is_causal: bool, scale: float | None):
    # The cached backward graph assumes the output's layout is the one the forward gives for these q strides (see the
    # module docstring); a q rebuilt by rematerialisation with other strides gets its output re-laid accordingly.
    strides = forward_output_strides(tuple(q.shape), tuple(q.stride()), tuple(out.shape))
    if out.stride() != strides:
        out = torch.empty_strided(out.shape, strides, dtype=out.dtype, device=out.device).copy_(out)
    return aten._scaled_dot_product_cudnn_attention_backward(
        g, q, k, v, out, lse, seed, offset, bias, None, None, q.shape[-2], k.shape[-2], dropout_p, is_causal,
        scale=scale)


def efficient_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: None, dropout_p: float,
                      is_causal: bool, scale: float | None):
    return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, is_causal, scale=scale)


def efficient_backward(g, q, k, v, bias: None, out, lse, seed, offset, dropout_p: float, is_causal: bool,
                       scale: float | None):
    gq, gk, gv, _ = aten._scaled_dot_product_efficient_attention_backward(
        g, q, k, v, None, out, lse, seed, offset, dropout_p, [True, True, True, False], is_causal, scale=scale)
    return gq, gk, gv


def cpu_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                      dropout_p: float, is_causal: bool, scale: float | None):
    # no random state: eager picks this kernel only without dropout
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask=bias,
                                                            scale=scale)


def cpu_flash_backward(g, q, k, v, bias, out, lse, dropout_p: float, is_causal: bool, scale: float | None):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, dropout_p, is_causal,
                                                                     attn_mask=bias, scale=scale)


def query_gradient_accumulator(g, q, *args, **kwargs) -> int:
    """The backward kernels' workspace: the query gradient accumulated in fp32 (flash's `dq_accum`, cuDNN's buffer
    that `convert_dq_to_16bits` rounds), allocated and freed inside the call."""
    return 4 * q.numel()


def attention_flops(q, k, v, bias, dropout_p: float, is_causal: bool, scale: float | None) -> int:
    """A forward's two matmuls, q @ k^T and probabilities @ v (half of them skipped under a causal mask); what the
    backward pays again to rerun it."""
    flops = 4 * q.numel() // q.shape[-1] * k.shape[-2] * q.shape[-1]
    return flops // 2 if is_causal else flops


sdpa = register_executor(OperatorExecutor("sdpa"))


def _forward(name: str, fn, random: bool = False) -> Symbol:
    return sdpa.register_operator(name, fn=fn, random=random, flops=attention_flops)


sdpa_flash_forward = _forward("sdpa_flash_forward", flash_forward)
sdpa_flash_backward = sdpa.register_operator("sdpa_flash_backward", fn=flash_backward,
                                             scratch=query_gradient_accumulator)
sdpa_cudnn_forward = _forward("sdpa_cudnn_forward", cudnn_forward)
sdpa_cudnn_inference = sdpa.register_operator("sdpa_cudnn_inference", fn=cudnn_inference)
sdpa_cudnn_backward = sdpa.register_operator("sdpa_cudnn_backward", fn=cudnn_backward,
                                             scratch=query_gradient_accumulator)
sdpa_efficient_forward = _forward("sdpa_efficient_forward", efficient_forward)
sdpa_efficient_backward = sdpa.register_operator("sdpa_efficient_backward", fn=efficient_backward)
sdpa_flash_forward_dropout = _forward("sdpa_flash_forward_dropout", flash_forward, random=True)
sdpa_cudnn_forward_dropout = _forward("sdpa_cudnn_forward_dropout", cudnn_forward, random=True)
sdpa_cudnn_inference_dropout = sdpa.register_operator("sdpa_cudnn_inference_dropout", fn=cudnn_inference,
                                                      random=True)
sdpa_efficient_forward_dropout = _forward("sdpa_efficient_forward_dropout", efficient_forward, random=True)
sdpa_cpu_flash_forward = _forward("sdpa_cpu_flash_forward", cpu_flash_forward)
sdpa_cpu_flash_backward = sdpa.register_operator("sdpa_cpu_flash_backward", fn=cpu_flash_backward)


@dataclass(frozen=True, slots=True)
class Kernels:
    forward: Symbol  # (q, k, v, bias, dropout_p, is_causal, scale) -> (out, lse, *random state)
    backward: Symbol  # (g, q, k, v, bias, *the forward's outputs, dropout_p, is_causal, scale) -> (gq, gk, gv)
    dropout_forward: Symbol | None = None  # the forward as a random operator, for dropout_p > 0
    inference: Symbol | None = None  # (q, k, v, bias, dropout_p, is_causal, scale) -> out, when no grad is needed
    dropout_inference: Symbol | None = None
    takes_bias: bool = False  # whether the kernels take an additive mask

    def pick_forward(self, dropout_p: float) -> Symbol | None:
        return self.dropout_forward if dropout_p != 0.0 else self.forward


_KERNELS = {
    ("cuda", int(SDPBackend.CUDNN_ATTENTION)): Kernels(sdpa_cudnn_forward, sdpa_cudnn_backward,
                                                       sdpa_cudnn_forward_dropout, sdpa_cudnn_inference,
                                                       sdpa_cudnn_inference_dropout, takes_bias=True),
    ("cuda", int(SDPBackend.FLASH_ATTENTION)): Kernels(sdpa_flash_forward, sdpa_flash_backward,
                                                       sdpa_flash_forward_dropout),
    ("cuda", int(SDPBackend.EFFICIENT_ATTENTION)): Kernels(sdpa_efficient_forward, sdpa_efficient_backward,
                                                           sdpa_efficient_forward_dropout),
    ("cpu", int(SDPBackend.FLASH_ATTENTION)): Kernels(sdpa_cpu_flash_forward, sdpa_cpu_flash_backward,
                                                      takes_bias=True),
}


def _kernels(q: TensorProxy, k: TensorProxy, v: TensorProxy, attn_mask: TensorProxy | None, dropout_p: float,
             is_causal: bool, scale: float | None, enable_gqa: bool) -> tuple[Kernels, int] | None:
    """The fused kernels eager would run for these inputs and eager's choice, or None when it would use its math
    kernel (or pad the head dimension, which fulmen does not restate), or they take no mask and there is one."""
    device = q.device.type
    if device == "cuda" and q.shape[-1] % (4 if q.dtype == torch.float32 else 8) != 0:
        return None
    choice = eager_choice(q, k, v, is_causal, scale, enable_gqa, attn_mask, dropout_p)
    kernels = _KERNELS.get((device, choice))
    if kernels is None or kernels.pick_forward(dropout_p) is None:
        return None
    if attn_mask is not None and not kernels.takes_bias:
        return None
    return kernels, choice


def _mask_accepted(attn_mask: Any, q: TensorProxy) -> bool:
    """A boolean mask, or an additive one in q's dtype that needs no grad (the kernels give it none), of q's device."""
    if attn_mask is None:
        return True
    if type(attn_mask) is not TensorProxy or attn_mask.device != q.device or attn_mask.requires_grad:
        return False
    if attn_mask.dtype == torch.bool:
        return True
    return attn_mask.dtype == q.dtype


def _bias(attn_mask: TensorProxy | None, q: TensorProxy, choice: int) -> TensorProxy | None:
    """The additive mask eager hands the kernel for `attn_mask` (see the module docstring)."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    fill = boolean_mask_fill(q.device, q.dtype, choice)
    return torch.where(attn_mask, torch.zeros((), dtype=q.dtype, device=q.device), fill)


def checker(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
            scale: float | None = None, enable_gqa: bool = False) -> bool:
    tensors = (q, k, v)
    if not all(type(t) is TensorProxy and t.device.type in ("cuda", "cpu") and t.dim() == 4 for t in tensors):
        return False
    if len({t.device for t in tensors}) != 1 or not _mask_accepted(attn_mask, q):
        return False
    if len({t.dtype for t in tensors}) != 1 or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    # grouped-query attention: the key/value heads are shared by q.shape[1] // k.shape[1] query heads each
    grouped = enable_gqa and k.shape[1] == v.shape[1] and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0
    heads = q.shape[:2] == k.shape[:2] == v.shape[:2] or (grouped and q.shape[0] == k.shape[0] == v.shape[0])
    if not heads or q.shape[-1] != k.shape[-1] or q.shape[-1] != v.shape[-1] or k.shape[-2] != v.shape[-2]:
        return False
    if is_causal and q.shape[-2] != k.shape[-2]:
        return False
    found = _kernels(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if found is None:
        return False
    # a boolean mask needs the value eager's conversion fills it with (None: it converts otherwise, so declined)
    return attn_mask is None or attn_mask.dtype != torch.bool or boolean_mask_fill(q.device, q.dtype,
                                                                                    found[1]) is not None


def execution_transform(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    kernels, choice = _kernels(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    bias = _bias(attn_mask, q, choice)
    inference = kernels.dropout_inference if dropout_p != 0.0 else kernels.inference
    if inference is not None:
        return inference(q, k, v, bias, dropout_p, is_causal, scale)
    return kernels.pick_forward(dropout_p)(q, k, v, bias, dropout_p, is_causal, scale)[0]


def grad_transform(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    kernels, choice = _kernels(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    bias = _bias(attn_mask, q, choice)
    saved = kernels.pick_forward(dropout_p)(q, k, v, bias, dropout_p, is_causal, scale)
    out = saved[0]
    grads = kernels.backward(get_grad(out), q, k, v, bias, *saved, dropout_p, is_causal, scale)
    put_grads((q, k, v), grads)
    return out


sdpa.register_implementation(torch.nn.functional.scaled_dot_product_attention, checker=checker,
                             execution_transform=execution_transform, grad_transform=grad_transform)
