"""The sdpa and torchcompile executors on CUDA, bf16 LitGPT against eager; peak memory of the default executors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from litgpt import GPT

import fulmen
from fulmen.executors.sdpa import sdpa
from fulmen.executors.torch_compile import torchcompile
from tests.cuda_memory import cuda_peak
from tests.models.litgpt_configs import shrunk

pytestmark = pytest.mark.cuda


def _loss(model, idx, targets):
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _model(name: str = "Llama-3.2-1B", **overrides):
    config = shrunk(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return GPT(config).cuda().to(torch.bfloat16), config


def _grads(model, loss_fn, idx, targets):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, idx, targets)
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("executors", [["sdpa"], ["torchcompile"], None], ids=["sdpa", "torchcompile", "default"])
def test_litgpt_bf16_matches_eager(executors):
    model, config = _model(head_size=64, n_embd=256, n_head=4, block_size=128)
    idx, targets = (torch.randint(0, config.padded_vocab_size, (2, 64), device="cuda") for _ in range(2))
    jitted = fulmen.jit(_loss, executors=executors)
    loss, grads = _grads(model, jitted, idx, targets)
    ref_loss, ref_grads = _grads(model, _loss, idx, targets)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
    for name, grad in grads.items():
        # bf16: compare relative to the grad's scale
        scale = ref_grads[name].abs().max().clamp_min(1e-6)
        assert (grad - ref_grads[name]).abs().max() / scale < 5e-2, name
    forward, backward = fulmen.last_traces(jitted)[-1], fulmen.last_backward_traces(jitted)[-1]
    executors_seen = {b.sym.executor for t in (forward, backward) for b in t.bound_symbols}
    if executors in (["sdpa"], None):
        names = {b.sym.name for t in (forward, backward) for b in t.bound_symbols}
        assert {"sdpa_flash_forward", "sdpa_flash_backward"} <= names
        assert "torch_vjp" not in names  # attention is not recomputed through autograd
    if executors in (["torchcompile"], None):
        assert torchcompile in executors_seen
    if executors == ["torchcompile"]:
        assert sdpa not in executors_seen


@pytest.mark.parametrize("backend", ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_attention_kernel_matches_eager(backend, dtype):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if dtype == torch.float32 and backend != "EFFICIENT_ATTENTION":
        pytest.skip("cuDNN and flash attention take half precision only (eager has no kernel either)")
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2) * 2

    with sdpa_kernel([getattr(SDPBackend, backend)]):
        jitted = fulmen.jit(f, executors=["sdpa"])
        out = jitted(q, k, v)
        names = {b.sym.name for b in fulmen.last_traces(jitted)[-1].bound_symbols}
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        expected = f(q, k, v)
        want = torch.autograd.grad(expected.float().square().sum(), (q, k, v))
    kernel = backend.split("_")[0].lower()
    assert f"sdpa_{kernel}_forward" in names
    assert f"sdpa_{kernel}_backward" in {b.sym.name for b in fulmen.last_backward_traces(jitted)[-1].bound_symbols}
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, expected, **tol)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, **tol)


def test_default_executors_peak_memory_at_most_eagers():
    model, config = _model(n_layer=4, n_embd=512, n_head=8, head_size=64, intermediate_size=1536,
                           padded_vocab_size=8192, vocab_size=8192, block_size=512)
    idx, targets = (torch.randint(0, 8192, (4, 512), device="cuda") for _ in range(2))
    jitted = fulmen.jit(_loss)
    fulmen_peak = cuda_peak(lambda: jitted(model, idx, targets))
    model.zero_grad(set_to_none=True)
    eager_peak = cuda_peak(lambda: _loss(model, idx, targets))
    print(f"peak forward+backward: eager {eager_peak / 2**20:.1f} MiB, fulmen {fulmen_peak / 2**20:.1f} MiB")
    assert fulmen_peak <= eager_peak
