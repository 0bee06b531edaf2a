"""Outputs that eager returns as an input itself or as a view of one share the input's memory and autograd history
under fulmen too, also when the program updated the input in place first. Oracle: eager on the same inputs."""

from __future__ import annotations

import pytest
import torch

import fulmen


def _shares_memory(out: torch.Tensor, tensor: torch.Tensor) -> bool:
    return out.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()


def updates_then_views(x, buf):
    buf.add_(x)
    return buf[1:], buf.view(9), buf.t()


def updates_through_a_chain(buf):
    rows = buf[1:]
    cols = rows.t()
    cols.mul_(2)
    return cols


@pytest.mark.parametrize("fn", [updates_then_views, updates_through_a_chain], ids=lambda fn: fn.__name__)
def test_a_view_of_an_input_updated_in_place_aliases_the_input(fn):
    jitted = fulmen.jit(fn)
    for _ in range(2):  # the trace's first call, then a cache hit
        x = torch.arange(9.0).reshape(3, 3)
        want_buf, got_buf = torch.ones(3, 3), torch.ones(3, 3)
        args = (x,) if fn is updates_then_views else ()
        want, got = fn(*args, want_buf), jitted(*args, got_buf)
        want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
            assert g.stride() == w.stride() and _shares_memory(g, got_buf)
        for w, g in zip(want, got):  # a write into an output reaches the input, as eager's
            w.fill_(7.0)
            g.fill_(7.0)
            torch.testing.assert_close(got_buf, want_buf, rtol=0, atol=0)


def scales_in_place(y, w):
    y.mul_(w)
    return y[1:]


def writes_rows(buf, w):
    buf[1:] = w * 2
    return buf[:2]


@pytest.mark.parametrize("fn", [scales_in_place, writes_rows], ids=lambda fn: fn.__name__)
def test_grads_through_a_returned_view_of_an_updated_input(fn):
    jitted = fulmen.jit(fn)
    for _ in range(2):
        results = []
        for run in (fn, jitted):
            a = torch.arange(6.0).reshape(2, 3).requires_grad_()
            w = torch.tensor([3.0, -1.0, 2.0], requires_grad=True)
            first = a * 1 if fn is scales_in_place else torch.zeros(3, 3)  # a non-leaf that requires grad, or none
            out = run(first, w)
            assert out._base is first
            (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()
            results.append((out.detach(), a.grad, w.grad))
        (want, want_a, want_w), (got, got_a, got_w) = results
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(got_w, want_w, rtol=0, atol=0)
        assert (got_a is None) == (want_a is None)
        if want_a is not None:
            torch.testing.assert_close(got_a, want_a, rtol=0, atol=0)


def test_a_view_taken_under_no_grad_has_no_history_as_eagers():
    def view_without_grad(x):
        with torch.no_grad():
            return x[1:], x * 2

    x = torch.randn(2, 3, requires_grad=True)
    (want_view, want), (got_view, got) = view_without_grad(x), fulmen.jit(view_without_grad)(x)
    assert want_view._base is x and want_view.grad_fn is None
    assert got_view._base is x and got_view.grad_fn is None and got_view.requires_grad == want_view.requires_grad
    assert got.requires_grad == want.requires_grad


def test_retain_grad_on_a_returned_view_that_other_outputs_use_is_refused():
    def view_and_its_use(x):
        view = x.t()
        return view, (view * view).sum()

    view, total = fulmen.jit(view_and_its_use)(torch.randn(2, 3, requires_grad=True))
    assert view.grad_fn is not None and total.grad_fn is not None
    view.retain_grad()  # eager's view.grad would include what reaches it through `total`
    with pytest.raises(fulmen.TraceError, match=r"output\[0\] .* has retain_grad\(\)"):
        total.backward()


CAPTURED = torch.ones(3, requires_grad=True)


class ReturnsItsTensors(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x):
        self.seen.add_(x.sum(0))
        return self.lin(x * CAPTURED), self.lin.weight.t(), self.seen, CAPTURED


def test_module_tensors_and_captured_tensors_are_returned_themselves():
    model = ReturnsItsTensors()
    jitted = fulmen.jit(model)
    for _ in range(2):
        out, weight_t, seen, captured = jitted(torch.ones(4, 3))
        assert weight_t._base is model.lin.weight and weight_t.grad_fn is not None
        assert seen is model.seen and captured is CAPTURED
        weight_t.sum().backward()
        torch.testing.assert_close(model.lin.weight.grad, torch.ones(2, 3))
        model.lin.weight.grad = None
    torch.testing.assert_close(model.seen, torch.full((3,), 8.0))
