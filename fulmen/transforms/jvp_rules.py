"""The JVP rules: every prim with floating outputs, and the torch-level leaves that are linear or common in
backward traces. Symbols not here are differentiated through their decomposition, or by torch's forward-mode AD.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fulmen.ops import backward_kernels, lookup
from fulmen.ops.rules.jvp import (
    Dot,
    add_tangents,
    as_tangent,
    bilinear,
    linear,
    tangent_or_zero,
)
from fulmen.ops.rules.tables import RuleKind, register
from fulmen.ops.utils import compute_dtype

JVP = RuleKind.JVP

# --- linear ops: the op applied to the tangents (zeros for the operands without one) -----------------------------
T = torch.Tensor
# --- bilinear ------------------------------------------------------------------------------------------------------
for _sym in (lookup(fn).symbol for fn in (torch.matmul, torch.outer, T.__rmatmul__)):
    register(JVP, _sym, bilinear(_sym))


# --- reductions and selections -------------------------------------------------------------------------------------
@register(JVP, torch.native_layer_norm)
def _native_layer_norm(dot: Dot, args: tuple, kwargs: dict):
    """The normalised output's tangent; the mean and rstd outputs get none, as eager's forward-mode AD gives them
    (they are not differentiable outputs there)."""
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    bound = dict(zip(names, args)) | kwargs
    x, normalized_shape, weight, bias, eps = (bound[name] for name in names)
    y, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    compute = rstd.dtype
    xhat = (x.to(compute) - mean) * rstd
    tangents = []
    if dot(x) is not None:
        t = dot(x).to(compute)
        tx = rstd * (t - t.mean(dims, keepdim=True) - xhat * (t * xhat).mean(dims, keepdim=True))
        tangents.append(tx * weight.to(compute) if weight is not None else tx)
    if weight is not None and dot(weight) is not None:
        tangents.append(xhat * dot(weight).to(compute))
    if bias is not None and dot(bias) is not None:
        tangents.append(dot(bias).to(compute))
    tangent = add_tangents(*tangents)
    return (y, mean, rstd), (None if tangent is None else as_tangent(tangent, y), None, None)


@register(JVP, backward_kernels.layer_norm_backward)
def _layer_norm_backward(dot: Dot, args: tuple, kwargs: dict):
    """The tangents of layer norm's grads (forward-over-reverse). The kernel takes the mean and rstd as given, but
    they are x's statistics (the grad rule passes native_layer_norm's), which get no tangent of their own (see
    above): their tangents follow from x's, as torch.func's decomposition of the backward recomputes them from x."""
    names = ("g", "x", "normalized_shape", "mean", "rstd", "weight", "bias_dtype", "output_mask")
    bound = dict(zip(names, args)) | kwargs
    g, x, normalized_shape, mean, rstd, weight, bias_dtype, output_mask = (bound[name] for name in names)
    grads = backward_kernels.layer_norm_backward(g, x, normalized_shape, mean, rstd, weight, bias_dtype,
                                                 output_mask)
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    batch = tuple(range(x.dim() - len(dims)))
    compute = compute_dtype(x.dtype)  # the kernel's: half-precision tensors in float32

    def mean_over(t):
        return t.mean(dims, keepdim=True)

    def batch_sum(t):
        return t.sum(batch) if batch else t

    tg, tx, tw = dot(g), dot(x), None if weight is None else dot(weight)
    tg, tx, tw = (None if t is None else t.to(compute) for t in (tg, tx, tw))
    g, rstd = g.to(compute), rstd.to(compute)
    xhat = (x.to(compute) - mean.to(compute)) * rstd
    w = None if weight is None else weight.to(compute)
    # d xhat and d rstd from x's tangent: rstd = (var + eps) ** -0.5 with var the biased variance over `dims`
    txhat = None if tx is None else rstd * (tx - mean_over(tx) - xhat * mean_over(tx * xhat))
    trstd = None if tx is None else -rstd * rstd * mean_over(xhat * tx)
    gxhat = g if w is None else g * w
    tgxhat = add_tangents(None if tg is None else (tg if w is None else tg * w), None if tw is None else g * tw)
    tangents: list[Any] = [None, None, None]
    if grads[0] is not None:
        inner = mean_over(gxhat * xhat)
        parts = [None if trstd is None else trstd * (gxhat - mean_over(gxhat) - xhat * inner)]
        if tgxhat is not None:
            parts.append(rstd * (tgxhat - mean_over(tgxhat) - xhat * mean_over(tgxhat * xhat)))
        if txhat is not None:
            parts.append(-rstd * (txhat * inner + xhat * mean_over(gxhat * txhat)))
        tangents[0] = add_tangents(*parts)
    if grads[1] is not None:
        tangents[1] = add_tangents(None if tg is None else batch_sum(tg * xhat),
                                   None if txhat is None else batch_sum(g * txhat))
    if grads[2] is not None and tg is not None:
        tangents[2] = batch_sum(tg)
    return grads, tuple(None if t is None else as_tangent(t, grad) for t, grad in zip(tangents, grads))


# --- torch-level leaves: activations and losses by their derivative, composites by their parts --------------------
for _fn, _operands in ((F.pad, (0, 3, "value")),):
    register(JVP, _fn, linear(lookup(_fn).symbol, _operands))


def _matmul_plus(fn, product):
    """addmm / baddbmm: beta * input + alpha * (m1 @ m2)."""

    def rule(dot: Dot, args: tuple, kwargs: dict):
        x, m1, m2 = args
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        y = fn(x, m1, m2, beta=beta, alpha=alpha)
        t1, t2 = dot(m1), dot(m2)
        parts = [None if t1 is None else product(t1, m2), None if t2 is None else product(m1, t2)]
        t = add_tangents(None if dot(x) is None else as_tangent(beta * dot(x), y),
                         None if not any(p is not None for p in parts) else alpha * add_tangents(*parts))
        return y, None if t is None else as_tangent(t, y)

    return rule


register(JVP, torch.addmm, _matmul_plus(lookup(torch.addmm).symbol, torch.matmul))
register(JVP, torch.baddbmm, _matmul_plus(lookup(torch.baddbmm).symbol, torch.matmul))


def _loss(fn, pointwise):
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


register(JVP, F.mse_loss, _loss(lookup(F.mse_loss).symbol, lambda d: 2 * d))
register(JVP, F.l1_loss, _loss(lookup(F.l1_loss).symbol, torch.sign))


def _conv(fn, spatial: int):
    def rule(dot: Dot, args: tuple, kwargs: dict):
        x, weight = args[:2]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        rest, options = args[3:], {k: v for k, v in kwargs.items() if k != "bias"}
        y = fn(x, weight, bias, *rest, **options)
        tx, tw, tb = dot(x), dot(weight), dot(bias) if bias is not None else None
        t = add_tangents(None if tx is None else fn(tx, weight, None, *rest, **options),
                         None if tw is None else fn(x, tw, None, *rest, **options),
                         None if tb is None else tb.reshape(-1, *(1,) * spatial).expand(y.shape))
        return y, None if t is None else as_tangent(t, y)

    return rule


for _fn, _spatial in ((F.conv1d, 1), (F.conv2d, 2)):
    register(JVP, _fn, _conv(lookup(_fn).symbol, _spatial))
