"""A Hugging Face Llama trained with padding masks over several lengths and batch sizes in two traces (the static one of
the first call, then one with symbolic sizes): losses and grads equal eager's bit for bit."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fulmen


def test_llama_with_padding_masks_over_lengths_in_two_traces():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).train()
    jitted = fulmen.jit(model)
    for step, (batch, length) in enumerate([(2, 5), (3, 9), (2, 12), (4, 7)]):
        generator = torch.Generator().manual_seed(step)
        ids = torch.randint(0, config.vocab_size, (batch, length), generator=generator)
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[0, : length // 2] = 0  # the first row left-padded
        labels = ids.masked_fill(mask == 0, -100)
        results = []
        for fn in (jitted, model):
            loss = fn(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            results.append((loss, [p.grad for p in model.parameters()]))
            model.zero_grad(set_to_none=True)
        (loss, grads), (expected, expected_grads) = results
        assert torch.equal(loss, expected), (batch, length)
        for got, want in zip(grads, expected_grads):
            assert torch.equal(got, want), (batch, length)
    assert fulmen.cache_misses(jitted) == 2, fulmen.last_cache_miss_reasons(jitted)
    assert '# input_ids: "cpu i64[s0, s1]"' in fulmen.last_traces(jitted)[-1].python()
