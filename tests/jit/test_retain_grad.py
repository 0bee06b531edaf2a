"""`retain_grad()` inside a jitted program, against eager: the call keeps the grad of the tensor it gives the caller
for the value (fulmen/runtime/output_grads.py, `Retained`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fulmen


def _returns_retained(x, w):
    y = x * w
    y.retain_grad()
    z = (x + 1).sin()
    return {"y": y, "z": z}


def _retains_an_argument(h, w):
    h.retain_grad()
    return (h * w).sum()


def _retains_an_inner_value(x, w):
    y = x * w
    y.retain_grad()  # never leaves the program: nothing to look at
    return y.sin().sum()


def _run(program: Callable[..., Any], jit: bool) -> list[tuple]:
    fn = fulmen.jit(program) if jit else program
    torch.manual_seed(0)
    x, w = torch.randn(4), torch.randn(4, requires_grad=True)
    seen = []
    for _ in range(3):  # the first call, then cache hits
        w.grad = None
        h = x * 2 + w  # a non-leaf argument
        out = fn(h if program is _retains_an_argument else x, w)
        loss = out if isinstance(out, torch.Tensor) else (out["y"] * out["y"]).sum() + out["z"].sum()
        loss.backward()
        kept = h.grad if program is _retains_an_argument else None if isinstance(out, torch.Tensor) else out["y"].grad
        seen.append((kept, w.grad.clone()))
    return seen


@pytest.mark.parametrize("program", [_returns_retained, _retains_an_argument, _retains_an_inner_value])
def test_retained_grads_match_eager(program):
    jitted, eager = _run(program, jit=True), _run(program, jit=False)
    for (kept, w_grad), (kept_eager, w_grad_eager) in zip(jitted, eager):
        torch.testing.assert_close(w_grad, w_grad_eager)
        if kept_eager is None:
            assert kept is None
        else:
            torch.testing.assert_close(kept, kept_eager)
    assert (program is _retains_an_inner_value) == (eager[0][0] is None)


def test_a_retained_output_other_outputs_were_computed_from_is_refused_at_backward():
    def program(x):
        y = x * 2
        y.retain_grad()
        return y, y.sum() * 3  # eager's y.grad has what reaches it through the second output too

    x = torch.ones(3, requires_grad=True)
    y, total = program(x)
    (y.sum() + total).backward()
    assert torch.equal(y.grad, torch.full((3,), 4.0))
    y, total = fulmen.jit(program)(x)
    with pytest.raises(fulmen.TraceError, match=r"output\[0\] .* has retain_grad\(\)"):
        (y.sum() + total).backward()


class _Keeps(nn.Module):
    def __init__(self, feeds: bool) -> None:
        super().__init__()
        self.feeds = feeds
        self.lin = nn.Linear(3, 3)
        self.register_buffer("hidden", torch.zeros(2, 3), persistent=False)

    def forward(self, x):
        self.hidden = self.lin(x)
        self.hidden.retain_grad()
        return self.hidden.tanh() if self.feeds else x.cos()


def test_a_retained_tensor_the_module_keeps_matches_eager():
    torch.manual_seed(0)
    eager, jitted_model = _Keeps(feeds=False), _Keeps(feeds=False)
    jitted_model.load_state_dict(eager.state_dict())
    jitted = fulmen.jit(jitted_model)
    for _ in range(3):
        x = torch.randn(2, 3, requires_grad=True)
        for model, fn in ((eager, eager), (jitted_model, jitted)):
            (fn(x).sum() + model.hidden.pow(2).sum()).backward()
        torch.testing.assert_close(jitted_model.hidden.grad, eager.hidden.grad)
        torch.testing.assert_close(jitted_model.lin.weight.grad, eager.lin.weight.grad)


def test_a_retained_tensor_the_module_keeps_and_the_output_uses_is_refused_at_backward():
    jitted = fulmen.jit(_Keeps(feeds=True))
    with pytest.raises(fulmen.TraceError, match=r"attribute hidden of a _Keeps module .* and output was computed"):
        jitted(torch.randn(2, 3)).sum().backward()


def test_retain_grad_on_a_value_without_grad_raises_as_eager():
    def program(x):
        x.retain_grad()
        return x * 2

    with pytest.raises(RuntimeError, match="can't retain_grad on Tensor that has requires_grad=False") as eager:
        program(torch.ones(2))
    with pytest.raises(RuntimeError, match=str(eager.value)):
        fulmen.jit(program)(torch.ones(2))
