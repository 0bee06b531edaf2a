"""Grad rules of the torch-level composites executors want to claim whole.

Each keeps the one torch call eager makes in the forward and writes the backward with torch ops, so a forward
trace reads like the program and an executor can replace the forward and backward of a composite together.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from fulmen.core.errors import TraceError
from fulmen.core.symbol import Tag, iter_proxies
from fulmen.ops import backward_kernels, impls
from fulmen.ops.nn import batch_norm_update, embedding_backward, native_layer_norm
from fulmen.ops.registry import SYMBOLS, impl_symbol, torch_symbol
from fulmen.ops.rules.grad import (
    differentiated_by_eager,
    differentiated_call,
    get_grad,
    put_grad,
    torch_vjp,
    wants_grad,
)
from fulmen.ops.rules.grad_formulas import matmul_rule
from fulmen.ops.rules.tables import RuleKind, register
from fulmen.ops.sdpa_kernels import eager_choice
from fulmen.ops.utils import canonical_dim, compute_dtype, is_tensor

native_dropout = torch_symbol(torch.native_dropout, tags=Tag.RANDOM)
attention_dropout = impl_symbol(impls.attention_dropout, tags=Tag.RANDOM)
attention_dropped = impl_symbol(impls.attention_dropped)
differentiated_by_eager(attention_dropped)  # by eager's backward of the attention it runs (sdpa's rule)



@register(RuleKind.GRAD, F.linear)
def linear_grad(x, weight, bias=None):
    if weight.dim() != 2:
        return NotImplemented
    y = F.linear(x, weight, bias)
    g = get_grad(y)
    if wants_grad(x):
        put_grad(x, torch.matmul(g, weight))
    if wants_grad(weight) or wants_grad(bias):
        g2 = g.reshape(-1, g.shape[-1])
        if wants_grad(weight):
            put_grad(weight, torch.matmul(g2.t(), x.reshape(-1, x.shape[-1])))
        if wants_grad(bias):
            put_grad(bias, g2.sum(0))
    return y


register(RuleKind.GRAD, torch.matmul, matmul_rule(torch.matmul))


def _softmax_rule(fn, backward):
    def rule(x, dim, dtype=None):
        y = fn(x, dim, dtype=dtype)
        put_grad(x, backward(get_grad(y), y, canonical_dim(dim, y.dim())).to(x.dtype))
        return y

    return rule


register(RuleKind.GRAD, torch.softmax, _softmax_rule(torch.softmax, backward_kernels.softmax_backward))
register(RuleKind.GRAD, torch.log_softmax, _softmax_rule(torch.log_softmax, backward_kernels.log_softmax_backward))


@register(RuleKind.GRAD, F.cross_entropy)
def cross_entropy_grad(logits, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                       reduction="mean", label_smoothing=0.0):
    """Class-index cross-entropy as eager computes it, log_softmax then nll_loss, with eager's kernels (their
    roundings differ by device: the CPU kernel rounds a half-precision row's log-sum-exp, the CUDA kernel does not),
    so the loss and grads are eager's bit for bit. The nll_loss grad is written as a comparison with an iota, which a
    fusion executor fuses with the log_softmax backward into one kernel, never materialising eager's
    vocabulary-sized cotangent of the log-probabilities."""
    if (logits.dim() != 2 or target.dtype.is_floating_point or weight is not None or size_average is not None
            or reduce is not None or label_smoothing != 0.0):
        return NotImplemented
    logp = torch.log_softmax(logits, 1)
    loss = F.nll_loss(logp, target, ignore_index=ignore_index, reduction=reduction)
    g = get_grad(loss)
    valid = target != ignore_index
    if reduction == "mean":  # eager divides by the count of valid targets in the logits' dtype
        g = g / valid.sum().to(logits.dtype)
    is_target = torch.arange(logits.shape[1], device=logits.device) == torch.where(valid, target, 0).unsqueeze(1)
    grad_logp = torch.where(is_target, torch.where(valid, -g, 0.0).unsqueeze(1), 0.0)
    put_grad(logits, backward_kernels.log_softmax_backward(grad_logp.to(logits.dtype), logp, 1))
    return loss


@register(RuleKind.GRAD, F.layer_norm)
def layer_norm_grad(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    return native_layer_norm_grad(x, normalized_shape, weight, bias, eps)[0]


@register(RuleKind.GRAD, torch.native_layer_norm)
def native_layer_norm_grad(x, normalized_shape, weight, bias, eps):
    """Grads through the normalised output only: eager gives the mean and rstd outputs no grad."""
    y, mean, rstd = native_layer_norm(x, normalized_shape, weight, bias, eps)
    mask = [wants_grad(x), wants_grad(weight), wants_grad(bias)]
    grads = backward_kernels.layer_norm_backward(get_grad(y), x, list(normalized_shape), mean, rstd, weight,
                                                 None if bias is None else bias.dtype, mask)
    for t, grad in zip((x, weight, bias), grads):
        if grad is not None:
            put_grad(t, grad)
    return y, mean, rstd


def _eager_fuses_rms_norm(x, normalized_shape, weight) -> bool:
    """Whether eager runs rms_norm for tensors like these as one fused kernel with a backward of its own (on GPUs)
    rather than as a composite of ops: asked of torch with stand-ins of the row's shape, outside the acquisition."""
    with torch._C.DisableTorchFunction(), torch.enable_grad():
        row = torch.empty(tuple(normalized_shape), dtype=x.dtype, device=x.device, requires_grad=True)
        w = None if weight is None else torch.empty(tuple(normalized_shape), dtype=weight.dtype, device=weight.device)
        return "Fused" in F.rms_norm(row, tuple(normalized_shape), w).grad_fn.name()


@register(RuleKind.GRAD, F.rms_norm)
def rms_norm_grad(x, normalized_shape, weight=None, eps=None):
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    compute = compute_dtype(x.dtype)
    eps = torch.finfo(compute).eps if eps is None else eps
    y = F.rms_norm(x, normalized_shape, weight, eps)
    if _eager_fuses_rms_norm(x, normalized_shape, weight):  # its backward kernel, through torch autograd
        tensors = [t for t in (x, weight) if is_tensor(t)]
        wrt = tuple(i for i, t in enumerate(tensors) if wants_grad(t))
        args = (x, tuple(normalized_shape), weight, eps)
        for i, grad in zip(wrt, torch_vjp(SYMBOLS["torch.nn.functional.rms_norm"], args, {}, wrt, (get_grad(y),))):
            put_grad(tensors[i], grad)
        return y
    # Eager's composite (x.to(opmath).pow(2).mean(keepdim) + eps, rsqrt, two muls, back to x's dtype) is
    # differentiated op by op; its grads are restated here in that order, so they round as eager's do.
    xc = x.to(compute) if compute != x.dtype else x
    r = torch.rsqrt(xc.pow(2).mean(dims, keepdim=True) + eps)
    g = get_grad(y)
    g = g.to(compute) if compute != x.dtype else g
    if wants_grad(weight):
        gw = g * (xc * r)
        batch = tuple(range(x.dim() - len(dims)))
        put_grad(weight, (gw.sum(batch) if batch else gw).to(weight.dtype))
    gn = g * weight if weight is not None else g
    if wants_grad(x):
        gr = (gn * xc).sum(dims, keepdim=True)
        gp = ((gr * -0.5) * r.pow(3)).expand(xc.shape) / math.prod(xc.shape[d] for d in dims)
        gx = gn * r + gp * (xc * 2)
        put_grad(x, gx.to(x.dtype) if compute != x.dtype else gx)
    return y


@register(RuleKind.GRAD, F.embedding)
def embedding_grad(index, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                   sparse=False):
    if max_norm is not None or sparse or weight.dim() != 2:
        return NotImplemented
    y = F.embedding(index, weight, padding_idx, scale_grad_by_freq=scale_grad_by_freq)
    padding = -1 if padding_idx is None else padding_idx % weight.shape[0]
    put_grad(weight, embedding_backward(get_grad(y), index, weight.shape[0], padding, scale_grad_by_freq))
    return y


@register(RuleKind.GRAD, F.gelu)
def gelu_grad(x, approximate="none"):
    y = F.gelu(x, approximate=approximate)
    put_grad(x, backward_kernels.gelu_backward(get_grad(y), x, approximate))
    return y


@register(RuleKind.GRAD, F.silu)
def silu_grad(x, inplace=False):
    y = F.silu(x)
    put_grad(x, backward_kernels.silu_backward(get_grad(y), x))
    return y


@register(RuleKind.GRAD, F.scaled_dot_product_attention)
def sdpa_grad(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if dropout_p != 0.0:
        return _sdpa_dropout_grad(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    kwargs = {"dropout_p": 0.0, "is_causal": is_causal, "scale": scale}
    if enable_gqa:
        kwargs["enable_gqa"] = True
    y = F.scaled_dot_product_attention(q, k, v, attn_mask, **kwargs)
    # Attention is recomputed in the backward (as flash attention does), so only q, k, v (and a mask) are saved.
    # A float mask is added to the scores, so it has a grad too (T5 passes its learned position bias as the mask).
    inputs = (q, k, v, attn_mask)
    wrt = tuple(i for i, t in enumerate(inputs) if wants_grad(t))
    grads = torch_vjp(SYMBOLS["torch.nn.functional.scaled_dot_product_attention"], inputs, kwargs, wrt,
                      (get_grad(y),))
    for i, grad in zip(wrt, grads):
        put_grad(inputs[i], grad)
    return y


def _sdpa_dropout_grad(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """The backward must see the dropout mask the forward drew (recomputing the attention would draw another).
    Eager's math kernel (its choice on CPU) returns the probabilities after dropout, whose zeros are that mask; a
    fused kernel draws inside itself, with its own generator offsets, which fulmen cannot replay."""
    if eager_choice(q, k, v, is_causal, scale, enable_gqa, attn_mask, dropout_p) != SDPBackend.MATH.value:
        raise TraceError(
            f"fulmen cannot differentiate scaled_dot_product_attention with dropout_p={dropout_p} on {q.device} "
            "here: eager's fused attention kernel draws the dropout mask inside itself, and only the sdpa executor "
            "gives its backward that same draw, for calls without an attention mask. Use the sdpa executor and no "
            "mask (is_causal=True), train with attention dropout 0 (e.g. attention_dropout=0.0 / attn_pdrop=0.0 in "
            "a Hugging Face config), or select the math kernel (torch.nn.attention.sdpa_kernel(SDPBackend.MATH))",
            differentiated_call().source,
        )
    y, probs = attention_dropout(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    kept = torch.ne(probs, 0)
    tensors = [t for t in (q, k, v, attn_mask) if is_tensor(t)]
    wrt = tuple(i for i, t in enumerate(tensors) if wants_grad(t))
    args = (q, k, v, attn_mask, kept, dropout_p, is_causal, scale, enable_gqa)
    for i, grad in zip(wrt, torch_vjp(attention_dropped, args, {}, wrt, (get_grad(y),))):
        put_grad(tensors[i], grad)
    return y


@register(RuleKind.GRAD, batch_norm_update)
def batch_norm_update_grad(x, running_mean, running_var, weight, bias, momentum, eps):
    out, mean, var = batch_norm_update(x, running_mean, running_var, weight, bias, momentum, eps)
    # Training mode normalizes by the batch's statistics: eager's backward of batch_norm without running statistics,
    # which leaves the running ones (the program updates them in place) unread, nor the momentum (a tensor for
    # momentum=None).
    args = (x, None, None, weight, bias, True, momentum if isinstance(momentum, float | None) else 0.0, eps)
    flat = list(iter_proxies(args))
    wrt = tuple(i for i, p in enumerate(flat) if p.requires_grad)
    for i, grad in zip(wrt, torch_vjp(SYMBOLS["torch.nn.functional.batch_norm"], args, {}, wrt, (get_grad(out),))):
        put_grad(flat[i], grad)
    return out, mean, var


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
