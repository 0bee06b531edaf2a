"""Reductions asked for a result dtype (`dtype=`), on integers and booleans: op_db's samples leave `dtype=` out, and
integer sums are where accumulation and wrapping show."""

from __future__ import annotations

import pytest
import torch

import fulmen

INPUTS = {
    "int8": torch.tensor([[100, 100, -3], [-128, 127, 1]], dtype=torch.int8),
    "uint8": torch.tensor([[200, 100, 3], [255, 0, 1]], dtype=torch.uint8),
    "bool": torch.tensor([[True, True, False], [True, False, False]]),
}
DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", INPUTS)
def test_sums_products_and_scans_in_the_dtype_asked_for(name, dtype):
    def f(x):
        sums = (x.sum(dtype=dtype), x.sum(1, keepdim=True, dtype=dtype), torch.sum(x, (0, 1), dtype=dtype))
        if dtype is torch.bool:  # eager has no boolean products or scans
            return sums
        return (*sums, x.prod(dtype=dtype), x.cumsum(1, dtype=dtype), x.cumprod(0, dtype=dtype))

    x = INPUTS[name]
    for got, want in zip(fulmen.jit(f)(x), f(x), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # uint8 products overflow float16
