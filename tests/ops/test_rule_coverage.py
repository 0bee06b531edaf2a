"""Rule coverage: for every symbol a trace can record (ops.registry.SYMBOLS and prims.PRIMS), which rules it has
(fulmen.ops.rules.tables: grad, JVP, batching, randomness), whether it has a decomposition, and how autodiff
differentiates it. A symbol must say how: a grad rule, its decomposition, or, for a leaf, its family's declaration
(fulmen.ops.rules.grad: `differentiated_by_eager`, `not_differentiable`). Autodiff takes eager's backward for a leaf
that declares nothing too, so nothing would show that fulmen never decided for it: this test does.

`python -m pytest -s tests/ops/test_rule_coverage.py` prints the table, one row per symbol.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import fulmen  # noqa: F401  (registers the symbols and their rules)
from fulmen.core.symbol import Symbol, Tag
from fulmen.ops.prims import PRIMS
from fulmen.ops.registry import SYMBOLS
from fulmen.ops.rules import tables
from fulmen.ops.rules.eager import EAGER_OPS
from fulmen.ops.rules.grad import Fallback, declared_fallback, fallback_of, fallbacks
from fulmen.ops.rules.tables import RuleKind
from fulmen.transforms.autodiff import STORAGE_OPS

# Symbols of fulmen's own transforms, defined outside fulmen/ops, that declare nothing yet: their owners declare
# them when their engines' symbols move to ops (issue 46, wave 2). Both are differentiated by eager's backward
# (grad of a jvp or of a vmap that fell back to a loop), which is right for them. The list must stay exact.
NOT_DECLARED_YET: set[str] = set()  # symbols allowed to reach eager's backward undeclared: none


@dataclass(frozen=True)
class Coverage:
    sym: Symbol
    kinds: frozenset[RuleKind]
    decomposition: bool
    eager_op: bool  # made by ops.eager_grads.eager_op (refused under autocast, its meta checked)
    grad: str  # how autodiff differentiates a call that needs a grad


def symbols() -> list[Symbol]:
    seen: dict[int, Symbol] = {}
    for sym in (*SYMBOLS.values(), *PRIMS.values()):
        seen.setdefault(id(sym), sym)
    return sorted(seen.values(), key=lambda s: s.printed)


def grad_path(sym: Symbol) -> str:
    """The path autodiff (transforms/autodiff.py, GradTransform._augment and _fallback_rule) takes, in its order."""
    if tables.rule(RuleKind.GRAD, sym) is not None:
        return "rule"
    if sym.decomposition is not None:
        return "decomposition"  # a random one runs its decomposition as forward work, so it draws once
    if sym.executor is not None or sym.tags & Tag.RANDOM or sym.printed in STORAGE_OPS:
        return "refused"
    fallback = fallback_of(sym)
    return "undeclared" if fallback is None else fallback.value


def coverage() -> list[Coverage]:
    return [Coverage(sym, frozenset(kind for kind in RuleKind if tables.rule(kind, sym) is not None),
                     sym.decomposition is not None, sym in EAGER_OPS, grad_path(sym)) for sym in symbols()]


def _table(rows: list[Coverage]) -> str:
    kinds = list(RuleKind)
    header = (f"{'symbol':<58}" + "".join(f"{kind.name[:14]:>15}" for kind in kinds)
              + f"{'decomp':>8}{'eager_op':>9}  grad")
    lines = [header]
    for row in rows:
        marks = "".join(f"{'x' if kind in row.kinds else '.':>15}" for kind in kinds)
        lines.append(f"{row.sym.printed:<58}{marks}{'x' if row.decomposition else '.':>8}"
                     f"{'x' if row.eager_op else '.':>9}  {row.grad}")
    paths = collections.Counter(row.grad for row in rows)
    lines.append(f"{len(rows)} symbols; grad: " + ", ".join(f"{path} {n}" for path, n in sorted(paths.items())))
    lines.append("rules: " + ", ".join(f"{kind.name} {len(tables.table(kind))}" for kind in kinds))
    return "\n".join(lines)


def test_every_symbol_says_how_it_is_differentiated():
    rows = coverage()
    print("\n" + _table(rows))
    undeclared = sorted(row.sym.printed for row in rows if row.grad == "undeclared")
    print(f"\n{len(undeclared)} symbols without a grad rule, a decomposition or a declaration:\n  " +
          "\n  ".join(undeclared))
    assert set(undeclared) == NOT_DECLARED_YET, (
        "each symbol needs a grad rule, a decomposition, or a declaration in its family (fulmen.ops.rules.grad: "
        "differentiated_by_eager(sym) where eager's backward is right, not_differentiable(sym) where no output "
        f"carries a grad); new without one: {sorted(set(undeclared) - NOT_DECLARED_YET)}; declared now, to drop from "
        f"NOT_DECLARED_YET: {sorted(NOT_DECLARED_YET - set(undeclared))}")


def test_a_declaration_is_the_path_autodiff_takes():
    """A symbol with a grad rule or a decomposition never reaches the fallback: declaring one for it too would say
    something that never happens. eager_op's symbols are declared differentiated by eager's backward."""
    shadowed = sorted(sym.printed for sym in fallbacks() if grad_path(sym) not in (
        Fallback.EAGER_BACKWARD.value, Fallback.NOT_DIFFERENTIABLE.value))
    assert not shadowed, f"declared, but differentiated otherwise (a rule, a decomposition, refused): {shadowed}"
    assert all(declared_fallback(sym) is Fallback.EAGER_BACKWARD for sym in EAGER_OPS)


def test_every_rule_is_keyed_by_a_symbol_a_trace_records():
    """A rule keyed by a symbol no trace records would never run. Besides the ops (SYMBOLS, PRIMS) traces record
    executors' operators (fulmen.extend: a user's register_grad on one) and regions of the user's program
    (Tag.REGION: an autograd.Function call)."""
    known = {id(sym) for sym in (*SYMBOLS.values(), *PRIMS.values())}
    stray = sorted(f"{kind.name}: {sym.printed}" for kind in RuleKind for sym in tables.table(kind)
                   if id(sym) not in known and sym.executor is None and not sym.tags & Tag.REGION)
    stray += sorted(f"fallback: {sym.printed}" for sym in fallbacks() if id(sym) not in known)
    assert not stray, f"rules keyed by symbols that are not ops: {stray}"
