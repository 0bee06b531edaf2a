"""Losses: cross-entropy and nll_loss (decomposed into prims), and the pointwise losses torch computes whole (mse,
l1, smooth l1, binary cross-entropy, KL divergence), with their rules. Split from nn.py, whose softmax they build on.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from fulmen.ops import prims
from fulmen.ops.kernels import backward_kernels
from fulmen.ops.nn import log_softmax_decomposition
from fulmen.ops.registry import lookup, torch_symbol
from fulmen.ops.rules.batch import Batch, broadcast
from fulmen.ops.rules.grad import differentiated_by_eager, get_grad, put_grad
from fulmen.ops.rules.jvp import Dot, as_tangent, tangent_or_zero
from fulmen.ops.rules.tables import RuleKind, register
from fulmen.ops.utils import convert, expand_to, is_tensor

GRAD, JVP, BATCH = RuleKind.GRAD, RuleKind.JVP, RuleKind.BATCH


def nll_loss_decomposition(logp, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                           reduction="mean") -> Any:
    if weight is not None or size_average is not None or reduce is not None or logp.dim() != 2:
        return NotImplemented
    n = logp.shape[0]
    valid = prims.ne(target, ignore_index)
    safe = prims.where(valid, target, expand_to(prims.full((), 0, dtype=target.dtype, device=target.device), (n,)))
    picked = prims.reshape(prims.take_along_axis(logp, prims.reshape(safe, (n, 1)), 1), (n,))
    zero = expand_to(prims.full((), 0.0, dtype=logp.dtype, device=logp.device), (n,))
    losses = prims.where(valid, prims.neg(picked), zero)
    if reduction == "none":
        return losses
    total = prims.sum(losses, (0,))
    if reduction == "sum":
        return total
    return prims.div(total, prims.sum(convert(valid, logp.dtype), (0,)))


def cross_entropy_decomposition(logits, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                                reduction="mean", label_smoothing=0.0) -> Any:
    if label_smoothing != 0.0 or logits.dim() != 2 or target.dtype.is_floating_point:
        return NotImplemented
    logp = log_softmax_decomposition(logits, 1)
    if logp is NotImplemented:  # empty logits
        return NotImplemented
    return nll_loss_decomposition(logp, target, weight, size_average, ignore_index, reduce, reduction)


torch_symbol(F.cross_entropy, decomposition=cross_entropy_decomposition)
torch_symbol(F.nll_loss, decomposition=nll_loss_decomposition)
torch_symbol(F.mse_loss)
torch_symbol(F.l1_loss)
torch_symbol(F.smooth_l1_loss)
torch_symbol(F.binary_cross_entropy)
torch_symbol(F.binary_cross_entropy_with_logits)
torch_symbol(F.kl_div)
differentiated_by_eager(F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.binary_cross_entropy,
                        F.binary_cross_entropy_with_logits, F.kl_div)


@register(GRAD, F.cross_entropy)
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


def _loss_jvp(fn, pointwise):
    """mse_loss / l1_loss (input, target, reduction): the pointwise derivative times the difference of tangents."""

    def rule(dot: Dot, args: tuple, kwargs: dict):
        x, target = args[:2]
        reduction = kwargs.get("reduction", "mean")
        if len(args) > 2 or any(v is not None for k, v in kwargs.items() if k != "reduction"):
            return NotImplemented  # the deprecated size_average / reduce arguments, a weight
        y = fn(x, target, reduction=reduction)
        difference = x - target
        t = pointwise(difference) * (tangent_or_zero(dot, x) - tangent_or_zero(dot, target))
        t = t.sum() if reduction == "sum" else t.mean() if reduction == "mean" else t
        return y, as_tangent(t, y)

    return rule


register(JVP, F.mse_loss, _loss_jvp(lookup(F.mse_loss).symbol, lambda d: 2 * d))
register(JVP, F.l1_loss, _loss_jvp(lookup(F.l1_loss).symbol, torch.sign))


def _loss_batch(fn):
    """A pointwise loss (input, target, ..., reduction=): its unreduced form, reduced over each example's dims."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        if len(args) > 2 or any(kwargs.get(k) is not None for k in ("size_average", "reduce")):
            return NotImplemented  # the deprecated size_average / reduce arguments, or positional options
        kwargs = {k: v for k, v in kwargs.items() if k not in ("size_average", "reduce")}
        reduction = kwargs.get("reduction", "mean")
        tensors = {k: v for k, v in kwargs.items() if is_tensor(v)}
        operands = broadcast(batch, *args, *tensors.values())
        options = {k: v for k, v in kwargs.items() if k != "reduction" and not is_tensor(v)}
        per_element = fn(*operands[:2], **dict(zip(tensors, operands[2:])), **options, reduction="none")
        dims = tuple(range(1, per_element.dim()))
        if reduction == "none":
            return per_element
        if reduction == "sum":
            return prims.sum(per_element, dims) if dims else per_element
        if reduction == "mean":
            count = math.prod(per_element.shape[1:])
            return prims.div(prims.sum(per_element, dims), count) if dims else per_element
        if reduction == "batchmean":  # kl_div: the sum over the first dim of each example
            return prims.div(prims.sum(per_element, dims), per_element.shape[1] if dims else 1)
        return NotImplemented

    return rule


for _fn in (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.binary_cross_entropy, F.binary_cross_entropy_with_logits,
            F.kl_div):
    register(BATCH, _fn, _loss_batch(lookup(_fn).symbol))
