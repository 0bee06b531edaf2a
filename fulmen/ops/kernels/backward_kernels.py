"""Eager's fused backward kernels as symbols, for the grad rules of the ops eager differentiates with one kernel
(and layer norm's backward's JVP rule, for forward-over-reverse).

tanh, sigmoid, silu, gelu, softmax, log_softmax and layer_norm have a backward kernel of their own in eager, which
computes in float32 for half-precision tensors and rounds once. Written as separate torch calls, the same formula
rounds after every step: up to several bfloat16 units apart from eager. So their grad rules call these symbols.
The torch executor runs eager's own kernel (bit-equal grads on every device and dtype); fusion regions
(`Tag.EAGER_ROUNDING`), and transforms without a rule of their own (vmap, jvp), see the decomposition: the kernel's
formula, rounded where the kernel on the call's device rounds. That is once, from float32, except on CUDA for:
- tanh and sigmoid, whose kernels compute in the tensors' own dtype (c10's BFloat16 and Half arithmetic rounds
  after every operation);
- softmax, whose kernel is given `grad * output` as one eager multiplication has written it in the dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fulmen.core.symbol import Tag
from fulmen.ops import prims
from fulmen.ops.kernels import impls
from fulmen.ops.registry import impl_symbol
from fulmen.ops.rules.jvp import Dot, add_tangents, as_tangent
from fulmen.ops.rules.tables import RuleKind, register
from fulmen.ops.utils import compute_dtype, convert, expand_to, keepdim_shape


def _upcast(*tensors: Any) -> list[Any]:
    return [convert(t, compute_dtype(t.dtype)) for t in tensors]


def _one_minus(t: Any) -> Any:
    return prims.add(prims.neg(t), 1.0)


def _kept_sum(t: Any, dims: tuple[int, ...]) -> Any:
    """The sum of `t` over `dims`, kept as size-1 dims and broadcast back to `t`'s shape."""
    return expand_to(prims.reshape(prims.sum(t, dims), keepdim_shape(t.shape, dims)), t.shape)


def _in_kernel_dtype(g, y) -> list[Any]:
    """`g` and `y` in the dtype eager's tanh and sigmoid backward kernels compute in: their common dtype on CUDA,
    float32 on CPU."""
    if g.device.type != "cuda":
        return _upcast(g, y)
    common = torch.promote_types(g.dtype, y.dtype)
    return [convert(g, common), convert(y, common)]


def _tanh_backward(g, y) -> Any:
    g_, y_ = _in_kernel_dtype(g, y)
    return convert(prims.mul(g_, _one_minus(prims.mul(y_, y_))), g.dtype)


def _sigmoid_backward(g, y) -> Any:
    g_, y_ = _in_kernel_dtype(g, y)
    return convert(prims.mul(prims.mul(g_, _one_minus(y_)), y_), g.dtype)


def _silu_backward(g, x) -> Any:
    g32, x32 = _upcast(g, x)
    s = prims.sigmoid(x32)
    return convert(prims.mul(prims.mul(g32, s), prims.add(prims.mul(x32, _one_minus(s)), 1.0)), g.dtype)


def _gelu_backward(g, x, approximate: str) -> Any:
    g32, x32 = _upcast(g, x)
    if approximate == "tanh":
        k, c = math.sqrt(2 / math.pi), 0.044715
        xx = prims.mul(x32, x32)
        t = prims.tanh(prims.mul(prims.add(x32, prims.mul(prims.mul(xx, x32), c)), k))
        slope = prims.mul(prims.mul(prims.mul(prims.mul(x32, 0.5), _one_minus(prims.mul(t, t))), k),
                          prims.add(prims.mul(xx, 3 * c), 1.0))
        dx = prims.add(prims.mul(prims.add(t, 1.0), 0.5), slope)
    else:
        cdf = prims.mul(prims.add(prims.erf(prims.mul(x32, 1 / math.sqrt(2))), 1.0), 0.5)
        pdf = prims.mul(prims.exp(prims.mul(prims.mul(x32, x32), -0.5)), 1 / math.sqrt(2 * math.pi))
        dx = prims.add(cdf, prims.mul(x32, pdf))
    return convert(prims.mul(g32, dx), g.dtype)


def _softmax_backward(g, y, dim: int) -> Any:
    if g.device.type == "cuda":
        gy32, y32 = _upcast(prims.mul(g, y), y)
        return convert(prims.sub(gy32, prims.mul(y32, _kept_sum(gy32, (dim,)))), y.dtype)
    g32, y32 = _upcast(g, y)
    return convert(prims.mul(y32, prims.sub(g32, _kept_sum(prims.mul(g32, y32), (dim,)))), y.dtype)


def _log_softmax_backward(g, y, dim: int) -> Any:
    g32, y32 = _upcast(g, y)
    return convert(prims.sub(g32, prims.mul(prims.exp(y32), _kept_sum(g32, (dim,)))), y.dtype)


def _layer_norm_backward(g, x, normalized_shape, mean, rstd, weight, bias_dtype, output_mask) -> Any:
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    batch = tuple(range(x.dim() - len(dims)))
    count = math.prod(x.shape[d] for d in dims)
    g32, x32 = _upcast(g, x)
    mean, rstd = (expand_to(convert(s, g32.dtype), x.shape) for s in (mean, rstd))
    xhat = prims.mul(prims.sub(x32, mean), rstd)
    gxhat = prims.mul(g32, expand_to(convert(weight, g32.dtype), x.shape)) if weight is not None else g32
    inner = prims.div(_kept_sum(prims.mul(gxhat, xhat), dims), count)
    centred = prims.sub(gxhat, prims.div(_kept_sum(gxhat, dims), count))
    gx = convert(prims.mul(rstd, prims.sub(centred, prims.mul(xhat, inner))), x.dtype) if output_mask[0] else None

    def param_grad(t, dtype):
        return convert(prims.sum(t, batch) if batch else t, dtype)

    gw = param_grad(prims.mul(g32, xhat), weight.dtype) if output_mask[1] else None
    gb = param_grad(g32, bias_dtype) if output_mask[2] else None
    return gx, gw, gb


def _kernel(fn, decomposition) -> Any:
    return impl_symbol(fn, tags=Tag.EAGER_ROUNDING, decomposition=decomposition)


tanh_backward = _kernel(impls.tanh_backward, _tanh_backward)
sigmoid_backward = _kernel(impls.sigmoid_backward, _sigmoid_backward)
silu_backward = _kernel(impls.silu_backward, _silu_backward)
gelu_backward = _kernel(impls.gelu_backward, _gelu_backward)
softmax_backward = _kernel(impls.softmax_backward, _softmax_backward)
log_softmax_backward = _kernel(impls.log_softmax_backward, _log_softmax_backward)
layer_norm_backward = _kernel(impls.layer_norm_backward, _layer_norm_backward)


@register(RuleKind.JVP, layer_norm_backward)
def layer_norm_backward_jvp(dot: Dot, args: tuple, kwargs: dict):
    """The tangents of layer norm's grads (forward-over-reverse). The kernel takes the mean and rstd as given, but
    they are x's statistics (the grad rule passes native_layer_norm's), which get no tangent of their own (its JVP
    rule, ops/nn.py): their tangents follow from x's, as torch.func's decomposition of the backward recomputes them
    from x."""
    names = ("g", "x", "normalized_shape", "mean", "rstd", "weight", "bias_dtype", "output_mask")
    bound = dict(zip(names, args)) | kwargs
    g, x, normalized_shape, mean, rstd, weight, bias_dtype, output_mask = (bound[name] for name in names)
    grads = layer_norm_backward(g, x, normalized_shape, mean, rstd, weight, bias_dtype,
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
