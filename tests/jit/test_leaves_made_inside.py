"""`requires_grad_()` inside a jitted program on a value it computed, against eager on the same inputs.

Eager makes such a value a leaf of autograd: what is computed from it requires grad, the grad stops there, in-place
updates of it (or of views of it) are refused while grad is enabled, and `requires_grad_(False)` undoes it. Hugging
Face's `gradient_checkpointing_enable()` installs such a call on the embeddings' output (tests/models/
test_hf_usage.py). Where fulmen cannot give eager's leaf (returned, or with no input to differentiate), it refuses,
naming the line.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import fulmen


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x, frozen = torch.randn(3, 4, generator=generator), torch.randn(4, 4, generator=generator)
    return x, torch.randn(4, 4, generator=generator).requires_grad_(), frozen


def made_leaf(x, w, frozen):
    h = x @ frozen
    h.requires_grad_()
    leaf = h.is_leaf and h.grad_fn is None
    return (h @ w).tanh().sum() * (2 if leaf else 3), (h * 2).is_leaf


def set_flag_twice(x, w, frozen):
    h = x @ frozen
    h.requires_grad = True
    h.requires_grad_()
    return (h @ w).sum()


def made_and_unmade(x, w, frozen):
    h = x @ frozen
    h.requires_grad_()
    h.requires_grad_(False)
    return (h @ w).sum(), h.is_leaf


def updated_under_no_grad(x, w, frozen):
    h = x @ frozen
    h.requires_grad_()
    with torch.no_grad():
        h.mul_(2)  # still a leaf
    return (h @ w).sum(), h.is_leaf


def read_through_detach(x, w, frozen):
    h = x @ frozen
    h.requires_grad_()
    h.detach().add_(1)
    return (h @ w).sum()


@pytest.mark.parametrize("fn", [made_leaf, set_flag_twice, made_and_unmade, updated_under_no_grad,
                                read_through_detach])
def test_a_leaf_made_inside_trains_as_eager(fn: Callable):
    x, w, frozen = _inputs()
    jitted = fulmen.jit(fn)
    for _ in range(2):  # the second call hits the cache
        want = fn(x, w, frozen)
        want_grad = torch.autograd.grad(want[0] if isinstance(want, tuple) else want, w)[0]
        got = jitted(x, w, frozen)
        got_grad = torch.autograd.grad(got[0] if isinstance(got, tuple) else got, w)[0]
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grad, want_grad)
    assert fulmen.cache_hits(jitted) == 1


def update_of_the_leaf(x, w, frozen):
    h = x @ frozen
    h.requires_grad_()
    h.mul_(2)
    return (h @ w).sum()


def update_of_a_view(x, w, frozen):
    h = x @ frozen
    h.requires_grad_()
    h[1:].mul_(2)
    return (h @ w).sum()


def setitem_of_the_leaf(x, w, frozen):
    h = x @ frozen
    h.requires_grad_()
    h[0] = 1.0
    return (h @ w).sum()


def unmake_a_computed_value(x, w, frozen):
    h = x @ w
    h.requires_grad_(False)
    return h.sum()


def integer_leaf(x, w, frozen):
    h = (x @ frozen).long()
    h.requires_grad_()
    return h


@pytest.mark.parametrize("fn", [update_of_the_leaf, update_of_a_view, setitem_of_the_leaf, unmake_a_computed_value,
                                integer_leaf])
def test_eager_errors_on_leaves_are_raised(fn: Callable):
    with pytest.raises(RuntimeError) as want:
        fn(*_inputs())
    with pytest.raises(RuntimeError) as got:
        fulmen.jit(fn)(*_inputs())
    assert str(got.value) == str(want.value)


def returns_the_leaf(x, w, frozen):
    h = x @ frozen
    h.requires_grad_()
    return (h @ w).sum(), {"leaf": h}


def nothing_else_requires_grad(x, w, frozen):
    h = x @ frozen
    h.requires_grad_()
    return (h @ w.detach()).sum()


@pytest.mark.parametrize(("fn", "trainable", "message"), [
    (returns_the_leaf, True,
     r"returns a tensor it made a leaf of autograd .*the output\[1\]\['leaf'\], shape \(3, 4\)"),
    (nothing_else_requires_grad, True, "while no input .* gets a grad"),  # w requires grad, but is not used so
    (returns_the_leaf, False, r"the output\[1\]\['leaf'\]"),
    (made_leaf, False, "while no input .* gets a grad"),  # no input requires grad at all
])
def test_a_leaf_eager_would_show_is_refused_naming_the_line(fn: Callable, trainable: bool, message: str):
    """Eager's returned leaf gets the whole grad in .grad; with no input that gets a grad, eager's outputs still
    require grad (from the leaf), where fulmen's call would run outside autograd."""
    x, w, frozen = _inputs()
    with pytest.raises(fulmen.TraceError, match=message) as error:
        fulmen.jit(fn)(x, w if trainable else w.detach(), frozen)
    assert error.value.location.line == "h.requires_grad_()"
