"""`InductorFunction`: Inductor's compiled graph called without AOTAutograd's wrappers where they would do nothing,
against eager on the same inputs, and the wrapped call kept where they would not."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch

from fulmen.core.inductor import InductorFunction, Variant


def _variant(compiled: InductorFunction) -> Variant:
    (variant,) = compiled.variants.values()
    return variant


def _enters_aot_wrappers(call: Callable[[], object]) -> bool:
    """Whether `call` runs any Python function of AOTAutograd's runtime (its wrappers around Inductor's graph)."""
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return any("_aot_autograd" in name for name in seen)


def region(x, w, b):
    y = torch.tanh(x) * w + b
    return y.softmax(-1), y.sum(0), x.t()


def test_a_functional_graph_calls_inductors_graph_directly():
    compiled = InductorFunction(region)
    x, w, b = torch.randn(8, 16), torch.randn(16), torch.randn(8, 1)
    first = compiled(x, w, b)
    variant = _variant(compiled)
    assert variant.direct is not None and variant.why_wrapped is None
    again = compiled(x, w, b)
    expected = region(x, w, b)
    assert isinstance(again, tuple) and len(again) == 3
    for got in (first, again):
        for value, want in zip(got, expected, strict=True):
            torch.testing.assert_close(value, want)
            assert value.stride() == want.stride()
    # the output that is a view of an input is one still, as in eager
    assert again[2].data_ptr() == x.data_ptr()
    assert not _enters_aot_wrappers(lambda: compiled(x, w, b))


def test_a_single_output_comes_back_as_a_tensor():
    compiled = InductorFunction(lambda x: torch.relu(x) * 2)
    x = torch.randn(5, 3)
    out = compiled(x)
    assert isinstance(out, torch.Tensor) and _variant(compiled).direct is not None
    torch.testing.assert_close(out, torch.relu(x) * 2)


def _mutates(x, y):
    x.add_(y)
    return x * 2


@pytest.mark.parametrize(("fn", "why"), [
    (_mutates, "mutates"),
    (lambda x, y: (x + y, None), "not tensors"),
])
def test_graphs_the_wrappers_are_needed_for_keep_them(fn, why):
    compiled = InductorFunction(fn)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    x_eager = x.clone()
    got = compiled(x, y)
    expected = fn(x_eager, y)
    variant = _variant(compiled)
    assert variant.direct is None and why in variant.why_wrapped
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(x, x_eager)  # the input mutation happened once, as in eager
    assert _enters_aot_wrappers(lambda: compiled(x.clone(), y))  # the probe above sees the wrappers


def test_layouts_key_a_variant_each_all_called_directly():
    compiled = InductorFunction(lambda x: (x.exp() + 1,))
    contiguous, transposed = torch.randn(6, 4), torch.randn(4, 6).t()
    for x in (contiguous, transposed, contiguous):
        torch.testing.assert_close(compiled(x)[0], x.exp() + 1)
    assert len(compiled.variants) == 2
    assert all(variant.direct is not None for variant in compiled.variants.values())


def test_a_direct_call_under_grad_mode_returns_what_the_wrapped_call_returns():
    """Inductor's code writes matmuls through `out=`, which autograd refuses while an input requires grad."""
    compiled = InductorFunction(lambda x, w: (x @ w + 1,))
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    (out,) = compiled(x, w)
    assert _variant(compiled).direct is not None
    assert not out.requires_grad
    torch.testing.assert_close(out, (x @ w + 1).detach())


def test_symbolic_rows_sliced_at_any_offset_compile_once_per_offset_kind():
    """A fused loss's chunks are slices of the targets at offsets that move with the rows. A variant compiled for
    offset 0 guards on it; the others take a symbolic offset, so a second pass over the same chunks, and other
    lengths, compile nothing new (each compile here was a retrace and an FX-cache hit on every call before)."""
    compiled = InductorFunction(lambda x, t: ((x * 2).sum(1) + t,), dynamic=(frozenset({0}), frozenset({0})))
    targets, first_pass = torch.randn(96), None
    for rows, chunk in ((96, 40), (96, 40), (90, 32), (72, 24)):
        for start in range(0, rows, chunk):
            t = targets[start:min(start + chunk, rows)]
            x = torch.randn(t.shape[0], 5)
            torch.testing.assert_close(compiled(x, t)[0], (x * 2).sum(1) + t)
        if first_pass is None:
            first_pass = len(compiled.guarded)
    assert first_pass <= 3  # offset 0; a symbolic offset equal to the rows (duck sizing); one unrelated to them
    assert len(compiled.guarded) == first_pass


def test_a_symbolic_variant_guards_as_its_compile_did_when_the_cache_holds_its_graph(tmp_path, monkeypatch):
    """Inductor specialises a reduction over the rows on the size it compiles at (here `4*s0 <= 4096`) and keeps
    that guard in its FX graph cache only for graphs that take sizes as SymInt arguments; a region's graph takes
    tensors alone. A second function compiling the same graph while the cache holds the first's code must guard as
    the first does, or a length past the bound would run code compiled for lengths within it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def weight_grad(w, x, g, r):
        return ((x * g * r).sum((0, 1)) * w,)

    def inputs(length):
        return torch.randn(32), torch.randn(4, length, 32), torch.randn(4, length, 32), torch.randn(4, length, 1)

    rows = (frozenset(), frozenset({1}), frozenset({1}), frozenset({1}))
    first, second = InductorFunction(weight_grad, dynamic=rows), InductorFunction(weight_grad, dynamic=rows)
    first(*inputs(688))
    second(*inputs(688))
    long = inputs(1744)
    assert not first.guarded[0][0](long)  # the bound its compile added (what this test is about)
    assert not second.guarded[0][0](long)
    for compiled in (first, second):
        torch.testing.assert_close(compiled(*long)[0], weight_grad(*long)[0], rtol=1e-4, atol=1e-4)
        assert len(compiled.guarded) == 2


def test_a_symbolic_function_asks_its_guards_once_per_layout(monkeypatch):
    """Which variant admits a layout is remembered: its guards run at a layout's first call only, and past
    ADMITTED_LAYOUTS the memory starts again."""
    import fulmen.core.inductor as inductor

    monkeypatch.setattr(inductor, "ADMITTED_LAYOUTS", 3)
    compiled = InductorFunction(lambda x, t: ((x * 2).sum(1) + t,), dynamic=(frozenset({0}), frozenset({0})))

    def call(rows):
        x, t = torch.randn(rows, 5), torch.randn(rows)
        torch.testing.assert_close(compiled(x, t)[0], (x * 2).sum(1) + t)

    call(7)  # compiles the one variant, for every row count
    admits, variant = compiled.guarded[0]
    asked = []
    compiled.guarded[0] = (lambda args: asked.append(args[0].shape[0]) or admits(args), variant)
    for rows in (7, 9, 9, 7):
        call(rows)
    assert asked == [9]
    for rows in (11, 13, 7):  # 13 is a fourth layout: the memory starts again, and 7 is asked anew
        call(rows)
    assert asked == [9, 11, 13, 7] and len(compiled.guarded) == 1
