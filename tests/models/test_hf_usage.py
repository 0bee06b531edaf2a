"""Hugging Face usage patterns beyond a plain training step (test_hf.py), each against eager on the same inputs.

Tiny Llama (and BERT) from tests/models/hf_configs.py; the outputs compared are all the tensors the model returns,
the loss and every parameter gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import AutoConfig

import fulmen
from tests.models.hf_configs import SMALL, batch

pytestmark = pytest.mark.usefixtures("one_thread")


def _build(family: str, class_name: str, **settings) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{**SMALL, **settings})
    return getattr(transformers, class_name)._from_config(config).eval()


def _assert_same_outputs(got, want) -> None:
    assert type(got) is type(want)
    assert got.keys() == want.keys()
    for key in want.keys():
        if key == "past_key_values":
            continue  # test_hf.py checks the cache
        mine, theirs = got[key], want[key]
        if isinstance(theirs, tuple):
            assert len(mine) == len(theirs), f"{key}: {len(mine)} tensors, eager returns {len(theirs)}"
            for i, (a, b) in enumerate(zip(mine, theirs)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, k=key, i=i: f"{k}[{i}]: {m}")
        else:
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_hidden_states_and_attentions_with_a_padding_mask(attn):
    """transformers installs its output-capturing hooks inside the first forward that asks for them. With a padding
    mask, fulmen acquires that forward twice (the first run reads `padding_mask.all()`, see fulmen/jit/compiling.py):
    the hooks the abandoned run installed stayed, and every layer's hidden state and attention map came back twice."""
    eager = _build("llama", "LlamaForCausalLM", attn_implementation=attn)
    model = copy.deepcopy(eager)
    jitted = fulmen.jit(model)
    inputs = batch(padded=True) | {"output_hidden_states": True, "output_attentions": attn == "eager"}
    for _ in range(2):  # the first call installs the hooks; the second runs with them in place
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        got, want = jitted(**inputs), eager(**inputs)
        _assert_same_outputs(got, want)
        got.loss.backward()
        want.loss.backward()
        for (name, mine), (_, theirs) in zip(model.named_parameters(), eager.named_parameters()):
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert [len(layer._forward_hooks) for layer in model.model.layers] == [
        len(layer._forward_hooks) for layer in eager.model.layers
    ]


@pytest.mark.parametrize(
    ("family", "class_name", "settings"),
    [
        ("gpt2", "GPT2LMHeadModel", {}),  # attn_pdrop=0.1 by default: dropout inside sdpa
        ("llama", "LlamaForCausalLM", {"attention_dropout": 0.3}),
        ("bert", "BertForMaskedLM", {}),  # attention_probs_dropout_prob=0.1, hidden dropout in nn.Dropout
    ],
    ids=["gpt2", "llama", "bert"],
)
def test_training_with_dropout_matches_eager_on_the_same_seed(family, class_name, settings):
    """`model.train()` with dropout: on the same seed, fulmen draws eager's masks, in the forward and for the
    backward. The grads used to come from a second draw (the backward recomputed attention with dropout)."""
    eager = _build(family, class_name, **settings).train()
    model = copy.deepcopy(eager)
    jitted = fulmen.jit(model)
    inputs = batch(padded=True)
    for seed in range(2):
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        want = eager(**inputs).loss
        torch.manual_seed(seed)
        got = jitted(**inputs).loss
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        got.backward()
        want.backward()
        for (name, mine), (_, theirs) in zip(model.named_parameters(), eager.named_parameters()):
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
