"""Fusion regions recompute cheap values the regions reading them can rebuild (fulmen.executors.region_remat), only
when peak memory does not rise; results stay eager's. Region code runs on CPU through Inductor here."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from litgpt import GPT

import fulmen
from fulmen.core.symbol import iter_proxies
from fulmen.executors.base import OperatorExecutor
from fulmen.executors.torch_compile import TorchCompileExecutor, torchcompile
from fulmen.extend import register_executor
from fulmen.transforms.remat import nbytes
from tests.models.litgpt_configs import shrunk

no_recompute = register_executor(TorchCompileExecutor("torchcompile_no_recompute", recompute_inputs=False))


def _regions(trace, executor):
    return [b for b in trace.bound_symbols if b.sym.executor is executor]


def _peak_bytes(trace) -> int:
    """Bytes of the values the trace's calls produce (views excluded), each alive from its call to its last reader:
    the model the rule keeps under its peak, computed independently here."""
    last = {}
    for position, bsym in enumerate(trace.bound_symbols):
        for name in bsym.arg_names():
            last[name] = position
    for proxy in iter_proxies(trace.output):
        last[proxy.pname] = len(trace.bound_symbols)
    live, peak, ends = 0, 0, {}
    for position, bsym in enumerate(trace.bound_symbols):
        for proxy in bsym.proxy_outputs():
            if not proxy.meta._is_view():
                live += nbytes(proxy)
                ends.setdefault(last.get(proxy.pname, position), []).append(nbytes(proxy))
        peak = max(peak, live)
        live -= sum(ends.pop(position, []))
    return peak


def _region_to_region_bytes(trace, executor) -> int:
    """Bytes regions write only for later regions to read."""
    regions = _regions(trace, executor)
    readers = {}
    for bsym in trace.bound_symbols:
        if bsym.sym.name == "del":
            continue
        for name in bsym.arg_names():
            readers.setdefault(name, []).append(bsym)
    outputs = {p.pname for p in iter_proxies(trace.output)}
    total = 0
    for region in regions:
        for proxy in region.proxy_outputs():
            reading = readers.get(proxy.pname, [])
            if proxy.pname not in outputs and reading and all(r.sym.executor is executor for r in reading):
                total += nbytes(proxy)
    return total


def _loss(model, idx, targets):
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def test_litgpt_backward_writes_less_between_regions_and_matches_eager():
    config = shrunk("Llama-3.2-1B")
    model = GPT(config)
    idx, targets = (torch.randint(0, config.padded_vocab_size, (2, 16)) for _ in range(2))
    runs = {}
    for executor in (torchcompile, no_recompute):
        jitted = fulmen.jit(_loss, executors=[executor])
        loss = jitted(model, idx, targets)
        loss.backward()
        runs[executor] = (loss.detach(), [p.grad.clone() for p in model.parameters()],
                          fulmen.last_traces(jitted)[-1], fulmen.last_backward_traces(jitted)[-1])
        model.zero_grad(set_to_none=True)
    want = _loss(model, idx, targets)
    want.backward()
    for loss, grads, _, _ in runs.values():
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
        for grad, p in zip(grads, model.parameters()):
            torch.testing.assert_close(grad, p.grad, rtol=1e-4, atol=1e-5)
    _, _, forward, backward = runs[torchcompile]
    _, _, plain_forward, plain_backward = runs[no_recompute]
    # the SwiGLU's silu(fc_1) and the normalised activations are recomputed where the backward reads them
    assert _region_to_region_bytes(backward, torchcompile) < _region_to_region_bytes(plain_backward, no_recompute)
    # regions sharing inputs merge across the matmuls between them (the SwiGLU backward's two become one)
    assert len(_regions(backward, torchcompile)) < len(_regions(plain_backward, no_recompute))
    # and the sums of two matmuls' outputs are computed inside the region that reads them
    lone = [b.sym.name for b in backward.bound_symbols if b.sym.name == "add"]
    assert lone == [] and [b.sym.name for b in plain_backward.bound_symbols if b.sym.name == "add"]
    for trace, plain in ((forward, plain_forward), (backward, plain_backward)):
        assert _peak_bytes(trace) <= _peak_bytes(plain)


@pytest.mark.parametrize("width, recomputed", [(8, True), (512, False)], ids=["peak_elsewhere", "peak_at_matmul"])
def test_a_lone_sum_moves_into_its_reader_only_under_the_peak(width, recomputed):
    # l1 + l2 read by the last region, past an independent matmul m: moving the sum there keeps l1 and l2 alive
    # across m instead of the sum. When m's output is small that stays under the peak (at the sum); when it is
    # large the peak is at m, and the move would raise it.
    def f(x, w, u, p):
        l1, l2 = x @ w, x @ u
        v = l1 + l2
        m = x @ p
        return torch.tanh(m).sum() + (v * 2).sin().sum()

    x, w, u, p = torch.randn(64, 32), torch.randn(32, 32), torch.randn(32, 32), torch.randn(32, width)
    jitted = fulmen.jit(f, executors=["torchcompile"])
    torch.testing.assert_close(jitted(x, w, u, p), f(x, w, u, p))
    trace = fulmen.last_traces(jitted)[-1]
    lone_adds = [b for b in trace.bound_symbols if b.sym.name == "add"]
    assert (not lone_adds) == recomputed
    (region,) = _regions(trace, torchcompile)
    reads = {p.pname for p in region.proxy_args()}
    assert len(reads) == (3 if recomputed else 2)  # l1, l2 and m; or the sum and m
    plain = fulmen.jit(f, executors=[no_recompute])
    plain(x, w, u, p)
    assert _peak_bytes(trace) <= _peak_bytes(fulmen.last_traces(plain)[-1])



def test_a_calls_declared_workspace_counts_at_the_call():
    # The "peak_elsewhere" program above, with m from an operator declaring a 1 MiB workspace (`scratch=`): the peak
    # is now at m, so keeping l1 and l2 alive across it would raise the peak, and the sum stays a call of its own.
    ex = OperatorExecutor("workspace_matmul")
    matmul = ex.register_operator("matmul_with_workspace", fn=torch.matmul, scratch=lambda x, p: 2 ** 20)

    def f(x, w, u, p, mm):
        l1, l2 = x @ w, x @ u
        v = l1 + l2
        m = mm(x, p)
        return torch.tanh(m).sum() + (v * 2).sin().sum()

    x, w, u, p = torch.randn(64, 32), torch.randn(32, 32), torch.randn(32, 32), torch.randn(32, 8)
    for mm, recomputed in ((matmul, False), (torch.matmul, True)):
        jitted = fulmen.jit(functools.partial(f, mm=mm), executors=[ex, "torchcompile"])
        torch.testing.assert_close(jitted(x, w, u, p), f(x, w, u, p, torch.matmul))
        trace = fulmen.last_traces(jitted)[-1]
        assert ("matmul_with_workspace" in {b.sym.name for b in trace.bound_symbols}) == (not recomputed)
        assert (not [b for b in trace.bound_symbols if b.sym.name == "add"]) == recomputed


def test_a_residual_stream_is_not_recomputed_from_every_layer():
    # h_k = h_{k-1} + norm(h_{k-1}) @ w_k, with every layer's output alive to the end: each sum is elementwise on
    # values that exist anyway, so each region could recompute it from the one before, and that one from the one
    # before it, until the last region re-adds every layer's output (a whole training step did so: 6x the norm's
    # time on a 22-layer TinyLlama). A recomputation reads no more bytes than materialising the value moves.
    def f(x, ws):
        h, layers = x, []
        for w in ws:
            layers.append((h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)) @ w)
            h = h + layers[-1]
        return h.sum(), layers  # every layer's output lives on, as a training step keeps them for the backward

    depth = 8
    x, ws = torch.randn(64, 32), [torch.randn(32, 32) / 8 for _ in range(depth)]
    jitted = fulmen.jit(f, executors=["torchcompile"])
    torch.testing.assert_close(jitted(x, ws), f(x, ws))
    regions = _regions(fulmen.last_traces(jitted)[-1], torchcompile)
    assert len(regions) >= depth
    assert max(len(region.proxy_args()) for region in regions) <= 3  # the stream, a matmul's output, at most one more
