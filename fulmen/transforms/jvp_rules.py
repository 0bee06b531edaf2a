"""The JVP rules: every prim with floating outputs, and the torch-level leaves that are linear or common in
backward traces. Symbols not here are differentiated through their decomposition, or by torch's forward-mode AD.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fulmen.ops import lookup, prims
from fulmen.ops.registry import SYMBOLS
from fulmen.transforms.jvp import JVP_RULES, Dot, add_tangents, register_jvp, zeros_like
from fulmen.transforms.vjp_prims import BINARY_VJPS, UNARY_VJPS, _keepdim


def _tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _as_tangent(t: Any, y: torch.Tensor) -> torch.Tensor:
    """A contribution to `y`'s tangent with `y`'s dtype and shape (a VJP formula may give a number, or a
    broadcastable tensor when a 0-dim operand met a dimensioned one)."""
    if not _tensor(t):
        return torch.full_like(y, t)
    t = t.to(y.dtype) if t.dtype != y.dtype else t
    return t.expand(y.shape) if tuple(t.shape) != tuple(y.shape) else t


# --- elementwise: the VJP formula applied to the tangent (a diagonal Jacobian is its own transpose) --------------
def _unary(prim, vjp):
    def rule(dot: Dot, args: tuple, kwargs: dict):
        (x,) = args
        y = prim(x)
        return y, _as_tangent(vjp(x, y, dot(x)), y)

    return rule


for _name, _vjp in UNARY_VJPS.items():
    JVP_RULES[getattr(prims, _name)] = _unary(getattr(prims, _name), _vjp)


def _binary(prim, vjp):
    def rule(dot: Dot, args: tuple, kwargs: dict):
        a, b = args
        y = prim(a, b)
        ta, tb = dot(a), dot(b)
        return y, add_tangents(None if ta is None else _as_tangent(vjp(a, b, y, ta)[0], y),
                               None if tb is None else _as_tangent(vjp(a, b, y, tb)[1], y))

    return rule


for _name, _vjp in BINARY_VJPS.items():
    JVP_RULES[getattr(prims, _name)] = _binary(getattr(prims, _name), _vjp)


@register_jvp(prims.where)
def _where(dot: Dot, args: tuple, kwargs: dict):
    cond, a, b = args
    y = prims.where(cond, a, b)
    ta, tb = dot(a), dot(b)
    return y, torch.where(cond, ta if ta is not None else 0.0, tb if tb is not None else 0.0).to(y.dtype)


# --- linear ops: the op applied to the tangents (zeros for the operands without one) -----------------------------
def _operand_tangent(dot: Dot, x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return type(x)(_operand_tangent(dot, item) for item in x)
    if _tensor(x):
        t = dot(x)
        return t if t is not None else zeros_like(x)
    if isinstance(x, (int, float, complex)) and not isinstance(x, bool):
        return type(x)(0)
    return x


def linear(fn: Callable[..., Any], operands: tuple[int | str, ...]):
    """The rule of `fn`, linear in the arguments at `operands` (positions or keywords) taken together."""

    def rule(dot: Dot, args: tuple, kwargs: dict):
        y = fn(*args, **kwargs)
        targs, tkwargs = list(args), dict(kwargs)
        for operand in operands:
            if isinstance(operand, int) and operand < len(targs):
                targs[operand] = _operand_tangent(dot, targs[operand])
            elif isinstance(operand, str) and operand in tkwargs:
                tkwargs[operand] = _operand_tangent(dot, tkwargs[operand])
        return y, fn(*targs, **tkwargs)

    return rule


PRIM_OPERANDS: dict[str, tuple[int, ...]] = {
    **dict.fromkeys(("convert_element_type", "device_put", "alias", "clone", "sum", "cumsum", "reshape", "permute",
                     "expand", "squeeze", "unsqueeze", "slice", "select", "cat", "flip", "take",
                     "take_along_axis"), (0,)),
    "pad": (0, 2), "index_put": (0, 2), "index_copy": (0, 3), "scatter_add": (0, 3), "slice_scatter": (0, 1),
    "select_scatter": (0, 1),
}
for _name, _operands in PRIM_OPERANDS.items():
    JVP_RULES[prims.PRIMS[_name]] = linear(prims.PRIMS[_name], _operands)

_EVERY_POSITIONAL = tuple(range(64))  # ops of any number of tensors (torch.broadcast_tensors(*tensors))
T = torch.Tensor
# Torch-level leaves (no prim decomposition) linear in the arguments at these positions or keywords.
TORCH_OPERANDS: dict[Callable[..., Any], tuple[int | str, ...]] = {
    **dict.fromkeys((torch.narrow, torch.diagonal, T.unfold, torch.roll, T.repeat, torch.tile, torch.hstack,
                     torch.vstack, torch.unbind, torch.tensor_split, torch.take_along_dim, torch.cumsum), (0,)),
    **dict.fromkeys((torch.broadcast_tensors, torch.atleast_1d, torch.atleast_2d, torch.atleast_3d),
                    _EVERY_POSITIONAL),
    torch.index_add: (0, 3, "source"), torch.scatter_add: (0, 3, "src"), torch.index_fill: (0, 3, "value"),
    torch.index_put: (0, 2, "values"), torch.masked_scatter: (0, 2), torch.slice_scatter: (0, 1, "src"),
    torch.select_scatter: (0, 1, "src"), torch.diagonal_scatter: (0, 1, "src"),
}
for _fn, _operands in TORCH_OPERANDS.items():
    _sym = lookup(_fn).symbol
    JVP_RULES[_sym] = linear(_sym, _operands)
# fulmen's functional forms of in-place updates
for _name, _operands in (("setitem", (0, 2)), ("copy", (1,)), ("fill", (1,)), ("view_scatter", (0, 1))):
    JVP_RULES[SYMBOLS[f"impls.{_name}"]] = linear(SYMBOLS[f"impls.{_name}"], _operands)


@register_jvp(torch.scatter)
def _scatter(dot: Dot, args: tuple, kwargs: dict):
    if "reduce" in kwargs:
        return NotImplemented
    return linear(lookup(torch.scatter).symbol, (0, 3, "src", "value"))(dot, args, kwargs)


# --- bilinear ------------------------------------------------------------------------------------------------------
def _bilinear(fn: Callable[..., Any]):
    def rule(dot: Dot, args: tuple, kwargs: dict):
        a, b = args[:2]
        y = fn(a, b, *args[2:], **kwargs)
        ta, tb = dot(a), dot(b)
        return y, add_tangents(None if ta is None else fn(ta, b, *args[2:], **kwargs),
                               None if tb is None else fn(a, tb, *args[2:], **kwargs))

    return rule


for _sym in (prims.matmul, *(lookup(fn).symbol for fn in (torch.matmul, torch.outer, T.__rmatmul__))):
    JVP_RULES[_sym] = _bilinear(_sym)


# --- reductions and selections -------------------------------------------------------------------------------------
def _extremum(prim):
    def rule(dot: Dot, args: tuple, kwargs: dict):
        x, dims = args
        y = prim(x, dims)
        hit = (x == _keepdim(y, x, dims)).to(x.dtype)
        return y, (dot(x) * hit).sum(dims) / hit.sum(dims)

    return rule


JVP_RULES[prims.amax] = _extremum(prims.amax)
JVP_RULES[prims.amin] = _extremum(prims.amin)


@register_jvp(prims.var)
def _var(dot: Dot, args: tuple, kwargs: dict):
    x, dims, correction = args
    y = prims.var(x, dims, correction)
    n = 1
    for d in dims:
        n *= x.shape[d]
    centered = x - _keepdim(x.mean(dims), x, dims)
    return y, (centered * dot(x)).sum(dims) * (2.0 / max(n - correction, 0))


def _sorted_values(prim, dim_position: int):
    def rule(dot: Dot, args: tuple, kwargs: dict):
        values, indices = prim(*args)
        dim = args[dim_position]
        return (values, indices), (torch.gather(dot(args[0]), dim, indices), None)

    return rule


JVP_RULES[prims.topk] = _sorted_values(prims.topk, 2)
JVP_RULES[prims.sort] = _sorted_values(prims.sort, 1)


@register_jvp(torch.logsumexp)
def _logsumexp(dot: Dot, args: tuple, kwargs: dict):
    x, dim = args[0], args[1] if len(args) > 1 else kwargs["dim"]
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    y = torch.logsumexp(x, dim, keepdim)
    kept = y if keepdim else torch.logsumexp(x, dim, True)
    return y, (dot(x) * torch.exp(x - kept)).sum(dim, keepdim=keepdim)

