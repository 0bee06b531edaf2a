"""`fulmen.distributed.clip_grad_norm_` on an undistributed module equals torch's, for every norm type, and refuses
non-finite norms when asked. (Distributed modules: the parity tests clip on 2 ranks.)"""

from __future__ import annotations

import math

import pytest
import torch

import fulmen.distributed as fd
from tests.distributed.workers import make_model


def _with_grads(seed: int = 0) -> torch.nn.Module:
    model = make_model(seed)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_matches_torch(norm_type):
    ours, theirs = _with_grads(), _with_grads()
    got = fd.clip_grad_norm_(ours, 0.5, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5, norm_type)
    torch.testing.assert_close(got, want)
    assert got > 0.5  # so the gradients were scaled
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_non_finite_norm():
    model = _with_grads()
    next(model.parameters()).grad[0, 0] = math.nan
    with pytest.raises(RuntimeError, match="non-finite"):
        fd.clip_grad_norm_(model, 0.5, error_if_nonfinite=True)
    assert torch.isnan(fd.clip_grad_norm_(model, 0.5))
