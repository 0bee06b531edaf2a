"""The torchcompile executor on traces with symbolic sizes: each fusion region compiled once by Inductor for symbolic
sizes (fulmen/core/inductor.py's guarded variants), reused at every length its guards admit; values close to eager's
(Inductor's kernels round otherwise, as for static traces)."""

from __future__ import annotations

import torch
from litgpt.model import GPT

import fulmen
from fulmen.core.inductor import InductorFunction
from tests.models.litgpt_configs import shrunk


def test_regions_of_a_symbolic_trace_compile_once_for_every_length():
    torch.manual_seed(0)
    model = GPT(shrunk("pythia-14m"))
    jitted = fulmen.jit(model, executors=["torchcompile"])
    for batch, length in [(2, 5), (3, 7), (2, 12), (4, 9)]:
        idx = torch.randint(0, model.config.padded_vocab_size, (batch, length))
        got = jitted(idx)
        got.sum().backward()
        grads = [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        want = model(idx)
        want.sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)
        model.zero_grad(set_to_none=True)
    assert fulmen.cache_misses(jitted) == 2
    regions = [
        b.sym.impl
        for t in (fulmen.last_traces(jitted)[-1], fulmen.last_backward_traces(jitted)[-1])
        for b in t.bound_symbols
        if b.sym.name.startswith("TorchCompile")
    ]
    assert regions
    for region in regions:
        compiled = getattr(region, "impl", region)  # a region's first run goes through fulmen's first-run check
        assert isinstance(compiled, InductorFunction)
        assert len(compiled.guarded) == 1 and not compiled.variants  # one symbolic variant, for all 3 lengths


def test_a_call_its_guards_refuse_compiles_another_variant():
    def fn(a, b):
        return torch.nn.functional.gelu(a) * b + a.shape[1]

    compiled = InductorFunction(fn, dynamic=(frozenset({1}), frozenset()))
    b = torch.randn(16)
    for length in (7, 9, 1, 12):  # 1: a symbolic size stands for sizes of 2 and more
        a = torch.randn(2, length, 16)
        torch.testing.assert_close(compiled(a, b), fn(a, b))
    assert len(compiled.guarded) == 2
