"""Reductions: sum, mean, amax/amin, max/min, var/std, prod, arg-reductions, topk, sorts, scans."""

from __future__ import annotations

from typing import Any

import torch

from fulmen.core.symbol import Symbol, Tag
from fulmen.ops import prims
from fulmen.ops.registry import method, torch_symbol
from fulmen.ops.rules.grad import differentiated_by_eager, not_differentiable
from fulmen.ops.utils import canonical_dims, convert, keepdim_shape


def _finish(out: Any, x: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> Any:
    return prims.reshape(out, keepdim_shape(x.shape, dims)) if keepdim and dims else out


def _numpy_names(decomposition):
    """Accepts torch's NumPy spellings `axis=` and `keepdims=` (`x.mean(axis=2)`) as `dim=` and `keepdim=`."""

    def normalized(x, *args, **kwargs) -> Any:
        for numpy_name, name in (("axis", "dim"), ("keepdims", "keepdim")):
            if numpy_name in kwargs:
                kwargs[name] = kwargs.pop(numpy_name)
        return decomposition(x, *args, **kwargs)

    return normalized


def sum_decomposition(x, dim=None, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> Any:
    if dtype is None and (not x.dtype.is_floating_point and not x.dtype.is_complex):
        dtype = torch.int64
    x = convert(x, dtype) if dtype is not None else x
    dims = canonical_dims(dim, x.dim())
    total = prims.sum(x, dims)
    # the prim sums integers into int64; a narrower dtype asked for wraps as eager's accumulation does
    total = convert(total, dtype) if total.dtype != x.dtype else total
    return _finish(total, x, dims, keepdim)


torch_symbol(torch.sum, decomposition=_numpy_names(sum_decomposition), aliases=(method("sum"),))


def mean_decomposition(x, dim=None, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> Any:
    x = convert(x, dtype) if dtype is not None else x
    dims = canonical_dims(dim, x.dim())
    count = 1
    for d in dims:
        count *= x.shape[d]
    total = prims.sum(x, dims)
    return _finish(prims.div(total, count), x, dims, keepdim)


torch_symbol(torch.mean, decomposition=_numpy_names(mean_decomposition), aliases=(method("mean"),))


def _extremum_decomposition(prim: Symbol):
    def decomposition(x, dim=None, keepdim: bool = False) -> Any:
        dims = canonical_dims(dim, x.dim())
        return _finish(prim(x, dims), x, dims, keepdim)

    return decomposition


torch_symbol(torch.amax, decomposition=_numpy_names(_extremum_decomposition(prims.amax)), aliases=(method("amax"),))
torch_symbol(torch.amin, decomposition=_numpy_names(_extremum_decomposition(prims.amin)), aliases=(method("amin"),))


def _max_min_decomposition(reduce: Symbol, binary: Symbol):
    def decomposition(x, *args, **kwargs) -> Any:
        if not args and not kwargs:
            return reduce(x, tuple(range(x.dim())))
        if args and isinstance(args[0], torch.Tensor):
            return NotImplemented  # elementwise max(a, b): left to torch's own rule
        return NotImplemented  # (values, indices) over a dim: one torch-level op

    return decomposition


torch_symbol(torch.max, decomposition=_max_min_decomposition(prims.amax, prims.maximum), aliases=(method("max"),))
torch_symbol(torch.min, decomposition=_max_min_decomposition(prims.amin, prims.minimum), aliases=(method("min"),))


@_numpy_names
def var_arguments(x, dim=None, unbiased=None, keepdim: bool = False, *, correction=None
                  ) -> tuple[tuple[int, ...], Any, bool]:
    """The reduced dims, the correction and keepdim of a call of torch.var or torch.std, in any of its spellings."""
    if isinstance(dim, bool):  # var(x, unbiased)
        dim, unbiased = None, dim
    if correction is None:
        correction = 0 if unbiased is False else 1
    return canonical_dims(dim, x.dim()), correction, keepdim


def var_decomposition(x, *args, **kwargs) -> Any:
    dims, correction, keepdim = var_arguments(x, *args, **kwargs)
    return _finish(prims.var(x, dims, correction), x, dims, keepdim)


torch_symbol(torch.var, decomposition=var_decomposition, aliases=(method("var"),))
torch_symbol(torch.std, decomposition=lambda *a, **k: prims.sqrt(var_decomposition(*a, **k)),
             aliases=(method("std"),))
torch_symbol(torch.var_mean)
torch_symbol(torch.std_mean)
torch_symbol(torch.prod, aliases=(method("prod"),))
torch_symbol(torch.argmax, aliases=(method("argmax"),))
torch_symbol(torch.argmin, aliases=(method("argmin"),))
torch_symbol(torch.all, aliases=(method("all"),))
torch_symbol(torch.any, aliases=(method("any"),))
torch_symbol(torch.count_nonzero, aliases=(method("count_nonzero"),))
torch_symbol(torch.logsumexp, aliases=(method("logsumexp"),))
torch_symbol(torch.norm, aliases=(method("norm"),))
torch_symbol(torch.linalg.vector_norm)
torch_symbol(torch.topk, aliases=(method("topk"),))
torch_symbol(torch.sort, aliases=(method("sort"),))
torch_symbol(torch.argsort, aliases=(method("argsort"),))
torch_symbol(torch.cumsum, aliases=(method("cumsum"),))
torch_symbol(torch.diff, aliases=(method("diff"),))
torch_symbol(method("sum_to_size"))
torch_symbol(torch.histc, aliases=(method("histc"),), tags=Tag.NO_GRAD)  # counts: eager gives them no grad
torch_symbol(torch.cumprod, aliases=(method("cumprod"),))
torch_symbol(torch.cummax, aliases=(method("cummax"),))
torch_symbol(torch.logcumsumexp, aliases=(method("logcumsumexp"),))
differentiated_by_eager(torch.var_mean, torch.std_mean, torch.prod, torch.logsumexp, torch.norm,
                        torch.linalg.vector_norm, torch.topk, torch.sort, torch.cumsum, torch.diff,
                        method("sum_to_size"), torch.cumprod, torch.cummax, torch.logcumsumexp)
not_differentiable(torch.argmax, torch.argmin, torch.all, torch.any, torch.count_nonzero, torch.argsort)  # integers
