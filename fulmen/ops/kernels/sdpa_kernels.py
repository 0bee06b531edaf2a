"""Which of torch's scaled_dot_product_attention kernels eager picks for a call, asked of torch's own selector, and
how eager hands a boolean mask to that kernel.

Both the sdpa executor (which fused kernel runs a call) and the grouped-attention pass (whether a call keeps its
kernel without the repeated key/value heads) need the answer eager would give, so they ask torch rather than
restate its rules.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from fulmen.core import symbolic
from fulmen.core.proxies import TensorProxy


def _stand_in(proxy: TensorProxy, sizes: dict) -> torch.Tensor:
    shape = [symbolic.concrete(s, sizes) for s in proxy.shape]
    strides = [symbolic.concrete(s, sizes) for s in proxy.stride()]
    tensor = torch.empty_strided(shape, strides, dtype=proxy.dtype, device=proxy.device)
    return tensor.requires_grad_(proxy.requires_grad)


def eager_choice(q: TensorProxy, k: TensorProxy, v: TensorProxy, is_causal: bool, scale: float | None,
                 enable_gqa: bool = False, attn_mask: TensorProxy | None = None, dropout_p: float = 0.0) -> int:
    """The `SDPBackend` eager's `F.scaled_dot_product_attention` picks for tensors laid out like these (torch's
    selector reads shapes, strides, dtypes, devices, requires_grad, the grad mode and the backend switches, and
    needs real tensors of the device: uninitialised stand-ins, outside the acquisition). For symbolic sizes, the
    choice at the traced, the smallest and a large size; a choice that differs between them is refused."""
    given = [t for t in (q, k, v, attn_mask) if t is not None]
    choices = set()
    with torch._C.DisableTorchFunction():
        for sizes in symbolic.probes(given):
            mask = _stand_in(attn_mask, sizes) if attn_mask is not None else None
            choices.add(torch._fused_sdp_choice(_stand_in(q, sizes), _stand_in(k, sizes), _stand_in(v, sizes), mask,
                                                dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa))
    if len(choices) > 1:
        names = ", ".join(SDPBackend(c).name for c in sorted(choices))
        raise symbolic.SymbolicSizeError(f"eager's scaled_dot_product_attention picks another kernel for other "
                                         f"sequence lengths ({names})")
    return choices.pop()


# The fused kernels that take an additive mask, and the name of that argument in their schema.
_BIAS_ARGUMENT = {
    torch.ops.aten._scaled_dot_product_cudnn_attention.default: "attn_bias",
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
}


class _HandedBias(TorchDispatchMode):
    """Records the additive mask eager's `F.scaled_dot_product_attention` hands to a fused kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.bias: object = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _BIAS_ARGUMENT.get(func)
        if name is not None:
            bound = {a.name: value for a, value in zip(func._schema.arguments, args)} | kwargs
            self.bias = bound.get(name)
        return func(*args, **kwargs)


@functools.lru_cache(maxsize=64)
def boolean_mask_fill(device: torch.device, dtype: torch.dtype, backend: int) -> float | None:
    """The value eager's `F.scaled_dot_product_attention` gives the masked-out places of a boolean mask when it hands
    the mask to `backend`'s kernel as an additive bias in q's `dtype` (0 where kept). PyTorch converts in C++, with a
    value of its own per kernel and version (-inf for most; a finite one for cuDNN in some), so it is read off a
    small call of eager's with that kernel selected, on the device. None when that call fails or hands over anything
    but `where(mask, 0, fill)` of the mask's shape in `dtype`: the mask is then not restated."""
    q_shape, mask_shape = (1, 1, 16, 64), (1, 1, 16, 16)
    with torch._C.DisableTorchFunction(), _disable_current_modes():
        q = torch.zeros(q_shape, dtype=dtype, device=device)  # no draw: the program's random stream is untouched
        mask = torch.ones(mask_shape, dtype=torch.bool, device=device).tril()
        recorder = _HandedBias()
        try:
            with sdpa_kernel([SDPBackend(backend)]), recorder:
                torch.nn.functional.scaled_dot_product_attention(q, q, q, mask)
        except RuntimeError:
            return None
        bias = recorder.bias
        if type(bias) is not torch.Tensor or bias.dtype != dtype or bias.shape != mask.shape:
            return None
        fill = bias[0, 0, 0, 1]  # masked out by the lower triangle
        expected = torch.where(mask, torch.zeros((), dtype=dtype, device=device), fill)
        return fill.item() if torch.equal(bias, expected) else None
