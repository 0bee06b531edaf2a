"""Symbolic sizes (JitOptions.dynamic, fulmen.mark_dynamic): one trace for the lengths its guards admit, each call
against eager on the same inputs (values, grads), the guards on what the program decided from a size, the miss reasons
naming them, printed traces re-runnable at other lengths, and the static path unchanged."""

from __future__ import annotations

import pytest
import torch

import fulmen
from fulmen.jit.jitted_module import core as jitted_core


def _grads(fn, *args):
    """fn's output and the grads of its sum w.r.t. every argument that requires grad."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    out = fn(*args)
    grads = torch.autograd.grad(out.sum(), leaves)
    return out, grads


def _inputs(T, B=2, seed=0):
    generator = torch.Generator().manual_seed(seed + 100 * T + B)
    return torch.randn(B, T, C, generator=generator, requires_grad=True)


C = 13  # a hidden size no length or batch size here equals (duck sizing would give them one symbol)
W = torch.randn(C, 4, generator=torch.Generator().manual_seed(1))


def block(x, w):
    y = torch.nn.functional.gelu(x @ w)
    return y.view(x.shape[0], -1, 2).softmax(-1) * torch.arange(2 * x.shape[1], dtype=x.dtype)[:, None]


def test_one_trace_for_many_lengths_equal_to_eager():
    w = W.clone().requires_grad_()
    jitted = fulmen.jit(block)
    for T in (4, 5, 7, 12, 9, 31, 2):
        x = _inputs(T)
        got, got_grads = _grads(jitted, x, w)
        want, want_grads = _grads(block, x, w)
        assert torch.equal(got, want)
        for g, e in zip(got_grads, want_grads):
            assert torch.equal(g, e)
    # the first call traces static shapes; the second, whose length differs, a symbolic length for all the rest
    assert fulmen.cache_misses(jitted) == 2 and fulmen.cache_hits(jitted) == 5


def test_symbolic_traces_print_the_symbol_and_run_as_printed():
    w = W.clone().requires_grad_()
    jitted = fulmen.jit(block)
    x = _inputs(5)
    fulmen.mark_dynamic(x, 1)
    jitted(x, w).sum().backward()
    forward = fulmen.last_traces(jitted)[-1]
    backward = fulmen.last_backward_traces(jitted)[-1]
    source = forward.python()
    assert '# x: "cpu f32[2, s0, 13]"' in source and "s0 = x.shape[1]" in source, source
    assert "torch.arange(2*s0, dtype=torch.float32)" in source and 't10: "cpu f32[2, 2*s0, 2]"' in source, source
    for trace, name in ((forward, "computation"), (backward, "backward")):
        namespace: dict = {}
        exec(trace.python(), namespace)  # valid Python as printed: its sizes read from its inputs' shapes
        assert callable(namespace[name])
    run = {}
    exec(source, run)
    for T in (3, 8):  # other lengths than the traced one (the batch size is static: it never changed)
        x = _inputs(T).detach()
        outputs = run["computation"](x, w.detach())
        assert torch.equal(outputs[0], block(x, w.detach()))


def branch(x):
    if x.shape[1] > 6:
        return x.sin() * x.shape[1]
    return x.cos() - x.shape[0]


def test_a_branch_on_a_length_is_right_on_both_sides_and_guarded():
    jitted = fulmen.jit(branch, options=fulmen.JitOptions(dynamic=True))
    for T in (3, 5, 9, 4, 12, 6, 7):
        x = _inputs(T).detach()
        assert torch.equal(jitted(x), branch(x)), T
    core = jitted_core(jitted)
    assert len(core._cache.entries) == 2  # one trace per side of the branch
    x = _inputs(9).detach()
    jitted = fulmen.jit(branch, options=fulmen.JitOptions(dynamic=True))
    jitted(_inputs(3).detach())
    assert torch.equal(jitted(x), branch(x))
    (reason,) = fulmen.last_cache_miss_reasons(jitted)
    assert reason.startswith("trace 0: s1 > 6 was False, now s1 = 9 (x.shape[1]); asked at test_dynamic_shapes.py")
    assert "if x.shape[1] > 6:" in reason


def test_sizes_0_and_1_are_traced_apart():
    jitted = fulmen.jit(branch, options=fulmen.JitOptions(dynamic=True))
    jitted(_inputs(4).detach())
    x = _inputs(1).detach()
    assert torch.equal(jitted(x), branch(x))
    assert fulmen.cache_misses(jitted) == 2
    (reason,) = fulmen.last_cache_miss_reasons(jitted)
    assert (
        "x.shape[1] is 1: a symbolic size stands for sizes of 2 and more (s1); sizes 0 and 1 are traced apart" in reason
    )
    source = fulmen.last_traces(jitted)[-1].python()
    assert '"cpu f32[s0, 1, s1]"' in source


def test_mark_dynamic_makes_the_first_trace_symbolic():
    x = _inputs(5).detach()
    fulmen.mark_dynamic(x, 1)
    jitted = fulmen.jit(branch)
    assert torch.equal(jitted(x), branch(x))
    assert '"cpu f32[2, s0, 13]"' in fulmen.last_traces(jitted)[-1].python()
    for T in (2, 4, 6):
        y = _inputs(T).detach()  # not marked: the callable keeps the dim symbolic
        assert torch.equal(jitted(y), branch(y))
    assert fulmen.cache_misses(jitted) == 1
    with pytest.raises(IndexError, match="dimension 3 is out of range"):
        fulmen.mark_dynamic(x, 3)


def test_a_dimension_that_stays_the_same_stays_static():
    jitted = fulmen.jit(branch)
    for T in (3, 4, 5):
        jitted(_inputs(T).detach())
    x = _inputs(5, B=3).detach()
    assert torch.equal(jitted(x), branch(x))
    reasons = fulmen.last_cache_miss_reasons(jitted)
    assert reasons[1] == "trace 1: x.shape[0] is 3; the trace holds it at 2 (a size becomes symbolic once it changes)"


def test_dynamic_false_keeps_one_static_trace_per_shape():
    static = fulmen.jit(block, options=fulmen.JitOptions(dynamic=False))
    default = fulmen.jit(block)
    w = W.clone()
    for T in (4, 5, 6):
        x = _inputs(T).detach()
        assert torch.equal(static(x, w), block(x, w))
    assert fulmen.cache_misses(static) == 3
    assert "symbolic" not in " ".join(fulmen.last_cache_miss_reasons(static))
    assert "s0" not in fulmen.last_traces(static)[-1].python()
    # where shapes never change, the default traces exactly what the static path traces
    x = _inputs(6).detach()
    default(x, w)
    assert [t.python() for t in fulmen.last_traces(default)] == [t.python() for t in fulmen.last_traces(static)]


BLOCK = 16
COS = torch.randn(BLOCK, C)


def rope_like(x):
    B, T, C = x.shape
    if T > BLOCK:
        raise ValueError(f"Cannot forward sequence of length {T}, max seq length is only {BLOCK}.")
    return (x * COS[:T]).reshape(B * T, C).view(B, T, C)


def test_a_length_past_the_block_size_fails_as_eager_fails():
    jitted = fulmen.jit(rope_like)
    for T in (4, 7, 16, 9):
        x = _inputs(T).detach()
        assert torch.equal(jitted(x), rope_like(x))
    with pytest.raises(ValueError, match="Cannot forward sequence of length 17, max seq length is only 16"):
        rope_like(_inputs(17).detach())
    with pytest.raises(ValueError, match="Cannot forward sequence of length 17, max seq length is only 16"):
        jitted(_inputs(17).detach())
    x = _inputs(11).detach()
    assert torch.equal(jitted(x), rope_like(x))
    assert fulmen.cache_misses(jitted) == 3  # static 4, symbolic 7 (up to the block size); 17 refused as eager
    assert "s0 <= 16" not in fulmen.last_traces(jitted)[-1].python()


class Counter:
    length = 0


def test_sizes_returned_or_stored_are_the_calls_ints():
    counter = Counter()

    def program(x):
        counter.length = x.shape[1]
        return x * 2, x.shape[1], x.shape

    jitted = fulmen.jit(program, options=fulmen.JitOptions(dynamic=True))
    for T in (3, 4, 3):
        x = _inputs(T).detach()
        out, length, shape = jitted(x)
        assert torch.equal(out, x * 2) and type(length) is int and length == T and shape == x.shape
        assert type(counter.length) is int and counter.length == T
    # a size the program returns is the traced call's: each length has its trace
    assert fulmen.cache_misses(jitted) == 2
    (reason,) = fulmen.last_cache_miss_reasons(jitted)[:1]
    assert "s1 was 3, used as a Python int (the program returns it), now s1 = 4 (x.shape[1])" in reason


def test_a_backward_of_some_outputs_built_later_sees_the_symbols():
    w = W.clone().requires_grad_()

    def two(x):
        y = (x @ w).view(x.shape[0], -1)
        return y.sum(), y * 2

    jitted = fulmen.jit(two, options=fulmen.JitOptions(dynamic=True))
    for T in (3, 6, 4):
        x = _inputs(T).detach()
        for pick in (0, 1):
            got = torch.autograd.grad(jitted(x)[pick].sum(), w)[0]
            want = torch.autograd.grad(two(x)[pick].sum(), w)[0]
            assert torch.equal(got, want)
    assert fulmen.cache_misses(jitted) == 1


def test_duck_sized_dimensions_that_part_ways_trace_again():
    jitted = fulmen.jit(lambda a, b: a + b.sum(), options=fulmen.JitOptions(dynamic=True))
    a, b = torch.randn(4, 5), torch.randn(4)
    jitted(a, b)
    a, b = torch.randn(4, 5), torch.randn(6)
    assert torch.equal(jitted(a, b), a + b.sum())
    (reason,) = fulmen.last_cache_miss_reasons(jitted)
    assert reason == "trace 0: a.shape[0] and b.shape[0] were equal when traced (the symbol s0), now 4 and 6"


def test_what_symbolic_sizes_cannot_do_yet_traces_static_shapes_and_says_why():
    def update(a, b):  # inputs sharing memory, updated in place: fulmen's aliasing plan needs static shapes
        a.mul_(2)
        return b + 1

    jitted = fulmen.jit(update, options=fulmen.JitOptions(dynamic=True))
    for n in (4, 6):
        base, twin = torch.randn(n), None
        twin = base.clone()
        got = jitted(base, base[1:])
        want = update(twin, twin[1:])
        assert torch.equal(got, want) and torch.equal(base, twin)
    reasons = fulmen.last_cache_miss_reasons(jitted)
    assert reasons[-1].startswith(
        "symbolic sizes are off for this callable: tracing with symbolic sizes failed "
        "(NotImplementedError: the program updates in place inputs that share memory)"
    )


def test_a_backward_that_saves_nothing_still_knows_the_length():
    # mean's grad divides by the length and is expanded to it: the backward takes the input only for its shape
    jitted = fulmen.jit(lambda h: h.mean(0) * 3)
    for n in (4, 6, 9):
        h = torch.randn(n, 5, requires_grad=True)
        (got,) = torch.autograd.grad(jitted(h).sum(), h)
        (want,) = torch.autograd.grad((h.mean(0) * 3).sum(), h)
        assert torch.equal(got, want)
    assert fulmen.cache_misses(jitted) == 2
    backward = fulmen.last_backward_traces(jitted)[-1].python()
    assert "s0 = h.shape[0]" in backward, backward


def test_rows_of_a_larger_batch_are_symbolic():
    # each rank's rows of a global batch (x[start:stop]) are views at an offset into the batch's storage: they stand
    # for tensors of their own, so every rank traces twice, as the one whose rows start the storage
    linear = torch.nn.Linear(C, 4)  # captured: its guard reads its storage offset, the program's inputs' stay free

    def rows(x, y):
        return torch.tanh(linear(x)).softmax(-1) * y[..., None]

    jitted = fulmen.jit(rows)
    for T in (4, 5, 7, 12, 9):
        x, y = _inputs(T, B=6).detach(), torch.randn(6, T)
        got, got_grads = _grads(jitted, x[2:4].requires_grad_(), y[2:4])
        want, want_grads = _grads(rows, x[2:4].requires_grad_(), y[2:4])
        assert torch.equal(got, want)
        for g, e in zip(got_grads, want_grads):
            assert torch.equal(g, e)
        assert x[2:4].storage_offset() == 2 * T * C
    assert fulmen.cache_misses(jitted) == 2, fulmen.last_cache_miss_reasons(jitted)
    assert '# x: "cpu f32[2, s0, 13]"' in fulmen.last_traces(jitted)[-1].python()


def test_a_program_reading_an_offset_of_a_view_gets_the_calls_offset():
    def offset(x):
        return x * x.storage_offset()

    jitted = fulmen.jit(offset)
    for T in (4, 5, 7):
        x = torch.randn(4, T)
        for view in (x[2:], x[:2], x[2:]):
            assert torch.equal(jitted(view), offset(view)), (T, view.storage_offset())
    # the symbolic trace holds for the offsets it read: each other offset traces again, the same one hits
    assert '"cpu f32[2, s0]"' in fulmen.last_traces(jitted)[-1].python()
    assert fulmen.cache_hits(jitted) >= 2
    reasons = fulmen.last_cache_miss_reasons(jitted)
    assert "the inputs' storage offsets (14,), traced with (0,) (the program reads them" in reasons[-1], reasons
