"""The batching rules of torch-level leaves (symbols without a prim decomposition, or whose decomposition declines
some arguments): elementwise ops, ops along a dim, scatters, losses, convolutions, matmul variants. They are written
with fulmen.ops.rules.batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fulmen.ops import lookup, prims
from fulmen.ops.registry import SYMBOLS
from fulmen.ops.rules.batch import Batch, batch_matmul, broadcast, elementwise, is_tensor, shift, with_dim
from fulmen.ops.rules.tables import RuleKind, register

BATCH = RuleKind.BATCH

register(BATCH, SYMBOLS["impls.keep_history"], elementwise(SYMBOLS["impls.keep_history"]))  # its value is the new one


@register(BATCH, SYMBOLS["impls.setitem"])
def _setitem(batch: Batch, args: tuple, kwargs: dict):
    x, index, value = args
    items = index if isinstance(index, tuple) else (index,)
    if any(is_tensor(item) for item in items):
        return NotImplemented  # advanced indexing: once per example
    x = batch.materialize(x)
    if batch.batched(value):
        with torch._C.DisableTorchFunction():  # a meta tensor, not a call of the program
            region = torch.empty(x.shape[1:], device="meta")[index].dim()
        value = batch.pad_to(value, region)
    return SYMBOLS["impls.setitem"](x, (slice(None), *items), value)


@register(BATCH, torch.ops.aten.index.Tensor)
def _aten_index(batch: Batch, args: tuple, kwargs: dict):
    """`x[i, j, ...]` with index tensors for its first dims: the batch becomes one more index (the first, an
    arange over x's batch dim) or stays the first dim of the broadcast indices."""
    x, indices = args
    if kwargs or not indices or any(i is None for i in indices):
        return NotImplemented  # a full slice between indices moves the indexed dims: once per example
    example = max(i.dim() - batch.batched(i) for i in indices)
    lifted = [batch.pad_to(batch.materialize(i), example) for i in indices]
    if batch.batched(x):
        rows = torch.arange(batch.size, device=x.device)
        lifted.insert(0, prims.reshape(rows, (batch.size, *(1,) * example)))
    return torch.ops.aten.index.Tensor(x, lifted)


# --- torch-level leaves with a dim argument ------------------------------------------------------------------------
# op -> where its dim argument is: (position, keyword, default)
DIM_OPS: dict[Callable[..., Any], tuple[int, str, int | None]] = {
    F.glu: (1, "dim", -1), F.normalize: (2, "dim", 1),
    torch.narrow: (1, "dim", None), torch.Tensor.unfold: (1, "dimension", None), torch.unbind: (1, "dim", 0),
    torch.tensor_split: (2, "dim", 0),
}


def _dim_rule(fn: Callable[..., Any]):
    return with_dim(lookup(fn).symbol, *DIM_OPS[fn])


for _fn in DIM_OPS:
    register(BATCH, _fn, _dim_rule(_fn))


@register(BATCH, torch.index_add)
def _index_add(batch: Batch, args: tuple, kwargs: dict):
    x, dim, index, source = args
    if batch.batched(index):
        return NotImplemented  # each example its own indices: once per example
    return lookup(torch.index_add).symbol(batch.materialize(x), shift(dim), index, batch.materialize(source),
                                          **kwargs)


@register(BATCH, torch.index_fill)
def _index_fill(batch: Batch, args: tuple, kwargs: dict):
    x, dim, index, value = args
    if batch.batched(index) or batch.batched(value):
        return NotImplemented
    return lookup(torch.index_fill).symbol(batch.materialize(x), shift(dim), index, value)


def _scatter_like(fn: Callable[..., Any]):
    """scatter / scatter_add (x, dim, index, src): every tensor batched, the dim moved."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        x, dim, *rest = args
        rest = [batch.materialize(a) for a in rest]
        kwargs = {key: batch.materialize(value) for key, value in kwargs.items()}
        return fn(batch.materialize(x), shift(dim), *rest, **kwargs)

    return rule


for _fn in (torch.scatter, torch.scatter_add):
    register(BATCH, _fn, _scatter_like(lookup(_fn).symbol))



@register(BATCH, torch.diagonal)
def _diagonal(batch: Batch, args: tuple, kwargs: dict):
    x, offset, dim1, dim2 = _diagonal_args(args, kwargs)
    return lookup(torch.diagonal).symbol(x, offset, shift(dim1), shift(dim2))


def _diagonal_args(args: tuple, kwargs: dict) -> tuple:
    names = ("offset", "dim1", "dim2")
    defaults = dict(zip(names, (0, 0, 1)))
    values = dict(zip(names, args[1:]))
    return (args[0], *(values.get(n, kwargs.get(n, defaults[n])) for n in names))


@register(BATCH, torch.tile)
def _tile(batch: Batch, args: tuple, kwargs: dict):
    x, dims = args[0], tuple(args[1] if len(args) > 1 else kwargs["dims"])
    x = batch.pad_to(x, len(dims))
    return lookup(torch.tile).symbol(x, (1, *(1,) * (x.dim() - 1 - len(dims)), *dims))


def _scatter_into(fn, dim_position: int, dim_default: int):
    """select_scatter / slice_scatter (x, src, dim, ...): both batched, the dim moved."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        args, kwargs = list(args), dict(kwargs)
        if len(args) > dim_position:
            args[dim_position] = shift(args[dim_position])
        else:
            kwargs["dim"] = shift(kwargs.get("dim", dim_default))
        x, src = args[0], args[1] if len(args) > 1 else kwargs.pop("src")
        return fn(batch.materialize(x), batch.materialize(src), *args[2:], **kwargs)

    return rule


register(BATCH, torch.select_scatter, _scatter_into(lookup(torch.select_scatter).symbol, 2, 0))
register(BATCH, torch.slice_scatter, _scatter_into(lookup(torch.slice_scatter).symbol, 2, 0))


def _batched_matmul(batch: Batch, a: Any, b: Any) -> torch.Tensor:
    out = batch_matmul(batch, (a, b), {})
    batch.names.add(out.pname)
    return out


@register(BATCH, torch.Tensor.__rmatmul__)
def _rmatmul(batch: Batch, args: tuple, kwargs: dict):
    x, other = args
    return batch_matmul(batch, (other, x), {})


@register(BATCH, torch.outer)
def _outer(batch: Batch, args: tuple, kwargs: dict):
    a, b = (batch.materialize(x) for x in args)
    return prims.mul(prims.expand(prims.unsqueeze(a, 2), (batch.size, a.shape[1], b.shape[1])),
                     prims.expand(prims.unsqueeze(b, 1), (batch.size, a.shape[1], b.shape[1])))


def _matmul_plus(fn):
    """addmm / baddbmm: beta * input + alpha * (m1 @ m2), from the batched matmul."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        x, m1, m2 = args
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        product = _batched_matmul(batch, m1, m2)
        scaled = product if alpha == 1 else prims.mul(product, alpha)
        batch.names.add(scaled.pname)
        if beta == 0:
            return scaled
        x = x if beta == 1 else prims.mul(x, beta)
        if x is not args[0] and batch.batched(args[0]):
            batch.names.add(x.pname)
        return elementwise(prims.add)(batch, (x, scaled), {})

    return rule


for _fn in (torch.addmm, torch.baddbmm):
    register(BATCH, _fn, _matmul_plus(lookup(_fn).symbol))


def _loss(fn):
    """A pointwise loss (input, target, ..., reduction=): its unreduced form, reduced over each example's dims."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        if len(args) > 2 or any(kwargs.get(k) is not None for k in ("size_average", "reduce")):
            return NotImplemented  # the deprecated size_average / reduce arguments, or positional options
        kwargs = {k: v for k, v in kwargs.items() if k not in ("size_average", "reduce")}
        reduction = kwargs.get("reduction", "mean")
        tensors = {k: v for k, v in kwargs.items() if is_tensor(v)}
        operands = broadcast(batch, *args, *tensors.values())
        options = {k: v for k, v in kwargs.items() if k != "reduction" and not is_tensor(v)}
        per_element = fn(*operands[:2], **dict(zip(tensors, operands[2:])), **options, reduction="none")
        dims = tuple(range(1, per_element.dim()))
        if reduction == "none":
            return per_element
        if reduction == "sum":
            return prims.sum(per_element, dims) if dims else per_element
        if reduction == "mean":
            count = math.prod(per_element.shape[1:])
            return prims.div(prims.sum(per_element, dims), count) if dims else per_element
        if reduction == "batchmean":  # kl_div: the sum over the first dim of each example
            return prims.div(prims.sum(per_element, dims), per_element.shape[1] if dims else 1)
        return NotImplemented

    return rule


for _fn in (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.binary_cross_entropy, F.binary_cross_entropy_with_logits,
            F.kl_div):
    register(BATCH, _fn, _loss(lookup(_fn).symbol))


def _conv(fn, spatial: int):
    """conv1d / conv2d over a batched input with unbatched weights: the batch joins the conv's own batch."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        x, weight, *rest = args
        if batch.batched(weight) or any(batch.batched(a) for a in (*rest, *kwargs.values())):
            return NotImplemented
        example = x.shape[1:]
        rows = x.shape[0] * (example[0] if len(example) == spatial + 2 else 1)
        out = fn(prims.reshape(x, (rows, *example[-(spatial + 1):])), weight, *rest, **kwargs)
        return prims.reshape(out, (batch.size, *example[:-(spatial + 1)], *out.shape[1:]))

    return rule


for _fn, _spatial in ((F.conv1d, 1), (F.conv2d, 2)):
    register(BATCH, _fn, _conv(lookup(_fn).symbol, _spatial))


@register(BATCH, F.pad)
def _pad(batch: Batch, args: tuple, kwargs: dict):
    """pad (reflect, replicate, circular): the batch joins the input's leading (batch, channel) dims."""
    x, pad = args[0], tuple(args[1] if len(args) > 1 else kwargs["pad"])
    mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
    if mode == "constant" or any(is_tensor(a) for a in (*args[1:], *kwargs.values())):
        return NotImplemented
    example, padded = x.shape[1:], len(pad) // 2
    lead = example[: len(example) - padded]
    if len(lead) not in (1, 2):
        return NotImplemented
    rows = x.shape[0] * math.prod(lead[:-1])
    flat = prims.reshape(x, (rows, lead[-1], *example[len(lead):]))
    out = lookup(F.pad).symbol(flat, pad, mode, *args[3:], **{k: v for k, v in kwargs.items() if k not in ("pad",
                                                                                                          "mode")})
    return prims.reshape(out, (batch.size, *lead, *out.shape[2:]))



def _by_example_shape(fn):
    """atleast_1d/2d/3d: each tensor reshaped as the op reshapes one example."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        if kwargs or any(not is_tensor(a) for a in args):
            return NotImplemented
        outs = []
        for x in args:
            x = batch.materialize(x)
            with torch._C.DisableTorchFunction():  # the op on a meta example, not a call of the program
                example = tuple(fn.impl(torch.empty(x.shape[1:], device="meta")).shape)
            outs.append(prims.reshape(x, (batch.size, *example)))
        return outs[0] if len(outs) == 1 else tuple(outs)

    return rule


for _fn in (torch.atleast_1d, torch.atleast_2d, torch.atleast_3d):
    register(BATCH, _fn, _by_example_shape(lookup(_fn).symbol))


@register(BATCH, torch.roll)
def _roll(batch: Batch, args: tuple, kwargs: dict):
    x, shifts = args[0], args[1] if len(args) > 1 else kwargs["shifts"]
    dims = args[2] if len(args) > 2 else kwargs.get("dims")
    roll = lookup(torch.roll).symbol
    if dims is None:  # over each flattened example
        flat = roll(prims.reshape(x, (batch.size, math.prod(x.shape[1:]))), shifts, 1)
        return prims.reshape(flat, tuple(x.shape))
    dims = tuple(shift(d) for d in dims) if isinstance(dims, (tuple, list)) else shift(dims)
    return roll(x, shifts, dims)
