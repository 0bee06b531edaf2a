"""`fulmen.vmap`: a function mapped over a batch dimension of its arguments, with torch.func.vmap's signature.

The function is acquired once on one example's shapes (fulmen.functional.derivatives.acquire) and its trace batched by
fulmen.functional.batching's rules, once per chunk of `chunk_size` examples; the results are moved to `out_dims`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch._functorch.apis
from torch.utils._pytree import _broadcast_to_and_flatten, tree_flatten, tree_leaves, tree_unflatten

from fulmen.acquisition.acquire import Interpreter, current_interpreter
from fulmen.acquisition.torch_func_calls import made_as
from fulmen.core.proxies import TensorProxy
from fulmen.functional.batching import BatchTransform, Randomness, draws_random
from fulmen.functional.derivatives import (
    Acquired,
    FunctionalTransform,
    acquire,
    fresh_proxy,
    name_of,
    transforming,
)
from fulmen.ops import prims


def _batch_dims(interpreter: Interpreter, flat: list, dims: list, name: str, in_dims: Any) -> int:
    sizes = []
    for x, d in zip(flat, dims):
        if d is None:
            continue
        if not isinstance(d, int) or isinstance(d, bool):
            raise ValueError(f"vmap({name}, in_dims={in_dims!r}, ...)(<inputs>): in_dims must hold ints or None, "
                             f"got {d!r}")
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"vmap({name}, in_dims={in_dims!r}, ...)(<inputs>): got in_dim={d} for an input of "
                             f"type {type(x).__name__}; only tensors are mapped over")
        if not -x.dim() <= d < max(x.dim(), 1) or x.dim() == 0:
            raise ValueError(f"vmap({name}, in_dims={in_dims!r}, ...)(<inputs>): got in_dim={d} for an input of "
                             f"{x.dim()} dims; expected -{x.dim()} <= in_dim < {x.dim()}")
        sizes.append(x.shape[d % x.dim()])
    if not sizes:
        raise ValueError(f"vmap({name}, in_dims={in_dims!r}, ...)(<inputs>): at least one input must be a tensor "
                         "mapped over (an in_dim that is not None)")
    if len(set(sizes)) > 1:
        raise ValueError(f"vmap: expected all tensors to have the same size in the mapped dimension, got sizes "
                         f"{sizes} for the mapped dimension")
    return sizes[0]


def _move(x: TensorProxy, source: int, destination: int) -> TensorProxy:
    if source == destination:
        return x
    order = [d for d in range(x.dim()) if d != source]
    order.insert(destination, source)
    return prims.permute(x, tuple(order))


def _vmap_inline(fn: Callable[..., Any], in_dims: Any, out_dims: Any, randomness: Randomness,
                 chunk_size: int | None, args: tuple, kwargs: dict) -> Any:
    interpreter = current_interpreter()
    name = name_of(fn)
    flat, spec = tree_flatten(args)
    dims = _broadcast_to_and_flatten(in_dims, spec)
    if dims is None:
        raise ValueError(f"vmap({name}, in_dims={in_dims!r}, ...)(<inputs>): expected in_dims to be an int, None "
                         "or a (nested) tuple matching the structure of the inputs")
    size = _batch_dims(interpreter, flat, dims, name, in_dims)
    batched_leaves = dims + [None] * len(tree_leaves(kwargs))
    moved = [_move(interpreter._values(x), d % x.dim(), 0) if d is not None else x for x, d in zip(flat, dims)]

    def make(i: int, outer: TensorProxy) -> TensorProxy:
        example = tuple(outer.shape[1:]) if batched_leaves[i] is not None else None
        return fresh_proxy(interpreter, outer, outer.requires_grad, example)

    acquired = acquire(interpreter, fn, tuple(tree_unflatten(moved, spec)), kwargs, make, "fulmen.vmap")
    # torch.func restores the RNG state before each chunk under randomness='same', so every chunk gets the first
    # one's draws: a program that draws runs as one chunk, drawing them once.
    step = size if randomness is Randomness.SAME and draws_random(acquired.trace.bound_symbols) else chunk_size or size
    chunks = []
    for start in range(0, size, step) if size else (0,):  # an empty batch is one empty chunk, as torch.func
        length = min(step, size - start)
        env, batched = {}, set()
        for fresh, outer, d in zip(acquired.fresh, acquired.outer, batched_leaves):
            if type(fresh) is not TensorProxy:
                continue
            if d is not None:
                if length != size:
                    outer = prims.slice(outer, (start, *(0,) * (outer.dim() - 1)), (start + length, *outer.shape[1:]),
                                        (1,) * outer.dim())
                batched.add(outer.pname)
            env[fresh.pname] = outer
        transform = BatchTransform(interpreter.builder, interpreter, env, batched, length, randomness)
        with transforming(interpreter):
            transform.run(acquired.trace.bound_symbols)
        chunks.append((transform, [transform.emitter.read(x) for x in acquired.results]))
    return _vmap_results(acquired, chunks, out_dims, name, size)


def _vmap_results(acquired: Acquired, chunks: list, out_dims: Any, name: str, size: int) -> Any:
    dims = _broadcast_to_and_flatten(out_dims, acquired.result_spec)
    if dims is None:
        raise ValueError(f"vmap({name}, ..., out_dims={out_dims!r}): expected out_dims to be an int, None or a "
                         "(nested) tuple matching the structure of the outputs")
    results = []
    for index, d in enumerate(dims):
        pieces = []
        for transform, values in chunks:
            value = values[index]
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"vmap({name}, ...): `{name}` must only return Tensors, got {type(value).__name__}")
            batched = transform.batch.batched(value)
            if d is None:
                if batched:
                    raise ValueError(f"vmap({name}, ..., out_dims=None): output {index} depends on the mapped inputs, "
                                     "so it has a batch dimension to put somewhere")
                pieces = [value]
                break
            pieces.append(value if batched else transform.batch.materialize(value))
        if d is None:
            results.append(pieces[0])
            continue
        value = pieces[0] if len(pieces) == 1 else prims.cat(pieces, 0)
        if not isinstance(d, int) or not -value.dim() <= d < value.dim():
            raise ValueError(f"vmap({name}, ..., out_dims={out_dims!r}): out_dim {d!r} is not a dim of an output with "
                             f"{value.dim()} dims (its batch dim included)")
        results.append(_move(value, 0, d % value.dim()))
    return tree_unflatten(results, acquired.result_spec)


def vmap(fn: Callable[..., Any], in_dims: Any = 0, out_dims: Any = 0, randomness: str = "error", *,
         chunk_size: int | None = None) -> FunctionalTransform:
    """torch.func.vmap: `fn` mapped over dim `in_dims` of its positional arguments (an int, None for arguments that
    are not mapped, or a nested tuple per argument), results stacked along `out_dims`. Keyword arguments are not
    mapped. `randomness`: "error" (random ops are refused), "same" (one draw for the whole batch, for random ops
    whose arguments are not mapped) or "different" (a draw per example). `chunk_size` maps that many examples at a
    time (less memory for the intermediate values)."""
    if not callable(fn):
        raise TypeError(f"fulmen.vmap expects a function, got {type(fn).__name__}")
    try:
        mode = Randomness(randomness)
    except ValueError:
        raise ValueError(f"fulmen.vmap: randomness must be 'error', 'same' or 'different', got {randomness!r}"
                         ) from None
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise ValueError(f"fulmen.vmap: chunk_size must be a positive int or None, got {chunk_size!r}")
    inline = functools.partial(_vmap_inline, fn, in_dims, out_dims, mode, chunk_size)
    return FunctionalTransform(lambda *args, **kwargs: inline(args, kwargs), f"vmap({name_of(fn)})")


# torch.vmap made inside a program fulmen acquires is this vmap (torch_func_calls.py)
made_as(torch._functorch.apis.vmap, "wrapped", lambda local: vmap(
    local["func"], local["in_dims"], local["out_dims"], local["randomness"], chunk_size=local["chunk_size"]))
