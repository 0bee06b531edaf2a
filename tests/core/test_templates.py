"""Decomposition templates (fulmen/core/templates.py): a repeated kind of call takes the parts its first
decomposition recorded instead of running the decomposition again, and every trace, printed with its parts at every
depth, forward and backward, static and symbolic, is the one running every decomposition gives; values as eager's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from litgpt import GPT

import fulmen
from fulmen.core import templates
from fulmen.ops.registry import SYMBOLS
from tests.models.litgpt_configs import shrunk


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _train(name: str, dynamic: bool | None):
    torch.manual_seed(0)
    model = GPT(shrunk(name))
    jitted = fulmen.jit(_loss, options=fulmen.JitOptions(dynamic=dynamic))
    losses = []
    for length in (5, 7):  # automatic: the second length traces with symbolic sizes
        generator = torch.Generator().manual_seed(length)
        x, y = (torch.randint(0, 96, (2, length), generator=generator) for _ in range(2))
        loss = jitted(model, x, y)
        loss.backward()
        losses.append(loss.detach())
    printed = [t.python(print_depth=3) for t in (*fulmen.last_traces(jitted), *fulmen.last_backward_traces(jitted))]
    return printed, losses, [p.grad for p in model.parameters()], fulmen.cache_misses(jitted)


@pytest.mark.parametrize("name", ["pythia-14m", "Llama-3.2-1B"])
@pytest.mark.parametrize("dynamic", [False, None], ids=["static", "symbolic"])
def test_traces_are_those_of_running_every_decomposition(name, dynamic, monkeypatch):
    with_templates = _train(name, dynamic)
    monkeypatch.setattr(templates, "ENABLED", False)
    without = _train(name, dynamic)
    assert with_templates[3] == without[3] == 2
    for got, want in zip(with_templates[0], without[0], strict=True):
        assert got == want
    for got, want in zip(with_templates[1] + with_templates[2], without[1] + without[2], strict=True):
        assert torch.equal(got, want)


def test_a_repeated_call_runs_its_decomposition_once(monkeypatch):
    linear = SYMBOLS["torch.nn.functional.linear"]
    runs = []
    decomposition = linear.decomposition

    def counted(*args, **kwargs):
        runs.append(tuple(args[0].shape))
        return decomposition(*args, **kwargs)

    monkeypatch.setattr(linear, "decomposition", counted)
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(6)))
    x = torch.randn(3, 8)

    def traced() -> int:
        runs.clear()
        torch.testing.assert_close(fulmen.jit(layers)(x), layers(x))
        return len(runs)

    # two kinds of linear (the first one's input needs no grad, the others' do), in each of the two traces that
    # record the forward (acquisition, then the joint forward and backward of the grad transform)
    assert traced() == 2 * 2
    monkeypatch.setattr(templates, "ENABLED", False)
    assert traced() == 6 * 2


def test_the_same_proxy_twice_is_its_own_kind_of_call():
    """x * x and x * y have the same metadata; their parts read the arguments each call has."""
    def f(x, y):
        return x * x + x * y + y * y

    x, y = torch.randn(4), torch.randn(4)
    jitted = fulmen.jit(f)
    torch.testing.assert_close(jitted(x, y), f(x, y))
    parts = [b for b in fulmen.last_traces(jitted)[0].bound_symbols if b.sym.name == "mul"]
    reads = [[p.pname for p in sub.proxy_args()] for b in parts for sub in b.subsymbols]
    assert reads == [["x", "x"], ["x", "y"], ["y", "y"]]


def test_random_parts_are_not_taken_again(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 8),
                                torch.nn.Dropout(0.5))
    x = torch.randn(4, 8)

    def printed():
        jitted = fulmen.jit(model)
        jitted(x)
        return fulmen.last_traces(jitted)[0].python(print_depth=3)

    with_templates = printed()
    monkeypatch.setattr(templates, "ENABLED", False)
    assert with_templates == printed()
