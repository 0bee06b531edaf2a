"""In-place updates and views on inputs and buffers: same results and same side effects as eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fulmen


def _check(fn, *inputs):
    eager_inputs = [t.clone() for t in inputs]
    jit_inputs = [t.clone() for t in inputs]
    expected = fn(*eager_inputs)
    actual = fulmen.jit(fn)(*jit_inputs)
    torch.testing.assert_close(actual, expected)
    for e, j in zip(eager_inputs, jit_inputs):
        torch.testing.assert_close(j, e)  # side effects on the inputs match
    return actual, jit_inputs


def test_add_inplace_on_input_returns_the_input():
    def f(x, y):
        return x.add_(y)

    x, y = torch.randn(3), torch.randn(3)
    out = fulmen.jit(f)(x, y)
    assert out is x  # eager identity: add_ returns its input
    _check(f, torch.randn(3), torch.randn(3))


def test_inplace_on_view_updates_base_and_sibling_views():
    def f(x):
        top, bottom = x[:2], x[2:]
        top.mul_(10)
        x[3] = -1.0
        whole = x.view(-1)
        return top + 0, bottom + 0, whole.sum()

    _check(f, torch.arange(12.0).reshape(4, 3))


def test_copy_and_index_copy_into_slices():
    def f(cache, pos, k):
        view = cache[:1, ...]
        view.index_copy_(1, pos, k)
        cache[1].copy_(k[0, 0])
        return cache * 1

    _check(f, torch.zeros(2, 5, 3), torch.tensor([1, 3]), torch.randn(1, 2, 3))


def test_slice_assignment_and_augmented_index_assignment():
    def f(x, idx, v):
        x[:, 1:3] = v
        x[idx] += 1
        return x.sum(0)

    _check(f, torch.randn(4, 4), torch.tensor([0, 2]), torch.randn(4, 2))


def test_inplace_dtype_rules_follow_eager():
    def f(x):
        return x.add_(1.5)

    with pytest.raises(fulmen.TraceError, match="can't be cast"):
        fulmen.jit(f)(torch.ones(2, dtype=torch.int64))


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("history", torch.zeros(4))

    def forward(self, x):
        self.steps.add_(1)
        self.history[1:3] = x
        return x * self.steps


def test_buffer_updates_are_written_back():
    eager = Counter()
    compiled = copy.deepcopy(eager)
    jitted = fulmen.jit(compiled)
    for _ in range(3):
        x = torch.randn(2)
        torch.testing.assert_close(jitted(x), eager(x))
    torch.testing.assert_close(compiled.steps, eager.steps)
    torch.testing.assert_close(compiled.history, eager.history)
    assert fulmen.cache_misses(jitted) == 1
    final = fulmen.last_traces(jitted)[-1].python()
    assert "prims.copy_(" in final  # the write-back is visible in the trace


class DtypeSwitch(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(3))

    def forward(self, x):
        if self.k.dtype != x.dtype:
            self.k = self.k.to(x.dtype)
        return self.k + x


def test_buffer_rebinding_reaches_the_module():
    module = DtypeSwitch()
    jitted = fulmen.jit(module)
    x = torch.randn(3, dtype=torch.float64)
    torch.testing.assert_close(jitted(x), x)
    assert module.k.dtype == torch.float64  # as eager would have left it
