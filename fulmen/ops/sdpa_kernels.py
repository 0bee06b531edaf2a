"""Which of torch's scaled_dot_product_attention kernels eager picks for a call, asked of torch's own selector.

Both the sdpa executor (which fused kernel runs a call) and the grouped-attention pass (whether a call keeps its
kernel without the repeated key/value heads) need the answer eager would give, so they ask torch rather than
restate its rules.
"""

from __future__ import annotations

import torch

from fulmen.core.proxies import TensorProxy


def _stand_in(proxy: TensorProxy) -> torch.Tensor:
    tensor = torch.empty_strided(proxy.shape, proxy.stride(), dtype=proxy.dtype, device=proxy.device)
    return tensor.requires_grad_(proxy.requires_grad)


def eager_choice(q: TensorProxy, k: TensorProxy, v: TensorProxy, is_causal: bool, scale: float | None,
                 enable_gqa: bool = False, attn_mask: TensorProxy | None = None, dropout_p: float = 0.0) -> int:
    """The `SDPBackend` eager's `F.scaled_dot_product_attention` picks for tensors laid out like these (torch's
    selector reads shapes, strides, dtypes, devices, requires_grad, the grad mode and the backend switches, and
    needs real tensors of the device: uninitialised stand-ins, outside the acquisition)."""
    with torch._C.DisableTorchFunction():
        mask = _stand_in(attn_mask) if attn_mask is not None else None
        return torch._fused_sdp_choice(_stand_in(q), _stand_in(k), _stand_in(v), mask, dropout_p, is_causal,
                                       scale=scale, enable_gqa=enable_gqa)
