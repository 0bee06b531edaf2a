"""A fused attention forward is not rerun for its backward (the output and log-sum-exp are saved), with or without a
mask, unless an activation memory budget asks for it; losses and grads stay eager's.

On CPU eager runs masked and unmasked `F.scaled_dot_product_attention` with its flash kernel, which returns the
log-sum-exp its backward takes, as cuDNN does on an H200: the sdpa executor claims both, the same decision as on the
GPU (the masked call's boolean mask handed over as eager's additive bias).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import fulmen
from fulmen.core.symbol import BoundSymbol
from fulmen.core.trace import Trace
from fulmen.executors import sdpa
from fulmen.transforms.remat import recompute_flops

_SDPA_PRINTED = "torch.nn.functional.scaled_dot_product_attention"


def _leaves(bsyms: list[BoundSymbol]):
    for bsym in bsyms:
        yield bsym
        yield from _leaves(bsym.subsymbols)


def attention_forwards(trace: Trace) -> list[str]:
    """The calls of `trace` that compute an attention forward: a fused kernel's forward, torch's own call, or torch
    autograd rerunning it for its grads."""
    found = []
    for bsym in _leaves(trace.bound_symbols):
        name = bsym.sym.name
        reruns = name == "torch_vjp" and getattr(bsym.args[0], "printed", None) == _SDPA_PRINTED
        if reruns or bsym.sym.printed == _SDPA_PRINTED or (name.startswith("sdpa_") and "_forward" in name):
            found.append(name)
    return found


def _llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _batch(padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 16), generator=generator)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :4] = 0  # left padding: the padded queries of row 0 see no key at all (fully masked rows)
    return ids, mask


def _loss(model: LlamaForCausalLM, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, labels=ids).loss


def _step(fn, model, ids, mask) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = fn(model, ids, mask)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_eagers(got, want) -> None:
    (loss, grads), (want_loss, want_grads) = got, want
    # fp32: the rest of the model (the fused loss, the norms' grads) rounds as fulmen's rules do, within 1e-7
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("padded", [True, False], ids=["padding-mask", "no-padding"])
def test_masked_llama_backward_holds_no_second_attention_forward(padded):
    model = _llama()
    ids, mask = _batch(padded)
    jitted = fulmen.jit(_loss)
    got = _step(jitted, model, ids, mask)
    forward, backward = fulmen.last_traces(jitted)[-1], fulmen.last_backward_traces(jitted)[-1]
    assert attention_forwards(forward) == ["sdpa_cpu_flash_forward"] * 2  # one per layer, the kernel eager runs
    assert attention_forwards(backward) == []
    assert [b.sym.name for b in backward.bound_symbols].count("sdpa_cpu_flash_backward") == 2
    _assert_eagers(got, _step(_loss, model, ids, mask))


def test_a_memory_budget_of_zero_reruns_the_attention_forward():
    model = _llama()
    ids, mask = _batch(padded=True)
    jitted = fulmen.jit(_loss, options=fulmen.JitOptions(activation_memory_budget=0.0))
    got = _step(jitted, model, ids, mask)
    assert "sdpa_cpu_flash_forward" in attention_forwards(fulmen.last_backward_traces(jitted)[-1])
    _assert_eagers(got, _step(_loss, model, ids, mask))


def test_the_dynamo_backend_saves_the_attention_forward_too():
    model = _llama()
    ids, mask = _batch(padded=True)
    backend = fulmen.dynamo.backend()
    compiled = torch.compile(_loss, backend=backend)
    try:
        got = _step(compiled, model, ids, mask)
    finally:
        torch._dynamo.reset()
    backwards = backend.last_backward_traces()
    assert backwards and all(attention_forwards(trace) == [] for trace in backwards)
    assert sum(attention_forwards(trace).count("sdpa_cpu_flash_forward") for trace in backend.last_traces()) == 2
    _assert_eagers(got, _step(_loss, model, ids, mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "2d-bool", "none"])
def test_claimed_attention_equals_eagers_bitwise(mask_kind, dtype):
    """The kernels eager runs, with the mask as eager hands it over: outputs and grads bit for bit."""
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 12, 16, generator=generator).to(dtype).requires_grad_() for _ in range(3))
    keep = torch.rand(2, 1, 12, 12, generator=generator) > 0.4
    keep[1, :, 3] = False  # a query that sees no key
    mask = {"bool": keep, "additive": torch.where(keep, 0.0, -1e4).to(dtype), "2d-bool": keep[0, 0],
            "none": None}[mask_kind]

    def attention(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)

    jitted = fulmen.jit(attention)
    out = jitted(q, k, v, mask)
    cotangent = torch.randn(out.shape, generator=generator).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), cotangent)
    want = attention(q, k, v, mask)
    want_grads = torch.autograd.grad(want, (q, k, v), cotangent)
    assert "sdpa_cpu_flash_forward" in attention_forwards(fulmen.last_traces(jitted)[-1])
    assert attention_forwards(fulmen.last_backward_traces(jitted)[-1]) == []
    assert torch.equal(out, want)
    for got, expected in zip(grads, want_grads):
        assert torch.equal(got, expected)


def test_the_cost_model_knows_a_fused_attention_forwards_flops():
    q = torch.randn(2, 4, 32, 16, requires_grad=True)
    jitted = fulmen.jit(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True))
    jitted(q).sum().backward()
    (call,) = fulmen.last_traces(jitted)[-1].bound_symbols[:1]
    assert call.sym is sdpa.sdpa_cpu_flash_forward
    # two matmuls of 32 x 32 x 16 multiply-adds per batch and head, half of them under the causal mask
    assert recompute_flops(call) == 4 * 2 * 4 * 32 * 32 * 16 // 2
