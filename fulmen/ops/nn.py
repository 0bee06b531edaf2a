"""Neural-network composites: linear, matmul, softmax, norms, activations, attention, embedding, convolutions (the
losses are in losses.py).

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
from torch.nn.attention import SDPBackend

from fulmen.core.errors import TraceError
from fulmen.core.symbol import Tag, iter_proxies
from fulmen.ops import prims
from fulmen.ops.kernels import backward_kernels, impls
from fulmen.ops.kernels.sdpa_kernels import eager_choice
from fulmen.ops.registry import SYMBOLS, TorchBinding, bind, impl_symbol, lookup, method, torch_symbol
from fulmen.ops.rules.batch import Batch, batch_matmul, elementwise, with_dim
from fulmen.ops.rules.eager import eager_op, nn_op
from fulmen.ops.rules.grad import (
    differentiated_by_eager,
    differentiated_call,
    get_grad,
    not_differentiable,
    put_grad,
    torch_vjp,
    wants_grad,
)
from fulmen.ops.rules.grad_formulas import kernel_grad, matmul_rule
from fulmen.ops.rules.jvp import Dot, add_tangents, as_tangent, bilinear, by_derivative, linear
from fulmen.ops.rules.tables import RuleKind, register
from fulmen.ops.utils import (
    canonical_dim,
    compute_dtype,
    convert,
    expand_to,
    is_tensor,
    keepdim_shape,
    to_float,
)

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
register(GRAD, torch.matmul, matmul_rule(torch.matmul))
for _fn in (torch.matmul, torch.outer, method("__rmatmul__")):
    register(JVP, _fn, bilinear(lookup(_fn).symbol))


def _matmul_plus_jvp(fn, product):
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


register(JVP, torch.addmm, _matmul_plus_jvp(lookup(torch.addmm).symbol, torch.matmul))
register(JVP, torch.baddbmm, _matmul_plus_jvp(lookup(torch.baddbmm).symbol, torch.matmul))


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


def _matmul_plus_batch(fn):
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
    register(BATCH, _fn, _matmul_plus_batch(lookup(_fn).symbol))


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


@register(GRAD, F.linear)
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


def _softmax_rule(fn, backward):
    def rule(x, dim, dtype=None):
        y = fn(x, dim, dtype=dtype)
        put_grad(x, backward(get_grad(y), y, canonical_dim(dim, y.dim())).to(x.dtype))
        return y

    return rule


register(GRAD, torch.softmax, _softmax_rule(torch.softmax, backward_kernels.softmax_backward))
register(GRAD, torch.log_softmax, _softmax_rule(torch.log_softmax, backward_kernels.log_softmax_backward))


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
torch_symbol(F.rms_norm, decomposition=rms_norm_decomposition, aliases=(torch.rms_norm,))  # Dynamo calls the latter
torch_symbol(F.group_norm)
torch_symbol(F.batch_norm)
# training mode with running statistics (acquire/tensor_calls.py)
batch_norm_update = impl_symbol(impls.batch_norm_update)
torch_symbol(F.normalize)
differentiated_by_eager(F.group_norm, F.batch_norm, F.normalize)
register(BATCH, F.normalize, with_dim(lookup(F.normalize).symbol, 2, "dim", 1))


@register(GRAD, F.layer_norm)
def layer_norm_grad(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    return native_layer_norm_grad(x, normalized_shape, weight, bias, eps)[0]


@register(GRAD, torch.native_layer_norm)
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


def _eager_fuses_rms_norm(x, normalized_shape, weight) -> bool:
    """Whether eager runs rms_norm for tensors like these as one fused kernel with a backward of its own (on GPUs)
    rather than as a composite of ops: asked of torch with stand-ins of the row's shape, outside the acquisition."""
    with torch._C.DisableTorchFunction(), torch.enable_grad():
        row = torch.empty(tuple(normalized_shape), dtype=x.dtype, device=x.device, requires_grad=True)
        w = None if weight is None else torch.empty(tuple(normalized_shape), dtype=weight.dtype, device=weight.device)
        return "Fused" in F.rms_norm(row, tuple(normalized_shape), w).grad_fn.name()


@register(GRAD, F.rms_norm)
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


@register(GRAD, batch_norm_update)
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


def gelu_decomposition(x, approximate: str = "none") -> Any:
    if approximate == "tanh":
        inner = prims.mul(prims.add(x, prims.mul(prims.mul(prims.mul(x, x), x), 0.044715)), math.sqrt(2 / math.pi))
        return prims.mul(prims.mul(x, 0.5), prims.add(prims.tanh(inner), 1.0))
    return prims.mul(prims.mul(x, 0.5), prims.add(prims.erf(prims.mul(x, 1 / math.sqrt(2))), 1.0))


def silu_decomposition(x, inplace: bool = False) -> Any:
    return prims.mul(x, prims.sigmoid(x))


torch_symbol(F.gelu, decomposition=gelu_decomposition)
torch_symbol(F.silu, decomposition=silu_decomposition)
# eager's backward kernel of each: its grads' bits
register(GRAD, F.gelu, kernel_grad(lambda x, approximate="none": F.gelu(x, approximate=approximate),
                                   lambda g, x, approximate="none": backward_kernels.gelu_backward(g, x, approximate)))
register(GRAD, F.silu, kernel_grad(F.silu, lambda g, x, inplace=False: backward_kernels.silu_backward(g, x)))
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
register(BATCH, F.glu, with_dim(lookup(F.glu).symbol, 1, "dim", -1))


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
# attention with dropout as eager's math kernel computes it, and its grad from the mask it drew (sdpa's grad rule)
attention_dropout = impl_symbol(impls.attention_dropout, tags=Tag.RANDOM)
attention_dropped = impl_symbol(impls.attention_dropped)
differentiated_by_eager(attention_dropped)  # by eager's backward of the attention it runs (sdpa's rule)


@register(GRAD, F.scaled_dot_product_attention)
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


@register(GRAD, F.embedding)
def embedding_grad(index, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                   sparse=False):
    if max_norm is not None or sparse or weight.dim() != 2:
        return NotImplemented
    y = F.embedding(index, weight, padding_idx, scale_grad_by_freq=scale_grad_by_freq)
    padding = -1 if padding_idx is None else padding_idx % weight.shape[0]
    put_grad(weight, embedding_backward(get_grad(y), index, weight.shape[0], padding, scale_grad_by_freq))
    return y


torch_symbol(F.one_hot)
not_differentiable(F.one_hot)  # integer
torch_symbol(F.pad, decomposition=lambda x, pad, mode="constant", value=None: prims.pad(x, tuple(pad), value or 0.0)
             if mode == "constant" else NotImplemented, aliases=(torch._C._nn.pad,))  # what F.pad calls (Dynamo graphs)
register(JVP, F.pad, linear(lookup(F.pad).symbol, (0, 3, "value")))


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


# Every convolution is a torch symbol, so autocast's conversions of its inputs are planned (transforms/autocast.py)
# as for any op; its grads are eager's backward (autodiff's fallback).
for _fn in (F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d):
    torch_symbol(_fn)
    differentiated_by_eager(_fn)


def _conv_jvp(fn, spatial: int):
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
    register(JVP, _fn, _conv_jvp(lookup(_fn).symbol, _spatial))


def _conv_batch(fn, spatial: int):
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
    register(BATCH, _fn, _conv_batch(lookup(_fn).symbol, _spatial))


torch_symbol(F.unfold)
torch_symbol(F.fold)
differentiated_by_eager(F.unfold, F.fold)


# --- with eager's grads (eager_grads.py): less common activations, distances and losses, and rrelu where it draws
# nothing (out of training; the feature and alpha dropouts are in factories.py) -------------------------------------
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
# the fused kernels nn.TransformerEncoderLayer and nn.MultiheadAttention run in eval where no grad is to be computed
# (their fast paths, taken as eager takes them: acquisition/lookasides.py)
for _name in ("_transformer_encoder_layer_fwd", "_native_multi_head_attention"):
    eager_op(getattr(torch, _name), printed=f"torch.{_name}")


eager_op(torch.rrelu, refuse=lambda x, lower=1 / 8, upper=1 / 3, training=False, generator=None: (
    "fulmen does not support torch.rrelu in training: its slopes are drawn at random, and only torch.dropout's draws "
    "are replayed for the backward; use leaky_relu, or evaluate the module in eval()") if training else None)
