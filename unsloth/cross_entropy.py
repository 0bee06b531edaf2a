"""Cross-entropy over rows of logits: Triton kernels for the per-row loss and log-sum-exp, and for the gradient.

Forward: each row's log-sum-exp is reduced by one program per `CHUNK` columns (online max and sum over `BLOCK`-wide
tiles, in fp32 whatever the logits' dtype); rows wider than `CHUNK` (vocabularies above 64k) get several programs
whose partial log-sum-exps a second kernel combines. loss = lse - logits[target]; 0 where target == ignore_index;
NaN for any other target outside [0, vocab), where torch would raise a device-side assert.

Backward: dlogits = (softmax(logits) - onehot(target)) * dloss per row, from the saved log-sum-exp, in the logits'
dtype. `dloss` is one value per row (reduction="none") or a 0-dim tensor shared by every row (sum, mean).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 65536  # the most columns one program reduces: wider rows are split, and their partial results combined
BLOCK = 4096  # columns per tile


@triton.jit
def _shift(running_max):
    """What to subtract before exp: the max, or 0 where nothing but -inf was seen (-inf - -inf would be NaN)."""
    return tl.where(running_max == float("-inf"), 0.0, running_max)


@triton.jit
def _row_loss(logits_row, target_ptr, row, lse, n_cols, ignore_index):
    target = tl.load(target_ptr + row)
    in_range = (target >= 0) & (target < n_cols)
    picked = tl.load(logits_row + target, mask=in_range & (target != ignore_index), other=0.0).to(tl.float32)
    loss = tl.where(in_range, lse - picked, float("nan"))
    return tl.where(target == ignore_index, 0.0, loss)


@triton.jit
def _forward_kernel(logits, row_stride, target, losses, lse_out, partial, n_cols, ignore_index, n_chunks,
                    CHUNK: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    logits_row = logits + row * row_stride
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, n_cols)
    # Per lane: the running max and the sum of exp(x - max) so far.
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    for offset in range(start, end, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        x = tl.load(logits_row + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        shift = _shift(new_max)
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
    # a chunk of nothing but -inf (a masked vocabulary) has lse -inf, which the combination ignores
    row_shift = _shift(tl.max(lane_max, 0))
    lse = row_shift + tl.log(tl.sum(lane_sum * tl.exp(lane_max - row_shift), 0))
    if SINGLE:
        tl.store(lse_out + row, lse)
        tl.store(losses + row, _row_loss(logits_row, target, row, lse, n_cols, ignore_index))
    else:
        tl.store(partial + row * n_chunks + chunk, lse)


@triton.jit
def _combine_kernel(logits, row_stride, target, losses, lse_out, partial, n_cols, ignore_index, n_chunks,
                    BLOCK_CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_CHUNKS)
    parts = tl.load(partial + row * n_chunks + offsets, mask=offsets < n_chunks, other=float("-inf"))
    top = _shift(tl.max(parts, 0))
    lse = top + tl.log(tl.sum(tl.exp(parts - top), 0))
    tl.store(lse_out + row, lse)
    tl.store(losses + row, _row_loss(logits + row * row_stride, target, row, lse, n_cols, ignore_index))


@triton.jit
def _backward_kernel(dlogits, logits, row_stride, target, lse, dloss, dloss_stride, n_cols, ignore_index,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(logits + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    target_col = tl.load(target + row)
    scale = tl.load(dloss + row * dloss_stride).to(tl.float32)
    scale = tl.where((target_col < 0) | (target_col >= n_cols), float("nan"), scale)
    scale = tl.where(target_col == ignore_index, 0.0, scale)
    grad = (tl.exp(x - tl.load(lse + row)) - tl.where(cols == target_col, 1.0, 0.0)) * scale
    tl.store(dlogits + row * n_cols + cols, grad.to(dlogits.dtype.element_ty), mask=mask)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def forward(logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
            chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, lse), both fp32 of shape (rows,), for 2-D `logits` (rows, vocab) and int64 `target` (rows,)."""
    if chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    logits, target = _rows(logits), target.contiguous()
    n_rows, n_cols = logits.shape
    losses = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(losses)
    if n_rows == 0:
        return losses, lse
    n_chunks = triton.cdiv(n_cols, chunk)
    block = min(BLOCK, chunk, triton.next_power_of_2(n_cols))
    partial = torch.empty((n_rows, n_chunks), dtype=torch.float32, device=logits.device) if n_chunks > 1 else lse
    _forward_kernel[(n_rows, n_chunks)](
        logits, logits.stride(0), target, losses, lse, partial, n_cols, ignore_index, n_chunks,
        CHUNK=chunk, BLOCK=block, SINGLE=n_chunks == 1, num_warps=8 if block >= 2048 else 4,
    )
    if n_chunks > 1:
        _combine_kernel[(n_rows,)](logits, logits.stride(0), target, losses, lse, partial, n_cols, ignore_index,
                                   n_chunks, BLOCK_CHUNKS=triton.next_power_of_2(n_chunks))
    return losses, lse


def backward(dloss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
             ignore_index: int) -> torch.Tensor:
    """d loss / d logits, in the logits' dtype; `dloss`: (rows,) or a 0-dim tensor applied to every row."""
    logits, target = _rows(logits), target.contiguous()
    n_rows, n_cols = logits.shape
    dlogits = torch.empty((n_rows, n_cols), dtype=logits.dtype, device=logits.device)
    if n_rows == 0:
        return dlogits
    dloss = dloss.contiguous()
    block = min(BLOCK, triton.next_power_of_2(n_cols))
    _backward_kernel[(n_rows, triton.cdiv(n_cols, block))](
        dlogits, logits, logits.stride(0), target, lse, dloss, 0 if dloss.dim() == 0 else 1, n_cols, ignore_index,
        BLOCK=block, num_warps=8 if block >= 2048 else 4,
    )
    return dlogits
