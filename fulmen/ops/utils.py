"""Helpers shared by decompositions: dtype promotion, broadcasting, dim canonicalization.

Decompositions run inside the trace builder with torch functions disabled, so they may read proxy metadata
(`x.shape`, `x.dtype`) and ask torch's meta kernels (`x.meta`) for shape rules directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from fulmen.core.proxies import TensorProxy
from fulmen.ops import prims


def softmax_logsumexp(x: torch.Tensor, dim: int) -> torch.Tensor:
    """torch.logsumexp over `dim` as eager's log-softmax normalises: NaN, not +inf, for a row holding +inf (eager's
    log-softmax, loss and grads are NaN throughout that row)."""
    lse = torch.logsumexp(x, dim)
    return torch.where(lse == math.inf, math.nan, lse)


def is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def is_real_number(x: Any) -> bool:
    """A Python int or float (not a bool, not a tensor)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def meta_of(x: Any) -> Any:
    return x.meta if type(x) is TensorProxy else x


def result_dtype(*args: Any, kind: str = "DEFAULT") -> torch.dtype:
    """torch's own n-ary type promotion (0-dim tensors and Python scalars are weaker than dimensioned tensors)."""
    operands = [meta_of(a) for a in args if a is not None]
    promotion = getattr(ELEMENTWISE_TYPE_PROMOTION_KIND, kind)
    return elementwise_dtypes(*operands, type_promotion_kind=promotion)[1]


def to_float(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype.is_floating_point or dtype.is_complex else torch.get_default_dtype()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype half-precision math is done in (float32); any other dtype computes in itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def convert(x: Any, dtype: torch.dtype) -> Any:
    if is_tensor(x):
        return x if x.dtype == dtype else prims.convert_element_type(x, dtype)
    if dtype == torch.bool:
        return bool(x)
    return x if dtype.is_floating_point or dtype.is_complex else int(x)


def broadcast_shape(*args: Any) -> torch.Size:
    return torch.broadcast_shapes(*(a.shape for a in args if is_tensor(a)))


def expand_to(x: Any, shape: Sequence[int]) -> Any:
    # (the lengths first: a tuple compares its items before its length, which asks a symbolic size a question)
    if not is_tensor(x) or x.dim() == len(shape) and tuple(x.shape) == tuple(shape):
        return x
    if x.dim() < len(shape):
        x = prims.reshape(x, (1,) * (len(shape) - x.dim()) + tuple(x.shape))
    return prims.expand(x, tuple(shape))


def canonical_dim(dim: int, ndim: int) -> int:
    ndim = max(ndim, 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim {dim} is out of range for a tensor of {ndim} dims")
    return dim % ndim


def canonical_dims(dims: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    if ndim == 0:
        return ()
    if dims is None or (isinstance(dims, (tuple, list)) and len(dims) == 0):
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted(canonical_dim(d, ndim) for d in dims))


def keepdim_shape(shape: Sequence[int], dims: Sequence[int]) -> tuple[int, ...]:
    return tuple(1 if i in dims else s for i, s in enumerate(shape))


def shape_arg(args: tuple) -> tuple[int, ...]:
    """`f(2, 3)` and `f((2, 3))` both name the shape (2, 3)."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args)
