"""What a JVP rule is written with: its signature, tangent helpers, and the rules that follow from an op's traits.

A JVP rule gets `dot` (a tensor's tangent, None when it is zero), then the call's arguments and keyword arguments,
and returns the call's outputs and their tangents (same structure, None for zero). It records with symbols and torch
calls on the proxies, as grad rules do, and may return NotImplemented to decline:

    @register(RuleKind.JVP, prims.where)
    def where_jvp(dot, args, kwargs):
        cond, a, b = args
        y = prims.where(cond, a, b)
        return y, torch.where(cond, tangent_or_zero(dot, a), tangent_or_zero(dot, b)).to(y.dtype)

The traits: an elementwise op's Jacobian is diagonal, so its JVP applies its VJP formula to the tangent (`unary`,
`binary`, `by_derivative`); a linear op's JVP is the op applied to the tangents (`linear`, `bilinear`); an op whose
outputs depend on its inputs' shapes alone has zero tangents (`constant`). fulmen.functional.forward_mode runs the
rules; this module imports only fulmen.core and the leaves of fulmen.ops, so an op's family module can hold them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fulmen.core import pytree
from fulmen.core.proxies import TensorProxy
from fulmen.ops import prims
from fulmen.ops.utils import is_tensor

Dot = Callable[[Any], TensorProxy | None]
JvpRule = Callable[[Dot, tuple, dict], tuple[Any, Any]]
# An elementwise derivative as the grad rules write it (fulmen/ops/prims/elementwise.py): the cotangent of the input
# from (x, y, g), or of both inputs from (a, b, y, g). Applied to a tangent it gives the output's tangent.
UnaryVjp = Callable[[Any, Any, Any], Any]
BinaryVjp = Callable[[Any, Any, Any, Any], tuple[Any, Any]]


def differentiable(x: Any) -> bool:
    return type(x) is TensorProxy and (x.dtype.is_floating_point or x.dtype.is_complex)


def zeros_like(x: TensorProxy) -> TensorProxy:
    return prims.full(tuple(x.shape), 0, dtype=x.dtype, device=x.device)


def add_tangents(*tangents: TensorProxy | None) -> TensorProxy | None:
    """The sum of the nonzero tangents (None when all are zero)."""
    present = [t for t in tangents if t is not None]
    if not present:
        return None
    total = present[0]
    for t in present[1:]:
        total = total + t
    return total


def as_tangent(t: Any, y: torch.Tensor) -> torch.Tensor:
    """A contribution to `y`'s tangent with `y`'s dtype and shape (a VJP formula may give a number, or a
    broadcastable tensor when a 0-dim operand met a dimensioned one)."""
    if not is_tensor(t):
        return torch.full_like(y, t)
    t = t.to(y.dtype) if t.dtype != y.dtype else t
    return t.expand(y.shape) if tuple(t.shape) != tuple(y.shape) else t


def tangent_or_zero(dot: Dot, x: Any) -> Any:
    """`x`'s tangent, or the number 0 (which broadcasts) for a number or a tensor without one."""
    return dot(x) if is_tensor(x) and dot(x) is not None else 0.0


# --- elementwise: the VJP formula applied to the tangent (a diagonal Jacobian is its own transpose) --------------
def unary(prim: Callable[..., Any], vjp: UnaryVjp) -> JvpRule:
    """The rule of an elementwise op of one tensor whose VJP formula is `vjp`."""

    def rule(dot: Dot, args: tuple, kwargs: dict):
        (x,) = args
        y = prim(x)
        return y, as_tangent(vjp(x, y, dot(x)), y)

    return rule


def binary(prim: Callable[..., Any], vjp: BinaryVjp) -> JvpRule:
    """The rule of an elementwise op of two tensors whose VJP formula is `vjp`."""

    def rule(dot: Dot, args: tuple, kwargs: dict):
        a, b = args
        y = prim(a, b)
        return y, binary_tangent(vjp, dot, a, b, y)

    return rule


def binary_tangent(vjp: BinaryVjp, dot: Dot, a: Any, b: Any, y: torch.Tensor) -> TensorProxy | None:
    """The tangent of `y`, an elementwise op of `a` and `b` whose VJP formula is `vjp`."""
    ta, tb = dot(a), dot(b)
    return add_tangents(None if ta is None else as_tangent(vjp(a, b, y, ta)[0], y),
                        None if tb is None else as_tangent(vjp(a, b, y, tb)[1], y))


def by_derivative(sym: Callable[..., Any], derivative: Callable[..., Any]) -> JvpRule:
    """The rule of an elementwise function of its first argument, whose derivative `derivative` gives from the
    call's arguments."""

    def rule(dot: Dot, args: tuple, kwargs: dict):
        y = sym(*args, **kwargs)
        return y, as_tangent(dot(args[0]) * derivative(*args, **kwargs), y)

    return rule


def constant(sym: Callable[..., Any]) -> JvpRule:
    """Outputs that do not depend on the values of the inputs (their shapes only): zero tangents."""

    def rule(dot: Dot, args: tuple, kwargs: dict):
        return sym(*args, **kwargs), None

    return rule


# --- linear ops: the op applied to the tangents (zeros for the operands without one) -----------------------------
def linear(fn: Callable[..., Any], operands: tuple[int | str, ...]) -> JvpRule:
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


def bilinear(fn: Callable[..., Any]) -> JvpRule:
    """The rule of `fn`, linear in each of its first two arguments (a product)."""

    def rule(dot: Dot, args: tuple, kwargs: dict):
        a, b = args[:2]
        y = fn(a, b, *args[2:], **kwargs)
        ta, tb = dot(a), dot(b)
        return y, add_tangents(None if ta is None else fn(ta, b, *args[2:], **kwargs),
                               None if tb is None else fn(a, tb, *args[2:], **kwargs))

    return rule


def _operand_tangent(dot: Dot, x: Any) -> Any:
    """`x` with its tensors replaced by their tangents and its numbers by zeros."""
    return pytree.tree_map(lambda leaf: _leaf_tangent(dot, leaf), x, pytree.is_leaf)


def _leaf_tangent(dot: Dot, x: Any) -> Any:
    if is_tensor(x):
        t = dot(x)
        return t if t is not None else zeros_like(x)
    if isinstance(x, (int, float, complex)) and not isinstance(x, bool):
        return type(x)(0)
    return x
