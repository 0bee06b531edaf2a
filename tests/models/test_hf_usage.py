"""Hugging Face usage patterns beyond a plain training step (test_hf.py), each against eager on the same inputs.

Tiny Llama, GPT-2 and BERT from tests/models/hf_configs.py; the outputs compared are all the tensors the model returns,
the loss and every parameter gradient. Finetuning setups: dropout in train mode, frozen weights with gradient
checkpointing (transformers then makes the embeddings' output a leaf of autograd inside the forward).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import AutoConfig
from transformers.integrations.neftune import activate_neftune

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


def _assert_same_grads(model: torch.nn.Module, eager: torch.nn.Module) -> None:
    for (name, mine), (_, theirs) in zip(model.named_parameters(), eager.named_parameters()):
        assert (mine.grad is None) == (theirs.grad is None), f"{name}: grad {mine.grad}, eager's {theirs.grad}"
        if theirs.grad is not None:
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_hidden_states_and_attentions_with_a_padding_mask(attn):
    """transformers installs its output-capturing hooks inside the first forward that asks for them. With a padding
    mask, fulmen acquires that forward twice (the first run reads `padding_mask.all()`, see
    fulmen/acquisition/is_compiling.py): the hooks the abandoned run installed stayed, and every layer's hidden state
    and attention map came back twice."""
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
        _assert_same_grads(model, eager)
    assert [len(layer._forward_hooks) for layer in model.model.layers] == [
        len(layer._forward_hooks) for layer in eager.model.layers
    ]


def _train_on_two_seeds(jitted, model, eager, inputs) -> None:
    """Two training calls, each on its own seed: fulmen's loss and grads equal eager's (its draws are eager's)."""
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
        _assert_same_grads(model, eager)


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
    _train_on_two_seeds(jitted, model, eager, inputs)


def _frozen_but_attention(model: torch.nn.Module, reentrant: bool) -> torch.nn.Module:
    """As a LoRA finetune leaves it: the embeddings and most weights frozen, gradient checkpointing on. transformers'
    `gradient_checkpointing_enable()` then hooks the input embeddings to call `output.requires_grad_(True)`."""
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(any(part in name for part in ("q_proj", "c_attn")))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


@pytest.mark.parametrize(("family", "class_name", "reentrant"), [
    ("llama", "LlamaForCausalLM", True),
    ("gpt2", "GPT2LMHeadModel", False),  # dropout on: checkpointing replays the masks
], ids=["llama-reentrant", "gpt2"])
def test_frozen_embeddings_with_gradient_checkpointing_train_as_eager(family, class_name, reentrant):
    """Frozen embeddings make `requires_grad_(True)` a leaf of autograd on their output (which fulmen refused, so no
    LoRA-style finetune with gradient checkpointing ran); the trainable weights get eager's grads, the second call
    hits the cache and an evaluation under no_grad gives eager's logits."""
    eager = _frozen_but_attention(_build(family, class_name).train(), reentrant)
    model = copy.deepcopy(eager)
    jitted = fulmen.jit(model)
    inputs = batch(padded=True)
    _train_on_two_seeds(jitted, model, eager, inputs)  # backward (reentrant checkpointing has no autograd.grad)
    assert fulmen.cache_hits(jitted) == 1
    eager.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(jitted(**inputs).logits, eager(**inputs).logits, rtol=1e-5, atol=1e-6)


def test_frozen_embeddings_refusals_name_the_output_and_the_line():
    """With gradient checkpointing and frozen embeddings, eager's `hidden_states[0]` is the leaf the hook made (its
    .grad filled by backward), and with every weight frozen eager's loss still requires grad: refused, naming the
    output and transformers' requires_grad_ line."""
    model = _frozen_but_attention(_build("llama", "LlamaForCausalLM").train(), reentrant=False)
    with pytest.raises(fulmen.TraceError, match=r"the output\['hidden_states'\]\[0\], shape \(2, 8, 32\)") as error:
        fulmen.jit(model)(**batch(padded=False), output_hidden_states=True)
    assert error.value.location.line == "output.requires_grad_(True)"
    model.requires_grad_(False)
    assert model(**batch(padded=False)).loss.requires_grad  # eager
    with pytest.raises(fulmen.TraceError, match="no input .* gets a grad") as error:
        fulmen.jit(model)(**batch(padded=False))
    assert error.value.location.line == "output.requires_grad_(True)"


def _smoothed_loss(logits, labels, vocab_size, **kwargs):
    logits, labels = logits[:, :-1].reshape(-1, vocab_size), labels[:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100, label_smoothing=0.1)


def test_a_loss_function_assigned_between_calls_is_used():
    """`model.loss_function = f` stores `_loss_function`, which transformers' property looks for with `hasattr`: the
    call after the assignment traced again (it hit the cache and returned the old loss before)."""
    eager = _build("llama", "LlamaForCausalLM")
    model = copy.deepcopy(eager)
    jitted = fulmen.jit(model)
    inputs = batch(padded=True)
    torch.testing.assert_close(jitted(**inputs).loss, eager(**inputs).loss)
    model.loss_function = eager.loss_function = _smoothed_loss
    want = eager(**inputs).loss
    got = jitted(**inputs).loss
    torch.testing.assert_close(got, want)
    got.backward()
    want.backward()
    _assert_same_grads(model, eager)
    assert fulmen.cache_misses(jitted) == 2


def test_neftune_noise_is_refused_naming_its_line_and_evaluation_matches():
    """transformers' NEFTune hook (Trainer's `neftune_noise_alpha`) draws `uniform_(-mag, mag)` with 0-dim tensor
    bounds, whose values eager reads as Python numbers: refused naming transformers' line (it failed inside fulmen's
    meta function before, 'Tensor.item() cannot be called on meta tensors'). In eval mode the hook draws nothing."""
    eager = _build("llama", "LlamaForCausalLM")
    activate_neftune(eager, neftune_noise_alpha=5.0)
    model = copy.deepcopy(eager)
    jitted = fulmen.jit(model)
    inputs = batch(padded=False)
    torch.testing.assert_close(jitted(**inputs).loss, eager(**inputs).loss)
    model.train()
    with pytest.raises(fulmen.DataDependentError, match=r"Tensor\.uniform_ with tensor arguments") as error:
        jitted(**inputs)
    assert error.value.location.line == "output = output + torch.zeros_like(output).uniform_(-mag_norm, mag_norm)"


def test_layerdrop_models_train_as_eager():
    """LayerDrop draws `torch.rand([])` per layer in train mode and skips the layer if it is below `layerdrop`:
    with the default 0.0 no draw is, so fulmen takes eager's branch (it refused the `if` before, so OPT, BART, Whisper
    and ~40 other families never trained); with layerdrop 0.5 the draw decides, refused naming transformers' line."""
    eager = _build("opt", "OPTForCausalLM").train()
    model = copy.deepcopy(eager)
    jitted = fulmen.jit(model)
    inputs = batch(padded=True)
    _train_on_two_seeds(jitted, model, eager, inputs)
    assert fulmen.cache_hits(jitted) == 1
    model.model.decoder.layerdrop = 0.5
    with pytest.raises(fulmen.DataDependentError, match="reads tensor values") as error:
        jitted(**inputs)
    assert error.value.location.line == "if dropout_probability < self.layerdrop:"


def test_retain_grad_on_a_hidden_state_is_refused_naming_it():
    """Interpretability code keeps the grad of a hidden state; eager's includes what reaches it through the layers
    after it, which fulmen's one autograd node cannot show: refused at backward, naming the output by its place in
    the model's output (it said 'output 7 (t154)') and the line that computed it."""
    jitted = fulmen.jit(_build("llama", "LlamaForCausalLM"))
    out = jitted(**batch(padded=False), output_hidden_states=True)
    out.hidden_states[1].retain_grad()
    with pytest.raises(fulmen.TraceError, match=r"output\['hidden_states'\]\[1\] \(t\d+\) of the jitted program has "
                       r"retain_grad\(\), and output\['loss'\], output\['logits'\], ") as error:
        out.loss.backward()
    assert error.value.location.line == "hidden_states = residual + hidden_states"


def test_training_without_a_cache_takes_eagers_attention_path():
    """With `use_cache=False` (gradient checkpointing sets it) and no attention mask, transformers reads the
    `position_ids` it builds to find packed sequences; fulmen knows their values (fulmen/acquisition/known_values.py),
    so it takes
    eager's path: `is_causal` with grouped heads. It took the compiler's path before (an explicit mask, repeated keys),
    and the bfloat16 grads rounded otherwise (by 8e-4)."""
    eager = _build("llama", "LlamaForCausalLM").train()
    model = copy.deepcopy(eager)
    jitted = fulmen.jit(model)
    inputs = batch(padded=False) | {"use_cache": False}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = eager(**inputs).loss, jitted(**inputs).loss
    assert torch.equal(got, want)
    got.backward()
    want.backward()
    for (name, mine), (_, theirs) in zip(model.named_parameters(), eager.named_parameters()):
        assert torch.equal(mine.grad, theirs.grad), name


def test_dropout_under_autocast_trains_as_eager_bit_for_bit():
    """GPT-2's residual, embedding and attention dropouts in bfloat16 under autocast: the grads are eager's bit for
    bit. They rounded otherwise by up to 1e-3 before e938007 (nn.Dropout; the op: tests/training/test_fabric_loops.py)
    and 9e75432 (sdpa's backward recomputed the attention in bfloat16; the op: tests/ops/test_sdpa_dropout.py)."""
    eager = _build("gpt2", "GPT2LMHeadModel").train()
    model = copy.deepcopy(eager)
    jitted = fulmen.jit(model)
    inputs = batch(padded=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(0)
        want = eager(**inputs).loss
        torch.manual_seed(0)
        got = jitted(**inputs).loss
    assert torch.equal(got, want)
    got.backward()
    want.backward()
    for (name, mine), (_, theirs) in zip(model.named_parameters(), eager.named_parameters()):
        assert torch.equal(mine.grad, theirs.grad), name
