"""Linear + cross-entropy over chunks of rows: the loss of a language model's head without its full logits.

`logits = linear(h, weight, bias)` followed by `cross_entropy(logits.to(dtype), target)` is computed chunk by chunk
of rows (tokens): each chunk's logits exist only while that chunk is processed. Traces print these symbols as
`fused_loss.NAME(...)`:

* `linear_cross_entropy` -> the loss (forward only: what runs without grad, or what a grad rule replaces).
* `linear_cross_entropy_forward` -> (loss, *grads): reductions "mean" and "sum" have a loss whose cotangent is one
  number, so each chunk's gradients for h, weight and bias are computed in the forward while its logits are at hand;
  only those gradients are kept for the backward.
* `linear_cross_entropy_backward(g, grads)` -> the grads scaled by the loss's cotangent `g`.
* `linear_cross_entropy_rows_backward` -> grads for reduction "none", whose per-row cotangent is only known in the
  backward: it recomputes each chunk's logits there.

`wants` says which of (h, weight, bias) get a gradient (a frozen weight gets none). Numerics follow eager's: the
logits are computed in the linear's dtype, converted to `dtype` (what the cross-entropy reads: a LitGPT upcast is
`dtype=torch.float32`), and the softmax works in float32 for half-precision `dtype`; the weight's gradient is summed
over chunks in float32 and rounded once, as a single matmul over all rows would be.

`compiled=True` runs each chunk's elementwise work (log-sum-exp, softmax, its gradient) as one torch.compile'd
function instead of a series of torch ops (the "torchcompile" executor chooses it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fulmen.core.inductor import InductorFunction, layouts
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import Symbol
from fulmen.core.symbolic import hint
from fulmen.core.trace import TraceBuilder
from fulmen.ops.registry import add_symbol
from fulmen.ops.rules.grad import differentiated_by_eager, get_grad, put_grads, wants_grad
from fulmen.ops.rules.tables import RuleKind, register
from fulmen.ops.utils import compute_dtype, softmax_logsumexp

REDUCTIONS = ("mean", "sum", "none")
# Automatic chunks: each chunk's logits take at most this fraction of the full logits' bytes (so they never all
# exist at once), and at most CHUNK_BYTES (a chunk's transients are its logits, which then hold their gradient, more
# in float32 when uncompiled), but at least MIN_ROWS rows: fewer rows leave a GPU's matmuls short of work. Every
# chunk also reads and writes the weight's float32 gradient accumulator once (for Llama 3's 128,256 x 2048 head, 2 GB
# of traffic): on an H200, TinyLlama's 8192 x 32000 logits in 8 chunks made the step 4 ms slower than unfused; in 2 it
# is as fast.
CHUNK_FRACTION = 2
CHUNK_BYTES = 512 * 2**20
MIN_ROWS = 1024
# Rows per chunk are a multiple of this (matmul tiles) when there are more.
ROW_MULTIPLE = 64


def chunk_rows_for(rows: int, vocab: int, dtype: torch.dtype) -> int:
    """The automatic number of rows per chunk for `rows` x `vocab` logits of `dtype`: chunks of equal length
    (the last one may be shorter), so a compiled chunk step has one or two shapes."""
    row_bytes = vocab * dtype.itemsize
    budget = min(rows * row_bytes // CHUNK_FRACTION, CHUNK_BYTES) // row_bytes
    chunk = max(budget, MIN_ROWS)
    if chunk >= rows:
        return rows
    multiple = ROW_MULTIPLE if chunk >= ROW_MULTIPLE else 1
    chunk -= chunk % multiple
    count = -(-rows // chunk)
    even = -(-rows // count)  # the same number of chunks, balanced: never more rows than `chunk`
    return -(-even // multiple) * multiple


# --- one chunk ------------------------------------------------------------------------------------------------------
def _losses(x: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float):
    """Per-row losses of compute-dtype logits `x` (0 where ignored), which rows count, the targets as gather
    indices, and each row's log-sum-exp."""
    valid = target != ignore_index
    safe = torch.where(valid, target, 0).long().unsqueeze(1)
    lse = softmax_logsumexp(x, 1)
    picked = x.gather(1, safe).squeeze(1)
    if label_smoothing:
        # torch's smoothing: (1 - e) * nll + e * mean over classes of -log_softmax
        losses = lse - (1 - label_smoothing) * picked - label_smoothing * x.mean(1)
    else:
        losses = lse - picked
    return torch.where(valid, losses, 0.0), valid, safe, lse


def chunk_step(logits: torch.Tensor, target: torch.Tensor, row_scale: torch.Tensor, ignore_index: int,
               label_smoothing: float, dtype: torch.dtype, want_grad: bool) -> tuple[torch.Tensor, Any]:
    """Per-row losses of one chunk (compute dtype) and, when `want_grad`, the gradient of `sum(losses * row_scale)`
    with respect to `logits`, in the logits' dtype. Ignored rows have loss 0 and gradient 0.

    Owns `logits` (the chunk's own matmul output): the gradient is built in a compute-dtype copy (the logits
    themselves when they have the compute dtype) and returned in the logits' buffer, so a chunk never holds a
    gradient beside its logits."""
    x = logits.to(dtype).to(compute_dtype(dtype))
    losses, valid, safe, lse = _losses(x, target, ignore_index, label_smoothing)
    if not want_grad:
        return losses, None
    grad = x.sub_(lse.unsqueeze(1)).exp_()
    if label_smoothing:
        grad.sub_(label_smoothing / x.shape[1])
    grad.scatter_add_(1, safe, torch.full_like(lse, label_smoothing - 1).unsqueeze(1))
    grad.mul_(torch.where(valid, row_scale, 0.0).unsqueeze(1))
    return losses, _into(logits, grad, dtype)


def _into(logits: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`grad.to(dtype).to(logits.dtype)` written over `logits` (the same rounding: copy_ rounds as .to does)."""
    if grad is not logits:
        logits.copy_(grad if dtype in (grad.dtype, logits.dtype) else grad.to(dtype))
    return logits


def fusible_chunk_step(logits: torch.Tensor, target: torch.Tensor, row_scale: torch.Tensor, ignore_index: int,
                       label_smoothing: float, dtype: torch.dtype, want_grad: bool) -> tuple[torch.Tensor, Any]:
    """`chunk_step` written for Inductor: the gradient as one expression of the logits (the target's column found by
    comparison, not written by a scatter), so it is one pass that reads the logits and writes their gradient over
    them (Inductor's kernel stores into the logits' buffer). A scatter into the gradient makes Inductor write it in
    float32 and read it again. The same operations in the same order as `chunk_step`, so the same values."""
    x = logits.to(dtype).to(compute_dtype(dtype))
    losses, valid, safe, lse = _losses(x, target, ignore_index, label_smoothing)
    if not want_grad:
        return losses, None
    grad = torch.exp(x - lse.unsqueeze(1))
    if label_smoothing:
        grad = grad - label_smoothing / x.shape[1]
    is_target = torch.arange(x.shape[1], device=x.device) == safe
    grad = torch.where(is_target, grad + (label_smoothing - 1), grad)
    grad = grad * torch.where(valid, row_scale, 0.0).unsqueeze(1)
    return losses, _into(logits, grad, dtype)


def _chunk_losses(logits: torch.Tensor, target: torch.Tensor, row_scale: torch.Tensor, **spec: Any) -> torch.Tensor:
    """`fusible_chunk_step`'s losses alone: its gradient, when wanted, is left in `logits`."""
    return fusible_chunk_step(logits, target, row_scale, **spec)[0]


@functools.cache
def _compiled_step(ignore_index: int, label_smoothing: float, dtype: torch.dtype, want_grad: bool,
                   rows: tuple[frozenset[int], ...] | None = None) -> InductorFunction:
    """Compiled without Dynamo: no guards run per chunk. A static trace's chunks have one or two lengths, compiled
    once per chunk layout; a trace of symbolic rows picks its chunks from each call's rows, so its step is compiled
    for symbolic rows (`rows`: the dims that vary, per argument), once for every length."""
    step = functools.partial(_chunk_losses, ignore_index=ignore_index, label_smoothing=label_smoothing, dtype=dtype,
                             want_grad=want_grad)
    return InductorFunction(step, key=layouts) if rows is None else InductorFunction(step, dynamic=rows)


_ROWS = frozenset({0})


def _step(compiled: bool, symbolic: bool) -> Callable[..., Any]:
    if not compiled:
        return chunk_step

    def step(logits: torch.Tensor, target: torch.Tensor, row_scale: torch.Tensor, *spec: Any) -> tuple[Any, Any]:
        want_grad = spec[-1]
        rows = (_ROWS, _ROWS, _ROWS if row_scale.dim() else frozenset()) if symbolic else None
        return _compiled_step(*spec, rows)(logits, target, row_scale), logits if want_grad else None

    return step


# --- the loop over chunks -------------------------------------------------------------------------------------------
def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """acc (+)= a @ b, with a float32 `acc` for half-precision a and b (no rounding between chunks)."""
    beta = 0 if first else 1  # the first chunk ignores the uninitialised accumulator
    if acc.dtype == a.dtype:
        torch.addmm(acc, a, b, beta=beta, out=acc)
    elif acc.device.type == "cuda":
        torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)
    else:  # no mixed-dtype matmul on CPU
        torch.addmm(acc, a.to(acc.dtype), b.to(acc.dtype), beta=beta, out=acc)


def _run(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor, *,
         ignore_index: int, reduction: str, label_smoothing: float, dtype: torch.dtype, chunk_rows: int | None,
         wants: tuple[bool, bool, bool], row_scale: torch.Tensor | None, compiled: bool) -> tuple[Any, tuple]:
    """The loss (None when `row_scale` is given: a backward) and the wanted grads of `sum(losses * scale)`, where
    the scale is `row_scale` per row, or 1 / (rows not ignored) for "mean", or 1 for "sum"."""
    compute = compute_dtype(dtype)
    hidden = h.shape[-1]
    h2 = h.reshape(-1, hidden)
    rows = h2.shape[0]
    symbolic = chunk_rows is None
    if symbolic:  # a trace of symbolic rows: chosen from this call's rows, as a static trace chooses
        chunk_rows = chunk_rows_for(rows, weight.shape[0], h.dtype)
    want_grad = any(wants)
    if row_scale is None:
        count = (target != ignore_index).sum().to(compute)
        scale = 1 / count if reduction == "mean" else torch.ones((), dtype=compute, device=h.device)
        losses_all = torch.empty(rows, dtype=compute, device=h.device) if reduction == "none" else None
        total = torch.zeros((), dtype=compute, device=h.device)
    grad_h = torch.empty_like(h2) if wants[0] else None
    acc_dtype = compute_dtype(weight.dtype)
    grad_w = torch.empty(weight.shape, dtype=acc_dtype, device=weight.device) if wants[1] else None
    grad_b = torch.zeros(weight.shape[0], dtype=acc_dtype, device=weight.device) if wants[2] else None
    step = _step(compiled, symbolic)
    for start in range(0, rows, chunk_rows):
        stop = min(start + chunk_rows, rows)
        h_chunk = h2[start:stop]
        chunk_scale = row_scale[start:stop].to(compute) if row_scale is not None else scale
        losses, grad = step(F.linear(h_chunk, weight, bias), target[start:stop], chunk_scale, ignore_index,
                            label_smoothing, dtype, want_grad)
        if row_scale is None:
            if losses_all is not None:
                losses_all[start:stop] = losses
            else:
                total += losses.sum()
        if grad_h is not None:
            torch.mm(grad, weight, out=grad_h[start:stop])
        if grad_w is not None:
            _accumulate_mm(grad_w, grad.t(), h_chunk, first=start == 0)
        if grad_b is not None:
            grad_b += grad.sum(0, dtype=acc_dtype)
        del grad, losses
    grads = []
    if grad_h is not None:
        grads.append(grad_h.view(h.shape))
    if grad_w is not None:
        grads.append(grad_w.to(weight.dtype))
    if grad_b is not None:
        grads.append(grad_b.to(bias.dtype))
    if row_scale is not None:
        return None, tuple(grads)
    # torch's mean divides the sum by the rows not ignored (NaN when every row is)
    loss = losses_all if losses_all is not None else total / count if reduction == "mean" else total
    return loss.to(dtype), tuple(grads)


def linear_cross_entropy(h, weight, bias, target, *, ignore_index: int, reduction: str, label_smoothing: float,
                         dtype: torch.dtype, chunk_rows: int | None, compiled: bool = False) -> torch.Tensor:
    """`cross_entropy(linear(h, weight, bias).to(dtype).reshape(-1, V), target, ...)` without its logits."""
    loss, _ = _run(h, weight, bias, target, ignore_index=ignore_index, reduction=reduction,
                   label_smoothing=label_smoothing, dtype=dtype, chunk_rows=chunk_rows, wants=(False, False, False),
                   row_scale=None, compiled=compiled)
    return loss


def linear_cross_entropy_forward(h, weight, bias, target, *, ignore_index: int, reduction: str,
                                 label_smoothing: float, dtype: torch.dtype, chunk_rows: int | None,
                                 wants: tuple[bool, bool, bool], compiled: bool = False) -> tuple[torch.Tensor, ...]:
    """The loss ("mean" or "sum") and the gradients of the loss for the `wants` among (h, weight, bias)."""
    loss, grads = _run(h, weight, bias, target, ignore_index=ignore_index, reduction=reduction,
                       label_smoothing=label_smoothing, dtype=dtype, chunk_rows=chunk_rows, wants=wants,
                       row_scale=None, compiled=compiled)
    return (loss, *grads)


def linear_cross_entropy_backward(g: torch.Tensor, grads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The forward's gradients scaled by the loss's cotangent: one foreach launch, which for a cotangent of the
    gradients' dtype runs vectorised (`grad * g` by a 0-dim CUDA tensor takes TensorIterator's broadcasting path, at
    about two thirds of its speed on a 0.5 GB weight gradient); the same products either way."""
    return tuple(torch._foreach_mul(list(grads), g))


def linear_cross_entropy_rows_backward(g: torch.Tensor, h, weight, bias, target, *, ignore_index: int,
                                       reduction: str, label_smoothing: float, dtype: torch.dtype,
                                       chunk_rows: int | None, wants: tuple[bool, bool, bool], compiled: bool = False
                                       ) -> tuple[torch.Tensor, ...]:
    """Gradients of reduction "none" losses with per-row cotangents `g`, recomputing each chunk's logits."""
    _, grads = _run(h, weight, bias, target, ignore_index=ignore_index, reduction=reduction,
                    label_smoothing=label_smoothing, dtype=dtype, chunk_rows=chunk_rows, wants=wants, row_scale=g,
                    compiled=compiled)
    return grads


# --- symbols --------------------------------------------------------------------------------------------------------
def _new(builder: TraceBuilder, like: TensorProxy, shape: tuple[int, ...], dtype: torch.dtype,
         requires_grad: bool = False) -> TensorProxy:
    return builder.make_proxy(torch.empty(shape, dtype=dtype, device="meta"), like.device,
                              requires_grad and torch.is_grad_enabled())


def _loss_proxy(builder: TraceBuilder, h, weight, bias, target, reduction: str, dtype: torch.dtype) -> TensorProxy:
    shape = tuple(target.shape) if reduction == "none" else ()
    differentiable = any(isinstance(t, torch.Tensor) and t.requires_grad for t in (h, weight, bias))
    return _new(builder, h, shape, dtype, differentiable)


def _grad_proxies(builder: TraceBuilder, wants, *tensors) -> tuple[TensorProxy, ...]:
    return tuple(_new(builder, t, tuple(t.shape), t.dtype) for t, wanted in zip(tensors, wants) if wanted)


def _loss_meta(builder, h, weight, bias, target, *, reduction, dtype, **spec):
    return _loss_proxy(builder, h, weight, bias, target, reduction, dtype)


def _forward_meta(builder, h, weight, bias, target, *, reduction, dtype, wants, **spec):
    return (_loss_proxy(builder, h, weight, bias, target, reduction, dtype),
            *_grad_proxies(builder, wants, h, weight, bias))


def _backward_meta(builder, g, grads):
    return tuple(_new(builder, grad, tuple(grad.shape), grad.dtype) for grad in grads)


def _rows_backward_meta(builder, g, h, weight, bias, target, *, wants, **spec):
    return _grad_proxies(builder, wants, h, weight, bias)


def _chunk_scratch(*args, chunk_rows: int | None, wants: tuple[bool, bool, bool] = (False, False, False),
                   **spec) -> int:
    """What `_run` allocates and frees within a call: one chunk's logits (which then hold their gradient); for the
    uncompiled step also their compute-dtype copy (unless they have that dtype) and torch.logsumexp's temporary of
    the same size; and the fp32 accumulators of the weight and bias gradients (when those are not fp32 already)."""
    h, weight, bias = args[-4:-1]
    rows = hint(h.numel() // h.shape[-1])  # symbolic rows count as the traced call's (a cost, decided once)
    rows = min(chunk_rows or chunk_rows_for(rows, weight.shape[0], h.dtype), rows)
    per_logit = weight.element_size()
    if not spec.get("compiled"):
        compute = compute_dtype(spec.get("dtype", weight.dtype))
        per_logit += compute.itemsize * (1 if weight.dtype == compute else 2)
    scratch = rows * weight.shape[0] * per_logit
    for tensor, wanted in zip((weight, bias), wants[1:]):
        if wanted and tensor.dtype != compute_dtype(tensor.dtype):
            scratch += tensor.numel() * compute_dtype(tensor.dtype).itemsize
    return scratch


def _symbol(fn: Callable[..., Any], meta: Callable[..., Any], chunked: bool = True) -> Symbol:
    printed = f"fused_loss.{fn.__name__}"
    sym = Symbol(name=fn.__name__, printed=printed, impl=fn, meta=meta, scratch=_chunk_scratch if chunked else None)
    return add_symbol(sym)


LINEAR_CROSS_ENTROPY = _symbol(linear_cross_entropy, _loss_meta)
LINEAR_CROSS_ENTROPY_FORWARD = _symbol(linear_cross_entropy_forward, _forward_meta)
LINEAR_CROSS_ENTROPY_BACKWARD = _symbol(linear_cross_entropy_backward, _backward_meta, chunked=False)
LINEAR_CROSS_ENTROPY_ROWS_BACKWARD = _symbol(linear_cross_entropy_rows_backward, _rows_backward_meta)
# the kernels LINEAR_CROSS_ENTROPY's grad rule records (below), differentiated again by eager's
differentiated_by_eager(LINEAR_CROSS_ENTROPY_FORWARD, LINEAR_CROSS_ENTROPY_BACKWARD, LINEAR_CROSS_ENTROPY_ROWS_BACKWARD)
#: The symbols that loop over chunks (they accept `compiled=`).
CHUNKED = (LINEAR_CROSS_ENTROPY, LINEAR_CROSS_ENTROPY_FORWARD, LINEAR_CROSS_ENTROPY_ROWS_BACKWARD)


@register(RuleKind.GRAD, LINEAR_CROSS_ENTROPY)
def linear_cross_entropy_grad(h, weight, bias, target, **spec):
    wants = (wants_grad(h), wants_grad(weight), wants_grad(bias))
    if spec["reduction"] == "none":  # a cotangent per row: the backward recomputes the logits
        loss = LINEAR_CROSS_ENTROPY(h, weight, bias, target, **spec)
        grads = LINEAR_CROSS_ENTROPY_ROWS_BACKWARD(get_grad(loss), h, weight, bias, target, **spec, wants=wants)
    else:
        loss, *saved = LINEAR_CROSS_ENTROPY_FORWARD(h, weight, bias, target, **spec, wants=wants)
        grads = LINEAR_CROSS_ENTROPY_BACKWARD(get_grad(loss), tuple(saved))
    put_grads([x for x, wanted in zip((h, weight, bias), wants) if wanted], grads)
    return loss
