"""fulmen's forward and backward traces inside torch.autograd: what users do with gradients works as in eager."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.core import pytree
from fulmen.core.symbol import map_proxies
from fulmen.distributed.transform import GradSync
from fulmen.ops.registry import SYMBOLS
from fulmen.ops.rules.grad import get_grad, put_grad
from fulmen.ops.rules.tables import RuleKind, register, rule
from fulmen.transforms.common import DEL


def _mlp(x, w1, b1, w2):
    return F.linear(F.silu(F.linear(x, w1, b1)), w2).sum()


def _params(requires=(True, True, True, True)):
    torch.manual_seed(0)
    shapes = [(4, 8), (16, 8), (16,), (3, 16)]
    return [torch.randn(s, requires_grad=r) for s, r in zip(shapes, requires)]


def _grads(fn, args):
    for a in args:
        a.grad = None
    fn(*args).backward()
    return [None if a.grad is None else a.grad.clone() for a in args]


def test_grads_match_eager_and_accumulate_across_calls():
    args = _params()
    jitted = fulmen.jit(_mlp)
    expected = _grads(_mlp, args)
    for a in args:
        a.grad = None
    jitted(*args).backward()
    jitted(*args).backward()  # a second call accumulates into .grad, as eager does
    for got, want in zip(args, expected):
        torch.testing.assert_close(got.grad, 2 * want)
    assert fulmen.cache_misses(jitted) == 1 and fulmen.cache_hits(jitted) == 1


def test_inputs_that_do_not_require_grad_get_none():
    args = _params(requires=(False, True, False, True))
    got = _grads(fulmen.jit(_mlp), args)
    want = _grads(_mlp, args)
    assert [g is None for g in got] == [True, False, True, False]
    for g, w in zip(got, want):
        if w is not None:
            torch.testing.assert_close(g, w)


def test_unused_parameter_gets_none_like_eager():
    x, w, unused = (torch.randn(3, requires_grad=True) for _ in range(3))
    fulmen.jit(lambda a, b, c: (a * b).sum())(x, w, unused).backward()
    assert unused.grad is None and x.grad is not None


def test_mixing_eager_and_jitted_code_in_one_graph():
    torch.manual_seed(0)
    a = torch.randn(5, 5, requires_grad=True)
    jitted = fulmen.jit(lambda x: torch.tanh(x @ x).exp())

    def program(f):
        h = torch.sin(a) * 2  # eager before
        y = f(h)
        return (y.cos() + h).sum()  # eager after, and h reused

    program(jitted).backward()
    got = a.grad.clone()
    a.grad = None
    program(lambda x: torch.tanh(x @ x).exp()).backward()
    torch.testing.assert_close(got, a.grad)


def test_non_differentiable_outputs_and_unused_outputs():
    def f(x):
        return x.argmax(-1), torch.exp(x), (x * 2).sum()

    x = torch.randn(4, 6, requires_grad=True)
    jitted = fulmen.jit(f)
    index, expo, total = jitted(x)
    assert not index.requires_grad and expo.requires_grad
    total.backward()  # exp's output gets no grad: its backward is skipped, not fed zeros
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    program = jitted.last_entry.program
    assert ((False, False, True), GradSync.SYNC) in program._backward_fns  # built for this pattern of cotangents


def test_no_grad_builds_no_backward_and_saves_nothing():
    args = _params()
    jitted = fulmen.jit(_mlp)
    with torch.no_grad():
        out = jitted(*args)
    assert not out.requires_grad
    assert fulmen.last_backward_traces(jitted) == []
    assert "saved" not in fulmen.last_traces(jitted)[-1].python()
    out = jitted(*args)  # grad mode is part of the cache key: a new entry with a backward
    assert out.requires_grad and fulmen.last_backward_traces(jitted)
    assert fulmen.cache_misses(jitted) == 2


def test_no_grad_region_inside_the_program_stops_gradients():
    def f(x):
        with torch.no_grad():
            scale = x.abs().max()
        return (x * scale).sum()

    x = torch.randn(6, requires_grad=True)
    fulmen.jit(f)(x).backward()
    got = x.grad.clone()
    x.grad = None
    f(x).backward()
    torch.testing.assert_close(got, x.grad)


def test_detach_stops_gradients():
    x = torch.randn(6, requires_grad=True)
    fulmen.jit(lambda a: (a * a.detach()).sum())(x).backward()
    torch.testing.assert_close(x.grad, x.detach())


def test_double_backward_is_a_clear_error():
    x = torch.randn(4, requires_grad=True)
    y = fulmen.jit(lambda a: (a.sin() ** 2).sum())(x)
    with pytest.raises(RuntimeError, match="double backward or backward\\(create_graph=True\\)"):
        torch.autograd.grad(y, x, create_graph=True)


def test_second_backward_without_retain_graph_is_a_clear_error():
    x = torch.randn(4, requires_grad=True)
    y = fulmen.jit(lambda a: (a.sin() ** 2).sum())(x)
    y.backward()  # retain_graph=True keeps the saved tensors (tests/training/test_autograd_contexts.py)
    with pytest.raises(RuntimeError, match="a second time.*Specify retain_graph=True"):
        y.backward()


def test_saved_input_modified_in_place_is_detected():
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(4)
    y = fulmen.jit(lambda a, b: (a * b).sum())(w, x)
    x.add_(1)  # b is saved for w's grad
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_backward_trace_frees_saved_tensors_as_it_goes():
    args = _params()
    jitted = fulmen.jit(_mlp)
    jitted(*args).backward()
    text = fulmen.last_backward_traces(jitted)[-1].python()
    assert "def backward(saved, cotangents):" in text and "saved.clear()" in text
    lines = text.splitlines()
    deleted_at = {name: i for i, line in enumerate(lines) if line.strip().startswith("del ")
                  for name in line.strip()[4:].split(", ")}
    returned_at = next(i for i, line in enumerate(lines) if line.strip().startswith("return "))
    saved = [p.pname for p in jitted.last_entry.program.plan.saved]
    assert saved
    for name in saved:  # every saved tensor is deleted after its last use, before the backward returns
        assert name in deleted_at and deleted_at[name] < returned_at, name
        used = re.compile(rf"\b{name}\b")
        last_use = max(i for i, line in enumerate(lines[: deleted_at[name]]) if used.search(line.split("#")[0]))
        assert last_use == deleted_at[name] - 1 or lines[last_use + 1].strip().startswith(("del ", "#")), name


@pytest.mark.parametrize(("padding_idx", "scale_grad_by_freq", "sparse"),
                         [(None, False, False), (3, False, False), (-2, True, False), (None, True, False),
                          (3, False, True)])
def test_embedding_weight_gradient_is_eagers_bit_for_bit(padding_idx, scale_grad_by_freq, sparse):
    """bfloat16 rows, each looked up hundreds of times: the gradient is summed by eager's own kernel, not by an
    index_add that rounds to bfloat16 at every addition (which differs from eager by whole units here), and
    scale_grad_by_freq divides by each index's count as eager does (it once went unseen); sparse=True gives eager's
    sparse gradient."""
    torch.manual_seed(0)
    weight = torch.randn(50, 64, dtype=torch.bfloat16, requires_grad=True)
    index = torch.randint(0, 5, (8, 500))
    g = torch.randn(8, 500, 64, dtype=torch.bfloat16)

    def lookup(weight, index):
        return F.embedding(index, weight, padding_idx, scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)

    jitted = fulmen.jit(lookup)
    (ours,) = torch.autograd.grad(jitted(weight, index), weight, g)
    (eager,) = torch.autograd.grad(lookup(weight, index), weight, g)
    assert ours.layout == eager.layout
    assert torch.equal(ours.to_dense(), eager.to_dense())
    if padding_idx is not None:
        assert not ours.to_dense()[padding_idx].any()
    kernel = "impls.embedding_backward(" in str(fulmen.last_backward_traces(jitted)[-1])
    assert kernel != sparse  # a sparse gradient comes from torch autograd itself


def _laid_out(shape: tuple[int, ...], layout: str) -> torch.Tensor:
    x = torch.randn(shape, dtype=torch.bfloat16)
    if layout == "transposed":  # stored column by column (a weight used as W.t())
        x = x.mT.contiguous().mT
    elif layout == "batch-strided" and x.dim() >= 3:  # batch dims that do not fold into rows without a copy
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    return x


@pytest.mark.parametrize(("a_shape", "b_shape"), [((4, 64, 32), (32, 16)), ((2, 3, 64, 32), (32, 16)),
                                                  ((64, 32), (4, 32, 16)), ((4, 64, 32), (1, 32, 16)),
                                                  ((1, 64, 32), (4, 32, 16)), ((4, 64, 32), (4, 32, 16))])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "batch-strided"])
@pytest.mark.parametrize("wants", ["both", "a", "b"])
def test_matmul_grads_are_eagers_bit_for_bit(a_shape, b_shape, layout, wants):
    """Eager's matmul folds a batched operand's rows into one mm when the other is a matrix that requires grad
    (and drops a broadcast batch of 1), so that matrix's grad is one product accumulated in float32 over every row.
    Summing per-batch bfloat16 products instead rounds each: off by whole units. The grads follow eager's folds and
    its mm backward, which computes a column-major operand's grad transposed."""
    torch.manual_seed(0)
    a = _laid_out(a_shape, layout).requires_grad_(wants in ("both", "a"))
    b = _laid_out(b_shape, layout).requires_grad_(wants in ("both", "b"))
    wrt = [t for t in (a, b) if t.requires_grad]
    expected = torch.matmul(a, b)
    g = torch.randn(expected.shape, dtype=torch.bfloat16)
    ours = torch.autograd.grad(fulmen.jit(torch.matmul)(a, b), wrt, g)
    eager = torch.autograd.grad(expected, wrt, g)
    assert all(torch.equal(x, y) for x, y in zip(ours, eager))


def test_custom_grad_rule_with_get_grad_and_put_grad():
    """A rule in the style of the seed's grad_transform replaces silu's backward; grads still equal eager's."""
    calls = []

    def silu_rule(x, inplace=False):
        y = F.silu(x)
        g = get_grad(y)
        calls.append(g)
        sig = torch.sigmoid(x)
        put_grad(x, g * (sig + y * (1 - sig)))
        return y

    silu = SYMBOLS["torch.nn.functional.silu"]
    previous = rule(RuleKind.GRAD, silu)
    register(RuleKind.GRAD, silu, silu_rule, replace=True)
    try:
        args = _params()
        got = _grads(fulmen.jit(_mlp), args)
    finally:
        register(RuleKind.GRAD, silu, previous, replace=True)
    assert calls, "the custom rule ran"
    for g, w in zip(got, _grads(_mlp, args)):
        torch.testing.assert_close(g, w)


def test_get_grad_outside_a_rule_is_an_error():
    with pytest.raises(RuntimeError, match="inside a grad rule"):
        get_grad(torch.randn(2))


def _run_checking_layouts(trace, *groups) -> list[str]:
    """Runs `trace` call by call on real tensors; the calls whose outputs are laid out otherwise than the trace
    records them."""
    env = {p.pname: t for p, t in zip(trace.inputs, [t for group in groups for t in group], strict=True)}
    wrong = []
    for bsym in trace.bound_symbols:
        if bsym.sym is DEL:
            continue
        args, kwargs = map_proxies((bsym.args, bsym.kwargs), lambda p: env[p.pname])
        result = bsym.sym.impl(*args, **kwargs)
        is_tensor = lambda obj: isinstance(obj, torch.Tensor)  # noqa: E731
        for proxy, value in zip(pytree.leaves(bsym.output, is_tensor), pytree.leaves(result, is_tensor), strict=True):
            env[proxy.pname] = value
            if value.stride() != proxy.stride():
                wrong.append(f"{bsym.sym.printed} -> {proxy.pname}: {proxy.stride()} recorded, {value.stride()} ran")
    return wrong


def test_backward_trace_records_the_layouts_that_run():
    # The permute's grad rule ran on a placeholder laid out as the permuted (strided) forward value, but the matmul's
    # grad arrives contiguous: permuted back, it is strided, and the reshape after the second permute copies.
    def fn(x, w):
        y = x.permute(0, 2, 1, 3) @ w
        return y.permute(0, 2, 1, 3).reshape(2, 6, 20).sin().sum()

    torch.manual_seed(0)
    x, w = torch.randn(2, 6, 4, 5, requires_grad=True), torch.randn(5, 5, requires_grad=True)
    jitted = fulmen.jit(fn, executors=["torch"])
    jitted(x, w).backward()
    forward, backward = fulmen.last_traces(jitted)[-1], fulmen.last_backward_traces(jitted)[-1]
    assert [name for name, _ in backward.input_groups] == ["saved", "cotangents"]
    with torch.no_grad():
        results = forward.python_callable()(x, w)
    saved = results[jitted.last_entry.program.n_outputs:]
    assert _run_checking_layouts(backward, saved, [torch.ones(())]) == []
