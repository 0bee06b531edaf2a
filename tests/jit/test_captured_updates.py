"""In-place updates of tensors the program captured (a global's, an object's attribute: a KV cache, a counter,
running statistics kept outside a module) are written back as an argument's are, against eager on the same calls:
values, the captured tensors afterwards, views and aliasing, autograd history, and cache hits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fulmen


class _Holder:
    def __init__(self) -> None:
        self.cache = torch.zeros(2, 5)
        self.steps = torch.zeros((), dtype=torch.long)
        self.mean, self.var = torch.zeros(3), torch.ones(3)


def _program(holder: _Holder):
    def step(x, position):
        holder.steps += 1
        holder.cache[:, position] = x  # at a position the trace reads on each call
        window = holder.cache[:, :2]  # a view of the captured tensor, updated through
        window.mul_(0.5)
        return holder.cache.sum(1) * holder.steps

    return step


def test_updates_of_captured_tensors_are_written_back_as_eagers():
    eager, mine = _Holder(), _Holder()
    step, jitted = _program(eager), fulmen.jit(_program(mine))
    position = torch.tensor(0)
    for i in range(4):
        x = torch.full((2,), float(i + 1))
        torch.testing.assert_close(jitted(x, position), step(x, position))
        torch.testing.assert_close(mine.cache, eager.cache, rtol=0, atol=0)
        assert mine.steps.item() == eager.steps.item() == i + 1
        position = position + 1
    assert fulmen.cache_misses(jitted) == 1 and fulmen.cache_hits(jitted) == 3


def test_functional_batch_norm_updates_captured_running_statistics():
    eager, mine = _Holder(), _Holder()

    def normalize(holder):
        return lambda x: F.batch_norm(x, holder.mean, holder.var, training=True, momentum=0.3)

    x = torch.randn(4, 3)
    torch.testing.assert_close(fulmen.jit(normalize(mine))(x), normalize(eager)(x))
    torch.testing.assert_close(mine.mean, eager.mean, rtol=0, atol=0)
    torch.testing.assert_close(mine.var, eager.var, rtol=0, atol=0)


def test_a_captured_tensor_given_a_value_with_history_takes_it_as_eager():
    memory_e, memory_m = torch.zeros(3), torch.zeros(3)
    w = torch.randn(3, requires_grad=True)

    def program(memory):
        def f(x):
            memory.copy_(x * w)
            return (memory * memory).sum()

        return f

    x = torch.randn(3)
    want = program(memory_e)(x)
    got = fulmen.jit(program(memory_m))(x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(memory_m, memory_e)
    (grad_e,) = torch.autograd.grad(want, w)
    (grad_m,) = torch.autograd.grad(got, w)
    torch.testing.assert_close(grad_m, grad_e)


def test_a_captured_tensor_that_is_also_an_argument_is_updated_once():
    shared_e, shared_m = torch.ones(4), torch.ones(4)

    def program(shared):
        def f(x):
            shared.add_(1)
            return x * 2  # x is `shared` itself: it reads the update

        return f

    want, got = program(shared_e)(shared_e), fulmen.jit(program(shared_m))(shared_m)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(shared_m, shared_e)


def test_a_captured_tensor_that_requires_grad_is_refused():
    weight = torch.ones(2, requires_grad=True)

    def program(x):
        weight.mul_(x)
        return x

    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        program(torch.ones(2))
    with pytest.raises(fulmen.FulmenError, match=r"(?s)captured torch.float32 tensor of shape \(2,\), a leaf of "
                                                 r"autograd that requires grad.*weight.mul_\(x\)"):
        fulmen.jit(program)(torch.ones(2))
