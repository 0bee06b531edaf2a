"""Tensors a proxy cannot stand for are refused, named, before anything runs: a subclass that changes what torch's
operators do (eager runs its `__torch_function__` / `__torch_dispatch__` on every call, a trace would skip it), and
layouts other than dense strided. Plain subclasses (nn.Parameter, a subclass keeping torch's defaults) trace as
eager runs them."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

import fulmen
from fulmen.core.errors import TraceError


class _ScalesAdd(torch.Tensor):
    """Scales `torch.add`'s result, as a user's scaling subclass would."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 10 if func in (torch.add, torch.Tensor.add) else out


class _Doubling(torch.Tensor):
    """A wrapper subclass (as DTensor, Float8 or NF4 weights are) whose multiplications give twice eager's."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrapped = tree_map(lambda a: a.inner if isinstance(a, _Doubling) else a, (args, kwargs or {}))
        out = func(*unwrapped[0], **unwrapped[1])
        return out * 2 if func is torch.ops.aten.mul.Tensor else out


class _Plain(torch.Tensor):
    pass


def _program(x):
    return torch.add(x, 1) * x


def test_a_subclass_overriding_torch_function_is_refused_naming_the_argument():
    x = torch.ones(2).as_subclass(_ScalesAdd)
    assert _program(x).as_subclass(torch.Tensor).tolist() == [20.0, 20.0]  # the case matters: eager scales the sum
    with pytest.raises(TraceError, match=r"tensor argument x: its class _ScalesAdd overrides __torch_function__"):
        fulmen.jit(_program)(x)


def test_a_wrapper_subclass_overriding_torch_dispatch_is_refused_naming_the_argument():
    x = _Doubling(torch.ones(2))
    assert (_program(x) == 4).all()  # eager doubles the product
    with pytest.raises(TraceError, match=r"tensor argument x: its class _Doubling overrides __torch_dispatch__"):
        fulmen.jit(_program)(x)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", _Doubling(torch.ones(2)))

    def forward(self, x):
        return x * self.scale


def test_a_module_tensor_of_such_a_class_is_refused_naming_it():
    with pytest.raises(TraceError, match=r"module's tensor scale: its class _Doubling"):
        fulmen.jit(_Scaled())(torch.ones(2))


SCALE = torch.ones(2).as_subclass(_ScalesAdd)


def _reads_global(x):
    return torch.add(SCALE, x)


def test_a_captured_tensor_of_such_a_class_is_refused_naming_the_line():
    with pytest.raises(TraceError, match=r"(?s)overrides __torch_function__.*return torch.add\(SCALE, x\)"):
        fulmen.jit(_reads_global)(torch.ones(2))


@pytest.mark.filterwarnings("ignore::UserWarning")  # sparse CSR, nested and quantized tensors are beta
@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "nested", "jagged", "quantized"])
def test_tensors_that_are_not_dense_are_refused_naming_the_argument(kind):
    make = {
        "sparse_coo": lambda: torch.eye(3).to_sparse(),
        "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
        "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "jagged": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
        "quantized": lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8),
    }[kind]
    t = make()
    with pytest.raises(TraceError, match=r"fulmen cannot trace the tensor argument t: "):
        fulmen.jit(lambda t: t * 2)(t)


def test_plain_subclasses_trace_as_eager_runs_them():
    def program(x, w):
        return torch.add(x, 1) * w, (x * w).sum()

    x, w = torch.randn(3).as_subclass(_Plain), nn.Parameter(torch.randn(3))
    got, expected = fulmen.jit(program)(x, w), program(x, w)
    for g, e in zip(got, expected):
        assert type(g) is type(e)
        torch.testing.assert_close(g.as_subclass(torch.Tensor), e.as_subclass(torch.Tensor))
    got[0].sum().backward()
    jitted_grad, w.grad = w.grad, None
    expected[0].sum().backward()
    torch.testing.assert_close(jitted_grad, w.grad)
