"""Eager autocast as the oracle: on PyTorch's OpInfo samples under CPU autocast (bfloat16), fulmen's outputs have
eager's dtypes and bits, and its grads equal eager's, for float32 inputs (autocast's conversions, stated in the
trace) and for bfloat16 inputs (ops that convert only under autocast)."""

from __future__ import annotations

import pytest
import torch

from tests.ops.opdb import autocast_cases, run_autocast_case, sweep
from tests.sweeps import share

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_autocast_equals_eagers(dtype, summary):
    # each input dtype its share of every OpInfo's samples: together they run each sample index of every OpInfo, in
    # one dtype or the other (tests/sweeps.py)
    cases = share(autocast_cases(dtype), DTYPES.index(dtype), len(DTYPES))
    result = sweep(cases, run_autocast_case)
    summary(f"op_db under CPU autocast (bfloat16), {dtype} inputs: {result.compared} samples equal eager's (outputs "
            f"bit for bit), {len(result.failures)} differ")
    assert not result.failures, "\n".join(result.failures[:30])
    assert result.compared >= 0.9 * len(cases), (result.compared, len(cases))
