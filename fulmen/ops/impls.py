"""Functional forms of in-place updates, as traces print them (`impls.setitem(...)`).

Acquisition turns every in-place update into one of these out-of-place calls (or the op's own out-of-place
symbol), so traces are pure until the final `prims.copy_` write-backs into the program's inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


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
