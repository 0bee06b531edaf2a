"""A buffer the forward registers (lazily, on its first call) is the module's afterwards, as in eager; and tensors
the program returns as distinct objects stay distinct when the trace computes them as one value."""

from __future__ import annotations

import pytest
import torch

import fulmen


class _Counts(torch.nn.Module):
    """Registers its counter on its first call, then counts calls in place."""

    def __init__(self, persistent: bool = True):
        super().__init__()
        self.persistent = persistent
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        if not hasattr(self, "calls"):
            self.register_buffer("calls", torch.zeros(()), persistent=self.persistent)
        self.calls.add_(1)
        return x * self.scale * self.calls


@pytest.mark.parametrize("persistent", [True, False])
def test_a_buffer_the_forward_registers_is_the_modules_from_then_on(persistent):
    eager, compiled = _Counts(persistent), _Counts(persistent)
    jitted = fulmen.jit(compiled)
    for _ in range(3):  # the first call registers; the next reads it (traced anew), the third hits that trace
        torch.testing.assert_close(jitted(torch.ones(2)), eager(torch.ones(2)), rtol=0, atol=0)
        torch.testing.assert_close(dict(compiled.named_buffers()), dict(eager.named_buffers()), rtol=0, atol=0)
        assert compiled.state_dict().keys() == eager.state_dict().keys()
    assert compiled.calls.item() == 3
    assert compiled._non_persistent_buffers_set == eager._non_persistent_buffers_set
    assert (fulmen.cache_misses(jitted), fulmen.cache_hits(jitted)) == (2, 1)


def test_a_module_given_to_the_program_gets_the_real_buffer_not_the_traces_stand_in():
    def program(module, x):
        return module(x)

    eager, compiled = _Counts(), _Counts()
    jitted = fulmen.jit(program)
    for _ in range(3):
        torch.testing.assert_close(jitted(compiled, torch.ones(2)), eager(torch.ones(2)), rtol=0, atol=0)
        assert type(compiled.calls) is torch.Tensor and compiled.calls.item() == eager.calls.item()


def test_a_refused_program_leaves_no_stand_in_in_the_module_it_was_given():
    class Registers(torch.nn.Module):
        def forward(self, x):
            self.register_buffer("table", x.cos())
            return x.sum().item()  # refused: data-dependent

    module = Registers()
    with pytest.raises(fulmen.DataDependentError):
        fulmen.jit(lambda m, x: m(x))(module, torch.ones(2))
    assert "table" not in module._buffers and not module._non_persistent_buffers_set


def test_two_layers_registering_equal_buffers_get_a_tensor_each():
    class Table(torch.nn.Module):
        def forward(self, x):
            if not hasattr(self, "table"):
                self.register_buffer("table", torch.arange(3.0))
            return x + self.table

    model = torch.nn.Sequential(Table(), Table())
    with torch.no_grad():
        fulmen.jit(model)(torch.ones(3))
    first, second = model[0].table, model[1].table
    assert first is not second and first.data_ptr() != second.data_ptr()
    first.add_(1)  # eager's are two tensors: updating one leaves the other
    torch.testing.assert_close(second, torch.arange(3.0))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_equal_computations_returned_separately_are_distinct_tensors(requires_grad):
    jitted = fulmen.jit(lambda x: (x * 2, x * 2, torch.zeros(2), torch.zeros(2)))
    x = torch.ones(2, requires_grad=requires_grad)
    for _ in range(2):
        a, b, c, d = jitted(x)
        assert a is not b and a.data_ptr() != b.data_ptr() and c.data_ptr() != d.data_ptr()
        if requires_grad:
            torch.testing.assert_close(torch.autograd.grad(a.sum() + 3 * b.sum(), x)[0], torch.full((2,), 8.0))


def test_one_tensor_returned_twice_stays_one_tensor():
    def program(x):
        y = x * 2
        return y, y

    first, second = fulmen.jit(program)(torch.ones(2))
    assert first is second
