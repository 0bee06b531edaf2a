"""What a batching rule is written with: the `Batch` it gets, helpers, and the rules that follow from an op's traits.

Every batched value carries its batch dimension first. A batching rule gets a `Batch` (the batch size, which values
are batched, helpers to batch an unbatched operand), then the call's arguments and keyword arguments, and returns
the call's outputs for the whole batch, each with the batch dimension first; it may return NotImplemented to decline:

    @register(RuleKind.BATCH, prims.permute)
    def permute_batch(batch, args, kwargs):
        x, perm = args
        return prims.permute(x, (0, *(p % (x.dim() - 1) + 1 for p in perm)))

The traits: an op that broadcasts its tensors elementwise (`elementwise`), an op of one tensor with a dim argument
(`with_dim`; the prims' explicit `over_dims` and `at_dim`), an op whose arguments name no dim (`same_call`), a matrix
product (`batch_matmul`). fulmen.functional.batching runs the rules; this module imports only
fulmen.core and the leaves of fulmen.ops, so an op's family module can hold them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fulmen.core.proxies import TensorProxy
from fulmen.ops import prims
from fulmen.ops.utils import is_tensor


class Batch:
    """What a batching rule knows: the batch size and which values carry the batch dimension (always dim 0)."""

    def __init__(self, size: int, batched: set[str]) -> None:
        self.size = size
        self.names = batched

    def batched(self, x: Any) -> bool:
        return type(x) is TensorProxy and x.pname in self.names

    def materialize(self, x: Any) -> Any:
        """`x` with a batch dimension: an unbatched tensor is broadcast over the batch (a view)."""
        if type(x) is not TensorProxy or self.batched(x):
            return x
        return prims.expand(prims.unsqueeze(x, 0), (self.size, *x.shape))

    def pad_to(self, x: TensorProxy, ndim: int) -> TensorProxy:
        """A batched `x` with size-1 dims after the batch dim, so that one example has `ndim` dims (for
        broadcasting against operands with more dims, which would otherwise align with the batch dim)."""
        example = x.dim() - 1
        if example >= ndim:
            return x
        return prims.reshape(x, (self.size, *(1,) * (ndim - example), *x.shape[1:]))


BatchRule = Callable[[Batch, tuple, dict], Any]


def shift(dim: int) -> int:
    """A dim of one example as a dim of the batch: non-negative dims move by one, negative ones stay."""
    return dim + 1 if dim >= 0 else dim


def example_shape(batch: Batch, x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.shape[1:]) if batch.batched(x) else tuple(x.shape)


def broadcast(batch: Batch, *operands: Any) -> list[Any]:
    """The tensor operands as batches of one common shape (one example's operands broadcast together)."""
    shapes = [example_shape(batch, x) for x in operands if is_tensor(x)]
    target = tuple(torch.broadcast_shapes(*shapes)) if shapes else ()
    result = []
    for x in operands:
        if is_tensor(x):
            x = batch.pad_to(x, len(target)) if batch.batched(x) else batch.materialize(x)
            if tuple(x.shape[1:]) != target:
                x = prims.expand(batch.pad_to(x, len(target)), (batch.size, *target))
        result.append(x)
    return result


def elementwise(fn: Callable[..., Any]) -> BatchRule:
    """The rule of an op that broadcasts its tensor arguments elementwise."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        keys = list(kwargs)
        operands = broadcast(batch, *args, *(kwargs[k] for k in keys))
        return fn(*operands[: len(args)], **dict(zip(keys, operands[len(args):])))

    return rule


def with_dim(fn: Callable[..., Any], position: int, keyword: str, default: int | None,
             flatten: bool = False) -> BatchRule:
    """The rule of an op of one tensor and a `dim` argument (at `position` or `keyword`). dim=None (every dim) is
    declined, or with `flatten` (ops that then reduce the flattened tensor) taken over each flattened example."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        if any(is_tensor(a) for a in (*args[1:], *kwargs.values())) or args[0].dim() == 1:
            return NotImplemented  # tensor arguments, or a 0-dim example (dims 0 and -1 name its one element)
        args, kwargs = list(args), dict(kwargs)
        if position < len(args):
            dim = args[position]
        else:
            dim = kwargs.get(keyword, default)
        if isinstance(dim, (tuple, list)) and dim and all(type(d) is int for d in dim):
            moved: Any = type(dim)(shift(d) for d in dim)
        elif type(dim) is int:
            moved = shift(dim)
        elif dim is None and flatten and len(args) <= position:
            x = args[0]
            keepdim = kwargs.pop("keepdim", False)
            out = fn(prims.reshape(x, (batch.size, math.prod(x.shape[1:]))), **{**kwargs, keyword: 1})
            return prims.reshape(out, (batch.size, *(1,) * (x.dim() - 1))) if keepdim else out
        else:
            return NotImplemented  # None (every dim) or another overload (var_mean(x, unbiased))
        if position < len(args):
            args[position] = moved
        else:
            kwargs[keyword] = moved
        return fn(*args, **kwargs)

    return rule


def same_call(fn: Callable[..., Any]) -> BatchRule:
    """The rule of an op whose arguments name no dim of its tensors (a conversion, a pad of the last dims): the
    batch is one call, as it stands."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        return fn(*args, **kwargs)

    return rule


def over_dims(prim: Callable[..., Any], empty_means_all: bool = True) -> BatchRule:
    """The rule of a prim `(x, dims, *rest)` over explicit dims (reductions, flip). With `empty_means_all`, no dims
    means all of them, which for one example of 0 dims is none: the batch reduces a size-1 dim instead."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        x, dims, *rest = args
        if not dims and empty_means_all:
            return prim(prims.unsqueeze(x, 1), (1,), *rest)
        return prim(x, tuple(shift(d) for d in dims), *rest)

    return rule


def at_dim(prim: Callable[..., Any], position: int, zero_dim_examples: bool = False) -> BatchRule:
    """The rule of a prim with one dim argument at `position`. A 0-dim example is declined unless
    `zero_dim_examples` (where dims 0 and -1 both name its one element; an unsqueeze's dim names an output dim)."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        if args[0].dim() == 1 and not zero_dim_examples:
            return NotImplemented
        args = list(args)
        args[position] = shift(args[position])
        return prim(*args)

    return rule


def batch_matmul(batch: Batch, args: tuple, kwargs: dict):
    """The rule of prims.matmul, and the batched product other rules build on (addmm, rmatmul)."""
    a, b = args
    batched_a, batched_b = batch.batched(a), batch.batched(b)
    ndim_a, ndim_b = len(example_shape(batch, a)), len(example_shape(batch, b))
    if ndim_a == 1:  # one example's vector times a matrix: a row vector, squeezed off the result
        a = prims.unsqueeze(a, a.dim() - 1)
    if ndim_b == 1:
        b = prims.unsqueeze(b, b.dim())
    # One example's batch dims broadcast right-aligned: pad the batched operands so the batch dims align.
    ndim = max(ndim_a, ndim_b, 2)
    a = batch.pad_to(a, ndim) if batched_a else a
    b = batch.pad_to(b, ndim) if batched_b else b
    out = prims.matmul(a, b)
    if ndim_a == 1:
        out = prims.squeeze(out, (out.dim() - 2,))
    if ndim_b == 1:
        out = prims.squeeze(out, (out.dim() - 1,))
    return out
