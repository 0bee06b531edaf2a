"""Registration helpers for torch ops whose grad is eager's own backward.

fulmen has no grad rule of its own for these ops (pooling, upsampling, recurrent layers, less common losses): each
is declared differentiated by eager's backward (rules.grad.differentiated_by_eager), which autodiff runs with torch
autograd on the op itself in the backward (recomputing its forward there): eager's grads wherever the op is
deterministic. An op whose call changes state or draws random numbers would change or draw again when recomputed,
so such calls are refused while tracing, naming the user's line (`refuse`). Under torch.autocast they are refused
too: autocast converts values inside some of them (`F.bilinear`'s `_trilinear`, the cuDNN RNN), which the trace,
run with autocast off, would not do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fulmen.core.errors import UnsupportedOpError
from fulmen.core.symbol import Symbol, iter_proxies, map_proxies
from fulmen.core.trace import TraceBuilder, infer_device
from fulmen.ops.registry import torch_symbol
from fulmen.ops.rules.grad import differentiated_by_eager

# Why a call cannot be traced exactly, or None when it can.
Refusal = Callable[..., str | None]
EAGER_OPS: set[Symbol] = set()  # the symbols registered here (their meta checks `refuse` and autocast)


def _checked_meta(fn: Callable[..., Any], refuse: Refusal | None, like: Callable[..., Any]) -> Callable[..., Any]:
    def meta(builder: TraceBuilder, *args: Any, **kwargs: Any) -> Any:
        device = infer_device(args, kwargs)
        if torch.is_autocast_enabled(device.type):
            raise UnsupportedOpError(f"fulmen cannot trace {fn.__name__} under torch.autocast: its grads are eager's "
                                     "backward, and autocast may convert values inside it that the trace would not; "
                                     "call it outside the autocast region", builder.source)
        reason = None if refuse is None else refuse(*args, **kwargs)
        if reason is not None:
            raise UnsupportedOpError(reason, builder.source)
        meta_args, meta_kwargs = map_proxies(args, lambda p: p.meta), map_proxies(kwargs, lambda p: p.meta)
        requires_grad = torch.is_grad_enabled() and any(p.requires_grad for p in iter_proxies((args, kwargs)))
        return builder.wrap_outputs(like(*meta_args, **meta_kwargs), device, requires_grad)

    return meta


def eager_op(fn: Callable[..., Any], printed: str | None = None, refuse: Refusal | None = None,
             like: Callable[..., Any] | None = None) -> Symbol:
    """`fn` as a torch-level symbol without a decomposition, differentiated by eager's backward (`like`: what gives
    its outputs on meta tensors, where `fn` has no meta kernel)."""
    sym = torch_symbol(fn, printed=printed, meta=_checked_meta(fn, refuse, like or fn))
    EAGER_OPS.add(sym)
    differentiated_by_eager(sym)
    return sym


def nn_op(name: str, refuse: Refusal | None = None) -> Symbol:
    """`torch._C._nn.<name>`, which torch.overrides cannot name."""
    return eager_op(getattr(torch._C._nn, name), printed=f"torch._C._nn.{name}", refuse=refuse)
