"""torch.compile with the fulmen backend and dynamic shapes: Dynamo's symbolic sizes pass through to one fulmen trace
with symbolic sizes (fulmen/dynamo/sizes.py), rather than one trace per value of Dynamo's size inputs; values and
grads against eager on the same inputs."""

from __future__ import annotations

import re

import pytest
import torch
from litgpt.model import GPT

import fulmen
from tests.models.litgpt_configs import shrunk


def scaled(x, w):
    return torch.nn.functional.gelu(x @ w).sum(-1) * x.shape[1]


def _misses(backend) -> list[int]:
    return [fulmen.cache_misses(piece.runner.jitted) for piece in backend.pieces if piece.by_fulmen]


@pytest.mark.parametrize("dynamic", [True, None])  # None: Dynamo makes a size dynamic once it changes
def test_dynamos_sizes_are_one_symbolic_fulmen_trace(dynamic):
    torch._dynamo.reset()
    backend = fulmen.dynamo.backend()
    compiled = torch.compile(scaled, backend=backend, dynamic=dynamic)
    w = torch.randn(13, 4, requires_grad=True)
    for length in (3, 5, 8, 11, 6):
        x = torch.randn(2, length, 13)
        got = compiled(x, w)
        (got_grad,) = torch.autograd.grad(got.sum(), w)
        want = scaled(x, w)
        (want_grad,) = torch.autograd.grad(want.sum(), w)
        assert torch.equal(got, want) and torch.equal(got_grad, want_grad), length
    # one graph with symbolic sizes (after a static one, where Dynamo makes the size dynamic on its change), each
    # piece traced once by fulmen: the graph's size input is read from x's shape in the trace
    assert _misses(backend) == ([1] if dynamic else [1, 1]), backend.report()
    source = backend.last_traces()[-1].python()
    length = re.search(r"(s\d) = L_x_\.shape\[1\]", source)
    assert length is not None and f"torch.mul(t8, {length.group(1)})" in source, source


def test_a_litgpt_model_compiled_with_dynamic_shapes_trains_as_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(shrunk("pythia-14m"))
    backend = fulmen.dynamo.backend()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for step, (batch, length) in enumerate([(2, 5), (3, 9), (2, 12)]):
        generator = torch.Generator().manual_seed(step)
        idx = torch.randint(0, model.config.padded_vocab_size, (batch, length), generator=generator)
        results = []
        for fn in (compiled, model):
            logits = fn(idx)
            logits.sum().backward()
            results.append((logits, [p.grad for p in model.parameters()]))
            model.zero_grad(set_to_none=True)
        (got, grads), (want, want_grads) = results
        assert torch.equal(got, want), (batch, length)
        for g, e in zip(grads, want_grads):
            assert torch.equal(g, e), (batch, length)
    assert all(misses == 1 for misses in _misses(backend)), backend.report()
