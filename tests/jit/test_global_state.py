"""Grad mode and autocast that a program changes with bare calls (as the graphs Dynamo captures do): a compilation
that fails, and each acquisition made again, starts from the caller's state. Oracle: eager on the same inputs."""

from __future__ import annotations

import pytest
import torch

import fulmen
from fulmen.core.errors import UnsupportedOpError


def grad_off_then_refused(x, w):
    y = x @ w
    torch._C._set_grad_enabled(False)
    cis = torch.polar(torch.ones_like(y), y)  # fulmen has no symbol for torch.polar: refused here
    torch._C._set_grad_enabled(True)
    return y * torch.view_as_real(cis).sum(-1)


def autocast_on_then_refused(x, w):
    torch.autocast("cpu", dtype=torch.bfloat16).__enter__()  # left by the refusal below, as a Dynamo graph's node
    return torch.polar(x @ w, x @ w)


@pytest.mark.parametrize("program", [grad_off_then_refused, autocast_on_then_refused])
def test_a_refused_program_leaves_grad_mode_and_autocast_as_the_caller_had_them(program):
    # left changed: the caller's fallback (eager, or fulmen.dynamo's) ran without grad or under bfloat16 autocast
    x, w = torch.randn(2, 3), torch.randn(3, 2, requires_grad=True)
    with pytest.raises(UnsupportedOpError, match="torch.polar"):
        fulmen.jit(program)(x, w)
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    assert torch.autocast_increment_nesting() == 1  # no autocast region left open
    torch.autocast_decrement_nesting()
    assert (x @ w).dtype == torch.float32 and (x @ w).requires_grad


def computed_before_a_read_only_eager_makes(x, w):
    y = x @ w
    torch._C._set_grad_enabled(False)
    if not torch.compiler.is_compiling() and bool(x.sum() > 1e9):  # libraries skip such reads under a compiler
        y = y * 0
    torch._C._set_grad_enabled(True)
    return y * 2


def test_a_program_acquired_again_starts_from_the_callers_grad_mode():
    # the second acquisition (as a compiler, after the value read) began with grad off: y had no history, no grad
    x = torch.randn(2, 3)
    grads = []
    for fn in (computed_before_a_read_only_eager_makes, fulmen.jit(computed_before_a_read_only_eager_makes)):
        w = torch.randn(3, 2, generator=torch.Generator().manual_seed(0)).requires_grad_()
        out = fn(x, w)
        assert out.requires_grad
        out.sum().backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[1], grads[0])


def turns_grad_off_for_its_caller(x, w):
    y = x @ w
    torch.set_grad_enabled(False)
    return y


def turns_autocast_on_for_its_caller(x, w):
    y = x @ w
    torch.set_autocast_enabled("cpu", True)
    return y


@pytest.mark.parametrize("program", [turns_grad_off_for_its_caller, turns_autocast_on_for_its_caller])
def test_the_state_a_program_leaves_changed_is_set_by_every_call(program):
    # the first call left it as eager does (acquisition applies it for real); a cache hit ran only the trace
    jitted = fulmen.jit(program)
    for fn in (program, jitted, jitted):
        out = fn(torch.randn(2, 3), torch.randn(3, 2, requires_grad=True))
        after = (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), out.requires_grad)
        torch.set_grad_enabled(True)
        torch.set_autocast_enabled("cpu", False)
        assert after == ((False, False, True) if program is turns_grad_off_for_its_caller else (True, True, True))
    assert fulmen.cache_hits(jitted) == 1
