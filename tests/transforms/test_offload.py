"""CPU offloading of saved tensors: what it chooses, how it rewrites the traces, that results and peak memory hold."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from litgpt.config import Config
from litgpt.model import GPT

import fulmen
from fulmen.core.trace import Trace, TraceBuilder
from fulmen.jit.jitted_module import core
from fulmen.ops import prims
from fulmen.options import OffloadOptions
from fulmen.transforms.offload import OFFLOAD, RELOAD, WAIT, OffloadTransform, candidates, choose
from fulmen.transforms.transform import GradTraces
from tests.models.litgpt_configs import shrunk

LAYERS = 4


def chain(x, w):
    for i in range(LAYERS):
        x = torch.tanh(x @ w[i])
    return x.sum()


class Capture(fulmen.Transform):
    def __init__(self):
        self.traces = None

    def transform_forward(self, traces):
        self.traces = traces
        return traces.forward


def _chain_traces():
    capture = Capture()
    x, w = torch.randn(64, 32), torch.randn(LAYERS, 32, 32, requires_grad=True)
    fulmen.jit(chain, transforms=[capture])(x, w).backward()
    return capture.traces


def test_candidates_are_the_computed_saved_tensors_by_distance():
    traces = _chain_traces()
    found = candidates(traces, ("cpu",))
    saved = {p.pname for p in traces.saved_by_forward}
    assert {c.name for c in found} < saved  # the input w (saved too) is no candidate
    assert "w" in saved and all(c.name not in ("x", "w") for c in found)
    tanhs = [c for c in found if c.nbytes == 64 * 32 * 4]
    assert len(tanhs) == LAYERS
    # the earlier a layer, the later the backward needs its output: distances fall layer by layer
    by_production = sorted(tanhs, key=lambda c: c.produced)
    assert [c.distance for c in by_production] == sorted((c.distance for c in tanhs), reverse=True)
    for c in found:
        assert c.produced <= c.last_forward_use < len(traces.forward.bound_symbols)
        assert c.distance == len(traces.forward.bound_symbols) - 1 - c.last_forward_use + c.first_backward_use
    assert candidates(traces, ("cuda",)) == []  # CPU tensors are never offloaded by default


def test_views_of_inputs_are_no_candidates():
    cpu = torch.device("cpu")
    with TraceBuilder() as builder:
        w = builder.make_proxy(torch.empty(64, 32, device="meta"), cpu, name="w")
        view = prims.reshape(w, (32, 64))  # saving it keeps nothing alive that the caller does not hold
        computed = prims.reshape(prims.exp(w), (32, 64))  # a view of a computed value: offloading it frees that
        out = prims.sum(computed, (0, 1))
        forward_calls = list(builder.bound_symbols)
        cotangent = builder.make_proxy(torch.empty((), device="meta"), cpu, name="cotangent")
        grad = prims.mul(view, computed)
    forward = Trace("forward", [w], forward_calls, (out, view, computed), "test")
    backward = Trace("backward", [view, computed, cotangent], builder.bound_symbols[len(forward_calls):], (grad,),
                     "test", input_groups=(("saved", 2), ("cotangents", 1)))
    found = candidates(GradTraces(forward, backward, 2), ("cpu",))
    assert [c.name for c in found] == [computed.pname]


def test_choose_by_size_distance_and_fraction():
    found = [c for c in candidates(_chain_traces(), ("cpu",)) if c.nbytes == 64 * 32 * 4]
    longest = sorted(found, key=lambda c: -c.distance)
    assert choose(found, 1.0, 0, 0) == longest
    assert choose(found, 0.5, 0, 0) == longest[:2]  # half the bytes: the two longest-lived
    assert choose(found, 0.3, 0, 0) == longest[:2]  # until at least the fraction is chosen
    assert choose(found, 0.25, 0, 0) == longest[:1]
    assert choose(found, 1.0, 64 * 32 * 4 + 1, 0) == []  # all below min_bytes
    cutoff = longest[1].distance
    assert choose(found, 1.0, 0, cutoff) == longest[:2]  # the short-lived ones stay


def _device_peak(forward, backward):
    """Bytes of non-host values alive at the worst point of running the final forward, then the backward (values
    the offloading copies to the host do not count; a wait's result is its input's storage)."""
    host = {b.output.pname for b in forward.bound_symbols if b.sym is OFFLOAD}
    live: dict[str, int] = {}
    storage: dict[str, str] = {}
    peak = 0

    def run(trace, start):
        nonlocal peak
        for proxy in start:
            if proxy.pname not in host:
                live[proxy.pname] = proxy.numel() * proxy.element_size()
        for bsym in trace.bound_symbols:
            if bsym.sym.name == "del":
                for proxy in bsym.args:
                    live.pop(storage.get(proxy.pname, proxy.pname), None)
                continue
            for proxy in bsym.proxy_outputs():
                if bsym.sym is WAIT:
                    storage[proxy.pname] = storage.get(bsym.args[0].pname, bsym.args[0].pname)
                elif proxy.pname not in host:
                    live[proxy.pname] = proxy.numel() * proxy.element_size()
            peak = max(peak, sum(live.values()))

    run(forward, forward.inputs)
    n_saved = backward.input_groups[0][1]
    saved = forward.output[len(forward.output) - n_saved:]
    live.clear()
    run(backward, list(forward.inputs) + list(saved))  # the caller still holds the inputs
    return peak


def _small_llama():
    config = shrunk("Llama-3.1-8B")
    config.n_layer = 3
    torch.manual_seed(0)
    return GPT(config)


def _step(jitted, idx):
    loss = F.cross_entropy(jitted(idx).flatten(0, 1), idx.flatten())
    loss.backward()
    return loss


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_rewrite_keeps_results_and_never_raises_the_peak(prefetch):
    model = _small_llama()
    idx = torch.randint(0, model.config.padded_vocab_size, (2, 16))
    expected = _step(model, idx)
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    plain = fulmen.jit(model)
    _step(plain, idx)
    model.zero_grad(set_to_none=True)
    options = OffloadOptions(min_bytes=0, min_distance=4, prefetch=prefetch)
    offloading = fulmen.jit(model, transforms=[OffloadTransform(options, device_types=("cpu",))])
    loss = _step(offloading, idx)
    torch.testing.assert_close(loss, expected)
    for got, grad in zip((p.grad for p in model.parameters()), want):
        torch.testing.assert_close(got, grad)

    forward, backward = fulmen.last_traces(offloading)[-1], fulmen.last_backward_traces(offloading)[-1]
    offloads = [b for b in forward.bound_symbols if b.sym is OFFLOAD]
    assert len(offloads) >= 6
    # each copy starts right after the call computing its tensor (the copies of one call's outputs one after another:
    # a fused attention forward's output and log-sum-exp)
    calls = [b for b in forward.bound_symbols if b.sym.name != "del"]
    for position, bsym in enumerate(calls):
        if bsym.sym is OFFLOAD:
            producer = next(c for c in reversed(calls[:position]) if c.sym is not OFFLOAD)
            assert bsym.args[0].pname in producer.output_names()
    # each reload starts ahead of its wait, which comes right before the first call reading the tensor; reload k
    # (in order of first use) starts after the first use of tensor k - prefetch, or with its own when they share it
    bsyms = [b for b in backward.bound_symbols if b.sym.name != "del"]
    reload_at = {b.output.pname: i for i, b in enumerate(bsyms) if b.sym is RELOAD}
    timeline = []
    for i, bsym in enumerate(bsyms):
        if bsym.sym is WAIT:
            name = bsym.output.pname
            first = next(j for j, b in enumerate(bsyms) if name in b.arg_names())
            assert all(b.sym is WAIT for b in bsyms[i:first])
            timeline.append((first, reload_at[bsym.args[0].pname]))
    assert len(timeline) == len(reload_at) == len(offloads)
    for k, (first, reload) in enumerate(timeline):
        assert reload < first
        if k >= prefetch > 0:
            assert reload > timeline[k - prefetch][0] or timeline[k - prefetch][0] == first
    assert "impls.offload_to_host" in str(forward) and "impls.reload_to_device" in str(backward)
    peak_plain = _device_peak(fulmen.last_traces(plain)[-1], fulmen.last_backward_traces(plain)[-1])
    peak_offloaded = _device_peak(forward, backward)
    assert peak_offloaded < peak_plain


def test_backward_for_another_pattern_of_cotangents():
    def two(x, w):
        h = torch.tanh(x @ w)
        h2 = torch.tanh(h @ w)
        return torch.tanh(h2 @ w).sum(), h2

    x, w = torch.randn(16, 8), torch.randn(8, 8, requires_grad=True)
    transform = OffloadTransform(OffloadOptions(min_bytes=0, min_distance=0), device_types=("cpu",))
    jitted = fulmen.jit(two, transforms=[transform])
    total, h2 = jitted(x, w)
    total.backward()  # h2 gets no cotangent: a backward of its own, reloading what it reads
    torch.testing.assert_close(w.grad, torch.func.grad(lambda w: two(x, w)[0])(w))
    assert any(b.sym is RELOAD for b in fulmen.last_backward_traces(jitted)[-1].bound_symbols)


def test_cpu_tensors_are_never_offloaded():
    model = _small_llama()
    idx = torch.randint(0, model.config.padded_vocab_size, (2, 16))
    jitted = fulmen.jit(model, offload=OffloadOptions(min_bytes=0, min_distance=0))
    loss = _step(jitted, idx)
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(loss, _step(model, idx))
    assert "CPU offloading" in core(jitted).pipeline.describe()
    assert not any("offload" in t.provenance.lower() for t in fulmen.last_traces(jitted))
    assert "offload" not in str(fulmen.last_traces(jitted)[-1])


def test_offloading_over_lengths_in_two_traces():
    """The rewrite of a symbolic trace (its candidates chosen once, by the traced call's bytes) serves every length:
    loss and grads torch.equal eager's over 5 (batch, length) shapes in 2 traces."""
    model = _small_llama()
    options = OffloadOptions(min_bytes=0, min_distance=4)
    jitted = fulmen.jit(model, transforms=[OffloadTransform(options, device_types=("cpu",))])
    for batch, length in [(2, 5), (3, 9), (2, 16), (4, 7), (2, 12)]:
        idx = torch.randint(0, model.config.padded_vocab_size, (batch, length))
        want = _step(model, idx)
        grads = [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        assert torch.equal(_step(jitted, idx), want), (batch, length)
        for got, expected in zip((p.grad for p in model.parameters()), grads, strict=True):
            assert torch.equal(got, expected), (batch, length)
        model.zero_grad(set_to_none=True)
    assert fulmen.cache_misses(jitted) == 2, fulmen.last_cache_miss_reasons(jitted)
    forward, backward = fulmen.last_traces(jitted)[-1], fulmen.last_backward_traces(jitted)[-1]
    assert '# idx: "cpu i64[s0, s1]"' in str(forward)
    offloads = sum(b.sym is OFFLOAD for b in forward.bound_symbols)
    assert offloads >= 6 and sum(b.sym is RELOAD for b in backward.bound_symbols) == offloads


@pytest.mark.parametrize(("changes", "message"), [
    ({"fraction": 0}, "fraction must be a number in (0, 1]"),
    ({"fraction": 1.5}, "fraction must be a number in (0, 1]"),
    ({"fraction": True}, "fraction must be a number in (0, 1]"),
    ({"min_bytes": -1}, "min_bytes must be a non-negative int"),
    ({"prefetch": 1.5}, "prefetch must be a non-negative int"),
])
def test_options_are_validated(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        OffloadOptions(**changes)
    with pytest.raises(TypeError, match="JitOptions.offload must be an OffloadOptions"):
        fulmen.JitOptions(offload=0.5)


@pytest.mark.cuda
def test_cuda_offloading_keeps_results_and_lowers_the_peak():
    config = Config.from_name("Llama-3.1-8B", n_layer=4, n_embd=256, n_head=4, n_query_groups=4, head_size=64,
                              intermediate_size=688, padded_vocab_size=512, vocab_size=512, block_size=1024)
    torch.manual_seed(0)
    model = GPT(config).cuda()
    idx = torch.randint(0, config.padded_vocab_size, (8, 1024), device="cuda")
    results = {}
    runs = (("plain", None, ["sdpa", "torch"]), ("offloaded", OffloadOptions(min_bytes=0), ["sdpa", "torch"]),
            ("offloaded, default executors", OffloadOptions(min_bytes=0), None))
    for name, offload, executors in runs:
        jitted = fulmen.jit(model, executors=executors, offload=offload)
        _step(jitted, idx)  # compile
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss = _step(jitted, idx)
        torch.cuda.synchronize()
        results[name] = (loss.detach(), [p.grad.clone() for p in model.parameters()],
                         torch.cuda.max_memory_allocated())
        model.zero_grad(set_to_none=True)
        if offload is not None:
            forward, backward = fulmen.last_traces(jitted)[-1], fulmen.last_backward_traces(jitted)[-1]
            assert str(forward).count("impls.offload_to_host") >= 8
            assert str(backward).count("impls.wait_for_copy") == str(forward).count("impls.offload_to_host")
    (loss, grads, peak), (loss_off, grads_off, peak_off) = results["plain"], results["offloaded"]
    # the same torch kernels on the same values: the loss is bitwise equal; gradients equal up to the order of a
    # reduction's additions, which CUDA varies with the addresses of reloaded copies and from run to run (the
    # embedding's repeated tokens): at most 4e-11 apart on an H200
    assert torch.equal(loss, loss_off)
    for (name, _), a, b in zip(model.named_parameters(), grads, grads_off):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")
    # torch.compile regions may split differently around the copies: equal up to rounding
    loss_default, grads_default, _ = results["offloaded, default executors"]
    torch.testing.assert_close(loss_default, loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, grads_default):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    print(f"\npeak allocated: {peak / 2**20:.1f} MiB without offloading, {peak_off / 2**20:.1f} MiB with")
    assert peak_off < 0.9 * peak


def test_copies_keep_the_saved_layout():
    """Host and reloaded copies have the saved tensor's strides, a view that is not dense included (the backward's
    kernels choose by layout); an expanded tensor cannot be written through its strides and is copied dense."""
    from fulmen.ops.kernels.impls import _empty_with_layout

    base = torch.randn(6, 8, 10)
    for x in (base, base.transpose(1, 2), base[:, 1:5, ::2]):
        copy = _empty_with_layout(x, torch.device("cpu"))
        assert copy.stride() == x.stride() and copy.shape == x.shape
        assert torch.equal(copy.copy_(x), x)
    expanded = torch.randn(6, 1, 10).expand(6, 8, 10)
    copy = _empty_with_layout(expanded, torch.device("cpu"))
    assert copy.is_contiguous() and torch.equal(copy.copy_(expanded), expanded)
