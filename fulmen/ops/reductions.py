"""Reductions: sum, mean, amax/amin, max/min, var/std, prod, arg-reductions, topk, sorts, scans."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fulmen.core.symbol import Symbol, Tag
from fulmen.ops import prims
from fulmen.ops.registry import TorchBinding, bind, lookup, method, torch_symbol
from fulmen.ops.rules.batch import Batch, elementwise, with_dim
from fulmen.ops.rules.eager import eager_op
from fulmen.ops.rules.grad import differentiated_by_eager, eager_grad_rule, get_grad, not_differentiable, put_grad
from fulmen.ops.rules.grad_formulas import BINARY_VJPS, keep_reduced, var_backward
from fulmen.ops.rules.jvp import Dot, binary_tangent, linear
from fulmen.ops.rules.tables import RuleKind, register
from fulmen.ops.utils import canonical_dims, convert, is_tensor, keepdim_shape


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


torch_max = torch_symbol(torch.max, decomposition=_max_min_decomposition(prims.amax, prims.maximum),
                         aliases=(method("max"),))
torch_min = torch_symbol(torch.min, decomposition=_max_min_decomposition(prims.amin, prims.minimum),
                         aliases=(method("min"),))


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
std = torch_symbol(torch.std, decomposition=lambda *a, **k: prims.sqrt(var_decomposition(*a, **k)),
                   aliases=(method("std"),))
_eager_std = eager_grad_rule(std)


@register(RuleKind.GRAD, std)
def std_grad(x, *args, **kwargs):
    """aten's std backward: no grad where the deviation is zero (the decomposition's chain rule multiplies sqrt's
    infinite slope there by a zero)."""
    dims, correction, _ = var_arguments(x, *args, **kwargs)
    if math.prod(x.shape[d] for d in dims) <= correction:
        return _eager_std(x, *args, **kwargs)  # no degrees of freedom: eager's own infinities and NaNs
    y = torch.std(x, *args, **kwargs)
    deviation = keep_reduced(y, x, dims)
    scale = torch.where(deviation == 0, 0.0, keep_reduced(get_grad(y), x, dims) / (2 * deviation))
    put_grad(x, var_backward(x, dims, correction, scale))
    return y


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


@register(RuleKind.JVP, torch.logsumexp)
def logsumexp_jvp(dot: Dot, args: tuple, kwargs: dict):
    x, dim = args[0], args[1] if len(args) > 1 else kwargs["dim"]
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    y = torch.logsumexp(x, dim, keepdim)
    kept = y if keepdim else torch.logsumexp(x, dim, True)
    return y, (dot(x) * torch.exp(x - kept)).sum(dim, keepdim=keepdim)


register(RuleKind.JVP, torch.cumsum, linear(lookup(torch.cumsum).symbol, (0,)))  # a leaf linear in its input


def _values_along(fn, dim_position: int, default_dim: int | None, keepdim_position: int | None = None):
    """Ops returning (values, indices) picked along a dim: the values' tangent is the tangent picked alike."""

    def rule(dot: Dot, args: tuple, kwargs: dict):
        dim = args[dim_position] if len(args) > dim_position else kwargs.get("dim", default_dim)
        if not isinstance(dim, int):
            return NotImplemented
        values, indices = fn(*args, **kwargs)
        keepdim = keepdim_position is None or (args[keepdim_position] if len(args) > keepdim_position
                                               else kwargs.get("keepdim", False))
        index = indices if keepdim or indices.dim() == args[0].dim() else indices.unsqueeze(dim)
        picked = torch.gather(dot(args[0]), dim, index)
        return (values, indices), (picked if keepdim or indices.dim() == args[0].dim() else picked.squeeze(dim), None)

    return rule


for _fn, _spec in ((torch.topk, (2, -1)), (torch.sort, (1, -1)), (torch.cummax, (1, None))):
    register(RuleKind.JVP, _fn, _values_along(lookup(_fn).symbol, *_spec))

# --- a dim argument: vmap moves it past the batch dim --------------------------------------------------------------
# op -> where its dim argument is: (position, keyword, default)
DIM_ARGUMENTS: dict[Callable[..., Any], tuple[int, str, int | None]] = {
    torch.logsumexp: (1, "dim", None), torch.cumsum: (1, "dim", None), torch.cumprod: (1, "dim", None),
    torch.logcumsumexp: (1, "dim", None), torch.cummax: (1, "dim", None), torch.topk: (2, "dim", -1),
    torch.sort: (1, "dim", -1), torch.argsort: (1, "dim", -1), torch.argmax: (1, "dim", None),
    torch.argmin: (1, "dim", None), torch.max: (1, "dim", None), torch.min: (1, "dim", None),
    torch.var_mean: (1, "dim", None), torch.std_mean: (1, "dim", None), torch.prod: (1, "dim", None),
    torch.all: (1, "dim", None), torch.any: (1, "dim", None), torch.count_nonzero: (1, "dim", None),
}
# dim=None reduces the flattened tensor: batched, each flattened example
FLATTENING = (torch.argmax, torch.argmin, torch.all, torch.any, torch.count_nonzero)
ELEMENTWISE_OF_TWO = (torch.max, torch.min)  # also ops of two tensors (maximum / minimum): their rules are below


def _dim_rule(fn: Callable[..., Any]):
    return with_dim(lookup(fn).symbol, *DIM_ARGUMENTS[fn], fn in FLATTENING)


for _fn in DIM_ARGUMENTS:
    if _fn not in ELEMENTWISE_OF_TWO:
        register(RuleKind.BATCH, _fn, _dim_rule(_fn))


# --- torch.max / torch.min: the full reduction, along a dim, or of two tensors elementwise -------------------------
def _extremum_grad(fn):
    def rule(x, *args, **kwargs):
        """The full reduction, as eager: ties share the cotangent evenly, and a NaN result gives it to the NaNs."""
        if args or kwargs:
            return NotImplemented
        y = fn(x)
        hit = (x == y) | (torch.isnan(x) & torch.isnan(y))
        put_grad(x, torch.where(hit, get_grad(y) / hit.sum(), 0.0).to(x.dtype))
        return y

    return rule


def _max_min_jvp(fn, elementwise: str):
    """Of two tensors elementwise (maximum / minimum), else the values along a dim."""
    along = _values_along(fn, 1, None, keepdim_position=2)

    def rule(dot: Dot, args: tuple, kwargs: dict):
        if len(args) < 2 or not is_tensor(args[1]):
            return along(dot, args, kwargs)
        a, b = args
        y = fn(a, b)
        return y, binary_tangent(BINARY_VJPS[elementwise], dot, a, b, y)

    return rule


def _max_min_batch(fn, along):
    """Of two tensors elementwise, else along a dim (`along`)."""
    pointwise = elementwise(fn)

    def rule(batch: Batch, args: tuple, kwargs: dict):
        return pointwise(batch, args, kwargs) if len(args) > 1 and is_tensor(args[1]) else along(batch, args, kwargs)

    return rule


for _fn, _sym, _elementwise in ((torch.max, torch_max, "maximum"), (torch.min, torch_min, "minimum")):
    register(RuleKind.GRAD, _sym, _extremum_grad(_fn))
    register(RuleKind.JVP, _sym, _max_min_jvp(_sym, _elementwise))
    register(RuleKind.BATCH, _sym, _max_min_batch(_sym, _dim_rule(_fn)))


# --- Statistics: covariance and correlation, binning into sorted boundaries (bucketize, searchsorted), the
# trapezoidal rule; eager's kernels and grads

for _fn in (torch.bucketize, torch.searchsorted, torch.trapezoid, torch.trapz, torch.cumulative_trapezoid):
    torch_symbol(_fn)
differentiated_by_eager(torch.trapezoid, torch.trapz, torch.cumulative_trapezoid)
not_differentiable(torch.bucketize, torch.searchsorted)  # indices


def _moment_like(fn: Any) -> Any:
    """cov and corrcoef have no meta kernel (they compare weights on the host). Their shape is set by the number of
    variables alone; their dtype, which the weights promote, by eager's kernel on one observation of each."""

    def like(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if x.dim() > 2:
            raise RuntimeError(f"{fn.__name__}(): expected input to have two or fewer dimensions but got an input "
                               f"with {x.dim()} dimensions")
        variables = x.shape[0] if x.dim() == 2 else 1
        small = torch.zeros((min(variables, 2), 1) if x.dim() == 2 else (1,), dtype=x.dtype)
        weights = {name: torch.ones(1, dtype=w.dtype) for name, w in kwargs.items()
                   if name in ("fweights", "aweights") and w is not None}
        with torch.device("cpu"):
            dtype = fn(small, *args, **{**kwargs, **weights}).dtype
        shape = (variables, variables) if x.dim() == 2 and variables != 1 else ()
        return torch.empty(shape, dtype=dtype, device="meta")

    return like


for _fn in (torch.cov, torch.corrcoef):
    bind(method(_fn.__name__), TorchBinding(eager_op(_fn, like=_moment_like(_fn))))
