"""Memory formats as eager gives them: `contiguous`, `clone` and `to` with `memory_format=` make the strides eager
makes, so what the program asks of the layout (`is_contiguous(memory_format=...)`, `view`) answers as eager, and
a returned tensor has eager's strides. Values and grads equal eager's, with composites run as their decompositions
(what a fusion executor compiles) and under `fulmen.vmap`."""

from __future__ import annotations

import pytest
import torch

import fulmen
from tests.ops.opdb import DECOMPOSED

CL, CL3D = torch.channels_last, torch.channels_last_3d
CONTIGUOUS, PRESERVE = torch.contiguous_format, torch.preserve_format

CASES = {
    "contiguous-cl": (lambda x: x.contiguous(memory_format=CL) * 2, 4, CONTIGUOUS),
    "contiguous-cl3d": (lambda x: x.contiguous(memory_format=CL3D) * 2, 5, CONTIGUOUS),
    "contiguous-of-cl": (lambda x: x.contiguous() * 2, 4, CL),
    "clone-cl": (lambda x: x.clone(memory_format=CL) + 1, 4, CONTIGUOUS),
    "clone-contiguous-of-cl": (lambda x: torch.clone(x, memory_format=CONTIGUOUS) + 1, 4, CL),
    "clone-preserves-cl": (lambda x: x.clone() + 1, 4, CL),
    "to-cl": (lambda x: x.to(memory_format=CL) * 3, 4, CONTIGUOUS),
    "to-dtype-cl": (lambda x: x.to(torch.float64, memory_format=CL) * 3, 4, CONTIGUOUS),
    "to-cl-of-cl-is-itself": (lambda x: (y := x * 1, y.to(memory_format=CL).add_(1))[0], 4, CL),
    "double-cl": (lambda x: x.double(memory_format=CL) * 3, 4, CONTIGUOUS),
    "asks-the-layout": (
        lambda x: (y := x.contiguous(memory_format=CL)) * (2 if y.is_contiguous(memory_format=CL) else 3)
        + (5 if y.is_contiguous() else 7), 4, CONTIGUOUS),
}


def _input(dims: int, layout: torch.memory_format) -> torch.Tensor:
    x = torch.randn((2, 3, 4, 5, 2)[:dims], dtype=torch.float64)
    return x.contiguous(memory_format=layout).requires_grad_()


def _results(fn, x: torch.Tensor):
    out = fn(x)
    out.sum().backward()
    grad, x.grad = x.grad, None
    return out, grad


@pytest.mark.parametrize("executors", [None, [DECOMPOSED]], ids=["default", "decomposed"])
@pytest.mark.parametrize("case", list(CASES))
def test_layouts_values_and_grads_equal_eagers(case, executors):
    fn, dims, layout = CASES[case]
    x = _input(dims, layout)
    want, want_grad = _results(fn, x.detach().clone(memory_format=PRESERVE).requires_grad_())
    got, got_grad = _results(fulmen.jit(fn, executors=executors), x)
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)


def test_a_view_eager_refuses_on_the_new_layout_is_refused():
    def program(x):
        return x.contiguous(memory_format=CL).view(2, -1)

    x = torch.randn(2, 3, 4, 5)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        program(x)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        fulmen.jit(program)(x)


def test_a_vmapped_layout_change_keeps_the_values():
    x = torch.randn(3, 2, 3, 4, 5)
    got = fulmen.vmap(fulmen.jit(lambda x: x.contiguous(memory_format=CL) * 2))(x)
    # torch.vmap does not take memory formats: the oracle is a loop over the examples
    torch.testing.assert_close(got, torch.stack([e.contiguous(memory_format=CL) * 2 for e in x]))
