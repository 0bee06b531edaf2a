"""In-place updates and views on inputs and buffers: same results and same side effects as eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fulmen


def _check(fn, *inputs):
    eager_inputs = [t.clone() for t in inputs]
    jit_inputs = [t.clone() for t in inputs]
    expected = fn(*eager_inputs)
    actual = fulmen.jit(fn)(*jit_inputs)
    torch.testing.assert_close(actual, expected)
    for e, j in zip(eager_inputs, jit_inputs):
        torch.testing.assert_close(j, e)  # side effects on the inputs match
    return actual, jit_inputs


def test_add_inplace_on_input_returns_the_input():
    def f(x, y):
        return x.add_(y)

    x, y = torch.randn(3), torch.randn(3)
    out = fulmen.jit(f)(x, y)
    assert out is x  # eager identity: add_ returns its input
    _check(f, torch.randn(3), torch.randn(3))


def test_inplace_on_view_updates_base_and_sibling_views():
    def f(x):
        top, bottom = x[:2], x[2:]
        top.mul_(10)
        x[3] = -1.0
        whole = x.view(-1)
        return top + 0, bottom + 0, whole.sum()

    _check(f, torch.arange(12.0).reshape(4, 3))


def test_copy_and_index_copy_into_slices():
    def f(cache, pos, k):
        view = cache[:1, ...]
        view.index_copy_(1, pos, k)
        cache[1].copy_(k[0, 0])
        return cache * 1

    _check(f, torch.zeros(2, 5, 3), torch.tensor([1, 3]), torch.randn(1, 2, 3))


def test_slice_assignment_and_augmented_index_assignment():
    def f(x, idx, v):
        x[:, 1:3] = v
        x[idx] += 1
        return x.sum(0)

    _check(f, torch.randn(4, 4), torch.tensor([0, 2]), torch.randn(4, 2))


def test_inplace_dtype_rules_follow_eager():
    def f(x):
        return x.add_(1.5)

    with pytest.raises(fulmen.TraceError, match="can't be cast"):
        fulmen.jit(f)(torch.ones(2, dtype=torch.int64))


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("history", torch.zeros(4))

    def forward(self, x):
        self.steps.add_(1)
        self.history[1:3] = x
        return x * self.steps


def test_buffer_updates_are_written_back():
    eager = Counter()
    compiled = copy.deepcopy(eager)
    jitted = fulmen.jit(compiled)
    for _ in range(3):
        x = torch.randn(2)
        torch.testing.assert_close(jitted(x), eager(x))
    torch.testing.assert_close(compiled.steps, eager.steps)
    torch.testing.assert_close(compiled.history, eager.history)
    assert fulmen.cache_misses(jitted) == 1
    final = fulmen.last_traces(jitted)[-1].python()
    assert "prims.copy_(" in final  # the write-back is visible in the trace


class DtypeSwitch(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(3))

    def forward(self, x):
        if self.k.dtype != x.dtype:
            self.k = self.k.to(x.dtype)
        return self.k + x


def test_buffer_rebinding_reaches_the_module():
    module = DtypeSwitch()
    jitted = fulmen.jit(module)
    x = torch.randn(3, dtype=torch.float64)
    torch.testing.assert_close(jitted(x), x)
    assert module.k.dtype == torch.float64  # as eager would have left it


# --- updates autograd does not see: through .detach() / .data, or under no_grad ---------------------------------------
def _detach_add(x):
    x.detach().add_(1)
    return x * x


def _data_mul(x):
    x.data.mul_(10)
    return x * x


@pytest.mark.parametrize("fn", [_detach_add, _data_mul])
def test_an_update_through_detach_or_data_lands_on_the_input(fn):
    for requires_grad in (False, True):
        eager_x = torch.arange(3.0, requires_grad=requires_grad)
        jit_x = torch.arange(3.0, requires_grad=requires_grad)
        expected, actual = fn(eager_x), fulmen.jit(fn)(jit_x)
        torch.testing.assert_close(actual, expected)
        torch.testing.assert_close(jit_x, eager_x)  # the input itself was updated
        assert jit_x._version == eager_x._version  # .data keeps off the version counter, .detach() shares it
        assert actual.requires_grad == expected.requires_grad
        if requires_grad:  # the input keeps its history: later reads differentiate to it
            expected.sum().backward()
            actual.sum().backward()
            torch.testing.assert_close(jit_x.grad, eager_x.grad)
            assert jit_x.is_leaf and jit_x.grad_fn is None


class Clipped(nn.Module):
    """Clamps its weight in place where autograd does not see it, as weight clipping does."""

    def __init__(self, how: str):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.how = how

    def forward(self, x):
        if self.how == "data":
            self.lin.weight.data.clamp_(-0.1, 0.1)
        elif self.how == "detach":
            self.lin.weight.detach()[0].clamp_(-0.1, 0.1)
        else:
            with torch.no_grad():
                self.lin.weight.clamp_(-0.1, 0.1)
        return self.lin(x)


@pytest.mark.parametrize("how", ["data", "detach", "no_grad"])
def test_a_parameter_updated_where_autograd_does_not_see_it_keeps_its_grads(how):
    torch.manual_seed(0)
    eager = Clipped(how)
    compiled = copy.deepcopy(eager)
    jitted = fulmen.jit(compiled)
    x = torch.randn(2, 3)
    for _ in range(2):
        expected, actual = eager(x), jitted(x)
        torch.testing.assert_close(actual, expected)
        torch.testing.assert_close(compiled.lin.weight, eager.lin.weight)
        expected.sum().backward()
        actual.sum().backward()
        torch.testing.assert_close(compiled.lin.weight.grad, eager.lin.weight.grad)
        torch.testing.assert_close(compiled.lin.bias.grad, eager.lin.bias.grad)
    assert fulmen.cache_misses(jitted) == 1


def test_an_intermediate_updated_under_no_grad_keeps_its_history():
    def f(x):
        y = x * 2
        with torch.no_grad():
            y[1:].add_(1)
        return y * 3

    eager_x, jit_x = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    expected, actual = f(eager_x), fulmen.jit(f)(jit_x)
    torch.testing.assert_close(actual, expected)
    assert actual.requires_grad
    expected.sum().backward()
    actual.sum().backward()
    torch.testing.assert_close(jit_x.grad, eager_x.grad)


def test_an_input_saved_for_backward_then_updated_in_place_fails_the_backward_as_eager():
    def f(x, w):
        y = x * w  # saves x for w's grad
        x.detach().add_(1)
        return y

    for fn in (f, fulmen.jit(f)):
        x, w = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
        y = fn(x, w)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_a_buffer_read_then_updated_is_not_recomputed_from_its_update():
    def f(buf, w):
        h = buf * 2  # the backward reads h, which eager saves; recomputing it from buf would read the update
        y = h * w
        buf.add_(1)
        return y

    eager_w, jit_w = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    f(torch.ones(3), eager_w).sum().backward()
    fulmen.jit(f)(torch.ones(3), jit_w).sum().backward()
    torch.testing.assert_close(jit_w.grad, eager_w.grad)


def test_an_update_through_a_view_of_a_captured_tensor_is_written_back_as_eagers():
    """(It was refused; tests/jit/test_captured_updates.py has the rest.)"""
    captured = {"eager": torch.ones(3), "jit": torch.ones(3)}

    def program(key):
        def f(x):
            captured[key].detach().add_(1)
            return x + captured[key]

        return f

    for _ in range(2):
        torch.testing.assert_close(fulmen.jit(program("jit"))(torch.ones(3)), program("eager")(torch.ones(3)))
        torch.testing.assert_close(captured["jit"], captured["eager"])


# --- an input updated with a value that requires grad gets its autograd history, as eager's in-place update does ----
def _fill_tail(buf, w):
    buf[1:] = w * 2
    return w.sum()


def test_an_input_updated_with_a_value_that_requires_grad_gets_its_history():
    results = []
    for fn in (_fill_tail, fulmen.jit(_fill_tail)):
        buf, w = torch.zeros(4), torch.ones(3, requires_grad=True)
        loss = fn(buf, w) + (buf * 5).sum()  # the later use of buf differentiates to w
        loss.backward()
        results.append((loss.detach(), buf.detach().clone(), buf.requires_grad, w.grad))
    (loss, buf, requires_grad, grad), (expected_loss, expected_buf, expected_requires_grad, expected_grad) = results
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(buf, expected_buf)
    assert requires_grad == expected_requires_grad
    torch.testing.assert_close(grad, expected_grad)


class Derived(nn.Module):
    """Stores a value derived from its parameter in a buffer: written into it, or assigned over it."""

    def __init__(self, assign: bool):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.register_buffer("buf", torch.zeros(3))
        self.assign = assign

    def forward(self, x):
        if self.assign:
            self.buf = self.w * x
        else:
            self.buf[1:] = self.w[1:] * x[1:]
        return x + 1


@pytest.mark.parametrize("assign", [False, True])
def test_a_buffer_given_a_value_that_requires_grad_keeps_its_history(assign):
    eager = Derived(assign)
    compiled = copy.deepcopy(eager)
    jitted = fulmen.jit(compiled)
    x = torch.full((3,), 2.0)
    torch.testing.assert_close(jitted(x), eager(x))
    torch.testing.assert_close(compiled.buf, eager.buf)
    assert compiled.buf.requires_grad == eager.buf.requires_grad
    (compiled.buf * 3).sum().backward()
    (eager.buf * 3).sum().backward()
    torch.testing.assert_close(compiled.w.grad, eager.w.grad)


# --- an input that requires grad, not a leaf, updated in place: its history grows by the update, as in eager -------
def _append(cache, value, index):
    cache.index_copy_(0, index, value)
    return cache.sum(0) * 2


def test_a_buffer_updated_in_place_over_two_calls_differentiates_through_both():
    # the kv-cache pattern: the first call gives the buffer a history, the second updates that non-leaf buffer
    results = []
    for fn in (_append, fulmen.jit(_append)):
        cache = torch.zeros(5, 3)
        first = torch.arange(6.0).reshape(2, 3).requires_grad_()
        second = torch.full((1, 3), 3.0, requires_grad=True)
        out1 = fn(cache, first, torch.tensor([0, 1]))
        assert cache.requires_grad and cache.grad_fn is not None
        out2 = fn(cache, second, torch.tensor([1]))
        ((out1 * torch.arange(3.0)).sum() + (out2**2).sum() + (cache * cache).sum()).backward()
        results.append((out1.detach(), out2.detach(), cache.detach().clone(), cache.requires_grad, first.grad,
                        second.grad))
    for actual, expected in zip(results[1], results[0]):
        torch.testing.assert_close(actual, expected)


def _scale(y, w):
    y.mul_(w)  # the backward needs y's old value for w's grad
    return y * 3


def test_a_non_leaf_input_scaled_in_place_differentiates_through_its_old_value():
    results = []
    for fn in (_scale, fulmen.jit(_scale)):
        x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        w = torch.tensor([-1.0, 1.0, 3.0], requires_grad=True)
        y = x * 2
        out = fn(y, w)
        (out.sum() + (y * y).sum()).backward()
        results.append((out.detach(), y.detach().clone(), y.requires_grad, x.grad, w.grad))
    for actual, expected in zip(results[1], results[0]):
        torch.testing.assert_close(actual, expected)


def test_an_input_saved_by_an_earlier_graph_then_updated_fails_its_backward_as_eager():
    for fn in (_scale, fulmen.jit(_scale)):
        x, v = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
        y = x * 2
        z = y * v  # saves y
        fn(y, torch.ones(3, requires_grad=True))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.sum().backward()


def test_a_leaf_that_requires_grad_updated_in_place_is_refused_as_eager():
    with pytest.raises(RuntimeError, match="leaf Variable"):
        _scale(torch.ones(3, requires_grad=True), torch.ones(3))
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(fulmen.TraceError, match="a leaf tensor that requires grad") as error:
        fulmen.jit(_scale)(x, torch.ones(3))
    assert error.value.location.line == "y.mul_(w)  # the backward needs y's old value for w's grad"
    torch.testing.assert_close(x.detach(), torch.ones(3))


def test_an_input_the_backward_gives_no_grad_keeps_autograd_out_of_its_freed_history():
    def f(x, state):
        return x * 2 + state.detach()  # state requires grad, but gets none

    x = torch.ones(3, requires_grad=True)
    state = torch.ones(3, requires_grad=True).exp()
    state.sum().backward()  # frees state's history, as a previous training step does
    fulmen.jit(f)(x, state).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def _double_in_place(t):
    t.mul_(2)
    return t.sum()


@pytest.mark.parametrize(
    "view", [lambda b: b[:3], lambda b: b.as_strided((2, 2), (3, 1)), lambda b: b.reshape(2, 3).t()],
    ids=["slice", "strided", "transposed"],
)
def test_updates_of_views_whose_elements_do_not_share_memory_match_eager(view):
    eager, jitted = torch.arange(6.0), torch.arange(6.0)
    torch.testing.assert_close(fulmen.jit(_double_in_place)(view(jitted)), _double_in_place(view(eager)))
    torch.testing.assert_close(jitted, eager, rtol=0, atol=0)


def test_an_update_of_an_input_whose_elements_overlap_is_refused_at_its_line():
    # eager writes each memory location as often as elements alias it, in its kernel's order
    base = torch.arange(6.0)
    _double_in_place(base.as_strided((3, 3), (1, 1)))
    assert not torch.equal(base, torch.arange(6.0) * 2)

    base = torch.arange(6.0)
    with pytest.raises(fulmen.TraceError, match=r"(?s)input t, whose elements may share memory .*t\.mul_\(2\)"):
        fulmen.jit(_double_in_place)(base.as_strided((3, 3), (1, 1)))
    assert torch.equal(base, torch.arange(6.0))
