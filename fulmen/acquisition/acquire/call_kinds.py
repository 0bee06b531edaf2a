"""The kinds of torch calls the interpreter (interpreter.py) tells apart before recording one: reads of metadata,
changes of global state, reads of tensor values, in-place updates of a shape, factories taking sizes; and the name a
torch callable is given in errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import resolve_name

T = torch.Tensor

# Reads of metadata: answered by the proxy itself (it carries the real shape, dtype, device, strides).
METADATA: frozenset = frozenset(
    {
        T.shape.__get__, T.dtype.__get__, T.device.__get__, T.ndim.__get__,
        T.is_cuda.__get__, T.is_cpu.__get__, T.is_meta.__get__, T.layout.__get__, T.is_sparse.__get__,
        T.is_quantized.__get__, T.is_nested.__get__, T.is_mkldnn.__get__,
        T.itemsize.__get__, T.nbytes.__get__, T.is_xpu.__get__, T.is_mps.__get__,
        T.size, T.dim, T.ndimension, T.numel, T.nelement, T.element_size, T.stride, T.is_contiguous,
        T.is_floating_point, T.is_complex, T.is_signed, T.get_device, T.__len__, T.__hash__,
        T.dim_order, T.is_conj, T.is_neg, torch.is_conj, torch.is_neg,
        torch.is_tensor, torch.is_floating_point, torch.is_complex, torch.numel, torch.result_type, torch.can_cast,
        torch.promote_types, torch.is_grad_enabled, torch.get_default_dtype, torch.is_autocast_enabled,
        torch.get_autocast_dtype, torch.is_inference_mode_enabled, torch.device,
    }
)

# Changes of global state the program makes (`with torch.no_grad():`, `with torch.autocast(...):`): applied for
# real while tracing, so the ops after them are recorded under that state.
STATE: frozenset = frozenset(
    {
        torch._C._set_grad_enabled, torch.set_autocast_enabled, torch.set_autocast_dtype,
        torch.autocast_increment_nesting, torch.autocast_decrement_nesting, torch.set_autocast_cache_enabled,
        torch.clear_autocast_cache, torch.is_autocast_cache_enabled,
    }
)

# Reads of tensor values: unknown while tracing.
DATA_DEPENDENT: frozenset = frozenset(
    {
        T.item, T.tolist, T.__bool__, T.__int__, T.__float__, T.__index__, T.__complex__, T.numpy, T.__array__,
        T.__contains__, T.nonzero, torch.nonzero, T.argwhere, torch.argwhere, torch.masked_select, T.masked_select,
        torch.unique, T.unique, torch.unique_consecutive, torch.equal, T.equal, torch.allclose, T.allclose,
        torch.is_nonzero, T.is_nonzero, torch.bincount, T.bincount, T.data_ptr, T.untyped_storage, T.__dlpack__,
    }
)


# Updates of a tensor's shape or strides in place: a trace value's metadata is fixed, and the tensor's other users
# (the caller, its views) would see the change.
SHAPE_UPDATES: frozenset = frozenset({T.unsqueeze_, T.squeeze_, T.transpose_, T.t_, T.swapdims_, T.swapaxes_,
                                      T.as_strided_, T.resize_, T.resize_as_})


# Factories whose leading arguments are sizes (all of them, or the first: torch.full's): eager reads a 0-dim integer
# tensor there as a Python int (nn.LSTM sizes its zero states by a packed sequence's batch_sizes[0]).
SIZED_FACTORIES: dict[Callable[..., Any], bool] = {torch.zeros: True, torch.ones: True, torch.empty: True,
                                                   torch.rand: True, torch.randn: True, torch.full: False}


def _describe(func: Callable[..., Any]) -> str:
    return resolve_name(func) or getattr(func, "__qualname__", repr(func))
