"""A Hugging Face Llama trains on CUDA in bf16 with a padding mask through fulmen.jit and the Dynamo backend with
eager's losses (run on the device machine: pytest -m cuda)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fulmen


def _model() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)


def _losses(loss_fn, model, steps: int = 4) -> list[float]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1024, (4, 256), generator=generator).cuda()
    mask = torch.ones_like(ids)
    mask[0, :32] = 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    losses = []
    for _ in range(steps):
        loss = loss_fn(model, ids, mask)
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _forward_and_loss(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask, labels=ids).loss


@pytest.mark.cuda
@pytest.mark.parametrize("how", ["fulmen.jit", "fulmen.dynamo"])
def test_hf_llama_trains_like_eager_on_cuda(how):
    want = _losses(_forward_and_loss, _model())
    if how == "fulmen.jit":
        compiled = fulmen.jit(_forward_and_loss)
    else:
        torch._dynamo.reset()
        backend = fulmen.dynamo.backend()
        compiled = torch.compile(_forward_and_loss, backend=backend)
    got = _losses(compiled, _model())
    assert got[0] == pytest.approx(want[0], rel=2e-3)  # same weights: bf16 kernel rounding only
    assert got == pytest.approx(want, rel=2e-2)
    assert got[-1] < got[0]
    if how == "fulmen.dynamo":
        assert all(piece.by_fulmen for piece in backend.pieces), backend.report()


@pytest.mark.cuda
def test_hf_gpt2_trains_with_attention_dropout_like_eager_on_cuda():
    """GPT-2's default config drops out attention probabilities, residuals and embeddings: in train() mode fulmen's
    loss and grads must be eager's on the same seed (the fused attention kernel's own draw replayed in its
    backward)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=512, n_positions=128, n_embd=128, n_layer=2, n_head=4, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(device="cuda").train()
    assert config.attn_pdrop > 0 and config.resid_pdrop > 0
    ids = torch.randint(0, 512, (4, 128), device="cuda")

    def loss_fn(model, ids):
        return model(input_ids=ids, labels=ids).loss

    results = []
    for fn, seed in ((loss_fn, 3), (fulmen.jit(loss_fn), 3), (loss_fn, 4)):
        torch.manual_seed(seed)
        loss = fn(model, ids)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        results.append((loss, grads))
    (want, want_grads), (got, got_grads), (other, _) = results
    assert not torch.allclose(other, want, rtol=1e-4, atol=0)  # the masks matter at this tolerance
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # float32: kernels fused otherwise than eager's
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
