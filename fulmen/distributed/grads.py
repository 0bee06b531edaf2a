"""Gradient clipping by the global norm of a distributed model's gradients."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from fulmen.distributed.setup import unwrap_module
from fulmen.distributed.specs import spec_of


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scales the gradients in place so their global norm is at most `max_norm`; returns that norm.

    The norm is the one of the full (unsharded, rank-averaged) gradients, so every rank clips by the same factor
    and the result equals `torch.nn.utils.clip_grad_norm_` on one process: sharded gradients contribute their
    shard's part (summed across ranks, their padding rows are zero), replicated ones count once.
    """
    params = [p for p in unwrap_module(model).parameters() if p.grad is not None]
    specs = [spec_of(p) for p in params]
    sharded = [p.grad for p, spec in zip(params, specs) if spec is not None and spec.sharded]
    replicated = [p.grad for p, spec in zip(params, specs) if spec is None or not spec.sharded]
    # the sharded parameters' group (fsdp may have been applied to a submodule only)
    group = next((spec.state.group for spec in specs if spec is not None and spec.sharded), None)
    device = params[0].grad.device if params else torch.device("cpu")
    norm_type = float(norm_type)

    def local(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), device=device)
        return torch.nn.utils.get_total_norm(grads, norm_type).to(device=device, dtype=torch.float32)

    if math.isinf(norm_type):
        total = local(sharded)
        if sharded:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        total = torch.maximum(total, local(replicated))
    else:
        total = local(sharded) ** norm_type
        if sharded:
            dist.all_reduce(total, group=group)
        total = (total + local(replicated) ** norm_type) ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so they cannot be "
                           "clipped; pass error_if_nonfinite=False to clip anyway")
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
