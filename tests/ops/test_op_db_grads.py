"""Eager autograd as the oracle: fulmen's outputs, which of them require grad, and the grads of every floating
input equal eager's on PyTorch's OpInfo samples (float64), composites run as their decompositions (what fusion
executors compile), with the samples' own values and with values at the edges (ties, zeros, bounds, infinities,
NaN), where a decomposition or a chain rule through it can disagree with eager's kernel and eager's backward."""

from __future__ import annotations

import pytest

from tests.ops.opdb import EDGE_VALUES, grad_cases, run_grad_case, sweep

CASES = list(grad_cases())


@pytest.mark.parametrize("values", list(EDGE_VALUES))
def test_grads_equal_eagers(values, summary):
    result = sweep(CASES, lambda case: run_grad_case(case, values))
    summary(f"op_db grads vs eager autograd ({values} values, composites as their decompositions): {result.compared} "
            f"samples equal, {len(result.failures)} differ, {result.no_oracle} without an eager answer")
    assert not result.failures, "\n".join(result.failures[:30])
    assert result.compared >= 0.9 * len(CASES), (result.compared, len(CASES))  # the oracle ran on the samples
