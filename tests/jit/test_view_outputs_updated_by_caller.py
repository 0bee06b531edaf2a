"""Outputs of a jitted call that eager returns as views (of a tensor the program computed, of another output, of an
input) are views the caller can update in place while they require grad, as eager's: the values after the update,
the grads of a backward after it (also through the base when the view and another output share memory), `_base`,
`_is_view()` and version counters. Oracle: eager on the same inputs, on the trace's first call and on a cache hit."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import fulmen
from fulmen.jit.jitted_module import core as jitted_core


def of_an_intermediate(x):
    return (x * 2).transpose(0, 1)


def of_another_output(x):
    a = x * 2
    return a, a[1:]


def of_an_input(x):
    return x.t()


def two_of_one_intermediate(x):
    a = x.sin()
    return a.t(), a[1:]


def through_a_chain(x):
    return (x * 2)[1:].t().unsqueeze(0)


def updated_by_the_program(x):
    a = x * 2
    v = a[1:]
    v.mul_(3)
    return a.t(), v


def and_a_value_computed_from_it(x):
    v = (x * 2).t()
    return v.exp(), v


def returned_twice(x):
    v = (x * 2).t()
    return v, v


def set_a_row(outs, w):
    outs[-1][0] = 0.0


def scale_by_a_weight(outs, w):
    out = outs[-1]
    out.mul_(w[: out.shape[-1]])


def fill_where_positive(outs, w):
    out = outs[-1]
    out.masked_fill_(out.detach() > 0, 0.0)


def put_a_weight_through_a_boolean_mask(outs, w):
    out = outs[-1]
    out[out.detach() > 0] = w[0] * 5  # index_put_ with a boolean mask, a value that requires grad


PROGRAMS = [of_an_intermediate, of_another_output, of_an_input, two_of_one_intermediate, through_a_chain,
            updated_by_the_program, and_a_value_computed_from_it, returned_twice]
UPDATES = [set_a_row, scale_by_a_weight, fill_where_positive, put_a_weight_through_a_boolean_mask]


def _base_of(out: torch.Tensor, outs: tuple, arg: torch.Tensor) -> str:
    """What `out` is a view of: another output, the argument, a tensor the caller got no other way, or nothing."""
    if not out._is_view():
        return "none"
    if out._base is arg:
        return "the argument"
    for k, other in enumerate(outs):
        if out._base is other:
            return f"output {k}"
    return f"a tensor of its own (requires_grad={out._base.requires_grad}, is_leaf={out._base.is_leaf})"


def _observe(fn: Callable, update: Callable, run: Callable) -> dict:
    x = torch.arange(12.0).reshape(3, 4).sub(5).div(3).requires_grad_()
    w = torch.tensor([2.0, -1.0, 0.5, 3.0], requires_grad=True)
    arg = x * 1  # a value with a history: eager lets the caller update a view of it
    outs = run(arg)
    outs = outs if isinstance(outs, tuple) else (outs,)
    seen = {"bases": [_base_of(o, outs, arg) for o in outs], "versions": [o._version for o in outs]}
    update(outs, w)
    seen["versions after"] = [o._version for o in outs]
    seen["values"] = [o.detach().clone() for o in outs]
    seen["same memory"] = [[o.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in outs]
                           for o in outs]
    total = sum((o * torch.arange(o.numel()).reshape(o.shape)).sum() for o in outs)
    total.backward()
    seen["grads"] = [x.grad, w.grad]
    return seen


@pytest.mark.parametrize("update", UPDATES, ids=lambda fn: fn.__name__)
@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda fn: fn.__name__)
def test_a_view_output_updated_in_place_by_the_caller_is_eagers(fn, update):
    jitted = fulmen.jit(fn)
    for _ in range(2):  # the trace's first call, then a cache hit
        want, got = _observe(fn, update, fn), _observe(fn, update, jitted)
        assert got["bases"] == want["bases"]
        assert got["same memory"] == want["same memory"]
        # the caller's update bumps the counter a view shares with its base, as eager's (a computed tensor's count
        # of the program's own updates is not eager's: 2 here, eager 1)
        bumps = [[after - before for before, after in zip(seen["versions"], seen["versions after"])]
                 for seen in (got, want)]
        assert bumps[0] == bumps[1]
        if fn is not updated_by_the_program:
            assert got["versions after"] == want["versions after"]
        for g, w in zip(got["values"], want["values"]):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        for g, w in zip(got["grads"], want["grads"]):
            torch.testing.assert_close(g, w)
    assert jitted_core(jitted).stats.misses == 1


def unbinds(x):
    return (x * 2).unbind(0)


def takes_a_view_under_no_grad(x):
    a = x * 2
    with torch.no_grad():
        return a.t()


@pytest.mark.parametrize("fn", [unbinds, takes_a_view_under_no_grad], ids=lambda fn: fn.__name__)
def test_a_view_eager_refuses_to_update_is_refused_as_eagers(fn):
    errors = []
    for run in (fn, fulmen.jit(fn)):
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        outs = run(x)
        out = outs[0] if isinstance(outs, tuple) else outs
        assert out._is_view() and out._base.requires_grad and out._base.grad_fn is not None
        with pytest.raises(RuntimeError) as error:
            out.mul_(w[: out.shape[-1]])
        errors.append(str(error.value).split(".")[0])
    assert errors[1] == errors[0]


class SpecAugmentLike(torch.nn.Module):
    """Hugging Face Wav2Vec2's feature projection and time masking (`_mask_hidden_states`): the masked frames take a
    learned embedding, written by the caller of the projection through a boolean mask."""

    def __init__(self):
        super().__init__()
        self.layer_norm = torch.nn.LayerNorm(6)
        self.projection = torch.nn.Linear(6, 5)
        self.masked_spec_embed = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 5))

    def project(self, features):
        # a linear of a contiguous 3-d input: eager's result (and the trace's) is a view of a 2-d one
        return self.projection(self.layer_norm(features.transpose(1, 2)))

    def forward(self, features, mask_time_indices, project):
        hidden_states = project(features)
        hidden_states[mask_time_indices] = self.masked_spec_embed.to(hidden_states.dtype)
        return hidden_states.tanh().sum()


def test_a_projection_updated_through_a_boolean_mask_by_the_caller_trains_as_eager():
    torch.manual_seed(0)
    model = SpecAugmentLike()
    features = torch.randn(2, 6, 7)
    mask = torch.tensor([[True, False, False, True, True, False, False], [False] * 6 + [True]])
    project = fulmen.jit(model.project)
    results = []
    for run in (model.project, project):
        model.zero_grad()
        loss = model(features, mask, run)
        loss.backward()
        results.append((loss.detach(), *(p.grad.clone() for p in model.parameters())))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want)


LINEAR = torch.nn.Linear(4, 5)


def a_linear_of_3d(x):
    return LINEAR(x)  # eager's result, and the trace's, is a view of the 2-d one linear computes


def a_view_of_a_linear_of_3d(x):
    return LINEAR(x).transpose(1, 2)  # a view of a tensor the forward returns for it, itself a view


def a_linear_of_3d_and_a_row_of_it(x):
    out = LINEAR(x)
    return out, out[0]


@pytest.mark.parametrize("fn", [a_linear_of_3d, a_view_of_a_linear_of_3d, a_linear_of_3d_and_a_row_of_it],
                         ids=lambda fn: fn.__name__)
def test_an_output_viewing_a_tensor_only_the_forward_makes_is_updated_as_eagers(fn):
    jitted = fulmen.jit(fn)
    x = torch.linspace(-1.0, 1.0, 24).reshape(2, 3, 4)
    for _ in range(2):
        results = []
        for run in (fn, jitted):
            LINEAR.zero_grad()
            w = torch.tensor(1.5, requires_grad=True)
            outs = run(x)
            outs = outs if isinstance(outs, tuple) else (outs,)
            outs[-1][0] = w  # the caller's update, with a value that requires grad
            sum((o * torch.arange(o.numel()).reshape(o.shape)).sum() for o in outs).backward()
            results.append(([o.detach().clone() for o in outs], w.grad, LINEAR.weight.grad, LINEAR.bias.grad))
        (got_outs, *got), (want_outs, *want) = results[1], results[0]
        for g, w in zip([*got_outs, *got], [*want_outs, *want]):
            torch.testing.assert_close(g, w)


def test_a_hook_on_the_base_of_a_view_output_that_other_outputs_use_is_refused():
    def view_and_a_sum_of_its_base(x):
        a = x * 2
        return a.t(), a.sum()

    y, total = fulmen.jit(view_and_a_sum_of_its_base)(torch.randn(3, 4, requires_grad=True))
    y._base.register_hook(lambda grad: grad)  # eager's sees the grad through y and through total
    with pytest.raises(fulmen.TraceError, match=r"output\[0\]\._base .* has a hook"):
        (y.sum() + total).backward()


def test_a_hook_on_a_view_output_sees_eagers_grad_and_one_backward_is_compiled():
    def view(x):
        return (x * 2).t()

    jitted = fulmen.jit(view)
    seen = []
    for run in (view, jitted):
        x = torch.arange(12.0).reshape(3, 4).requires_grad_()
        y = run(x)
        y.register_hook(lambda grad: seen.append(grad.clone()))
        y[0] = 1.0
        (y * torch.arange(12.0).reshape(4, 3)).sum().backward()
        seen.append(x.grad)
    for got, want in zip(seen[2:], seen[:2]):
        torch.testing.assert_close(got, want)
    # the node's own output for the view never gets a grad: the backward compiled with the forward is the one run
    assert len(jitted_core(jitted)._cache.entries[0].program._backward_fns) == 1


def test_two_view_outputs_of_one_hidden_base_name_every_output_once():
    # the trace returns the base once beside the program's outputs: one label for it, so the outputs after it (an
    # updated input) keep their own names in messages
    def two_views_and_an_update(x, buf):
        t = x * 2
        buf.add_(t.sum(0))
        return t.transpose(0, 1), t[0]

    jitted = fulmen.jit(two_views_and_an_update)
    jitted(torch.randn(3, 4, requires_grad=True), torch.zeros(4))
    places = jitted_core(jitted)._cache.entries[0].program.places
    assert places == ("output[0]", "output[1]", "output[0]._base"), places  # the updated input: by its number
