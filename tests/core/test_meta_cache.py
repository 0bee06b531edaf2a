"""The builder's meta caches (fulmen/core/trace.py): with symbolic sizes a meta kernel costs milliseconds of SymInt
arithmetic (an attention's math decomposition about 80 ms a layer on a 2-core CPU), so the layout a kind of call
gave is taken again: a view of an input with as_strided, a view of a tensor the call made (a matmul's
`mm(...).view`, the attention's output) of a new base laid out as that one, get_grad's placeholder by the
differentiated output's layout. Every trace and every value's layout (strides, storage offset, whether it is a view)
is the one running every meta kernel gives, forward and backward, and values are the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from litgpt import GPT

import fulmen
from fulmen.core import trace as trace_module
from fulmen.core.trace import TraceBuilder
from fulmen.ops.registry import SYMBOLS
from tests.models.litgpt_configs import shrunk

SDPA = SYMBOLS["torch.nn.functional.scaled_dot_product_attention"]


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _layouts(trace) -> list[tuple]:
    return [(p.pname, str(tuple(p.shape)), str(p.meta.stride()), str(p.meta.storage_offset()), p.meta._is_view())
            for bsym in trace.bound_symbols for p in bsym.proxy_outputs()]


def _train(name: str, monkeypatch):
    meta_runs = []
    impl = SDPA.impl

    def counted(q, *args, **kwargs):
        if q.device.type == "meta":
            meta_runs.append(any(isinstance(n, torch.SymInt) for n in q.shape))  # symbolic sizes
        return impl(q, *args, **kwargs)

    monkeypatch.setattr(SDPA, "impl", counted)
    torch.manual_seed(0)
    model = GPT(shrunk(name))
    jitted = fulmen.jit(_loss, executors=["sdpa", "torch"])
    losses = []
    for length in (5, 7):  # the second length traces with symbolic sizes
        generator = torch.Generator().manual_seed(length)
        x, y = (torch.randint(0, 96, (2, length), generator=generator) for _ in range(2))
        loss = jitted(model, x, y)
        loss.backward()
        losses.append(loss.detach())
    monkeypatch.setattr(SDPA, "impl", impl)
    traces = (*fulmen.last_traces(jitted), *fulmen.last_backward_traces(jitted))
    return ([t.python(print_depth=3) for t in traces], [_layouts(t) for t in traces], losses,
            [p.grad for p in model.parameters()], fulmen.cache_misses(jitted), meta_runs, model.config.n_layer)


@pytest.mark.parametrize("name", ["pythia-14m", "Llama-3.2-1B"])
def test_symbolic_traces_and_layouts_are_those_of_running_every_meta_kernel(name, monkeypatch):
    cached = _train(name, monkeypatch)
    with monkeypatch.context() as off:
        off.setattr(trace_module, "_view_layout", lambda *args: None)
        off.setattr(TraceBuilder, "cached_meta", lambda self, sym, args, kwargs, compute: compute())
        uncached = _train(name, monkeypatch)
    assert cached[4] == uncached[4] == 2
    assert cached[0] == uncached[0]  # every trace, printed with its parts
    assert cached[1] == uncached[1]  # every value's strides, storage offset and view-ness
    for got, want in zip(cached[2] + cached[3], uncached[2] + uncached[3], strict=True):
        assert torch.equal(got, want)
    # the symbolic trace asks the attention's meta kernel once for all its layers, not once a layer
    layers = cached[6]
    assert layers > 1 and sum(cached[5]) == 1 and sum(uncached[5]) == layers
