"""LitGPT usage patterns beyond one forward and one training step (test_litgpt.py), each against eager.

Tiny float64 models, so that the comparisons can be tight: the jitted model runs the same ops as eager.
"""

from __future__ import annotations

import copy

import pytest
import torch
from litgpt.config import Config
from litgpt.generate.base import generate
from litgpt.model import GPT, LLaMAMoE

import fulmen

TIGHT = dict(rtol=1e-12, atol=1e-12)


pytestmark = pytest.mark.usefixtures("one_thread")


def _pair() -> tuple[GPT, GPT]:
    """An eager model and an identical copy to jit."""
    torch.manual_seed(0)
    config = Config.from_name("Llama-3.1-8B", n_layer=2, n_embd=64, n_head=4, n_query_groups=2, head_size=16,
                              intermediate_size=96, padded_vocab_size=96, vocab_size=96, block_size=32)
    eager = GPT(config).to(torch.float64).eval()
    return eager, copy.deepcopy(eager)


def _assert_same_buffers(eager: GPT, compiled: GPT) -> None:
    for (name, want), (name_c, got) in zip(eager.named_buffers(), compiled.named_buffers(), strict=True):
        assert name == name_c
        torch.testing.assert_close(got, want, **TIGHT, msg=lambda m, n=name: f"{n}: {m}")


def test_kv_cache_decode_under_inference_mode():
    """LitGPT's generate decodes under torch.inference_mode(). Meta tensors made there are inference tensors, which
    torch tracks no views of, so the KV cache update through `self.k[:bs].index_copy_(...)` was never written back:
    each decode step read a cache without its last tokens (logits off by ~0.3), and the trace acquired there, cached
    without the write, dropped it under no_grad too."""
    eager, compiled = _pair()
    jitted = fulmen.jit(compiled)
    for model in (eager, compiled):
        model.set_kv_cache(batch_size=2, dtype=torch.float64)  # as the model: no conversion under inference mode
    prompt = torch.randint(0, 96, (2, 5))
    with torch.inference_mode():
        torch.testing.assert_close(jitted(prompt, torch.arange(5)), eager(prompt, torch.arange(5)), **TIGHT)
        _assert_same_buffers(eager, compiled)
        for step in range(5, 8):
            token, at = torch.randint(0, 96, (2, 1)), torch.tensor([step])
            torch.testing.assert_close(jitted(token, at), eager(token, at), **TIGHT)
            _assert_same_buffers(eager, compiled)
    with torch.no_grad():  # the same trace: the grad mode is the same, the cache key does not hold inference mode
        token, at = torch.randint(0, 96, (2, 1)), torch.tensor([8])
        torch.testing.assert_close(jitted(token, at), eager(token, at), **TIGHT)
    _assert_same_buffers(eager, compiled)


def test_generate_samples_the_same_tokens():
    """litgpt.generate.base.generate (prefill, then one token at a time with input_pos and input_pos_maxp1, top-k
    sampling) on the jitted model returns eager's tokens, and leaves the same KV cache."""
    eager, compiled = _pair()
    jitted = fulmen.jit(compiled)
    for model in (eager, jitted):
        model.set_kv_cache(batch_size=1, dtype=torch.float64)
    prompt = torch.randint(0, 96, (5,))
    torch.manual_seed(3)
    want = generate(eager, prompt, max_returned_tokens=12, temperature=0.8, top_k=5)
    torch.manual_seed(3)
    got = generate(jitted, prompt, max_returned_tokens=12, temperature=0.8, top_k=5)
    assert got.tolist() == want.tolist()
    _assert_same_buffers(eager, compiled)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_write_into_a_slice_of_a_buffer(mode):
    """The smallest form of the above: an in-place update of a view of a buffer, under either mode."""

    class Accumulate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("total", torch.zeros(2, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.total[:1].add_(x) * 2

    eager, compiled = Accumulate(), Accumulate()
    jitted = fulmen.jit(compiled)
    for _ in range(2):
        x = torch.randn(1, 4)
        with mode():
            torch.testing.assert_close(jitted(x), eager(x), rtol=0, atol=0)
        torch.testing.assert_close(compiled.total, eager.total, rtol=0, atol=0)


def test_mixture_of_experts_with_an_expert_that_overflows_where_not_routed():
    """fulmen runs LitGPT's LLaMAMoE experts on every token (lookasides.py: eager's torch.where routing is
    data-dependent). An expert overflowing on tokens it is not routed to, which eager never runs it on, gave nan
    (0 * inf) in the output and the grads where eager's are finite."""
    config = Config.from_name("Mixtral-8x7B-v0.1", n_embd=8, moe_intermediate_size=16, n_expert=4,
                              n_expert_per_token=2, n_head=2, n_query_groups=2, head_size=4)
    torch.manual_seed(0)
    eager = LLaMAMoE(config).to(torch.float64)
    with torch.no_grad():
        eager.gate.weight.abs_()
        eager.gate.weight[3] = -1.0  # positive inputs never route to expert 3
        eager.experts[3].fc_1.weight.mul_(1e160)  # and it overflows on every token
        eager.experts[3].fc_2.weight.mul_(1e160)
    compiled = copy.deepcopy(eager)
    x = torch.rand(2, 5, 8, dtype=torch.float64)
    want, got = eager(x), fulmen.jit(compiled)(x)
    torch.testing.assert_close(got, want, **TIGHT)
    want.square().sum().backward()
    got.square().sum().backward()
    for (name, p), p_c in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(p_c.grad, p.grad, **TIGHT, msg=lambda m, n=name: f"{n}: {m}")


def test_is_inference_of_a_new_tensor_under_inference_mode():
    """The metas are made outside inference mode (above); the tensors the program sees still answer as eager's."""

    def program(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        return y + 1 if y.is_inference() else y - 1

    x = torch.ones(3)
    with torch.inference_mode():
        torch.testing.assert_close(fulmen.jit(program)(x), program(x), rtol=0, atol=0)
