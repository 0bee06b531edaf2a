"""Training under fulmen.jit follows eager step by step: the seed-002 GPT-2 and a LitGPT Llama, Adam, 10 steps."""

from __future__ import annotations

import copy

import pytest
import torch
from litgpt.model import GPT as LitGPT

import fulmen
from tests.models.gpt2_seed import GPT, tiny_config
from tests.models.litgpt_configs import shrunk

STEPS = 10


def _train(model, step_fn, batches, lr=1e-3) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        loss = step_fn(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _batches(vocab: int, B: int, T: int, overfit: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    data = [(torch.randint(0, vocab, (B, T)), torch.randint(0, vocab, (B, T))) for _ in range(STEPS)]
    return [data[0]] * STEPS if overfit else data


@pytest.mark.parametrize("overfit", [True, False], ids=["one-batch", "new-batches"])
def test_seed_gpt2_adam_matches_eager(overfit):
    torch.manual_seed(0)
    eager = GPT(tiny_config()).train()
    model = copy.deepcopy(eager)
    jitted = fulmen.jit(model)
    batches = _batches(96, 4, 16, overfit)
    targets_masked = [(x, y.masked_fill(y % 7 == 0, -1)) for x, y in batches]  # ignore_index=-1 entries
    expected = _train(eager, lambda x, y: eager(x, y)[1], targets_masked)
    actual = _train(model, lambda x, y: jitted(x, y)[1], targets_masked)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=0)
    assert expected[-1] < expected[0]  # it trains
    assert fulmen.cache_misses(jitted) == 1
    # Tied weights stay tied: the one tensor got the grads of both uses.
    assert model.transformer.wte.weight is model.lm_head.weight
    torch.testing.assert_close(model.lm_head.weight, eager.lm_head.weight, rtol=1e-4, atol=1e-5)


def test_litgpt_llama_adam_matches_eager():
    torch.manual_seed(0)
    eager = LitGPT(shrunk("Llama-3.1-8B")).train()
    model = copy.deepcopy(eager)
    jitted = fulmen.jit(model)
    vocab = eager.config.padded_vocab_size

    def loss_of(net):
        return lambda x, y: torch.nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten())

    batches = _batches(vocab, 2, 16, overfit=False)
    expected = _train(eager, loss_of(eager), batches)
    actual = _train(model, loss_of(jitted), batches)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=0)
