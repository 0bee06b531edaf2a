"""Indexing whose meaning depends on an index tensor's values, against eager.

- A 0-dim integer tensor (`x[i]`, `x[i, :, j] = v`): eager reads its value and selects before anything else, so
  `x[i]` is a view of `x`, a write through it reaches `x`, and mixed with advanced indices it places dims as
  `x[1, :, j]` does (not as a broadcast index would).
- A write through a boolean mask (`x[mask] = 0`): the result has `x`'s shape whatever the mask holds, so it is
  traced; a read through one (`x[mask]`) has a shape set by the values and stays refused.

Oracle: eager on the same inputs (values, grads, the inputs after the call, the aliasing of the result, errors).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import fulmen

J = torch.tensor([[0, 1], [1, 0]])


def _leaf() -> torch.Tensor:
    return torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()


READS: dict[str, Callable[..., torch.Tensor]] = {
    "x[i]": lambda x, i: x[i] * 2,
    "x[:, i]": lambda x, i: x[:, i].exp(),
    "x[..., i]": lambda x, i: x[..., i] * x[..., 0],
    "x[i, :, j]": lambda x, i: x[i, :, J] * 2,
    "x[j, :, i]": lambda x, i: x[J, :, i] * 2,
    "x[None, i, 1:]": lambda x, i: x[None, i, 1:] * 2,
    "x[i, i]": lambda x, i: x[i, i] * 3,
    "x[i][0]": lambda x, i: x[i][0] * 2,
}


@pytest.mark.parametrize("index", [1, -1, 0], ids=["1", "-1", "0"])
@pytest.mark.parametrize("name", READS)
def test_reading_with_a_0_dim_index_gives_eagers_values_and_grads(name, index):
    fn = READS[name]
    i = torch.tensor(index)
    eager, jitted = _leaf(), _leaf()
    want, got = fn(eager, i), fulmen.jit(fn)(jitted, i)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(jitted.grad, eager.grad, rtol=0, atol=0)


def test_a_cached_trace_reads_the_index_of_each_call():
    fn = fulmen.jit(lambda x, i: x[i] * 2)
    x = _leaf().detach()
    for index in (0, 1, -1, torch.tensor(1, dtype=torch.int32)):
        i = index if isinstance(index, torch.Tensor) else torch.tensor(index)
        torch.testing.assert_close(fn(x, i), x[i] * 2, rtol=0, atol=0)
    assert fulmen.cache_misses(fn) == 2  # int64 and int32 indices; the values never retrace
    assert "impls.select_at(x, 0, i)" in str(fulmen.last_traces(fn)[-1])


def _write_through_view(x, i):
    y = x[i]
    y.add_(1)
    return x * 1


def _base_written_after(x, i):
    y = x[i]
    x.mul_(2)
    return y * 1


def _setitem(x, i):
    x[i] = 7
    return x * 1


def _setitem_mixed(x, i):
    x[i, :, J] = torch.arange(12.0, dtype=x.dtype).reshape(3, 2, 2)  # the shape of x[1, :, J]
    return x * 1


def _setitem_add(x, i):
    x[i, 0] += 5
    return x * 1


@pytest.mark.parametrize("fn", [_write_through_view, _base_written_after, _setitem, _setitem_mixed, _setitem_add])
def test_writes_through_and_into_a_0_dim_indexed_view_are_eagers(fn):
    i = torch.tensor(1)
    eager, jitted = _leaf().detach(), _leaf().detach()
    torch.testing.assert_close(fulmen.jit(fn)(jitted, i), fn(eager, i), rtol=0, atol=0)
    torch.testing.assert_close(jitted, eager, rtol=0, atol=0)


def test_the_result_is_a_view_of_the_input_as_in_eager():
    i = torch.tensor(1)
    eager, jitted = _leaf().detach(), _leaf().detach()
    select = lambda x, i: x[i]  # noqa: E731
    select(eager, i).add_(100)
    fulmen.jit(select)(jitted, i).add_(100)
    torch.testing.assert_close(jitted, eager, rtol=0, atol=0)


def test_an_index_out_of_range_raises_index_error_as_in_eager():
    x = _leaf().detach()
    with pytest.raises(IndexError):
        x[torch.tensor(5)]
    with pytest.raises(IndexError, match="out of range"):
        fulmen.jit(lambda x, i: x[i] * 2)(x, torch.tensor(5))


def test_vmap_and_jvp_see_the_select_as_a_gather():
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    i = torch.tensor([0, 2, -1, 1, 0])
    fn = lambda x, i: x[i].sin()  # noqa: E731
    torch.testing.assert_close(fulmen.vmap(fn)(x, i), torch.func.vmap(fn)(x, i), rtol=0, atol=0)
    tangent = torch.ones_like(x[0])
    got = fulmen.jvp(lambda x: fn(x, torch.tensor(-1)), (x[0],), (tangent,))
    want = torch.func.jvp(lambda x: fn(x, torch.tensor(-1)), (x[0],), (tangent,))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# --- writes through a boolean mask ---------------------------------------------------------------------------------


def _mask_scalar(x, m, v):
    y = x.clone()
    y[m] = 0.5
    return y.exp()


def _mask_neg_inf_softmax(x, m, v):
    y = x * 1
    y[~m] = float("-inf")
    return y.softmax(-1)


def _mask_rows(x, m, v):
    y = x * 2
    y[m[:, 0]] = v  # a mask over the leading dim, a value broadcast to each chosen row
    return y


def _mask_after_slice(x, m, v):
    y = x * 2
    y[:, m[0]] = v[0, :1]
    return y


def _mask_by_values(x, m, v):
    y = x.clone()
    y[y < 0] = v[0, 0]
    return y


@pytest.mark.parametrize("fn", [_mask_scalar, _mask_neg_inf_softmax, _mask_rows, _mask_after_slice, _mask_by_values])
def test_a_write_through_a_boolean_mask_gives_eagers_values_and_grads(fn):
    def inputs():
        g = torch.Generator().manual_seed(1)
        x = torch.randn(4, 5, dtype=torch.float64, generator=g).requires_grad_()
        v = torch.randn(1, 5, dtype=torch.float64, generator=g).requires_grad_()
        return x, (x.detach() > 0), v

    (xe, m, ve), (xj, _, vj) = inputs(), inputs()
    want, got = fn(xe, m, ve), fulmen.jit(fn)(xj, m, vj)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(fulmen.jit(fn)(xj, ~m, vj), fn(xe, ~m, ve), rtol=0, atol=0)  # another mask, a hit
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(xj.grad, xe.grad, rtol=0, atol=0)
    assert (vj.grad is None) == (ve.grad is None)
    if ve.grad is not None:
        torch.testing.assert_close(vj.grad, ve.grad, rtol=0, atol=0)


def test_a_write_through_a_mask_with_one_value_per_true_element_checks_the_count_as_eager():
    def scatter(x, m, values):
        x[m] = values
        return x * 1

    x = torch.zeros(3, 4)
    m = torch.tensor([[True, False, True, False]] * 3)
    values = torch.arange(6.0)
    jitted = fulmen.jit(scatter)
    torch.testing.assert_close(jitted(x.clone(), m, values), scatter(x.clone(), m, values), rtol=0, atol=0)
    fewer = m.clone()
    fewer[0, 0] = False  # 5 true elements for 6 values
    with pytest.raises(RuntimeError) as eager:
        scatter(x.clone(), fewer, values)
    with pytest.raises(RuntimeError) as ours:
        jitted(x.clone(), fewer, values)
    assert str(ours.value) == str(eager.value)


def test_reading_through_a_mask_is_refused_naming_the_line():
    with pytest.raises(fulmen.DataDependentError, match=r"(?s)boolean mask.*test_indexing_by_value\.py"):
        fulmen.jit(lambda x: x[x > 0].sum())(torch.randn(3))


def test_a_fusion_region_holding_the_select_gathers_and_gives_eagers_values_and_grads():
    from fulmen.executors.torch_compile import TorchCompileExecutor

    fn = lambda x, i: (x[i] * 2).sin() + x[:, i].sum()  # noqa: E731
    i = torch.tensor(-1)
    eager, jitted = _leaf(), _leaf()
    want = fn(eager, i)
    got = fulmen.jit(fn, executors=[TorchCompileExecutor(), "torch"])(jitted, i)
    torch.testing.assert_close(got, want)
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(jitted.grad, eager.grad)
