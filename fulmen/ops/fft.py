"""`torch.fft` and the short-time Fourier transforms, with eager's kernels. Their values are complex where the
transform's are, and their grads are eager's backward (complex values follow torch's convention: fulmen.ops.complex).

`torch.stft` is torch's Python (run inline, padding the signal first); its builtin is what is bound. `istft` is
refused under autocast, as eager ops are (`eager_grads`).
"""

from __future__ import annotations

import torch

from fulmen.ops.registry import torch_symbol
from fulmen.ops.rules.eager import eager_op
from fulmen.ops.rules.grad import differentiated_by_eager, not_differentiable

_TRANSFORMS = ("fft ifft fft2 ifft2 fftn ifftn rfft irfft rfft2 irfft2 rfftn irfftn hfft ihfft hfft2 ihfft2 hfftn "
               "ihfftn fftshift ifftshift fftfreq rfftfreq").split()
for _name in _TRANSFORMS:
    torch_symbol(getattr(torch.fft, _name))
torch_symbol(torch._C._VariableFunctions.stft, printed="torch._C._VariableFunctions.stft")
differentiated_by_eager(*(getattr(torch.fft, name) for name in _TRANSFORMS if not name.endswith("freq")),
                        torch._C._VariableFunctions.stft)
not_differentiable(torch.fft.fftfreq, torch.fft.rfftfreq)  # factories


def _istft_like(x: torch.Tensor, n_fft: int, hop_length: int | None = None, win_length: int | None = None,
                window: torch.Tensor | None = None, center: bool = True, normalized: bool = False,
                onesided: bool | None = None, length: int | None = None,
                return_complex: bool = False) -> torch.Tensor:
    """istft has no meta kernel (it checks the window's overlap-add envelope, a value). Its signal's length is
    eager's: the frames overlap-added, less the centering padding, or `length`."""
    if x.dim() not in (2, 3) or not x.dtype.is_complex:
        raise RuntimeError("istft: expected a complex tensor of 2 or 3 dimensions (batch, frequency, frames)")
    hop = hop_length if hop_length is not None else n_fft // 4
    frames = x.shape[-1]
    signal = n_fft + hop * (frames - 1) - (2 * (n_fft // 2) if center else 0)
    shape = (*x.shape[:-2], length if length is not None else signal)
    return torch.empty(shape, dtype=x.dtype if return_complex else x.dtype.to_real(), device="meta")


eager_op(torch.istft, printed="torch.istft", like=_istft_like)
