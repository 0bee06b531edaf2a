"""Traits of an op declared once, with every rule that follows from them.

An elementwise op has a diagonal Jacobian, so the formula of its inputs' cotangents (its VJP) is all there is to
say about its derivatives: the grad rule applies it to the output's cotangent, the JVP rule to the inputs' tangents
(the Jacobian is its own transpose), and the op batches by broadcasting its operands.

    elementwise_binary(prims.PRIMS["mul"], lambda a, b, y, g: (g * b, g * a))

registers the three rules of `mul`. Other traits derive one kind of rule each, and sit in the modules of their kind:
"linear in these operands" (fulmen.ops.rules.jvp.linear), "the dim is this argument"
(fulmen.ops.rules.batch.with_dim).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fulmen.core.symbol import Symbol
from fulmen.ops.rules import jvp
from fulmen.ops.rules.batch import elementwise
from fulmen.ops.rules.grad import get_grad, put_grad
from fulmen.ops.rules.grad_formulas import sum_to
from fulmen.ops.rules.tables import RuleKind, register
from fulmen.ops.utils import is_tensor

T = torch.Tensor
UnaryVjp = Callable[[T, T, T], T]  # d(x) from (x, y, g): the input, the output and the output's cotangent
BinaryVjp = Callable[[Any, Any, T, T], tuple[Any, Any]]  # (d(a), d(b)) from (a, b, y, g); a or b may be a number


def elementwise_unary(target: Symbol | Callable[..., Any], vjp: UnaryVjp) -> None:
    """Declares `target` (a symbol, or the torch callable of one) elementwise in its one tensor, with `vjp` as the
    formula of its input's cotangent: registers its grad, JVP and batching rules."""
    register(RuleKind.GRAD, target, _unary_grad(target, vjp))
    register(RuleKind.JVP, target, jvp.unary(target, vjp))
    register(RuleKind.BATCH, target, elementwise(target))


def elementwise_binary(target: Symbol | Callable[..., Any], vjp: BinaryVjp) -> None:
    """Declares `target` elementwise in two operands (broadcast against each other), with `vjp` as the formula of
    their cotangents: registers its grad, JVP and batching rules."""
    register(RuleKind.GRAD, target, _binary_grad(target, vjp))
    register(RuleKind.JVP, target, jvp.binary(target, vjp))
    register(RuleKind.BATCH, target, elementwise(target))


def _unary_grad(op: Callable[..., Any], vjp: UnaryVjp):
    def rule(x):
        y = op(x)
        put_grad(x, vjp(x, y, get_grad(y)))
        return y

    return rule


def _binary_grad(op: Callable[..., Any], vjp: BinaryVjp):
    def rule(a, b):
        y = op(a, b)
        grad_a, grad_b = vjp(a, b, y, get_grad(y))
        for x, grad in ((a, grad_a), (b, grad_b)):
            if is_tensor(x) and x.requires_grad:
                # A 0-dim CPU tensor may meet a dimensioned operand (it acts as a scalar): sum its grad down.
                put_grad(x, _to(sum_to(grad, tuple(x.shape)) if is_tensor(grad) else grad, x))
        return y

    return rule


def _to(grad: Any, like: T) -> T:
    if not isinstance(grad, torch.Tensor):
        return torch.full_like(like, grad)
    return grad if grad.dtype == like.dtype else grad.to(like.dtype)
