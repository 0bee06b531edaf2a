"""`x.requires_grad = True` / `x.requires_grad_()` on a view inside the program (Hugging Face's Wav2Vec2 feature
encoder does it to `input_values[:, None]` in training), as eager: the view becomes a leaf of autograd, what is
computed from it requires grad, its grad goes no further; eager's errors for a non-leaf and for an in-place update of
the leaf; a later in-place update of the memory it shares refused, naming both lines."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import fulmen

W = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))


def _view_made_leaf(x, w):
    v = x[:, None]
    v.requires_grad = True
    return (v @ w).sum(), v.requires_grad, v.is_leaf


def _view_of_a_computed_value(x, w):
    v = (x * 2).t()
    v.requires_grad_()
    return (w @ v).tanh().sum()


def _view_made_leaf_then_viewed(x, w):
    v = x.unsqueeze(0)
    v.requires_grad_(True)
    return (v[0] @ w).sum() + v.sum()


@pytest.mark.parametrize("fn", [_view_made_leaf, _view_of_a_computed_value, _view_made_leaf_then_viewed])
def test_a_view_made_a_leaf_gives_eagers_values_flags_and_grads(fn):
    x = torch.randn(4, 3)
    w_eager, w_ours = W.clone().requires_grad_(), W.clone().requires_grad_()
    want, got = fn(x, w_eager), fulmen.jit(fn)(x, w_ours)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    assert [type(g) for g in got] == [type(w) for w in want]
    assert all(g == w if not isinstance(w, torch.Tensor) else torch.equal(g, w) for g, w in zip(got, want))
    assert got[0].requires_grad
    want[0].backward()
    got[0].backward()
    assert torch.equal(w_ours.grad, w_eager.grad)


def _assign_on_a_non_leaf(x, w):
    h = x @ w
    h.requires_grad = True  # eager's setter refuses a tensor with a history (requires_grad_(True) would not)
    return h.sum()


def _update_the_leaf_view(x, w):
    v = x[:, None]
    v.requires_grad = True
    v.mul_(2)
    return (v @ w).sum()


@pytest.mark.parametrize("fn", [_assign_on_a_non_leaf, _update_the_leaf_view])
def test_eagers_errors(fn):
    w = W.clone().requires_grad_()
    with pytest.raises(RuntimeError) as eager:
        fn(torch.randn(4, 3), w)
    with pytest.raises(RuntimeError) as ours:
        fulmen.jit(fn)(torch.randn(4, 3), w)
    assert type(ours.value) is type(eager.value) and str(ours.value) == str(eager.value)


def _update_the_base_after(x, w):
    v = x[:, None]
    v.requires_grad = True
    x.mul_(2)  # eager's leaf sees the new values through the memory it shares
    return (v @ w).sum()


def test_an_update_of_the_memory_a_leaf_view_shares_is_refused_naming_both_lines():
    with pytest.raises(
        fulmen.TraceError,
        match=r"(?s)shares its memory with a view it made a leaf.*"
        r"v.requires_grad = True.*x.mul_\(2\)",
    ):
        fulmen.jit(_update_the_base_after)(torch.randn(4, 3), W.clone().requires_grad_())


def _tiny_wav2vec2() -> torch.nn.Module:
    config = transformers.Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        num_labels=3,
        mask_time_prob=0.0,
        layerdrop=0.0,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,
        feat_proj_dropout=0.1,
        final_dropout=0.1,
    )
    torch.manual_seed(0)
    return transformers.Wav2Vec2ForSequenceClassification(config).train()  # the feature encoder not frozen


def test_a_tiny_wav2vec2_trains_as_eager_without_freezing_its_feature_encoder():
    eager = _tiny_wav2vec2()
    ours = copy.deepcopy(eager)
    jitted = fulmen.jit(ours)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    ours_opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    for step in range(2):
        audio = torch.randn(2, 400, generator=torch.Generator().manual_seed(step))
        labels = torch.tensor([step % 3, 2])
        torch.manual_seed(10 + step)  # the same dropout draws
        want = eager(input_values=audio, labels=labels).loss
        torch.manual_seed(10 + step)
        got = jitted(input_values=audio, labels=labels).loss
        assert torch.equal(got, want)
        want.backward()
        got.backward()
        for (name, p), q in zip(eager.named_parameters(), ours.parameters()):
            assert (q.grad is None) == (p.grad is None), name
            assert p.grad is None or torch.equal(q.grad, p.grad), name
        assert eager.wav2vec2.feature_extractor.conv_layers[0].conv.weight.grad is not None
        for opt in (eager_opt, ours_opt):
            opt.step()
            opt.zero_grad()
