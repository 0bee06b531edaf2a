"""Grouped-query attention without repeated heads (fulmen.transforms.grouped_attention) against eager.

- CPU: with the kernel check forced (a Transform at the acquired stage, the public hook), LitGPT GQA and MQA models
  give eager's loss and grads (float64) while their final traces call sdpa with `enable_gqa=True` and repeat no head.
- Declines, with the reason in the provenance: on CPU (torch's math kernel), heads repeated along another dim, only
  one of key and value repeated, a mask; a model with as many key/value heads as query heads is left alone silently;
  the pass runs by default and not with `JitOptions(grouped_query_attention=False)`.
- CUDA: the grouped call runs eager's kernel (cuDNN on Hopper) and equals eager's own grouped call bit for bit;
  a LitGPT GQA model's loss and grads stay eager's (bf16 tolerance).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from litgpt import GPT, Config

import fulmen
from fulmen.transforms.grouped_attention import PROVENANCE, group_query_attention

SDPA = "torch.nn.functional.scaled_dot_product_attention"
REPEATED = fulmen.JitOptions(grouped_query_attention=False)


class ForcedGrouping(fulmen.Transform):
    """The pass with its kernel check answering yes: what CUDA's selector says, on CPU."""

    def transform_acquired(self, trace):
        return group_query_attention(trace, kernel_of=lambda *args: True)


def _model(n_query_groups: int, dtype=torch.float64, device="cpu") -> GPT:
    torch.manual_seed(0)
    config = Config(n_layer=2, n_head=8, n_query_groups=n_query_groups, n_embd=64, block_size=32, vocab_size=100,
                    padded_vocab_size=100, bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
                    intermediate_size=128)
    with torch.device(device):
        return GPT(config).to(dtype)


def _loss(model, x):
    return F.cross_entropy(model(x).flatten(0, 1), x.flatten())


def _grads(model) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _calls(trace, name: str):
    return [b for b in trace.bound_symbols if b.sym.printed == name or b.sym.name == name]


def _grouping_note(jitted) -> str | None:
    notes = [t.provenance for t in fulmen.last_traces(jitted) if t.provenance.startswith(PROVENANCE)]
    return notes[0] if notes else None


@pytest.mark.parametrize("n_query_groups", [2, 1], ids=["gqa", "mqa"])
def test_grouped_calls_give_eagers_loss_and_grads(n_query_groups):
    model = _model(n_query_groups)
    x = torch.randint(0, 100, (2, 16))
    jitted = fulmen.jit(_loss, options=fulmen.JitOptions(transforms=[ForcedGrouping()]))
    loss = jitted(model, x)
    loss.backward()
    grads = _grads(model)
    expected = _loss(model, x)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    for got, want in zip(grads, _grads(model)):  # float64: torch's CPU attention kernels differ by ~1e-9 anyway
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-8)
    acquired, final = fulmen.last_traces(jitted)[0], fulmen.last_traces(jitted)[-1]
    assert len(_calls(acquired, "repeat_interleave")) == 4  # k and v of both layers, before the pass
    assert not _calls(final, "repeat_interleave")
    calls = _calls(final, SDPA)
    assert len(calls) == 2 and all(call.kwargs.get("enable_gqa") is True for call in calls)
    assert all(call.args[1].shape[1] == n_query_groups for call in calls)  # the model's own key heads


def test_declined_on_cpu_with_the_reason_and_left_alone_without_repeats():
    x = torch.randint(0, 100, (2, 16))
    jitted = fulmen.jit(_loss)
    jitted(_model(2), x)
    assert "torch would not run the grouped call with the kernel of the repeated one" in _grouping_note(jitted)
    assert all(not c.kwargs.get("enable_gqa") for t in fulmen.last_traces(jitted) for c in _calls(t, SDPA))
    mha = fulmen.jit(_loss)
    mha(_model(8), x)  # as many key/value heads as query heads: nothing repeated, nothing to say
    assert _grouping_note(mha) is None
    off = fulmen.jit(_loss, options=REPEATED)
    off(_model(2), x)
    assert _grouping_note(off) is None  # the pass does not run


@pytest.mark.parametrize(("shapes", "repeat", "reason"), [
    (((2, 1, 32, 4), (2, 1, 8, 4), (2, 1, 8, 4)),
     lambda k, v: (k.repeat_interleave(4, dim=2), v.repeat_interleave(4, dim=2)), "other than the heads"),
    (((2, 4, 8, 4), (2, 1, 8, 4), (2, 1, 8, 4)),
     lambda k, v: (k.repeat_interleave(4, dim=1), v.expand(2, 4, 8, 4)), "only one of"),
    (((2, 4, 8, 4), (2, 2, 8, 4), (2, 1, 8, 4)),
     lambda k, v: (k.repeat_interleave(2, dim=1), v.repeat_interleave(4, dim=1)), "not repeated once per query"),
], ids=["sequence-dim", "value-expanded", "different-repeats"])
def test_other_repeats_are_declined_with_their_reason(shapes, repeat, reason):
    def attention(q, k, v):
        k, v = repeat(k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (torch.randn(shape, dtype=torch.float64) for shape in shapes)
    jitted = fulmen.jit(attention)  # these reasons come before the kernel check
    torch.testing.assert_close(jitted(q, k, v), attention(q, k, v))
    assert reason in _grouping_note(jitted)
    assert all(not c.kwargs.get("enable_gqa") for c in _calls(fulmen.last_traces(jitted)[-1], SDPA))


def test_a_mask_is_declined():
    def attention(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)

    q, k, v = torch.randn(1, 4, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    mask = torch.rand(8, 8) > 0.3
    jitted = fulmen.jit(attention)
    torch.testing.assert_close(jitted(q, k, v, mask), attention(q, k, v, mask))
    assert "attention mask or dropout" in _grouping_note(jitted)


# ---- CUDA (run on the device machine: pytest -m cuda tests/transforms) -------------------------------------------
@pytest.mark.cuda
def test_cuda_grouped_call_is_eagers_grouped_call_bit_for_bit():
    torch.manual_seed(0)
    q = torch.randn(2, 16, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cotangent = torch.randn(2, 16, 512, 64, device="cuda", dtype=torch.bfloat16)

    def repeated(q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)

    def run(fn):
        q.grad = k.grad = v.grad = None
        out = fn(q, k, v)
        out.backward(cotangent)
        return out.detach(), q.grad, k.grad, v.grad

    jitted = fulmen.jit(repeated)
    ours = run(jitted)
    grouped = run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    eager = run(repeated)
    for got, want in zip(ours, grouped):
        assert torch.equal(got, want)
    for got, want in zip(ours, eager):  # the key/value gradients sum the query heads in another order
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)
    final = fulmen.last_traces(jitted)[-1]
    assert not _calls(final, "repeat_interleave") and "grouped at" in _grouping_note(jitted)
    assert {b.sym.name for b in final.bound_symbols} & {"sdpa_cudnn_forward", "sdpa_flash_forward"}


@pytest.mark.cuda
def test_cuda_litgpt_gqa_model_keeps_eagers_loss_and_grads():
    model = _model(2, torch.bfloat16, "cuda")
    x = torch.randint(0, 100, (4, 32), device="cuda")
    grouped, repeated = fulmen.jit(_loss), fulmen.jit(_loss, options=REPEATED)
    results = []
    for fn in (grouped, repeated, _loss):
        loss = fn(model, x)
        loss.backward()
        results.append((loss.detach(), _grads(model)))
    assert "grouped at" in _grouping_note(grouped)
    for loss, grads in results[:2]:
        torch.testing.assert_close(loss, results[2][0], rtol=1e-2, atol=0)
        for got, want in zip(grads, results[2][1]):
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2e-3)
