"""The prologue: what a call must match to reuse a compiled trace.

The cache key is built from cheap reads only: the input structure (with its Python values), each tensor's shape,
dtype, device and requires_grad, the grad mode and the autocast state. Module attributes the program read are
checked after the key matched (see overrides.AttributeGuard).
"""

from __future__ import annotations

import torch


def tensor_key(tensors: list[torch.Tensor]) -> tuple:
    return tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in tensors)


def global_state_key() -> tuple:
    # the sdpa executor picks its attention kernel by torch's backend switches (torch.nn.attention.sdpa_kernel)
    attention = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled(),
                 torch.backends.cuda.mem_efficient_sdp_enabled())
    if not torch._C._is_any_autocast_enabled():
        return (torch.is_grad_enabled(), attention)
    autocast = tuple(
        (device, torch.get_autocast_dtype(device))
        for device in ("cpu", "cuda")
        if torch.is_autocast_enabled(device)
    )
    return (torch.is_grad_enabled(), attention, autocast)

