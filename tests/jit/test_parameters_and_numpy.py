"""The class of a parameter, and NumPy arrays a program hands to torch, inside a trace: as eager, or refused.

A proxy answers `isinstance` and `x.__class__` with the class of the tensor it stands for (an nn.Parameter argument,
a module's own parameter, a subclass of Parameter, a tensor marked by nn.Buffer), and the cache key holds that class:
a plain tensor passed where a Parameter was traced takes a trace of its own. `type(x)` cannot be answered so (the
proxy's type is fulmen's): it is refused for a proxy of another class, naming the line.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import fulmen
from fulmen.core.errors import TraceError


def _isinstance_parameter(x, p):
    return x + 1 if isinstance(p, nn.Parameter) else x


def _class_reads(x, p):
    out = x * 2 if p.__class__ is nn.Parameter else x
    out = out + 10 if p.__class__.__name__ == "Parameter" else out
    return out + 100 if isinstance(p * 1, nn.Parameter) else out  # what an op returns is a plain Tensor


class _Scale(nn.Parameter):
    pass


def _subclass_reads(x, p):
    return x * 3 if isinstance(p, _Scale) else x * 5


@pytest.mark.parametrize("fn", [_isinstance_parameter, _class_reads, _subclass_reads])
def test_the_class_of_a_parameter_argument_is_eagers_and_guarded(fn: Callable):
    x = torch.ones(3)
    param, scale, plain = nn.Parameter(torch.full((3,), 2.0)), _Scale(torch.full((3,), 2.0)), torch.full((3,), 2.0)
    jitted = fulmen.jit(fn)
    # a Parameter, a plain tensor (same metadata but requires_grad), a subclass, then the first again
    for p in (param, plain.requires_grad_(), scale, plain.detach(), param):
        torch.testing.assert_close(jitted(x, p), fn(x, p), rtol=0, atol=0)
    assert jitted.stats.hits == 1  # the last call reuses the Parameter's trace; the others each traced their own


def test_a_parameter_argument_keeps_eagers_grad():
    x, p = torch.randn(4), nn.Parameter(torch.randn(4))
    fn = lambda x, p: (x * p).sum() if isinstance(p, nn.Parameter) else x.sum()
    fulmen.jit(fn)(x, p).backward()
    got = p.grad.clone()
    p.grad = None
    fn(x, p).backward()
    torch.testing.assert_close(got, p.grad, rtol=0, atol=0)


class _Classes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        self.marked = nn.Buffer(torch.ones(2))  # a Buffer: isinstance(self.marked, nn.Buffer) holds in eager
        self.register_buffer("plain", torch.ones(2))

    def forward(self, x):
        out = x + 1 if isinstance(self.w, nn.Parameter) else x
        out = out + 10 if self.w.__class__.__name__ == "Parameter" else out
        out = out + 100 if isinstance(self.marked, nn.Buffer) else out
        return out + 1000 if isinstance(self.plain, nn.Buffer) else out


def test_a_modules_own_parameters_and_buffers_answer_isinstance_as_eager():
    model, x = _Classes(), torch.zeros(2)
    jitted = fulmen.jit(model)
    torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
    assert model(x).tolist() == [111.0, 111.0]
    # the module's buffer replaced by one of the other kind (same metadata): a trace of its own
    model.plain = nn.Buffer(torch.ones(2))
    model.marked = torch.ones(2)
    assert not isinstance(model.marked, nn.Buffer)
    torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
    assert model(x).tolist() == [1011.0, 1011.0]


def test_type_of_a_parameter_is_refused_naming_the_line():
    def fn(x, p):
        return x + 1 if type(p) is nn.Parameter else x

    with pytest.raises(TraceError, match=r"type\(\) of the Parameter p.*isinstance\(x, Parameter\)") as error:
        fulmen.jit(fn)(torch.ones(2), nn.Parameter(torch.ones(2)))
    assert "type(p) is nn.Parameter" in str(error.value)  # the user's line


def test_an_uninitialized_parameter_is_refused_naming_the_fix():
    with pytest.raises(TraceError, match="uninitialized parameter or buffer of a lazy module.*call the module once"):
        fulmen.jit(nn.LazyLinear(2))(torch.ones(1, 3))

