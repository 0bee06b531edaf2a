"""Every LitGPT architecture (shrunk, fp32) under fulmen.jit matches eager logits, with and without a KV cache."""

from __future__ import annotations

import pytest
import torch
from litgpt.config import Config, configs
from litgpt.model import GPT

import fulmen
from tests.models.litgpt_configs import architecture_key, representative_names, shrunk

NAMES = representative_names()
# Decoding with a sliding-window KV cache reads `input_pos.max().item()` in LitGPT's KVCache: data-dependent.
SLIDING_WINDOW = {name for name in NAMES if Config.from_name(name).sliding_window_size is not None}


def _model(name: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(shrunk(name))
    model.eval()
    return model


@pytest.mark.parametrize("name", NAMES)
def test_forward_matches_eager(name):
    model = _model(name)
    idx = torch.randint(0, model.config.padded_vocab_size, (2, 9))
    jitted = fulmen.jit(model)
    torch.testing.assert_close(jitted(idx), model(idx), rtol=1e-5, atol=1e-5)
    # a second call with a new batch hits the cache
    idx2 = torch.randint(0, model.config.padded_vocab_size, (2, 9))
    torch.testing.assert_close(jitted(idx2), model(idx2), rtol=1e-5, atol=1e-5)
    assert fulmen.cache_hits(jitted) == 1 and fulmen.cache_misses(jitted) == 1


@pytest.mark.parametrize("name", NAMES)
def test_kv_cache_decode_matches_eager(name):
    eager, compiled = _model(name), _model(name)
    vocab = eager.config.padded_vocab_size
    for model in (eager, compiled):
        model.set_kv_cache(batch_size=2)
    jitted = fulmen.jit(compiled)
    prompt = torch.randint(0, vocab, (2, 5))
    pos = torch.arange(5)
    if name in SLIDING_WINDOW:
        with pytest.raises(fulmen.DataDependentError, match=r"item.*\n.*model.py"):
            jitted(prompt, input_pos=pos)
        return
    torch.testing.assert_close(jitted(prompt, input_pos=pos), eager(prompt, input_pos=pos), rtol=1e-5, atol=1e-5)
    for step in range(5, 8):
        token = torch.randint(0, vocab, (2, 1))
        at = torch.tensor([step])
        torch.testing.assert_close(jitted(token, input_pos=at), eager(token, input_pos=at), rtol=1e-5, atol=1e-5)
    # the cache buffers were updated in place exactly as eager updated them
    for (name_e, buf_e), (name_c, buf_c) in zip(eager.named_buffers(), compiled.named_buffers()):
        assert name_e == name_c
        torch.testing.assert_close(buf_c, buf_e, rtol=1e-5, atol=1e-5)
    assert fulmen.cache_misses(jitted) == 2  # prefill and decode shapes; the decode steps hit


def test_coverage_report(summary):
    """How many of LitGPT's configs the representative architectures above cover."""
    covered = {architecture_key(shrunk(name)) for name in NAMES}
    keys = [architecture_key(Config(**entry)) for entry in configs]
    n_covered = sum(1 for key in keys if key in {architecture_key(Config.from_name(n)) for n in NAMES})
    summary(f"LitGPT coverage: {len(NAMES)} architectures cover {n_covered}/{len(configs)} configs")
    assert covered and n_covered == len(configs)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _grads(model: GPT) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", NAMES)
def test_loss_and_grads_match_eager(name):
    """The jitted module inside an eager loss: loss and every parameter's grad equal eager's (fp32, rtol 1e-5)."""
    model = _model(name).train()
    vocab = model.config.padded_vocab_size
    idx, targets = torch.randint(0, vocab, (2, 9)), torch.randint(0, vocab, (2, 9))
    loss = _loss(fulmen.jit(model)(idx), targets)
    loss.backward()
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    expected_loss = _loss(model(idx), targets)
    expected_loss.backward()
    expected = _grads(model)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("name", ["Llama-3.1-8B", "Gemma-2-2b", "falcon-7b", "phi-1_5"])
def test_jitted_loss_function_with_captured_model(name):
    """A jitted function that calls the (captured) model and the loss: parameters are captured inputs with grads."""
    model = _model(name).train()
    vocab = model.config.padded_vocab_size
    idx, targets = torch.randint(0, vocab, (2, 9)), torch.randint(0, vocab, (2, 9))
    step = fulmen.jit(lambda i, t: _loss(model(i), t))
    loss = step(idx, targets)
    loss.backward()
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    expected_loss = _loss(model(idx), targets)
    expected_loss.backward()
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    for key, grad in _grads(model).items():
        torch.testing.assert_close(got[key], grad, rtol=1e-5, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}")
    backward = fulmen.last_backward_traces(step)[-1].python()
    # the lm_head and the loss are one fused op (no full logits in the forward), unless the logits are soft-capped
    fused = "fused_loss.linear_cross_entropy_forward(" in fulmen.last_traces(step)[-1].python()
    assert fused == (model.config.final_logit_softcapping is None)
    assert "def backward(saved, cotangents):" in backward and "saved.clear()" in backward
