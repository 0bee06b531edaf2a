"""Reads of tensors made from Python numbers alone (fulmen/acquisition/known_values.py) are answered as eager
answers them.

Each program takes eager's branch; under a compiler (`torch.compiler.is_compiling()`) it would take another, which
fulmen took before: a read of any tensor value made it trace the program again as a compiler (compiling.py), the
way transformers' reads of the `position_ids` it builds did. Reads of what is not known stay refused.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import fulmen


def positions_are_consecutive(x):
    positions = torch.arange(x.shape[-1]).unsqueeze(0)
    steps = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    if not torch.compiler.is_compiling() and ((steps != 1).cumsum(-1)[:, -1] == 0).all():
        return x * 2
    return x * 5


def item_and_tolist(x):
    counts = torch.ones(3, dtype=torch.long).cumsum(0)
    if torch.compiler.is_compiling():
        return x * 5
    return x[: counts[1].item()] * sum(counts.tolist()) + int(counts[0])


def updated_in_place(x):
    steps = torch.zeros(2, dtype=torch.int32)
    steps.add_(3)
    return x * 5 if torch.compiler.is_compiling() else x * int(steps[0])


@pytest.mark.parametrize("fn", [positions_are_consecutive, item_and_tolist, updated_in_place])
def test_a_read_of_values_made_from_python_numbers_takes_eagers_branch(fn: Callable):
    x = torch.randn(4, 3, requires_grad=True)
    jitted = fulmen.jit(fn)
    for _ in range(2):
        want, got = fn(x), jitted(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])
    assert fulmen.cache_hits(jitted) == 1


def reads_an_argument(x):
    return x * 2 if (x > 0).all() else x


def reads_floats(x):
    return x * 2 if torch.arange(3.0).sum() > 1 else x  # float contents: a device may round otherwise


def reads_a_draw(x):
    return x * 2 if torch.randint(0, 2, (1,)).item() else x


def reads_what_an_argument_updated(x):
    counts = torch.arange(3)
    counts.add_(x.long())
    return x * 2 if counts[0] == 0 else x


@pytest.mark.parametrize("fn", [reads_an_argument, reads_floats, reads_a_draw, reads_what_an_argument_updated])
def test_a_read_of_values_not_known_is_refused(fn: Callable):
    with pytest.raises(fulmen.DataDependentError, match="reads tensor values"):
        fulmen.jit(fn)(torch.ones(3))
