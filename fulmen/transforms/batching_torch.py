"""The batching rules of torch-level leaves (symbols without a prim decomposition, or whose decomposition declines
some arguments): elementwise ops, ops along a dim, scatters, losses, convolutions, matmul variants. They are written
with fulmen.ops.rules.batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fulmen.ops import lookup, prims
from fulmen.ops.rules.batch import Batch, batch_matmul, broadcast, elementwise, is_tensor, with_dim
from fulmen.ops.rules.tables import RuleKind, register

BATCH = RuleKind.BATCH

# --- torch-level leaves with a dim argument ------------------------------------------------------------------------
# op -> where its dim argument is: (position, keyword, default)
DIM_OPS: dict[Callable[..., Any], tuple[int, str, int | None]] = {
    F.glu: (1, "dim", -1), F.normalize: (2, "dim", 1),
}


def _dim_rule(fn: Callable[..., Any]):
    return with_dim(lookup(fn).symbol, *DIM_OPS[fn])


for _fn in DIM_OPS:
    register(BATCH, _fn, _dim_rule(_fn))




def _batched_matmul(batch: Batch, a: Any, b: Any) -> torch.Tensor:
    out = batch_matmul(batch, (a, b), {})
    batch.names.add(out.pname)
    return out


@register(BATCH, torch.Tensor.__rmatmul__)
def _rmatmul(batch: Batch, args: tuple, kwargs: dict):
    x, other = args
    return batch_matmul(batch, (other, x), {})


@register(BATCH, torch.outer)
def _outer(batch: Batch, args: tuple, kwargs: dict):
    a, b = (batch.materialize(x) for x in args)
    return prims.mul(prims.expand(prims.unsqueeze(a, 2), (batch.size, a.shape[1], b.shape[1])),
                     prims.expand(prims.unsqueeze(b, 1), (batch.size, a.shape[1], b.shape[1])))


def _matmul_plus(fn):
    """addmm / baddbmm: beta * input + alpha * (m1 @ m2), from the batched matmul."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        x, m1, m2 = args
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        product = _batched_matmul(batch, m1, m2)
        scaled = product if alpha == 1 else prims.mul(product, alpha)
        batch.names.add(scaled.pname)
        if beta == 0:
            return scaled
        x = x if beta == 1 else prims.mul(x, beta)
        if x is not args[0] and batch.batched(args[0]):
            batch.names.add(x.pname)
        return elementwise(prims.add)(batch, (x, scaled), {})

    return rule


for _fn in (torch.addmm, torch.baddbmm):
    register(BATCH, _fn, _matmul_plus(lookup(_fn).symbol))


def _loss(fn):
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
    register(BATCH, _fn, _loss(lookup(_fn).symbol))


def _conv(fn, spatial: int):
    """conv1d / conv2d over a batched input with unbatched weights: the batch joins the conv's own batch."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        x, weight, *rest = args
        if batch.batched(weight) or any(batch.batched(a) for a in (*rest, *kwargs.values())):
            return NotImplemented
        example = x.shape[1:]
        rows = x.shape[0] * (example[0] if len(example) == spatial + 2 else 1)
        out = fn(prims.reshape(x, (rows, *example[-(spatial + 1):])), weight, *rest, **kwargs)
        return prims.reshape(out, (batch.size, *example[:-(spatial + 1)], *out.shape[1:]))

    return rule


for _fn, _spatial in ((F.conv1d, 1), (F.conv2d, 2)):
    register(BATCH, _fn, _conv(lookup(_fn).symbol, _spatial))


@register(BATCH, F.pad)
def _pad(batch: Batch, args: tuple, kwargs: dict):
    """pad (reflect, replicate, circular): the batch joins the input's leading (batch, channel) dims."""
    x, pad = args[0], tuple(args[1] if len(args) > 1 else kwargs["pad"])
    mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
    if mode == "constant" or any(is_tensor(a) for a in (*args[1:], *kwargs.values())):
        return NotImplemented
    example, padded = x.shape[1:], len(pad) // 2
    lead = example[: len(example) - padded]
    if len(lead) not in (1, 2):
        return NotImplemented
    rows = x.shape[0] * math.prod(lead[:-1])
    flat = prims.reshape(x, (rows, lead[-1], *example[len(lead):]))
    out = lookup(F.pad).symbol(flat, pad, mode, *args[3:], **{k: v for k, v in kwargs.items() if k not in ("pad",
                                                                                                          "mode")})
    return prims.reshape(out, (batch.size, *lead, *out.shape[2:]))



