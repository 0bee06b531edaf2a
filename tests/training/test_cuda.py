"""The autodiff on the GPU: LitGPT grads, autocast bf16 and peak memory against eager (run on the device)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from litgpt.model import GPT as LitGPT

import fulmen
from tests.cuda_memory import cuda_peak
from tests.models.gpt2_seed import GPT, tiny_config
from tests.models.litgpt_configs import shrunk
from tests.training_steps import assert_backward_matches_eager

pytestmark = pytest.mark.cuda


def _loss(net, idx, targets):
    return F.cross_entropy(net(idx).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("name", ["Llama-3.1-8B", "Gemma-2-2b", "phi-1_5"])
def test_litgpt_grads_match_eager_on_cuda(name):
    torch.manual_seed(0)
    model = LitGPT(shrunk(name)).cuda().train()
    vocab = model.config.padded_vocab_size
    idx, targets = (torch.randint(0, vocab, (2, 16), device="cuda") for _ in range(2))
    loss = _loss(fulmen.jit(model), idx, targets)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    expected = _loss(model, idx, targets)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, k=n: f"{k}: {m}")


def test_bf16_embedding_gradient_is_eagers_on_cuda():
    """Llama 3's vocabulary, 8192 lookups of 50 tokens: eager sums each row in float32 and rounds once; so does
    fulmen (eager's kernel), bit for bit, every run. A bfloat16 index_add differs: it rounds at every addition."""
    torch.manual_seed(0)
    weight = torch.randn(128256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    index = torch.randint(0, 50, (4, 2048), device="cuda")
    g = torch.randn(4, 2048, 256, device="cuda", dtype=torch.bfloat16)
    jitted = fulmen.jit(lambda weight, index: F.embedding(index, weight))
    ours = [torch.autograd.grad(jitted(weight, index), weight, g)[0] for _ in range(2)]
    (eager,) = torch.autograd.grad(F.embedding(index, weight), weight, g)
    assert torch.equal(ours[0], eager) and torch.equal(ours[1], eager)
    rounding_each_add = torch.zeros_like(weight).index_add(0, index.flatten(), g.flatten(0, 1))
    assert not torch.equal(rounding_each_add, eager)


def test_seed_gpt2_autocast_bf16_on_cuda():
    torch.manual_seed(0)
    model = GPT(tiny_config()).cuda().train()
    jitted = fulmen.jit(model)
    x, y = (torch.randint(0, 96, (4, 32), device="cuda") for _ in range(2))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits, loss = jitted(x, y)
        eager_logits, eager_loss = model(x, y)
    assert (logits.dtype, loss.dtype) == (eager_logits.dtype, eager_loss.dtype)
    torch.testing.assert_close(loss, eager_loss, rtol=1.6e-2, atol=1e-3)
    assert_backward_matches_eager(model, loss, eager_loss)


def test_litgpt_peak_memory_at_most_eagers_on_cuda():
    config = shrunk("Llama-3.1-8B")
    config.n_layer, config.n_embd, config.n_head, config.n_query_groups = 4, 256, 4, 4
    config.head_size, config.intermediate_size, config.block_size = 64, 688, 256
    torch.manual_seed(0)
    model = LitGPT(config).cuda().train()
    jitted = fulmen.jit(copy.deepcopy(model))
    vocab = config.padded_vocab_size
    idx, targets = (torch.randint(0, vocab, (8, 256), device="cuda") for _ in range(2))
    eager = cuda_peak(lambda: _loss(model, idx, targets))
    model.zero_grad(set_to_none=True)
    ours = cuda_peak(lambda: _loss(jitted, idx, targets))
    print(f"\nCUDA fwd+bwd peak above the parameters: eager {eager / 2**20:.1f} MiB, fulmen {ours / 2**20:.1f} MiB")
    assert ours <= eager
