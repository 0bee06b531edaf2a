"""User `torch.autograd.Function`s under fulmen.jit: the forward is traced, the Function's own backward is the grad.

Oracle: eager autograd running the same Function on the same inputs (values, grads, which grads exist).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint as bound_checkpoint

import fulmen


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def _grads(fn, *inputs):
    """fn's output and the grads of its inputs that require grad, under eager and under fulmen.jit."""
    results = []
    for run in (fn, fulmen.jit(fn)):
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        out = run(*leaves)
        (out if out.dim() == 0 else out.sum()).backward()
        results.append((out.detach(), [t.grad for t in leaves]))
    return results


def _assert_same(fn, *inputs):
    (want, want_grads), (got, got_grads) = _grads(fn, *inputs)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w)


def test_issue_cases_square_path_and_square_only():
    w, x = torch.randn(3, 4, requires_grad=True), torch.randn(2, 3)
    _assert_same(lambda w, x: (Square.apply(x @ w) + x @ w).sum(), w, x)
    _assert_same(lambda w, x: Square.apply(x @ w).sum(), w, x)


def test_backward_trace_holds_the_functions_backward():
    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * 7.0 * x  # deliberately not the true derivative: the user's backward is what runs

    x = torch.randn(5, requires_grad=True)
    jitted = fulmen.jit(lambda x: Cube.apply(x).sum())
    jitted(x).backward()
    torch.testing.assert_close(x.grad, 7.0 * x.detach())
    assert "Cube.apply(x)" in str(fulmen.last_traces(jitted)[0])
    assert "7.0" in str(fulmen.last_backward_traces(jitted)[-1])


def test_non_tensor_arguments_and_needs_input_grad():
    seen = []

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, factor, y):
            ctx.factor = factor
            ctx.save_for_backward(y)
            return x * factor + y

        @staticmethod
        def backward(ctx, g):
            seen.append(ctx.needs_input_grad)
            gx = g * ctx.factor if ctx.needs_input_grad[0] else None
            gy = g if ctx.needs_input_grad[2] else None
            return gx, None, gy

    x, y = torch.randn(4, requires_grad=True), torch.randn(4)
    _assert_same(lambda x, y: Scale.apply(x, 3.0, y), x, y)
    assert seen == [(True, False, False), (True, False, False)]  # eager's, then fulmen's


def test_intermediates_saved_and_ctx_attributes():
    class Softplus(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, beta):
            e = torch.exp(beta * x)
            ctx.beta = beta
            ctx.save_for_backward(e)  # an intermediate, not an input
            return torch.log1p(e) / beta

        @staticmethod
        def backward(ctx, g):
            (e,) = ctx.saved_tensors
            return g * e / (1 + e), None

    _assert_same(lambda x: Softplus.apply(x, 2.0), torch.randn(6, requires_grad=True))


def test_mark_non_differentiable_and_integer_outputs():
    class SortWithIndex(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            values, index = torch.sort(x)
            ctx.mark_non_differentiable(index)
            ctx.save_for_backward(index)
            return values, index

        @staticmethod
        def backward(ctx, g_values, g_index):
            (index,) = ctx.saved_tensors
            return torch.zeros_like(g_values).scatter(0, index, g_values)

    def fn(x):
        values, index = SortWithIndex.apply(x)
        assert not index.requires_grad
        return (values * torch.arange(5.0)).sum() + index.sum()

    _assert_same(fn, torch.randn(5, requires_grad=True))


def test_setup_context_style_and_returning_an_input():
    class Identity(torch.autograd.Function):  # gradient reversal, a common one
        @staticmethod
        def forward(x):
            return x

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return -g

    w = torch.randn(3, requires_grad=True)
    _assert_same(lambda w: (Identity.apply(w) * w).sum(), w)


def test_no_grad_and_inputs_without_grad_run_the_forward_only():
    x = torch.randn(4)
    jitted = fulmen.jit(lambda x: Square.apply(x))
    torch.testing.assert_close(jitted(x), x * x)
    assert fulmen.last_backward_traces(jitted) == []
    with torch.no_grad():
        out = fulmen.jit(lambda x: Square.apply(x))(x.requires_grad_())
    assert not out.requires_grad


def test_backward_reading_tensor_values_is_refused_naming_the_function_and_line():
    class Clip(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            if g.abs().max() > 1:  # data-dependent
                g = g / g.abs().max()
            return g

    with pytest.raises(fulmen.DataDependentError,
                       match=r"backward of autograd.Function .*Clip.*\n.*test_autograd_function.py:\d+ in backward"):
        fulmen.jit(lambda x: Clip.apply(x).sum())(torch.randn(3, requires_grad=True))


def test_forward_reading_tensor_values_is_refused_naming_the_function():
    class Branchy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2 if x.sum() > 0 else x

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(fulmen.DataDependentError, match=r"forward of autograd.Function .*Branchy"):
        fulmen.jit(lambda x: Branchy.apply(x))(torch.randn(3, requires_grad=True))


def test_mark_dirty_and_wrong_grad_count_are_refused():
    class AddOneInPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_dirty(x)
            return x.add_(1)

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(fulmen.TraceError, match="mark_dirty"):
        fulmen.jit(lambda x: AddOneInPlace.apply(x.clone()))(torch.randn(3, requires_grad=True))

    class TwoGrads(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g, g

    with pytest.raises(fulmen.TraceError, match="returned 2 grads; its forward takes 1"):
        fulmen.jit(lambda x: TwoGrads.apply(x).sum())(torch.randn(3, requires_grad=True))


def test_grad_broadcast_to_the_input_shape_like_eager():
    class Expand(torch.autograd.Function):
        @staticmethod
        def forward(ctx, bias, n):
            return bias.expand(n, bias.shape[0]).clone()

        @staticmethod
        def backward(ctx, g):
            return g, None  # (n, d) for a (d,) input: the engine sums it down

    _assert_same(lambda b: Expand.apply(b, 4), torch.randn(3, requires_grad=True))


def test_nested_functions_and_a_module_parameter():
    class Outer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return Square.apply(x) * w  # the inner call runs without grad, as in eager

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g * 2 * x * w, (g * x * x).sum(0)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3))

        def forward(self, x):
            return Outer.apply(x, self.w).sum()

    layer = Layer()
    x = torch.randn(2, 3, requires_grad=True)
    layer(x).backward()
    want = (x.grad.clone(), layer.w.grad.clone())
    x.grad, layer.w.grad = None, None
    fulmen.jit(layer)(x).backward()
    torch.testing.assert_close(x.grad, want[0])
    torch.testing.assert_close(layer.w.grad, want[1])


def test_outside_acquisition_apply_is_torchs_own():
    fulmen.jit(lambda x: Square.apply(x).sum())(torch.randn(3, requires_grad=True))
    assert torch.autograd.Function.__dict__["apply"].__func__.__module__ == "torch.autograd.function"
    x = torch.randn(3, requires_grad=True)
    Square.apply(x).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())


def test_reentrant_checkpoint_is_a_checkpointed_region():
    """Called through a name bound before fulmen ran (as libraries import it), so torch's own checkpoint runs and
    applies its CheckpointFunction."""
    w = torch.randn(4, 4, requires_grad=True)

    def fn(x, w):
        def block(x):
            return torch.tanh(x @ w) * 2

        return bound_checkpoint(block, x, use_reentrant=True).sum()

    x = torch.randn(3, 4, requires_grad=True)
    fn(x, w).backward()
    want = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    jitted = fulmen.jit(fn)
    jitted(x, w).backward()
    torch.testing.assert_close(x.grad, want[0])
    torch.testing.assert_close(w.grad, want[1])
    assert any(b.checkpoint_region for b in fulmen.last_traces(jitted)[0].bound_symbols)


GRAD_SCALE = 2.0


class ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, config):
        ctx.config = config
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * GRAD_SCALE * ctx.config.factor, None  # a global and a config kept in ctx, read in backward only


class _Config:
    def __init__(self):
        self.factor = 1.0


def test_python_state_the_backward_reads_is_guarded():
    global GRAD_SCALE
    config = _Config()

    def program(x, c):
        return ScaleGrad.apply(x, c).sin()

    jitted = fulmen.jit(program)
    try:
        for scale, factor in ((2.0, 1.0), (5.0, 1.0), (5.0, 3.0), (5.0, 3.0)):
            GRAD_SCALE, config.factor = scale, factor
            x = torch.randn(3, requires_grad=True)
            jitted(x, config).sum().backward()
            torch.testing.assert_close(x.grad, x.detach().cos() * scale * factor)
    finally:
        GRAD_SCALE = 2.0
    assert (fulmen.cache_misses(jitted), fulmen.cache_hits(jitted)) == (3, 1)
    assert "attribute factor" in fulmen.last_cache_miss_reasons(jitted)[1]


class NoMaterialize(torch.autograd.Function):
    """A backward that tells a grad that did not arrive (None) from one that did (set_materialize_grads(False))."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, g1, g2):
        like = g1 if g1 is not None else g2
        return (g1 * 2 if g1 is not None else like + 100) + (g2 * 3 if g2 is not None else like - 100)


def _second_only(x):
    return NoMaterialize.apply(x)[1].sin()


def _both_returned(x):
    return NoMaterialize.apply(x)


def test_unmaterialized_grads_that_all_arrive_are_eagers():
    _assert_same(lambda x: sum(NoMaterialize.apply(x)).sin(), torch.randn(3, requires_grad=True))


def test_a_grad_that_does_not_arrive_at_an_unmaterialized_backward_is_refused_naming_the_function_and_line():
    x = torch.randn(3, requires_grad=True)
    _second_only(x).sum().backward()
    torch.testing.assert_close(x.grad, 4 * (3 * x.detach()).cos() + 100)  # eager's backward saw None for g1
    with pytest.raises(fulmen.TraceError, match=r"(?s)NoMaterialize .*output 0 .*set_materialize_grads\(False\)"
                                                r".*NoMaterialize\.apply\(x\)\[1\]"):
        fulmen.jit(_second_only)(torch.randn(3, requires_grad=True))


def test_an_output_the_caller_does_not_differentiate_is_refused_at_the_backward():
    x = torch.randn(3, requires_grad=True)
    _both_returned(x)[1].sum().backward()  # eager: None for output 0
    out = fulmen.jit(_both_returned)(torch.randn(3, requires_grad=True))
    with pytest.raises(fulmen.TraceError, match=r"(?s)NoMaterialize .*output 0 .*NoMaterialize\.apply\(x\)"):
        out[1].sum().backward()
