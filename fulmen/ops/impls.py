"""Functional forms of in-place updates, as traces print them (`impls.setitem(...)`).

Acquisition turns every in-place update into one of these out-of-place calls (or the op's own out-of-place
symbol), so traces are pure until the final `prims.copy_` write-backs into the program's inputs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map_only


def setitem(x: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """`x` with `x[index] = value` applied, leaving `x` untouched."""
    out = x.clone()
    out[index] = value
    return out


def copy(dst: torch.Tensor, src: Any) -> torch.Tensor:
    """The value `dst` holds after `dst.copy_(src)`."""
    if not isinstance(src, torch.Tensor):
        return torch.full_like(dst, src)
    return src.to(device=dst.device, dtype=dst.dtype).expand_as(dst).clone()


def fill(x: torch.Tensor, value: Any) -> torch.Tensor:
    """The value `x` holds after `x.fill_(value)`."""
    if isinstance(value, torch.Tensor):
        return value.to(device=x.device, dtype=x.dtype).expand_as(x).clone()
    return torch.full_like(x, value)


def batch_norm_update(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                      weight: torch.Tensor | None, bias: torch.Tensor | None, momentum: float | None,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`F.batch_norm(..., training=True)` as a pure function: its output and the running statistics it leaves. The
    update lands on copies, so recomputing it (a backward without a grad rule does) never updates the buffers again;
    acquisition writes the new statistics back once."""
    mean, var = running_mean.clone(), running_var.clone()
    out = torch.nn.functional.batch_norm(x, mean, var, weight, bias, True, momentum, eps)
    return out, mean, var


def view_scatter(
    base: torch.Tensor, value: torch.Tensor, view_fn: Callable[..., Any], args: tuple, kwargs: dict, index: int | None
) -> torch.Tensor:
    """`base` after writing `value` into the view `view_fn(base, *args, **kwargs)` (its `index`-th output)."""
    out = base.clone()
    view = view_fn(out, *args, **kwargs)
    if index is not None:
        view = view[index]
    view.copy_(value)
    return out


def torch_vjp(fn: Callable[..., Any], args: tuple, kwargs: dict, wrt: tuple[int, ...], cotangents: tuple) -> tuple:
    """Grads of `fn(*args, **kwargs)` for its `wrt`-th tensor arguments, by torch autograd on `fn` itself.

    The backward of an op fulmen has no grad rule for: it recomputes the op under autograd and pulls the
    cotangents back through it.
    """
    position = itertools.count()
    leaves: list[torch.Tensor] = []

    def leaf(t: torch.Tensor) -> torch.Tensor:
        if next(position) in wrt:
            t = t.detach().requires_grad_(True)
            leaves.append(t)
        return t

    with torch.enable_grad():
        args, kwargs = tree_map_only(torch.Tensor, leaf, (args, kwargs))
        out = fn(*args, **kwargs)
    floating = [o for o in tree_leaves(out)
                if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex())]
    pairs = [(o, g) for o, g in zip(floating, cotangents) if o.requires_grad]
    grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads))
