"""Indexing with a 0-dim integer tensor (`x[i]`, `x[i, :, j] = v`) against eager.

Eager reads such an index's value and selects before anything else: `x[i]` is a view of `x`, a write through it
reaches `x`, and mixed with advanced indices it places dims as `x[1, :, j]` does (not as a broadcast index would).
Oracle: eager on the same inputs (values, grads, the inputs after the call, the aliasing of the result).
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
