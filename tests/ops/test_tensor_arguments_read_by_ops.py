"""Ops whose kernels read a tensor argument's value (eager's `.item()` inside the op): narrow's start (the shape is
known: length) runs as eager, as a view of its input; tensor_split's indices and repeat_interleave's repeats without
output_size set the output's shape, and are refused naming the line (they failed inside torch's meta kernels); so is a
factory's size given as a tensor whose value is unknown."""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

import fulmen
from tests.ops.opdb import XFAIL_TENSOR_ARGUMENT

X = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
START = torch.tensor(2)


def _narrowed(x, start):
    return x.narrow(1, start, 3) * 2


def _written_through(x, start):
    h = x * 1
    view = torch.narrow(h, 1, start, 2)
    view.mul_(10)  # eager writes into h through the view
    return h, view


@pytest.mark.parametrize("fn", [_narrowed, _written_through])
def test_narrow_at_a_tensor_start_gives_eagers_values_and_grads(fn):
    for start in (START, torch.tensor(-3)):
        want_in, got_in = X.clone().requires_grad_(), X.clone().requires_grad_()
        want, got = fn(want_in, start), fulmen.jit(fn)(got_in, start)
        want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        sum(w.sum() for w in want).backward()
        sum(g.sum() for g in got).backward()
        assert torch.equal(got_in.grad, want_in.grad)


def test_narrow_at_a_tensor_start_under_jvp_and_vmap():
    tangent = torch.ones_like(X)
    fn = lambda x: _narrowed(x, START)  # noqa: E731
    want = torch.func.jvp(fn, (X,), (tangent,))
    got = fulmen.jvp(fn, (X,), (tangent,))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    batch = torch.stack([X, X * 2, -X])  # torch.func.vmap has no batching rule for narrow.Tensor: eager per example
    assert torch.equal(fulmen.vmap(fn)(batch), torch.stack([fn(x) for x in batch]))


def test_narrow_refuses_a_float_start_as_eager_does():
    with pytest.raises(RuntimeError, match="start must be an 0-dim integral Tensor"):
        X.narrow(1, torch.tensor(1.5), 2)
    with pytest.raises(RuntimeError, match="start must be an 0-dim integral Tensor"):
        fulmen.jit(lambda x: x.narrow(1, torch.tensor(1.5), 2))(X)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (
            lambda x: torch.tensor_split(x, torch.tensor([1, 3]), 1),
            "tensor_split with its indices or sections given as",
        ),
        (
            lambda x: x.repeat_interleave(torch.tensor([1, 2, 1, 2]), 0),
            "repeat_interleave with repeats given as a tensor",
        ),
        (lambda x: torch.zeros(3, (x > 0).sum()), "torch.zeros with a size given as a tensor"),
    ],
    ids=["tensor_split", "repeat_interleave", "zeros"],
)
def test_an_output_shape_set_by_a_tensors_value_is_refused_naming_the_line(fn, message):
    fn(X)  # eager reads the values
    with pytest.raises(fulmen.DataDependentError, match=rf"(?s){message}.*test_tensor_arguments_read_by_ops\.py"):
        fulmen.jit(fn)(X.clone())


def test_repeat_interleave_with_output_size_runs_as_eager():
    fn = lambda x: x.repeat_interleave(torch.tensor([1, 2, 1, 2]), 0, output_size=6)  # noqa: E731
    assert torch.equal(fulmen.jit(fn)(X), fn(X))


@pytest.mark.parametrize("name", sorted(XFAIL_TENSOR_ARGUMENT))
def test_op_db_samples_with_tensor_arguments_are_refused_as_data_dependent(name):
    opinfo = next(o for o in op_db if o.name == name and not o.variant_test_name)
    samples = [
        s
        for s in opinfo.sample_inputs("cpu", torch.float32)
        if "output_size" not in s.kwargs and any(isinstance(v, torch.Tensor) for v in (*s.args, *s.kwargs.values()))
    ]
    assert samples
    for sample in samples:
        with pytest.raises(fulmen.DataDependentError, match="unknown while tracing"):
            fulmen.jit(lambda x, args, kwargs: opinfo.op(x, *args, **kwargs))(sample.input, sample.args, sample.kwargs)
