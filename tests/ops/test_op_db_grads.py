"""Eager autograd as the oracle: fulmen's outputs, which of them require grad, and the grads of every floating
input equal eager's on PyTorch's OpInfo samples (float64), composites run as their decompositions (what fusion
executors compile), with the samples' own values and with values at the edges (ties, zeros, bounds, infinities,
NaN), where a decomposition or a chain rule through it can disagree with eager's kernel and eager's backward."""

from __future__ import annotations

import warnings

import pytest

from tests.ops.opdb import EDGE_VALUES, NoEagerAnswer, NotDifferentiable, grad_cases, run_grad_case, vjp_xfail_reason

CASES = list(grad_cases())


@pytest.mark.parametrize("values", list(EDGE_VALUES))
def test_grads_equal_eagers(values, summary):
    compared, no_oracle, failures = 0, 0, []
    for case in CASES:
        if vjp_xfail_reason(case):  # refused with a clear error (test_op_db_vjp checks the refusals)
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run_grad_case(case, values)
            compared += 1
        except NotDifferentiable:
            continue
        except NoEagerAnswer:
            no_oracle += 1
        except Exception as error:  # noqa: BLE001 - every sample is reported, not only the first
            failures.append(f"{case.id}: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
    summary(f"op_db grads vs eager autograd ({values} values, composites as their decompositions): {compared} "
            f"samples equal, {len(failures)} differ, {no_oracle} without an eager answer")
    assert not failures, "\n".join(failures[:30])
    assert compared >= 0.9 * len(CASES), (compared, len(CASES))  # the oracle ran on the samples
