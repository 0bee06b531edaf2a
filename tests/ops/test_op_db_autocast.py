"""Eager autocast as the oracle: on PyTorch's OpInfo samples under CPU autocast (bfloat16), fulmen's outputs have
eager's dtypes and bits, and its grads equal eager's, for float32 inputs (autocast's conversions, stated in the
trace) and for bfloat16 inputs (ops that convert only under autocast)."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.ops.opdb import NoEagerAnswer, autocast_cases, run_autocast_case, vjp_xfail_reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_autocast_equals_eagers(dtype, summary):
    compared, failures = 0, []
    cases = list(autocast_cases(dtype))
    for case in cases:
        if vjp_xfail_reason(case):  # refused with a clear error (test_op_db_vjp checks the refusals)
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run_autocast_case(case)
            compared += 1
        except NoEagerAnswer:
            continue
        except Exception as error:  # noqa: BLE001 - every sample is reported, not only the first
            failures.append(f"{case.id}: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
    summary(f"op_db under CPU autocast (bfloat16), {dtype} inputs: {compared} samples equal eager's (outputs bit "
            f"for bit), {len(failures)} differ")
    assert not failures, "\n".join(failures[:30])
    assert compared >= 0.9 * len(cases), (compared, len(cases))
