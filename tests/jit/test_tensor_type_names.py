"""`Tensor.type(name)` with a type's name ("torch.DoubleTensor") or class (torch.DoubleTensor), as eager: the
conversion it names (or the tensor itself where it names the tensor's own type), its grads, and eager's errors; with
no argument, the name of the tensor's type."""

from __future__ import annotations

import pytest
import torch

import fulmen

TYPES = [
    "torch.DoubleTensor",
    torch.DoubleTensor,
    "torch.FloatTensor",
    "torch.HalfTensor",
    "torch.BFloat16Tensor",
    "torch.LongTensor",
    "torch.BoolTensor",
    "torch.Tensor",
    torch.float64,
]


@pytest.mark.parametrize("name", TYPES, ids=str)
def test_a_conversion_by_type_name_is_eagers(name):
    def fn(x):
        y = x.type(name)
        return y, y is x

    x = torch.randn(3, 4)
    want_in, got_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    (want, want_same), (got, got_same) = fn(want_in), fulmen.jit(fn)(got_in)
    assert got.dtype == want.dtype and torch.equal(got, want) and got_same == want_same
    assert got.requires_grad == want.requires_grad
    if want.requires_grad:
        cotangent = torch.randn(want.shape, generator=torch.Generator().manual_seed(0)).to(want.dtype)
        assert torch.equal(
            torch.autograd.grad(got, got_in, cotangent)[0], torch.autograd.grad(want, want_in, cotangent)[0]
        )


def test_the_name_of_the_tensors_type():
    x = torch.randn(2).double()
    assert fulmen.jit(lambda x: x.type())(x) == x.type() == "torch.DoubleTensor"


@pytest.mark.parametrize(("name", "error"), [("torch.NoSuchTensor", ValueError), (5, TypeError)], ids=str)
def test_eagers_errors(name, error):
    x = torch.randn(2)
    with pytest.raises(error) as eager:
        x.type(name)
    with pytest.raises(error) as ours:
        fulmen.jit(lambda x: x.type(name))(x)
    assert str(ours.value).splitlines()[0] == str(eager.value)
