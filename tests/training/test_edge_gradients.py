"""Gradients at the edges, where eager's backward decides what the gradient is: no degrees of freedom, an op eager
cannot differentiate, a logit of +inf under the fused loss. (The op_db sweep in tests/ops/test_op_db_grads.py
covers the elementwise and reduction edges sample by sample.)"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import fulmen
from tests.ops.opdb import DECOMPOSED


def _grads(fn, *inputs):
    """fn's outputs and the grads of `inputs` under eager and under fulmen.jit, on copies of the same values."""
    results = []
    for run in (fn, fulmen.jit(fn)):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "degrees of freedom is <= 0"
            out = run(*leaves)
            grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
        results.append((out.detach(), grads))
    return results


@pytest.mark.parametrize("call", [
    lambda x: torch.var(x),
    lambda x: torch.var(x, 0),
    lambda x: torch.std(x),
    lambda x: torch.std(x, 0, correction=2),
    lambda x: torch.std(x, 0),
], ids=["var", "var-dim", "std", "std-correction-2", "std-dim"])
def test_reductions_without_degrees_of_freedom_give_eagers_grads(call):
    """A single element with Bessel's correction: the value and the grad are NaN (or -0) in eager. fulmen used to
    refuse the grad with a ZeroDivisionError from its own formula."""
    (want, want_grads), (got, got_grads) = _grads(call, torch.tensor([3.0], dtype=torch.float64))
    torch.testing.assert_close(got, want, equal_nan=True)
    torch.testing.assert_close(got_grads, want_grads, equal_nan=True)


def test_std_of_a_constant_row_has_eagers_zero_grad():
    x = torch.tensor([[2.0, 2.0, 2.0], [1.0, 2.0, 4.0]], dtype=torch.float64)
    (_, want), (_, got) = _grads(lambda t: t.std(1), x)
    assert torch.equal(want[0][0], torch.zeros(3, dtype=torch.float64))  # eager masks sqrt's infinite slope
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_floor_divide_is_differentiated_as_eager_refuses_to():
    x = torch.tensor([3.0, 4.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="floor_divide is not implemented"):
        torch.floor_divide(x, 2.0).sum().backward()
    program = fulmen.jit(lambda t: torch.floor_divide(t, 2.0).sum())
    with pytest.raises(RuntimeError, match="floor_divide is not implemented"):
        program(x).backward()
    # a floor division no grad reaches stays fine, as in eager
    both = fulmen.jit(lambda t: ((t * t).sum(), torch.floor_divide(t, 2.0)))
    loss, quotient = both(x)
    loss.backward()
    assert torch.equal(x.grad, 2 * x.detach()) and torch.equal(quotient, torch.tensor([1.0, 2.0]))


def test_rounding_division_has_zero_grads_even_by_zero():
    a, b = torch.tensor([1.0, 2.0, 0.0]), torch.tensor([1.0, 0.0, 0.0])
    (_, want), (_, got) = _grads(lambda p, q: torch.div(p, q, rounding_mode="floor"), a, b)
    assert all(torch.equal(g, torch.zeros(3)) for g in want)
    assert all(torch.equal(g, w) for g, w in zip(got, want))  # floor(a / b)'s chain rule gave NaN here


@pytest.mark.parametrize("target", [0, 1], ids=["target-is-the-inf-logit", "target-elsewhere"])
def test_fused_loss_row_with_an_infinite_logit_is_nan_as_in_eager(target):
    """eager's log-softmax of a row holding +inf is NaN throughout, so is its loss; torch.logsumexp alone would
    make the loss +inf (or NaN) and the row's other gradients zero."""
    h = torch.tensor([[1.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    w = torch.tensor([[math.inf, 0.0], [1.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    targets = torch.tensor([target, 0])

    def loss(h, w):
        return F.cross_entropy(F.linear(h, w), targets, reduction="none")

    program = fulmen.jit(loss)
    got = program(h, w)
    assert "linear_cross_entropy" in str(fulmen.last_traces(program)[-1])  # the fused, chunked loss ran
    torch.testing.assert_close(got, loss(h, w), equal_nan=True)
    assert got[0].isnan()


@pytest.mark.parametrize("bounds", [
    (0, 3), (None, 2.5), (-1.0, None), (math.nan, None),
    (torch.tensor([0.0, math.nan, 0.0, 6.0]), torch.tensor([3.0, 3.0, -1.0, 2.0])),
], ids=["ints", "max-only", "min-only", "nan-bound", "tensor-bounds"])
def test_clamp_values_and_grads_are_eagers_as_decomposed(bounds):
    """clamp's values as fusion executors compute them (its decomposition, prim by prim) and its grads: a NaN input
    gets no grad, a NaN tensor bound propagates, a lower bound above the upper one gives the upper one."""
    x = torch.tensor([1.0, -2.0, math.nan, 5.0], requires_grad=True)
    lower, upper = bounds

    def f(x):
        return x.clamp(lower, upper) * torch.arange(1.0, 5.0)

    want = f(x)
    got = fulmen.jit(f, executors=[DECOMPOSED])(x)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(got.nansum(), x), torch.autograd.grad(want.nansum(), x))
