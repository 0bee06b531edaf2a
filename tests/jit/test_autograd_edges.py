"""Autograd edge cases of a jitted program against eager: what fulmen cannot give exactly is refused, never guessed.

Oracle: eager PyTorch running the same program on the same inputs (values, grads, errors).
"""

from __future__ import annotations

import pytest
import torch

import fulmen
from fulmen.core.errors import TraceError


def _complex_leaf() -> torch.Tensor:
    return torch.randn(3, dtype=torch.complex128, generator=torch.Generator().manual_seed(0)).requires_grad_()


@pytest.mark.parametrize(
    "fn",
    [lambda x: x * (1 + 2j), lambda x: x.exp(), lambda x: (x * x).sin(), lambda x: 1 / x],
    ids=["mul", "exp", "sin", "reciprocal"],
)
def test_differentiating_a_complex_tensor_is_refused_naming_it_and_the_line(fn):
    eager = _complex_leaf()
    fn(eager).real.sum().backward()
    assert eager.grad is not None  # eager differentiates it: fulmen's real-valued rules would conjugate its grad

    with pytest.raises(TraceError, match=r"(?s)complex tensor x .*test_autograd_edges\.py"):
        fulmen.jit(fn)(_complex_leaf())


def test_complex_values_without_grad_still_compute_as_eager():
    x = _complex_leaf().detach()
    torch.testing.assert_close(fulmen.jit(lambda x: (x * x).exp())(x), (x * x).exp(), rtol=0, atol=0)
