"""What fulmen knows about an op beyond its symbol: one table per kind of rule, keyed by symbol, filled through
`register` alone.

    @register(RuleKind.GRAD, torch.softmax)
    def softmax_grad(x, dim, dtype=None): ...

A symbol has at most one rule of a kind: a second registration is refused unless it says `replace=True` (what
`fulmen.register_grad` and the other extension points do, since their users replace a rule on purpose). The
transforms that run rules (autodiff, forward mode, batching) only read these tables, through `rule` and `table`.
A target is a symbol or a torch callable bound to one (ops/registry.py), so every table has one kind of key.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from fulmen.core.symbol import Symbol
from fulmen.ops.registry import symbol_of


class RuleKind(enum.Enum):
    """The kinds of rule an op may have; the value says what one is, for messages."""

    GRAD = "a grad rule"  # reverse mode: records the op's forward and puts the grads of its inputs (autodiff)
    JVP = "a JVP rule"  # forward mode: the tangent of each output from the inputs' tangents (forward_mode)
    BATCH = "a batching rule"  # vmap: the op over a batch dimension of its arguments (batching)
    BATCH_SAME_RANDOMNESS = "a batching rule for randomness='same'"  # a random op whose draw vmap shares
    DRAWS = "a draw predicate"  # whether a call of a random op draws at all (dropout with p=0 does not)
    # Rules that hold for complex values (torch's convention: conjugate Wirtinger derivatives); a call on complex
    # values takes these alone, else eager's own derivative (fulmen.ops.complex)
    COMPLEX_GRAD = "a grad rule for complex values"
    COMPLEX_JVP = "a JVP rule for complex values"


class DuplicateRuleError(ValueError):
    """A second rule of one kind for one symbol, without `replace=True`."""


Rule = TypeVar("Rule", bound=Callable[..., Any])

_TABLES: dict[RuleKind, dict[Symbol, Callable[..., Any]]] = {kind: {} for kind in RuleKind}


def register(kind: RuleKind, target: Symbol | Callable[..., Any], rule: Rule | None = None, *,
             replace: bool = False) -> Any:
    """Makes `rule` the `kind` rule of `target` (a symbol, or a torch callable bound to one). Without `rule`, a
    decorator that registers the function it decorates. A symbol that has a rule of this kind keeps it unless
    `replace` is set: a second registration is an error, so two files can never silently disagree on an op."""
    sym = symbol_of(target, kind.value)

    def decorator(fn: Rule) -> Rule:
        existing = _TABLES[kind].get(sym)
        if existing is not None and existing is not fn and not replace:
            raise DuplicateRuleError(
                f"{sym.printed} has {kind.value} already ({_where(existing)}); a second one ({_where(fn)}) needs "
                f"replace=True")
        _TABLES[kind][sym] = fn
        return fn

    return decorator if rule is None else decorator(rule)


def remove(kind: RuleKind, target: Symbol | Callable[..., Any]) -> Callable[..., Any] | None:
    """Takes `target`'s `kind` rule out of its table (for tests and extensions that put one back), returning it."""
    return _TABLES[kind].pop(symbol_of(target, kind.value), None)


def rule(kind: RuleKind, sym: Symbol) -> Callable[..., Any] | None:
    """The `kind` rule of `sym`, or None."""
    return _TABLES[kind].get(sym)


def table(kind: RuleKind) -> Mapping[Symbol, Callable[..., Any]]:
    """The `kind` rules, read-only: rules are added through `register` alone."""
    return types.MappingProxyType(_TABLES[kind])


def _where(fn: Callable[..., Any]) -> str:
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", type(fn).__name__)
    return f"{name} at {code.co_filename}:{code.co_firstlineno}" if code is not None else name
