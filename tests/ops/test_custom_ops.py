"""Operators a program calls that torch and fulmen do not define: torch.library custom ops, and MoE routing ops."""

from __future__ import annotations

import pytest
import torch

import fulmen


@torch.library.custom_op("fulmen_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _backward(ctx, g):
    (x,) = ctx.saved_tensors
    return g * ctx.scale * (1 - torch.tanh(x) ** 2), None


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


torch.library.register_autograd("fulmen_test::scaled_tanh", _backward, setup_context=_setup)


@torch.library.custom_op("fulmen_test::add_into", mutates_args=("out",))
def add_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.add_(x)


@add_into.register_fake
def _(x, out):
    return None


def test_custom_op_is_recorded_and_differentiated_by_its_registered_backward():
    x = torch.randn(4, 3, requires_grad=True)

    def fn(x):
        return torch.ops.fulmen_test.scaled_tanh(x * 2, 3.0).sum()

    fn(x).backward()
    want = x.grad.clone()
    x.grad = None
    jitted = fulmen.jit(fn)
    jitted(x).backward()
    torch.testing.assert_close(x.grad, want)
    assert "torch.ops.fulmen_test.scaled_tanh(" in str(fulmen.last_traces(jitted)[-1])


def test_custom_op_that_mutates_an_argument_is_refused():
    with pytest.raises(fulmen.UnsupportedOpError, match="fulmen_test.add_into"):
        fulmen.jit(lambda x, y: torch.ops.fulmen_test.add_into(x, y))(torch.randn(3), torch.zeros(3))


def test_histc_counts_without_grad_and_grouped_offsets():
    ids = torch.tensor([2, 0, 2, 3, 2, 1])

    def offsets(ids, x):
        counts = torch.histc(ids.float(), bins=4, min=0, max=3)
        return torch.cumsum(counts, 0, dtype=torch.int32), (x * counts.sum()).sum()

    x = torch.randn(3, requires_grad=True)
    got = fulmen.jit(offsets)(ids, x)
    want = offsets(ids, x)
    torch.testing.assert_close(got[0], want[0])
    assert not fulmen.jit(lambda v: torch.histc(v, bins=3))(torch.randn(5, requires_grad=True)).requires_grad


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm is newer than this torch")
def test_grouped_mm_in_fp32_on_cpu_matches_eager():
    rows, weight = torch.randn(8, 32, requires_grad=True), torch.randn(4, 32, 16, requires_grad=True)
    offsets = torch.tensor([2, 3, 6, 8], dtype=torch.int32)

    def experts(rows, weight):
        return torch._grouped_mm(rows, weight, offs=offsets).square().sum()

    experts(rows, weight).backward()
    want = rows.grad.clone(), weight.grad.clone()
    rows.grad = weight.grad = None
    fulmen.jit(experts)(rows, weight).backward()
    torch.testing.assert_close(rows.grad, want[0])
    torch.testing.assert_close(weight.grad, want[1])
