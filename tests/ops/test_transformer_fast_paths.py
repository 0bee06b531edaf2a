"""nn.TransformerEncoder, nn.TransformerEncoderLayer and nn.MultiheadAttention take eager's path: with a grad to
compute, the composite one (values and grads bit for bit); in eval with none, eager's fused kernels (bit for bit);
the encoder's nested-tensor fast path (eval, src_key_padding_mask, no grad) refused, naming what to change."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fulmen

X = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))
PADDING = torch.tensor([[False] * 5 + [True], [False] * 3 + [True] * 3])  # padded at the end of each row


def _encoder(**options) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, **options).eval()


def _encode(encoder):
    return lambda x, padding: encoder(x, src_key_padding_mask=padding)


def _attend(attention):
    return lambda x, padding: attention(x, x, x, key_padding_mask=padding)[0]


def test_in_eval_with_grads_to_compute_it_gives_eagers_values_and_grads():
    encoder = _encoder()  # its weights require grad: eager takes the composite path, whatever the mask
    want = _encode(encoder)(X, PADDING)
    want_grads = torch.autograd.grad(want.square().sum(), list(encoder.parameters()))
    got = fulmen.jit(_encode(encoder))(X, PADDING)
    got_grads = torch.autograd.grad(got.square().sum(), list(encoder.parameters()))
    assert torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))


def test_in_training_it_gives_eagers_values():
    encoder = _encoder().train()
    assert torch.equal(fulmen.jit(_encode(encoder))(X, PADDING), _encode(encoder)(X, PADDING))


@pytest.mark.parametrize(
    "make",
    [
        lambda: _encode(_encoder(enable_nested_tensor=False)),
        lambda: _encode(_encoder().layers[0]),
        lambda: _attend(_encoder().layers[0].self_attn),
    ],
    ids=["encoder_without_nested_tensors", "encoder_layer", "multihead_attention"],
)
def test_without_grads_eagers_fused_kernels_run(make):
    fn = make()
    with torch.no_grad():
        want, got = fn(X, PADDING), fulmen.jit(fn)(X, PADDING)
    assert torch.equal(got, want)


@pytest.mark.parametrize("grad", ["no_grad", "frozen_weights"])
def test_the_nested_tensor_fast_path_is_refused_naming_what_to_change(grad):
    encoder = _encoder()
    if grad == "frozen_weights":
        encoder.requires_grad_(False)
    context = torch.no_grad() if grad == "no_grad" else torch.enable_grad()
    with context:
        want = _encode(encoder)(X, PADDING)
        assert want[1, 3:].abs().max() == 0  # eager's nested path: zeros where padded
        with pytest.raises(
            fulmen.UnsupportedOpError,
            match=r"(?s)nested-tensor fast path.*left-aligned.*enable_nested_tensor=False.*"
            r"set_fastpath_enabled\(False\).*test_transformer_fast_paths\.py",
        ):
            fulmen.jit(_encode(encoder))(X, PADDING)


def test_with_the_fast_path_disabled_it_gives_eagers_values():
    encoder = _encoder()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            want, got = _encode(encoder)(X, PADDING), fulmen.jit(_encode(encoder))(X, PADDING)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert torch.equal(got, want)
