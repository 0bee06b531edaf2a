"""The prim set: the small, closed vocabulary every torch-level symbol decomposes into.

Prims take tensors of matching shape and dtype (decompositions insert the conversions and broadcasts) or Python
scalars. Each is executable outside a trace, so a trace printed at prim depth runs as it stands:
`from fulmen.ops import prims`.

This module holds the symbols only; their grad, JVP and batching rules sit in this package's modules by prim kind
(elementwise, reductions, shapes, indexing, factories), which fulmen.ops loads. They cannot sit here: the rules are
written with fulmen.ops.rules and fulmen.ops.utils, which are themselves written in prims (a batched operand is
`prims.expand`ed, a zero tangent is a `prims.full`), so the symbols are the layer below every rule.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fulmen.core.symbol import Symbol, Tag
from fulmen.core.trace import ALIAS

PRIMS: dict[str, Symbol] = {}


def _prim(name: str, impl: Callable[..., Any], tags: Tag = Tag.NONE, meta: Callable[..., Any] | None = None) -> Symbol:
    return _listed(Symbol(name=name, printed=f"prims.{name}", impl=impl, is_prim=True, tags=tags, meta=meta))


def _listed(sym: Symbol) -> Symbol:
    if sym.name in PRIMS:
        raise ValueError(f"prim {sym.name} is defined twice")
    PRIMS[sym.name] = sym
    return sym


# Elementwise unary prims run the torch function of the same name.
UNARY = (
    "abs neg exp exp2 expm1 log log1p log2 log10 sqrt rsqrt sin cos tan asin acos atan sinh cosh tanh asinh acosh "
    "atanh erf erfc erfinv sigmoid sign signbit floor ceil round trunc reciprocal logical_not bitwise_not isfinite "
    "isnan isinf lgamma digamma frac"
).split()
# Elementwise binary prims: operands have one dtype and shape (or are Python scalars).
BINARY = (
    "add sub mul div remainder fmod pow maximum minimum atan2 eq ne lt le gt ge bitwise_and bitwise_or bitwise_xor "
    "logical_and logical_or logical_xor copysign hypot nextafter bitwise_left_shift bitwise_right_shift"
).split()

for _name in UNARY + BINARY:
    globals()[_name] = _prim(_name, getattr(torch, _name))

where = _prim("where", torch.where)
convert_element_type = _prim("convert_element_type", lambda x, dtype: x.to(dtype))
# Meta tensors cannot be copied to a device: the output is the input's metadata on the new device.
device_put = _prim("device_put", lambda x, device: x.to(device), meta=lambda builder, x, device: builder.make_proxy(
    torch.empty_like(x.meta), torch.device(device), x.requires_grad and torch.is_grad_enabled()))
alias = _listed(ALIAS)  # core's: a trace builder records it where a call returns one of its inputs
# memory_format: the strides of the copy (eager's `clone(memory_format=...)`; preserved by default)
clone = _prim("clone", lambda x, memory_format=torch.preserve_format: x.clone(memory_format=memory_format))

# Reductions over explicit dims.
sum = _prim("sum", lambda x, dims: torch.sum(x, dims))  # noqa: A001
prod = _prim("prod", lambda x, dims: torch.prod(x, dims[0]) if len(dims) == 1 else torch.prod(x.flatten()))
amax = _prim("amax", lambda x, dims: torch.amax(x, dims))
amin = _prim("amin", lambda x, dims: torch.amin(x, dims))
var = _prim("var", lambda x, dims, correction: torch.var(x, dims, correction=correction))
argmax = _prim("argmax", lambda x, dim: torch.argmax(x, dim))
argmin = _prim("argmin", lambda x, dim: torch.argmin(x, dim))
topk = _prim("topk", lambda x, k, dim, largest, sorted: tuple(torch.topk(x, k, dim, largest, sorted)))
sort = _prim(
    "sort", lambda x, dim, descending, stable: tuple(torch.sort(x, dim=dim, descending=descending, stable=stable))
)
cumsum = _prim("cumsum", lambda x, dim: torch.cumsum(x, dim))

# Shape prims.
reshape = _prim("reshape", lambda x, shape: x.reshape(shape), Tag.VIEW)
permute = _prim("permute", lambda x, perm: x.permute(perm), Tag.VIEW)
expand = _prim("expand", lambda x, shape: x.expand(shape), Tag.VIEW)
squeeze = _prim("squeeze", lambda x, dims: x.squeeze(dims), Tag.VIEW)
unsqueeze = _prim("unsqueeze", lambda x, dim: x.unsqueeze(dim), Tag.VIEW)


def _slice_impl(x: torch.Tensor, starts: Sequence[int], ends: Sequence[int], steps: Sequence[int]) -> torch.Tensor:
    return x[tuple(builtins.slice(s, e, st) for s, e, st in zip(starts, ends, steps))]


slice = _prim("slice", _slice_impl, Tag.VIEW)  # noqa: A001
select = _prim("select", lambda x, dim, index: x.select(dim, index), Tag.VIEW)
cat = _prim("cat", lambda tensors, dim: torch.cat(tensors, dim))
flip = _prim("flip", lambda x, dims: torch.flip(x, dims))
pad = _prim("pad", lambda x, pad, value: torch.nn.functional.pad(x, pad, value=value))
take = _prim("take", lambda x, index, dim: torch.index_select(x, dim, index))
take_along_axis = _prim("take_along_axis", lambda x, index, dim: torch.gather(x, dim, index))
index_put = _prim("index_put", lambda x, indices, values, accumulate: torch.index_put(x, indices, values, accumulate))
index_copy = _prim("index_copy", lambda x, dim, index, source: torch.index_copy(x, dim, index, source))
scatter_add = _prim("scatter_add", lambda x, dim, index, src: torch.scatter_add(x, dim, index, src))
slice_scatter = _prim(
    "slice_scatter", lambda x, src, dim, start, end, step: torch.slice_scatter(x, src, dim, start, end, step)
)
select_scatter = _prim("select_scatter", lambda x, src, dim, index: torch.select_scatter(x, src, dim, index))
matmul = _prim("matmul", torch.matmul)

# Factories.
full = _prim("full", lambda shape, value, *, dtype, device: torch.full(shape, value, dtype=dtype, device=device))
iota = _prim(
    "iota",
    lambda length, start, step, *, dtype, device: torch.arange(
        start, start + length * step, step, dtype=dtype, device=device
    )[:length],
)
uniform = _prim(
    "uniform",
    lambda shape, low, high, *, dtype, device: torch.empty(shape, dtype=dtype, device=device).uniform_(low, high),
    Tag.RANDOM,
)

def _copy_impl(src: torch.Tensor, dst: torch.Tensor, bumps: int = 1) -> torch.Tensor:
    # `bumps`: how many times the program's updates bump dst's version counter in eager, one per update (0: all were
    # made through `.data`, which eager keeps off the version counter)
    if bumps == 0:
        dst.data.copy_(src)
    elif bumps == 1 or dst.is_inference():  # an inference tensor has no version counter
        dst.copy_(src)
    else:
        version = dst._version
        dst.copy_(src)
        torch._C._autograd._unsafe_set_version_counter((dst,), (version + bumps,))
    return dst


# Writes `src` into the input tensor `dst` (the functionalized form of an in-place update of a program input).
copy_ = _prim("copy_", _copy_impl, Tag.IMPURE)
