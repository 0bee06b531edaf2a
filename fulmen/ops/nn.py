"""Neural-network composites: linear, matmul, softmax, norms, activations, attention, embedding, losses.

These are the symbols executors want to claim whole (and autodiff gives their own rules); each still
decomposes into prims so anything that is not claimed can descend to its parts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch._meta_registrations
import torch.nn.functional as F

from fulmen.ops import impls, prims
from fulmen.ops.eager_grads import eager_op, nn_op
from fulmen.ops.registry import TorchBinding, bind, impl_symbol, lookup, method, torch_symbol
from fulmen.ops.rules.batch import elementwise
from fulmen.ops.rules.grad import differentiated_by_eager, not_differentiable
from fulmen.ops.rules.jvp import by_derivative
from fulmen.ops.rules.tables import RuleKind, register
from fulmen.ops.utils import canonical_dim, compute_dtype, convert, expand_to, keepdim_shape, to_float

GRAD, JVP, BATCH = RuleKind.GRAD, RuleKind.JVP, RuleKind.BATCH


def _matmul_decomposition(a, b) -> Any:
    return prims.matmul(a, b)


torch_symbol(torch.matmul, decomposition=_matmul_decomposition,
             aliases=(method("matmul"), method("__matmul__"), torch.mm, method("mm"), torch.bmm, method("bmm")))
torch_symbol(method("__rmatmul__"))
torch_symbol(torch.einsum)
torch_symbol(torch.outer, aliases=(method("outer"), torch.ger))
torch_symbol(torch.baddbmm, aliases=(method("baddbmm"),))
torch_symbol(torch.addmm, aliases=(method("addmm"),))
differentiated_by_eager(method("__rmatmul__"), torch.einsum, torch.outer, torch.baddbmm, torch.addmm)


def _grouped_mm_meta(builder, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """torch's own output rule (`_create_grouped_mm_output_tensor`); its meta kernel also demands bf16 inputs, which
    the CPU kernel does not."""
    offsets = offs.meta if offs is not None else None
    out = torch._meta_registrations._create_grouped_mm_output_tensor(mat_a.meta, mat_b.meta, offsets, out_dtype)
    requires_grad = torch.is_grad_enabled() and (mat_a.requires_grad or mat_b.requires_grad)
    return builder.make_proxy(out, mat_a.device, requires_grad)


if hasattr(torch, "_grouped_mm"):  # one matmul per group of rows (mixture-of-experts layers)
    torch_symbol(torch._grouped_mm, printed="torch._grouped_mm",
                 meta=_grouped_mm_meta if hasattr(torch._meta_registrations, "_create_grouped_mm_output_tensor")
                 else None)
    differentiated_by_eager(torch._grouped_mm)


def linear_decomposition(x, weight, bias=None) -> Any:
    w = prims.permute(weight, (1, 0)) if weight.dim() == 2 else weight
    out = prims.matmul(x, w)
    if bias is not None:
        out = prims.add(out, expand_to(bias, out.shape))
    return out


torch_symbol(F.linear, decomposition=linear_decomposition)


def _softmax_parts(x, dim, dtype):
    x = convert(x, dtype) if dtype is not None else convert(x, to_float(x.dtype))
    dim = canonical_dim(dim, x.dim())
    shifted = prims.sub(x, expand_to(prims.reshape(prims.amax(x, (dim,)), keepdim_shape(x.shape, (dim,))), x.shape))
    return x, dim, shifted


def _refuse_integral(name: str, x: Any, dtype: torch.dtype | None) -> None:
    """Eager's kernels refuse integer and bool inputs unless dtype= names a floating one; torch's meta kernel gives
    them the input's dtype, so without this the trace would hold a value eager never computes."""
    if dtype is None and not (x.dtype.is_floating_point or x.dtype.is_complex):
        raise NotImplementedError(f"{name} is not implemented for {x.dtype} inputs (as in eager); pass dtype= a "
                                  "floating dtype, or convert the input")


def softmax_decomposition(x, dim=None, _stacklevel=3, dtype=None) -> Any:
    _refuse_integral("softmax", x, dtype)
    if dim is None or x.numel() == 0:
        return NotImplemented
    x, dim, shifted = _softmax_parts(x, dim, dtype)
    exp = prims.exp(shifted)
    total = prims.reshape(prims.sum(exp, (dim,)), keepdim_shape(x.shape, (dim,)))
    return prims.div(exp, expand_to(total, x.shape))


def log_softmax_decomposition(x, dim=None, _stacklevel=3, dtype=None) -> Any:
    _refuse_integral("log_softmax", x, dtype)
    if dim is None or x.numel() == 0:
        return NotImplemented
    x, dim, shifted = _softmax_parts(x, dim, dtype)
    total = prims.reshape(prims.sum(prims.exp(shifted), (dim,)), keepdim_shape(x.shape, (dim,)))
    return prims.sub(shifted, expand_to(prims.log(total), x.shape))


def _functional_softmax_args(input, dim=None, _stacklevel=3, dtype=None) -> tuple[tuple, dict[str, Any]]:
    if dim is None:  # torch's deprecated implicit dim
        dim = 0 if input.dim() in (0, 1, 3) else 1
    return (input, dim), ({"dtype": dtype} if dtype is not None else {})


_softmax = torch_symbol(
    torch.softmax, decomposition=lambda x, dim, dtype=None: softmax_decomposition(x, dim, dtype=dtype),
    aliases=(method("softmax"), torch.special.softmax))
_log_softmax = torch_symbol(
    torch.log_softmax, decomposition=lambda x, dim, dtype=None: log_softmax_decomposition(x, dim, dtype=dtype),
    aliases=(method("log_softmax"), torch.special.log_softmax))
bind(F.softmax, TorchBinding(_softmax, normalize=_functional_softmax_args))
bind(F.log_softmax, TorchBinding(_log_softmax, normalize=_functional_softmax_args))


def _normalize(x, normalized_shape, eps, *, center: bool):
    """`x` normalised over its last `len(normalized_shape)` dims, with its mean (None unless `center`) and
    reciprocal standard deviation, both shaped as `x` with those dims kept as size 1."""
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    kept = keepdim_shape(x.shape, dims)
    count = math.prod(x.shape[d] for d in dims)
    mean = None
    if center:
        mean = prims.reshape(prims.div(prims.sum(x, dims), count), kept)
        x = prims.sub(x, expand_to(mean, x.shape))
    meansq = prims.div(prims.sum(prims.mul(x, x), dims), count)
    rstd = prims.reshape(prims.rsqrt(prims.add(meansq, eps)), kept)
    return prims.mul(x, expand_to(rstd, x.shape)), mean, rstd


def _affine(out, weight, bias):
    if weight is not None:
        out = prims.mul(out, expand_to(convert(weight, out.dtype), out.shape))
    if bias is not None:
        out = prims.add(out, expand_to(convert(bias, out.dtype), out.shape))
    return out


def layer_norm_decomposition(x, normalized_shape, weight=None, bias=None, eps=1e-5) -> Any:
    return native_layer_norm_decomposition(x, normalized_shape, weight, bias, eps)[0]


def native_layer_norm_decomposition(x, normalized_shape, weight, bias, eps) -> Any:
    """The layer norm with the statistics its backward reads, in the compute dtype (what torch's meta kernel
    gives; the CPU kernel rounds them to a half-precision input's dtype): the norm's grad rule keeps this call in
    the forward, and a decomposition lets fusion executors put it in one kernel with what is around it."""
    normed, mean, rstd = _normalize(convert(x, compute_dtype(x.dtype)), normalized_shape, eps, center=True)
    return convert(_affine(normed, weight, bias), x.dtype), mean, rstd


def rms_norm_decomposition(x, normalized_shape, weight=None, eps=None) -> Any:
    compute = compute_dtype(x.dtype)
    eps = torch.finfo(compute).eps if eps is None else eps
    normed, _, _ = _normalize(convert(x, compute), normalized_shape, eps, center=False)
    return convert(_affine(normed, weight, None), x.dtype)


torch_symbol(F.layer_norm, decomposition=layer_norm_decomposition)
native_layer_norm = torch_symbol(torch.native_layer_norm, decomposition=native_layer_norm_decomposition,
                                 differentiable_outputs=(True, False, False))
torch_symbol(F.rms_norm, decomposition=rms_norm_decomposition)
torch_symbol(F.group_norm)
torch_symbol(F.batch_norm)
batch_norm_update = impl_symbol(impls.batch_norm_update)  # training mode with running statistics (acquire.py)
torch_symbol(F.normalize)
differentiated_by_eager(F.group_norm, F.batch_norm, F.normalize)


def gelu_decomposition(x, approximate: str = "none") -> Any:
    if approximate == "tanh":
        inner = prims.mul(prims.add(x, prims.mul(prims.mul(prims.mul(x, x), x), 0.044715)), math.sqrt(2 / math.pi))
        return prims.mul(prims.mul(x, 0.5), prims.add(prims.tanh(inner), 1.0))
    return prims.mul(prims.mul(x, 0.5), prims.add(prims.erf(prims.mul(x, 1 / math.sqrt(2))), 1.0))


def silu_decomposition(x, inplace: bool = False) -> Any:
    return prims.mul(x, prims.sigmoid(x))


torch_symbol(F.gelu, decomposition=gelu_decomposition)
torch_symbol(F.silu, decomposition=silu_decomposition)
# (the activations that may update their input in place: activations.py)
for _fn in (F.softplus, F.logsigmoid, F.glu, F.softsign, F.tanhshrink):
    torch_symbol(_fn)
    differentiated_by_eager(_fn)
# elementwise: fn -> d(output)/d(input), from (x, *the call's other arguments)
_DERIVATIVES: dict[Callable[..., Any], Callable[..., Any]] = {
    F.softplus: lambda x, beta=1.0, threshold=20.0: torch.where(x * beta > threshold, 1.0, torch.sigmoid(x * beta)),
    F.logsigmoid: lambda x: torch.sigmoid(-x),
    F.softsign: lambda x: 1 / ((1 + torch.abs(x)) * (1 + torch.abs(x))),
    F.tanhshrink: lambda x: torch.tanh(x) * torch.tanh(x),
}
for _fn, _derivative in _DERIVATIVES.items():
    register(JVP, _fn, by_derivative(lookup(_fn).symbol, _derivative))
    register(BATCH, _fn, elementwise(lookup(_fn).symbol))


def sdpa_decomposition(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False) -> Any:
    if dropout_p != 0.0 or enable_gqa:
        return NotImplemented
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    lq, lk = q.shape[-2], k.shape[-2]
    scores_shape = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])) + (lq, lk)
    kt = prims.permute(k, tuple(range(k.dim() - 2)) + (k.dim() - 1, k.dim() - 2))
    scores = prims.mul(prims.matmul(q, kt), scale)
    if is_causal:
        row = expand_to(prims.reshape(prims.iota(lq, 0, 1, dtype=torch.int64, device=q.device), (lq, 1)), (lq, lk))
        col = expand_to(prims.reshape(prims.iota(lk, 0, 1, dtype=torch.int64, device=q.device), (1, lk)), (lq, lk))
        keep = expand_to(prims.le(col, row), scores_shape)
        scores = prims.where(keep, scores, expand_to(prims.full((), -math.inf, dtype=q.dtype, device=q.device),
                                                     scores_shape))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            ninf = expand_to(prims.full((), -math.inf, dtype=q.dtype, device=q.device), scores_shape)
            scores = prims.where(expand_to(attn_mask, scores_shape), scores, ninf)
        else:
            scores = prims.add(scores, expand_to(convert(attn_mask, scores.dtype), scores_shape))
    probs = softmax_decomposition(scores, -1)
    return prims.matmul(convert(probs, v.dtype), v)


torch_symbol(F.scaled_dot_product_attention, decomposition=sdpa_decomposition)


def embedding_decomposition(index, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                            sparse=False) -> Any:
    # take's gradient is dense and unscaled: sparse=True is left to torch autograd, and scale_grad_by_freq is always
    # differentiated by F.embedding's grad rule (eager's kernel), never through this decomposition
    if max_norm is not None or sparse:
        return NotImplemented
    flat = prims.reshape(index, (index.numel(),))
    rows = prims.take(weight, flat, 0)
    return prims.reshape(rows, tuple(index.shape) + (weight.shape[1],))


torch_symbol(F.embedding, decomposition=embedding_decomposition)


def embedding_backward_decomposition(g, index, num_weights: int, padding_idx: int, scale_grad_by_freq: bool) -> Any:
    """`impls.embedding_backward` as a scatter-add in float32 for half-precision cotangents (the kernel's sum)."""
    n, width = index.numel(), g.shape[-1]
    acc = compute_dtype(g.dtype)
    rows = convert(prims.reshape(g, (n, width)), acc)
    flat = prims.reshape(index, (n,))
    if scale_grad_by_freq:  # each row's contributions divided by how often its index occurs
        ones = prims.full((n,), 1.0, dtype=acc, device=g.device)
        counts = prims.scatter_add(prims.full((num_weights,), 0.0, dtype=acc, device=g.device), 0, flat, ones)
        rows = prims.div(rows, expand_to(prims.reshape(prims.take(counts, flat, 0), (n, 1)), (n, width)))
    spread = prims.expand(prims.reshape(flat, (n, 1)), (n, width))
    if padding_idx >= 0:
        zero = expand_to(prims.full((), 0.0, dtype=acc, device=g.device), (n, width))
        rows = prims.where(prims.ne(spread, padding_idx), rows, zero)
    zeros = prims.full((num_weights, width), 0.0, dtype=acc, device=g.device)
    return convert(prims.scatter_add(zeros, 0, spread, rows), g.dtype)


embedding_backward = impl_symbol(impls.embedding_backward, decomposition=embedding_backward_decomposition)
torch_symbol(F.one_hot)
not_differentiable(F.one_hot)  # integer
torch_symbol(F.pad, decomposition=lambda x, pad, mode="constant", value=None: prims.pad(x, tuple(pad), value or 0.0)
             if mode == "constant" else NotImplemented, aliases=(torch._C._nn.pad,))  # what F.pad calls (Dynamo graphs)


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
# Every convolution is a torch symbol, so autocast's conversions of its inputs are planned (transforms/autocast.py)
# as for any op; its grads are eager's backward (autodiff's fallback).
for _fn in (F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d):
    torch_symbol(_fn)
    differentiated_by_eager(_fn)
torch_symbol(F.unfold)
torch_symbol(F.fold)
differentiated_by_eager(F.unfold, F.fold)


# --- with eager's grads (eager_grads.py): less common activations, distances and losses, and the dropouts and
# rrelu where they draw nothing (out of training, or p=0) ------------------------------------------------------------
for _fn in (F.prelu, F.hardshrink, F.softshrink, F.bilinear, F.cosine_similarity, F.pairwise_distance,
            torch.margin_ranking_loss, torch.hinge_embedding_loss, torch.cosine_embedding_loss, torch.poisson_nll_loss,
            torch.triplet_margin_loss, torch.cdist):
    eager_op(_fn)
for _name in ("huber_loss", "soft_margin_loss", "multi_margin_loss", "multilabel_margin_loss"):
    nn_op(_name)


def _ctc_loss_like(log_probs: torch.Tensor, targets: Any, input_lengths: Any, target_lengths: Any, blank: int = 0,
                   reduction: int = 1, zero_infinity: bool = False) -> torch.Tensor:
    """ctc_loss's output on meta tensors: torch has no meta kernel for lengths given as tensors (its CPU and CUDA
    kernels read their values), and the output's shape does not depend on them."""
    batched = log_probs.dim() == 3
    shape = (log_probs.shape[1],) if batched and reduction == 0 else ()
    return log_probs.new_empty(shape)


eager_op(torch.ctc_loss, like=_ctc_loss_like)


def _embedding_bag_refusal(input: Any, weight: Any, offsets: Any = None, max_norm: float | None = None,
                           norm_type: float = 2, scale_grad_by_freq: bool = False, mode: str = "mean",
                           sparse: bool = False, *rest: Any, **kwargs: Any) -> str | None:
    if max_norm is not None:
        return ("fulmen cannot trace F.embedding_bag with max_norm: it renormalises the weight's rows in place, which "
                "recomputing it for the backward would do again; renormalise outside the jitted function "
                "(torch.embedding_renorm_ under torch.no_grad)")
    if sparse:
        return ("fulmen cannot trace F.embedding_bag with sparse=True: its grad is a sparse tensor, which fulmen's "
                "backward does not produce; use sparse=False")
    return None


# F.embedding_bag as a whole: the op it calls (torch.embedding_bag) returns bookkeeping tensors whose shapes torch's
# meta kernel does not give as the CPU kernel does; F.embedding_bag returns only the bags.
eager_op(F.embedding_bag, refuse=_embedding_bag_refusal)


def _draws(name: str) -> Any:
    def refuse(x: Any, p: float, training: bool) -> str | None:
        if training and p > 0:
            return (f"fulmen does not support torch.{name} drawing in training (p={p}): only torch.dropout's draws are "
                    "replayed for the backward; use nn.Dropout, or keep the module outside the jitted function")
        return None

    return refuse


for _fn in (torch.feature_dropout, torch.alpha_dropout, torch.feature_alpha_dropout):
    eager_op(_fn, refuse=_draws(_fn.__name__))
eager_op(torch.rrelu, refuse=lambda x, lower=1 / 8, upper=1 / 3, training=False, generator=None: (
    "fulmen does not support torch.rrelu in training: its slopes are drawn at random, and only torch.dropout's draws "
    "are replayed for the backward; use leaky_relu, or evaluate the module in eval()") if training else None)
