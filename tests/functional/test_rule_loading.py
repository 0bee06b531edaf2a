"""The JVP and batching rules are loaded by whatever imports fulmen, into fulmen.ops.rules.tables, and their API
modules stay below the transforms (so an op's family module can hold its rules)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.func as tf

import fulmen
from fulmen.ops import lookup
from fulmen.ops.rules.tables import DuplicateRuleError, RuleKind, register, rule

ROOT = Path(__file__).resolve().parents[2]

# One rule of each family that had a rule file of its own before the rules moved next to their ops (prims, shape,
# reductions, nn, factories; factories also gives the draw predicates), by the printed name of its symbol.
EXPECTED = {
    "JVP": ["prims.exp", "prims.reshape", "torch.logsumexp", "torch.nn.functional.conv2d"],
    "BATCH": ["prims.matmul", "prims.sum", "torch.roll", "torch.max"],
    "BATCH_SAME_RANDOMNESS": ["torch.rand_like", "torch.nn.functional.dropout"],
    "DRAWS": ["torch.nn.functional.dropout"],
}

REPORT = """
import json
from fulmen.ops.rules.tables import RuleKind, table
print(json.dumps({kind.name: sorted(sym.printed for sym in table(kind)) for kind in RuleKind}))
"""


@pytest.mark.parametrize("module", ["fulmen.functional.forward_mode", "fulmen.functional.batching"])
def test_importing_an_engine_alone_loads_every_rule_file(module):
    done = subprocess.run([sys.executable, "-c", f"import {module}\n{REPORT}"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    tables = json.loads(done.stdout.splitlines()[-1])
    assert len(tables["JVP"]) > 100 and len(tables["BATCH"]) > 100
    for kind, names in EXPECTED.items():
        assert set(names) <= set(tables[kind]), (kind, set(names) - set(tables[kind]))


@pytest.mark.parametrize("path", ["fulmen/ops/rules/jvp.py", "fulmen/ops/rules/batch.py"])
def test_rule_apis_import_only_core_and_the_leaves_of_ops(path):
    leaves = {"fulmen.ops.prims", "fulmen.ops.kernels.impls", "fulmen.ops.registry", "fulmen.ops.utils"}
    imported = []
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fulmen"):
            names = [node.module] if node.module != "fulmen.ops" else [f"fulmen.ops.{a.name}" for a in node.names]
            imported += names
        elif isinstance(node, ast.Import):
            imported += [a.name for a in node.names if a.name.startswith("fulmen")]
    allowed = [m for m in imported if m.startswith(("fulmen.core", "fulmen.ops.rules.")) or m in leaves]
    assert imported and imported == allowed, set(imported) - set(allowed)


def test_a_second_jvp_or_batching_rule_is_refused():
    for kind in (RuleKind.JVP, RuleKind.BATCH):
        existing = rule(kind, lookup(torch.logsumexp).symbol)
        with pytest.raises(DuplicateRuleError, match="torch.logsumexp has"):
            register(kind, torch.logsumexp, lambda *args: NotImplemented)
        assert rule(kind, lookup(torch.logsumexp).symbol) is existing


@pytest.mark.parametrize("op", [torch.max, torch.min])
def test_one_batching_rule_of_max_and_min_batches_both_overloads(op):
    """torch.max / min of two tensors (elementwise) and along a dim: one registered rule handles both."""
    x, y = torch.randn(5, 3, 4, dtype=torch.float64), torch.randn(5, 3, 4, dtype=torch.float64)

    def of_two(a, b):
        return op(a, b)

    def along(a):
        return op(a, 1).values

    for fn, in_dims, args in ((of_two, 0, (x, y)), (of_two, (0, None), (x, y[0])), (along, 0, (x,))):
        batched = fulmen.vmap(fn, in_dims=in_dims)
        torch.testing.assert_close(batched(*args), tf.vmap(fn, in_dims=in_dims)(*args), rtol=0, atol=0)
        assert "impls.batch_loop" not in str(fulmen.last_traces(batched)[-1])  # batched by the rule, not a loop
