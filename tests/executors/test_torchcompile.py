"""The torchcompile executor on CPU: LitGPT forward and backward against eager, regions and their reuse."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from litgpt import GPT

import fulmen
from fulmen.executors.torch_compile import TorchCompileExecutor, torchcompile
from fulmen.transforms.remat import leaf_calls
from tests.models.litgpt_configs import shrunk


def _loss(model, idx, targets):
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _regions(trace) -> list:
    return [bsym for bsym in trace.bound_symbols if bsym.sym.executor is torchcompile]


def test_litgpt_forward_and_backward_match_eager():
    config = shrunk("Llama-3.2-1B")
    config.n_layer = 3
    model = GPT(config)
    idx, targets = (torch.randint(0, config.padded_vocab_size, (2, 16)) for _ in range(2))
    jitted = fulmen.jit(_loss, executors=["torchcompile"])
    loss = jitted(model, idx, targets)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    expected = _loss(model, idx, targets)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)

    forward, backward = fulmen.last_traces(jitted)[-1], fulmen.last_backward_traces(jitted)[-1]
    regions = _regions(forward) + _regions(backward)
    assert len(_regions(forward)) >= config.n_layer and len(_regions(backward)) >= config.n_layer
    for region in regions:  # no matmul or attention inside a region
        assert not {sub.sym.name for sub in region.subsymbols} & {"linear", "matmul", "scaled_dot_product_attention"}
    assert "TorchCompile0(" in str(forward)
    # the layers' identical regions share compiled functions
    assert 0 < len({id(region.sym.impl) for region in regions}) < len(regions)


def _compiled_functions(n_layer: int) -> int:
    config = shrunk("Llama-3.2-1B")
    config.n_layer = n_layer
    model = GPT(config)
    idx, targets = (torch.randint(0, config.padded_vocab_size, (2, 16)) for _ in range(2))
    jitted = fulmen.jit(_loss, executors=["torchcompile"])
    jitted(model, idx, targets).backward()
    traces = (fulmen.last_traces(jitted)[-1], fulmen.last_backward_traces(jitted)[-1])
    return len({id(region.sym.impl) for trace in traces for region in _regions(trace)})


def test_more_identical_layers_compile_no_more_regions():
    # each layer's forward and backward regions print the same source (names by position, calls in a fixed order),
    # so they share one compiled function whatever the depth: compile time does not grow with the layers
    assert _compiled_functions(6) == _compiled_functions(3)


def test_regions_follow_the_executor_order():
    x = torch.randn(4, 8, requires_grad=True)

    def f(x):
        return torch.softmax(torch.tanh(x) * 2, -1).sum()

    torch_only = fulmen.jit(f, executors=["torch"])
    fused = fulmen.jit(f, executors=["torchcompile"])
    torch.testing.assert_close(fused(x), torch_only(x))
    assert not _regions(fulmen.last_traces(torch_only)[-1])
    assert len(_regions(fulmen.last_traces(fused)[-1])) == 1


def test_regions_call_inductors_code_without_dynamo():
    # A region is traced and compiled once per layout of its arguments and then called directly: no Dynamo frame
    # (whose guards torch.compile would evaluate on every call) is ever traced, and another layout of the same
    # shapes (a trace of its own: strides are in the cache key) gets its own compiled variant of the region's code,
    # not code indexed for the first.
    from torch._dynamo.utils import counters

    from fulmen.core.inductor import InductorFunction

    def f(x, w):
        return torch.softmax(torch.tanh(x) * w, -1)

    jitted = fulmen.jit(f, executors=["torchcompile"])
    x, w = torch.randn(8, 16), torch.randn(16)
    counters.clear()
    torch.testing.assert_close(jitted(x, w), f(x, w))
    torch.testing.assert_close(jitted(x, w), f(x, w))
    (region,) = _regions(fulmen.last_traces(jitted)[-1])
    assert isinstance(region.sym.impl, InductorFunction) and len(region.sym.impl.variants) == 1
    transposed = torch.randn(16, 8).t()
    torch.testing.assert_close(jitted(transposed, w), f(transposed, w))
    (again,) = _regions(fulmen.last_traces(jitted)[-1])
    assert fulmen.cache_misses(jitted) == 2 and again.sym.impl is region.sym.impl
    assert len(region.sym.impl.variants) == 2
    assert counters["stats"]["unique_graphs"] == 0 and counters["stats"]["calls_captured"] == 0  # no Dynamo


def test_a_residual_add_and_the_layer_norm_after_it_are_one_region():
    """`native_layer_norm` (the layer norm's grad rule keeps it in the forward) decomposes, so the residual add and
    the norm after it fuse as Inductor fuses them; its grads still come through the normalised output only."""
    norm = torch.nn.LayerNorm(8)
    x, h = torch.randn(2, 4, 8, requires_grad=True), torch.randn(2, 4, 8, requires_grad=True)

    def f(x, h):
        return (norm(x + h) * torch.arange(8.0)).sum()

    jitted = fulmen.jit(f, executors=["torchcompile"])
    loss = jitted(x, h)
    loss.backward()
    got = [t.grad.clone() for t in (x, h, norm.weight, norm.bias)]
    for t in (x, h, norm.weight, norm.bias):
        t.grad = None
    expected = f(x, h)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for value, t in zip(got, (x, h, norm.weight, norm.bias), strict=True):
        torch.testing.assert_close(value, t.grad)
    forward = fulmen.last_traces(jitted)[-1]
    (region,) = _regions(forward)
    assert {"add", "native_layer_norm"} <= {sub.sym.name for sub in region.subsymbols}


def test_native_layer_norm_called_directly_matches_eager():
    """Its mean and rstd outputs get no grad, as in eager: a loss reading them gets only the normalised output's."""
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, dtype=torch.float64, requires_grad=True)

    def f(x, weight):
        return torch.native_layer_norm(x, (5,), weight, None, 1e-5)

    def loss(y, mean, rstd):
        return (y * y).sum() + mean.sum() + rstd.sum()

    expected = f(x, weight)
    want = torch.autograd.grad(loss(*expected), (x, weight))
    for executors in (["torch"], ["torchcompile"]):
        got = fulmen.jit(f, executors=executors)(x, weight)
        for value, reference in zip(got, expected, strict=True):
            torch.testing.assert_close(value, reference)
        grads = torch.autograd.grad(loss(*got), (x, weight))
        for value, reference in zip(grads, want, strict=True):
            torch.testing.assert_close(value, reference)


def test_reshapes_that_copy_count_as_kernels():
    """The backward of a fused qkv projection split into heads assembles the heads' grads: each arrives from a matmul
    laid out (B, H, T, D), is transposed back and reshaped (a copy), and the three are concatenated (and seen as
    rows, for the projection's grads are matmuls over all B * T rows, as eager folds them). Four kernels in eager,
    so one region here, writing the concatenated grad once."""
    B, T, H, D = 2, 8, 2, 4
    x = torch.randn(B, T, H * D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(H * D, 3 * H * D, dtype=torch.float64, requires_grad=True)

    def f(x, w):
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (x @ w).split(H * D, dim=2))
        return ((q @ k.mT).softmax(-1) @ v).sum()

    jitted = fulmen.jit(f, executors=["torchcompile"])
    jitted(x, w).backward()
    got = [x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    f(x, w).backward()
    torch.testing.assert_close(got, [x.grad, w.grad])
    backward = fulmen.last_backward_traces(jitted)[-1]
    (assembly,) = [r for r in _regions(backward) if any(sub.sym.name == "cat" for sub in r.subsymbols)]
    assert sum(sub.sym.name == "reshape" for sub in assembly.subsymbols) == 4  # 3 heads, then the rows' view
    assert (B * T, 3 * H * D) in [tuple(out.shape) for out in assembly.output]


def matmuls_in_and_out_of_regions(trace, executor) -> tuple[int, int]:
    """How many matmuls `trace` runs inside `executor`'s regions, and how many outside them."""
    counts = [0, 0]
    for bsym in trace.bound_symbols:
        counts[bsym.sym.executor is not executor] += sum(leaf.sym.name == "matmul" for leaf in leaf_calls(bsym))
    return counts[0], counts[1]


def test_matmuls_join_regions_when_asked():
    """`fuse_matmuls=True` hands Inductor the matmuls with their neighbours (the linear layers, and on CPU the
    attention's own matmuls); values and grads stay eager's. (The default executor keeps them out:
    test_litgpt_forward_and_backward_match_eager.)"""
    config = shrunk("Llama-3.2-1B")
    config.n_layer = 2
    model = GPT(config).double()
    idx, targets = (torch.randint(0, config.padded_vocab_size, (2, 16)) for _ in range(2))
    expected = _loss(model, idx, targets)
    expected.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    with_matmuls = TorchCompileExecutor("torchcompile_with_matmuls", fuse_matmuls=True)
    jitted = fulmen.jit(_loss, executors=[with_matmuls])
    loss = jitted(model, idx, targets)
    loss.backward()
    torch.testing.assert_close(loss, expected)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], msg=name)
    for trace in (fulmen.last_traces(jitted)[-1], fulmen.last_backward_traces(jitted)[-1]):
        fused, alone = matmuls_in_and_out_of_regions(trace, with_matmuls)
        # every linear and attention matmul of both layers (7 each) is in a region, forward and backward
        assert fused >= 7 * config.n_layer and alone == 0, (fused, alone)


def test_floor_division_and_remainder_in_a_region_round_as_eager():
    """Eager floors Python's way (0.9 // 0.1 is 8, 1 // -inf is -1); floor(a / b), which a region compiled from a
    decomposition computed, gives 9 and -0."""
    a = torch.tensor([0.9, 1.0, -1.0, 5.0, 7.5, -7.5, 1e30], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([0.1, -math.inf, math.inf, 0.0, 2.5, 0.1, 3.0], dtype=torch.float64, requires_grad=True)

    def f(a, b):
        return torch.tanh(a) + torch.div(a, b, rounding_mode="floor") * 2 + torch.remainder(a, b) * b

    jitted = fulmen.jit(f, executors=["torchcompile"])
    got, want = jitted(a, b), f(a, b)
    assert _regions(fulmen.last_traces(jitted)[-1])
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    grads = torch.autograd.grad(got.nansum(), (a, b))
    torch.testing.assert_close(grads, torch.autograd.grad(want.nansum(), (a, b)), rtol=1e-12, atol=0, equal_nan=True)
    with torch.no_grad():  # the operator, which eager cannot differentiate
        quotient = fulmen.jit(lambda a, b: torch.tanh(a) + a // b, executors=["torchcompile"])(a, b)
        torch.testing.assert_close(quotient, torch.tanh(a) + a // b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_powers_in_a_region_round_as_eagers_kernel(dtype):
    """A tensor to a number's power, inside a region, as eager's CPU kernel computes it: the exponent in the tensor's
    dtype, and in bfloat16 cubes and inverse squares as two rounded products (float16 calls powf). Inductor's own
    lowering of `pow` rounds once from float32 with the exponent as given: a third of the elements differ."""
    generator = torch.Generator().manual_seed(0)
    x = ((torch.rand(16, 515, generator=generator) * 3 + 0.1) * torch.randn(16, 515, generator=generator).sign())
    x = x.to(dtype).requires_grad_()

    def f(x):
        return x ** 3 * 2 + (x * 2) ** -2 - x.abs() ** 0.3

    want = f(x)
    v = torch.randn(want.shape, generator=generator).to(dtype)
    jitted = fulmen.jit(f, executors=[torchcompile])
    got = jitted(x)
    assert [b.sym.executor for b in fulmen.last_traces(jitted)[-1].bound_symbols[:1]] == [torchcompile]
    assert torch.equal(got, want)
    assert torch.equal(torch.autograd.grad(got, x, v)[0], torch.autograd.grad(want, x, v)[0])


def test_half_precision_chains_in_a_region_round_as_eager():
    """Regions round each op's result to its dtype as eager's kernels write it (Inductor's emulate_precision_casts):
    RoPE's arithmetic and erf's and a division's grads are eager's bits. Without the option Inductor keeps float32
    between the fused ops, and they differ."""
    generator = torch.Generator().manual_seed(0)
    x, y, cos, sin = (torch.randn(8, 64, generator=generator).to(torch.bfloat16) for _ in range(4))
    x.requires_grad_()
    y.requires_grad_()

    def f(x, y, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
        return (x * cos + rotated * sin) * 3 + torch.erf(x) / y

    want = f(x, y, cos, sin)
    v = torch.randn(want.shape, generator=generator).to(want.dtype)
    want_grads = torch.autograd.grad(want, (x, y), v)
    inductor_roundings = TorchCompileExecutor("torchcompile_inductor_roundings", {"emulate_precision_casts": False})
    for executor, exact in ((torchcompile, True), (inductor_roundings, False)):
        jitted = fulmen.jit(f, executors=[executor])
        got = jitted(x, y, cos, sin)
        assert any(b.sym.executor is executor for b in fulmen.last_traces(jitted)[-1].bound_symbols)
        grads = torch.autograd.grad(got, (x, y), v)
        same = torch.equal(got, want) and all(torch.equal(g, w) for g, w in zip(grads, want_grads))
        assert same == exact, executor.name


def test_a_lone_call_between_matmuls_runs_as_eagers_kernel():
    """GPT-2's MLP: a gelu between two matmuls. In the forward one eager kernel either way, so no region: it keeps
    eager's kernel and its rounding (Inductor's gelu differs from eager's CUDA kernel in a unit here and there). In
    the backward the gelu recomputed for the second weight's gradient and the gelu's gradient, each alone between
    matmuls, read the same input: they become one region that reads it once. A gelu followed by a scaling is two
    kernels and one region."""
    generator = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(shape, generator=generator).to(torch.bfloat16).requires_grad_()
                 for shape in ((8, 16), (16, 64), (64, 16)))

    def mlp(x, w1, w2):
        return F.gelu(x @ w1, approximate="tanh") @ w2

    jitted = fulmen.jit(mlp, executors=[torchcompile])
    got = jitted(x, w1, w2)
    assert not _regions(fulmen.last_traces(jitted)[-1])
    (region,) = _regions(fulmen.last_backward_traces(jitted)[-1])
    assert [call.sym.name for call in region.subsymbols if "gelu" in call.sym.name] == ["gelu", "gelu_backward"]
    want = mlp(x, w1, w2)
    v = torch.randn(want.shape, generator=generator).to(want.dtype)
    assert torch.equal(got, want)
    for g, w in zip(torch.autograd.grad(got, (x, w1, w2), v), torch.autograd.grad(want, (x, w1, w2), v)):
        assert torch.equal(g, w)

    scaled = fulmen.jit(lambda x, w1, w2: (F.gelu(x @ w1) * 2) @ w2, executors=[torchcompile])
    scaled(x, w1, w2)
    assert len(_regions(fulmen.last_traces(scaled)[-1])) == 1


def test_the_swiglu_activation_and_its_gradient_join_regions():
    """Llama's MLP, `down(silu(gate(x)) * up(x))`: the silu waits for the up projection and its gradient for the two
    weight-gradient matmuls, each a lone elementwise call between matmuls. The silu is recomputed in the region of
    the product, and the gradient moves up into the region that computes what it reads, so no activation kernel runs
    on its own in either trace (issue 51: they were separate eager kernels in the Hugging Face Llama step)."""
    generator = torch.Generator().manual_seed(0)
    x, gate, up, down = (torch.randn(shape, generator=generator).to(torch.bfloat16).requires_grad_()
                         for shape in ((2, 8, 16), (32, 16), (32, 16), (16, 32)))

    def mlp(x, gate, up, down):
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

    jitted = fulmen.jit(mlp, executors=[torchcompile])
    got = jitted(x, gate, up, down)
    forward, backward = fulmen.last_traces(jitted)[-1], fulmen.last_backward_traces(jitted)[-1]
    for trace in (forward, backward):
        alone = [b.sym.name for b in trace.bound_symbols if b.sym.name in ("silu", "silu_backward", "mul")]
        assert not alone, (alone, str(trace))
    assert any("silu_backward" in call.sym.name for region in _regions(backward) for call in region.subsymbols)
    want = mlp(x, gate, up, down)
    v = torch.randn(want.shape, generator=generator).to(want.dtype)
    assert torch.equal(got, want)
    inputs = (x, gate, up, down)
    for g, w in zip(torch.autograd.grad(got, inputs, v), torch.autograd.grad(want, inputs, v)):
        torch.testing.assert_close(g, w, rtol=1.6e-2, atol=1e-2)  # Inductor's silu: a bf16 unit here and there
