"""LitGPT's finetuning models (LoRA, Adapter, Adapter v2) under fulmen.jit match eager: losses, which parameters get
grads and their values, AdamW steps over accumulated micro-batches, freeze schedules, train/eval, merged LoRA weights,
KV-cache decoding, and the buffers LoRA registers on its first call (tiny fp32 models; eager is the oracle)."""

from __future__ import annotations

import copy
from dataclasses import asdict

import pytest
import torch
from litgpt import adapter, adapter_v2, lora

import fulmen
from tests.models.litgpt_configs import shrunk

VOCAB = 96
TINY = dict(n_layer=2, n_embd=32, n_head=4, n_query_groups=2, head_size=8, intermediate_size=64)


def _config(module, name: str = "Llama-3.1-8B", **extra):
    fields = {k: v for k, v in asdict(shrunk(name)).items() if k in module.Config.__dataclass_fields__ and k != "name"}
    return module.Config(**{**fields, **TINY, **extra})


def _lora_pair(dropout: float) -> tuple[lora.GPT, lora.GPT]:
    """A LoRA model on every weight but the keys (LitGPT's default: the QKV layer pads with `lora_ind`), with
    nonzero B so that LoRA changes the output, only LoRA trainable; and a copy of it."""
    config = _config(lora, lora_r=4, lora_alpha=8, lora_dropout=dropout, lora_query=True, lora_key=False,
                     lora_value=True, lora_projection=True, lora_mlp=True, lora_head=True)
    torch.manual_seed(0)
    model = lora.GPT(config)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    lora.mark_only_lora_as_trainable(model)
    return model, copy.deepcopy(model)


def _loss(model, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), targets.flatten())


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (2, 9), generator=generator), torch.randint(0, VOCAB, (2, 9), generator=generator))
            for _ in range(n)]


def _same_step(eager, compiled, run_compiled, batches, seed: int) -> None:
    """One optimizer step's forward and backward over `batches` (accumulated): losses and grads as eager's."""
    for k, (idx, targets) in enumerate(batches):
        torch.manual_seed(seed + k)  # LoRA dropout draws as eager's
        expected = _loss(eager, idx, targets) / len(batches)
        expected.backward()
        torch.manual_seed(seed + k)
        got = _loss(run_compiled, idx, targets) / len(batches)
        got.backward()
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    _same_grads(eager, compiled, atol=1e-7)


def _same_grads(eager, compiled, atol: float) -> None:
    """A grad on exactly the parameters eager gives one (frozen ones keep `.grad is None`), equal to eager's."""
    for (name, want), (_, have) in zip(eager.named_parameters(), compiled.named_parameters()):
        assert (have.grad is None) == (want.grad is None), name
        if want.grad is not None:
            torch.testing.assert_close(have.grad, want.grad, rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def _same_buffers(eager, compiled) -> None:
    """The same buffers by name and value, each its own tensor (two layers' `lora_ind` are two tensors in eager)."""
    want, have = dict(eager.named_buffers(remove_duplicate=False)), dict(compiled.named_buffers(remove_duplicate=False))
    assert list(have) == list(want)
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=0, atol=0)
    assert len({id(t) for t in have.values()}) == len(have)


def test_lora_finetuning_matches_eager():
    eager, compiled = _lora_pair(0.1)  # dropout 0 (no Dropout module): test_lora_model_given_to_a_jitted_loss
    jitted = fulmen.jit(compiled)
    trainable = [n for n, p in eager.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (eager, compiled)]
    batches = _batches(6)
    for step in range(3):  # two micro-batches per step
        _same_step(eager, compiled, jitted, batches[2 * step: 2 * step + 2], seed=10 * step)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for (name, want), (_, have) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # the QKV layers' `lora_ind`, registered by their first call, are the module's from then on, as in eager
    _same_buffers(eager, compiled)

    idx = batches[0][0]
    for model in (eager, compiled):
        model.eval()
    with torch.no_grad():
        torch.testing.assert_close(jitted(idx), eager(idx), rtol=1e-5, atol=1e-6)
        for model in (eager, compiled):
            lora.merge_lora_weights(model)
        # the merged weights (and `merged`, which skips the LoRA branch) are what the jitted model reads now
        torch.testing.assert_close(jitted(idx), eager(idx), rtol=1e-5, atol=1e-6)


def test_lora_freeze_schedule_and_train_eval_toggles():
    """requires_grad toggled between calls: exactly eager's parameters get grads; eval() turns LoRA dropout off."""
    eager, compiled = _lora_pair(0.2)
    jitted = fulmen.jit(compiled)
    batches = _batches(4)

    def unfreeze(model):
        model.lm_head.linear.weight.requires_grad_(True)
        model.transformer.h[0].attn.qkv.lora_A.requires_grad_(False)

    for k, change in enumerate((None, unfreeze, lora.mark_only_lora_as_trainable, "eval")):
        for model in (eager, compiled):
            if change == "eval":
                model.eval()
            elif change is not None:
                change(model)
        _same_step(eager, compiled, jitted, batches[k: k + 1], seed=k)
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)


def test_lora_kv_cache_decoding_matches_eager():
    eager, compiled = _lora_pair(0.1)
    for model in (eager, compiled):
        model.eval()
        model.set_kv_cache(batch_size=2)
    jitted = fulmen.jit(compiled)
    generator = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        prompt = torch.randint(0, VOCAB, (2, 5), generator=generator)
        torch.testing.assert_close(jitted(prompt, input_pos=torch.arange(5)), eager(prompt, input_pos=torch.arange(5)),
                                   rtol=1e-5, atol=1e-6)
        for position in range(5, 8):
            token, at = torch.randint(0, VOCAB, (2, 1), generator=generator), torch.tensor([position])
            torch.testing.assert_close(jitted(token, input_pos=at), eager(token, input_pos=at), rtol=1e-5, atol=1e-6)
    _same_buffers(eager, compiled)
    # prefill (registering `lora_ind`), then one decoding trace for every step
    assert fulmen.cache_misses(jitted) == 2 and fulmen.cache_hits(jitted) == 2


def test_lora_model_given_to_a_jitted_loss():
    """The model as an argument of a jitted `forward_and_loss` (as fulmen.pretrain jits it): the `lora_ind` its first
    call registers is a real tensor on the model afterwards, not the trace's stand-in."""
    eager, compiled = _lora_pair(0.0)
    step = fulmen.jit(_loss)
    for idx, targets in _batches(3):
        expected = _loss(eager, idx, targets)
        expected.backward()
        got = step(compiled, idx, targets)
        got.backward()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    _same_grads(eager, compiled, atol=1e-6)
    _same_buffers(eager, compiled)
    assert fulmen.cache_misses(step) == 2  # the call that registered the buffers, then one trace reading them


def test_adapter_v2_finetuning_matches_eager():
    """Adapter v2's linears and norms (no adapter-prompt layers: see the next test), AdamW steps as eager's."""
    config = _config(adapter_v2, adapter_prompt_length=4, adapter_start_layer=TINY["n_layer"])
    torch.manual_seed(0)
    eager = adapter_v2.GPT(config)
    for name, param in eager.named_parameters():
        if "adapter_" in name:
            torch.nn.init.normal_(param, mean=float("scale" in name), std=0.3)
    adapter_v2.mark_only_adapter_v2_as_trainable(eager)
    compiled = copy.deepcopy(eager)
    jitted = fulmen.jit(compiled)
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (eager, compiled)]
    for step, batch in enumerate(_batches(3)):
        _same_step(eager, compiled, jitted, [batch], seed=step)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for (name, want), (_, have) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("variant", [adapter, adapter_v2], ids=["adapter", "adapter_v2"])
def test_adapter_prompt_cache_is_refused_naming_litgpts_line(variant):
    """Adapter attention stores its prompt's keys and values in `adapter_kv_cache` on every call with grad (LitGPT
    issue #1287: eager's second training step fails on the freed graph). A trace cannot store a tensor it computed
    into the module, so fulmen refuses at the first call, naming LitGPT's line, and leaves the module as it was."""
    torch.manual_seed(0)
    model = variant.GPT(_config(variant, adapter_prompt_length=4, adapter_start_layer=1))
    mark = (adapter.mark_only_adapter_as_trainable if variant is adapter
            else adapter_v2.mark_only_adapter_v2_as_trainable)
    mark(model)
    idx = _batches(1)[0][0]
    with pytest.raises(fulmen.TraceError, match=r"adapter_kv_cache.*adapter\.py:\d+") as error:
        fulmen.jit(model)(idx)
    assert "self.adapter_kv_cache = (ak, av)" in str(error.value)
    assert model.transformer.h[1].attn.adapter_kv_cache is None
    model(idx).sum().backward()  # the module still runs eagerly


def test_lora_dropout_inside_mixture_of_experts_is_refused_and_eval_matches():
    """fulmen runs each expert on every token (routing is data-dependent); eager draws an expert's LoRA dropout mask
    for its routed tokens only, so a trace cannot draw eager's mask: refused, naming LitGPT's dropout line. Without
    draws (eval) the model matches eager."""
    config = _config(lora, "Mixtral-8x7B-v0.1", lora_r=2, lora_alpha=4, lora_dropout=0.1, lora_query=True,
                     lora_value=True, lora_mlp=True)
    torch.manual_seed(0)
    model = lora.GPT(config)
    lora.mark_only_lora_as_trainable(model)
    jitted = fulmen.jit(model)
    idx = _batches(1)[0][0]
    with pytest.raises(fulmen.UnsupportedOpError, match=r"LLaMAMoE when an expert draws random numbers.*lora\.py:\d+"):
        jitted(idx)
    model.eval()
    torch.testing.assert_close(jitted(idx), model(idx), rtol=1e-5, atol=1e-6)
