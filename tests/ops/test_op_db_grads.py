"""Eager autograd as the oracle: fulmen's outputs, which of them require grad, and the grads of every floating
input equal eager's on PyTorch's OpInfo samples (float64), composites run as their decompositions (what fusion
executors compile), with the samples' own values and with values at the edges (ties, zeros, bounds, infinities,
NaN), where a decomposition or a chain rule through it can disagree with eager's kernel and eager's backward."""

from __future__ import annotations

import pytest

from tests.ops.opdb import EDGE_VALUES, grad_cases, run_grad_case, sweep
from tests.sweeps import share

CASES = list(grad_cases())
# Each value set its share of every OpInfo's samples: together they differentiate every sample (tests/sweeps.py)
CASES_BY_VALUES = {values: share(CASES, part, len(EDGE_VALUES)) for part, values in enumerate(EDGE_VALUES)}


@pytest.mark.parametrize("values", list(EDGE_VALUES))
def test_grads_equal_eagers(values, summary):
    cases = CASES_BY_VALUES[values]
    result = sweep(cases, lambda case: run_grad_case(case, values))
    summary(f"op_db grads vs eager autograd ({values} values, composites as their decompositions): {result.compared} "
            f"samples equal, {len(result.failures)} differ, {result.no_oracle} without an eager answer")
    assert not result.failures, "\n".join(result.failures[:30])
    assert result.compared >= 0.9 * len(cases), (result.compared, len(cases))  # the oracle ran on the samples
