"""Hugging Face inference and generation through fulmen, against the same model run eagerly.

Tiny Llama and GPT-2 (tests/models/hf_configs.py's sizes). `model.generate` runs with the model's forward jitted;
greedy decoding must give eager's token ids and scores. A KV cache the model returns is checked in test_hf.py; a
cache the program extends by storing new tensors into Python objects (DynamicCache) is refused, and left as it was;
a StaticCache, updated in place, decodes as eager.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import AutoConfig, DynamicCache, StaticCache

import fulmen
from tests.models.hf_configs import SMALL

pytestmark = pytest.mark.usefixtures("one_thread")

CLASSES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}


def _build(family: str, **settings) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{**SMALL, **settings})
    return getattr(transformers, CLASSES[family])._from_config(config).eval()


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the first left-padded by two tokens."""
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("beams", [1, 2], ids=["greedy", "beams"])
@pytest.mark.parametrize("family", list(CLASSES))
def test_generate_with_a_jitted_forward_gives_eagers_tokens_and_scores(family, beams):
    """generate reads the forward's signature to choose its arguments: the jitted forward showed (*args, **kwargs),
    so GPT-2 got no position_ids from the attention mask, and the left-padded row gave other scores and tokens."""
    eager = _build(family)
    model = copy.deepcopy(eager)
    model.forward = fulmen.jit(model.forward)
    ids, mask = _prompt()
    settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, num_beams=beams,
                    pad_token_id=0, use_cache=False, return_dict_in_generate=True, output_scores=True)
    want, got = eager.generate(**settings), model.generate(**settings)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == 4
    for step, (mine, theirs) in enumerate(zip(got.scores, want.scores)):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=lambda m, s=step: f"step {s}: {m}")
    if beams > 1:
        torch.testing.assert_close(got.sequences_scores, want.sequences_scores)
        assert torch.equal(got.beam_indices, want.beam_indices)
    # each step's input is one token longer: the first length traced static, the second with a symbolic length
    # that the last two reuse (JitOptions(dynamic=None))
    assert fulmen.cache_misses(model.forward) == 2 and fulmen.cache_hits(model.forward) == 2, (
        fulmen.last_cache_miss_reasons(model.forward))


class _Decoder(torch.nn.Module):
    """Keeps its KV cache between calls, as a chat loop would."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm
        self.cache = DynamicCache()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, past_key_values=self.cache, use_cache=True).logits


def _same_cache(mine: DynamicCache, theirs: DynamicCache) -> None:
    assert len(mine.layers) == len(theirs.layers)
    for layer, (a, b) in enumerate(zip(mine.layers, theirs.layers)):
        assert type(a.keys) is torch.Tensor and type(a.values) is torch.Tensor, f"layer {layer} holds {type(a.keys)}"
        torch.testing.assert_close(a.keys, b.keys, msg=lambda m, i=layer: f"layer {i} keys: {m}")
        torch.testing.assert_close(a.values, b.values, msg=lambda m, i=layer: f"layer {i} values: {m}")


def test_a_kv_cache_the_program_extends_in_place_is_refused_and_left_as_it_was():
    """DynamicLayer.update stores `torch.cat([self.keys, new])` into the cache. The cache here is no argument but a
    module's plain attribute: the store happened while acquiring, the trace's stand-ins stayed in the cache, and the
    next call (any use of the cache after it) failed or read them."""
    eager = _Decoder(_build("llama"))
    mine = _Decoder(copy.deepcopy(eager.lm))
    ids, _ = _prompt()
    prefill = eager(ids)
    mine(ids)  # the prefill runs eagerly: the jitted call finds a cache with tensors in it
    token = prefill[:, -1:].argmax(-1)
    jitted = fulmen.jit(mine)
    with pytest.raises(fulmen.FulmenError, match=r"attribute `keys` of DynamicLayer object \(cache_utils.py:\d+ in "
                                                 r"update\): it stores a tensor computed by the program"):
        jitted(token)
    _same_cache(mine.cache, eager.cache)  # as the prefill left it
    torch.testing.assert_close(mine(token), eager(token))  # and eager can go on with it
    _same_cache(mine.cache, eager.cache)


def test_generate_with_a_kv_cache_is_refused_naming_the_cache_and_the_line():
    """generate gives the forward a DynamicCache to extend in place: refused (it was, naming the argument but no
    line), with the way out."""
    model = _build("llama")
    model.forward = fulmen.jit(model.forward)
    ids, mask = _prompt()
    with pytest.raises(fulmen.FulmenError, match=r"attribute `keys` of DynamicLayer object \(cache_utils.py:\d+ in "
                                                 r"lazy_initialization\).* use_cache=False"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_a_returned_kv_cache_given_back_is_refused_and_left_as_eager_returned_it():
    eager = _build("llama")
    jitted = fulmen.jit(copy.deepcopy(eager))
    ids, mask = _prompt()
    want, got = eager(input_ids=ids, attention_mask=mask), jitted(input_ids=ids, attention_mask=mask)
    _same_cache(got.past_key_values, want.past_key_values)
    token, mask = want.logits[:, -1:].argmax(-1), torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    with pytest.raises(fulmen.FulmenError, match=r"attribute `keys` of DynamicLayer object \(cache_utils.py:\d+ in "
                                                 r"update\)"):
        jitted(input_ids=token, attention_mask=mask, past_key_values=got.past_key_values)
    _same_cache(got.past_key_values, want.past_key_values)


def _static_cache(model: torch.nn.Module) -> StaticCache:
    cache = StaticCache(config=model.config, max_cache_len=16)
    cache.early_initialization(2, 2, 8, torch.float32, torch.device("cpu"))
    return cache


def test_a_static_cache_decodes_as_eager_with_one_trace_per_step_shape():
    """StaticLayer.update copies each step's keys into the cache's preallocated tensors, which the program captured:
    fulmen writes those in-place updates back as an argument's. Logits and the whole cache equal eager's at every
    step, and the decoding steps share one trace (the positions are a tensor)."""
    eager = _build("llama")
    jitted = fulmen.jit(copy.deepcopy(eager))
    caches = [_static_cache(eager), _static_cache(eager)]
    ids, _ = _prompt()
    position = torch.arange(6)
    for step in range(4):
        want = eager(input_ids=ids, past_key_values=caches[0], use_cache=True, cache_position=position).logits
        output = jitted(input_ids=ids, past_key_values=caches[1], use_cache=True, cache_position=position)
        assert output.past_key_values is caches[1]  # as eager returns it
        got = output.logits
        torch.testing.assert_close(got, want, msg=lambda m, s=step: f"step {s}: {m}")
        for mine, theirs in zip(caches[1].layers, caches[0].layers):
            torch.testing.assert_close(mine.keys, theirs.keys, rtol=0, atol=0)
            torch.testing.assert_close(mine.values, theirs.values, rtol=0, atol=0)
        ids, position = want[:, -1:].argmax(-1), position[-1:] + 1
    assert fulmen.cache_misses(jitted) == 2 and fulmen.cache_hits(jitted) == 2  # the prefill, then one per token


def test_generate_with_a_static_cache_gives_eagers_tokens():
    """A StaticCache made ready before generate (`early_initialization`): one made by generate itself allocates its
    tensors inside the first call, a store of new tensors into Python objects, which fulmen refuses."""
    eager = _build("llama")
    model = copy.deepcopy(eager)
    model.forward = fulmen.jit(model.forward)
    ids, mask = _prompt()
    settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                    return_dict_in_generate=True, output_scores=True)
    want = eager.generate(**settings, past_key_values=_static_cache(eager))
    got = model.generate(**settings, past_key_values=_static_cache(model))
    assert torch.equal(got.sequences, want.sequences)
    for mine, theirs in zip(got.scores, want.scores):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(got.past_key_values.layers, want.past_key_values.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=0, atol=0)
    # the cache comes back as itself (a copy was a new object each step: a new trace per token)
    assert fulmen.cache_misses(model.forward) == 2 and fulmen.cache_hits(model.forward) == 3
