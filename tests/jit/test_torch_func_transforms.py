"""torch.vmap, torch.func.vmap and torch.func.grad made inside a fulmen.jit program are traced with fulmen's own
transforms: values and grads as eager's. transformers builds its attention masks so (sdpa_mask: four nested
torch.vmaps of the mask function, under torch's TransformGetItemToIndex, which makes `mask[b, kv]` an aten.index)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

import fulmen

# the dims transformers' _vmap_expansion_sdpa maps over: key, query, head, batch (innermost first)
_BHQKV = [(None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)]


def _grads(out: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out.sum(), tensors))


def _masked_scores(scores: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    def mask(batch_idx, head_idx, q_idx, kv_idx):
        return (kv_idx <= q_idx) & padding[batch_idx, kv_idx]  # causal and not padded

    for dims in _BHQKV:
        mask = torch.vmap(mask, in_dims=dims, out_dims=0)
    b, h, q, kv = scores.shape
    with TransformGetItemToIndex():
        allowed = mask(torch.arange(b), torch.arange(h), torch.arange(q), torch.arange(kv))
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)


def test_nested_vmaps_of_a_mask_function_as_transformers_builds_its_mask():
    padding = torch.tensor([[True, True, True, True, True], [False, False, True, True, True]])
    scores = torch.randn(2, 3, 5, 5, requires_grad=True)
    jitted = fulmen.jit(_masked_scores)
    got, want = jitted(scores, padding), _masked_scores(scores, padding)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(_grads(got.nan_to_num(), scores), _grads(want.nan_to_num(), scores), rtol=0, atol=0)
    other = torch.tensor([[True, True, False, True, True], [True, True, True, True, True]])  # a trace input
    torch.testing.assert_close(jitted(scores, other), _masked_scores(scores, other), rtol=0, atol=0, equal_nan=True)
    assert fulmen.cache_misses(jitted) == 1


def test_the_mask_of_transformers_sdpa_mask():
    masking = pytest.importorskip("transformers.masking_utils")

    def program(attention_mask: torch.Tensor) -> torch.Tensor:
        mask_function = masking.and_masks(masking.causal_mask_function,
                                          masking.padding_mask_function(attention_mask.bool()))
        with TransformGetItemToIndex():
            return masking._vmap_expansion_sdpa(mask_function)(
                torch.arange(2), torch.arange(1), torch.arange(6), torch.arange(6))

    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    got, want = fulmen.jit(program)(attention_mask), program(attention_mask)
    assert got.dtype == torch.bool and torch.equal(got, want)


@pytest.mark.parametrize("vmap", [torch.vmap, torch.func.vmap], ids=["torch.vmap", "torch.func.vmap"])
def test_vmap_with_its_options(vmap):
    def program(x, w):
        rows = vmap(lambda r, w: torch.tanh(r @ w) * r.sum(), in_dims=(0, None), out_dims=1, chunk_size=2)(x, w)
        return rows.sin()

    x, w = torch.randn(5, 3, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    got, want = fulmen.jit(program)(x, w), program(x, w)
    torch.testing.assert_close(got, want)
    for g, e in zip(_grads(got, x, w), _grads(want, x, w)):
        torch.testing.assert_close(g, e)


def test_grad_inside_a_program():
    def program(x, y):
        dx, dy = torch.func.grad(lambda a, b: (torch.sin(a) * b).sum(), argnums=(0, 1))(x, y)
        (value, aux) = torch.func.grad(lambda a: ((a**3).sum(), a.mean()), has_aux=True)(y)
        return dx * 2 + dy + value * aux

    x, y = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    got, want = fulmen.jit(program)(x, y), program(x, y)
    torch.testing.assert_close(got, want)
    for g, e in zip(_grads(got, x, y), _grads(want, x, y)):  # through the grads: second order
        torch.testing.assert_close(g, e)


def test_a_transform_made_inside_leaves_torchs_transforms_alone():
    vmapped = fulmen.jit(lambda x: torch.vmap(torch.sin)(x))
    x = torch.randn(3, 2)
    torch.testing.assert_close(vmapped(x), torch.sin(x))
    made = torch.vmap(torch.sin)  # outside fulmen: torch's own
    assert made.__code__.co_filename.endswith("apis.py") and made.__wrapped__ is torch.sin
    torch.testing.assert_close(made(x), torch.sin(x))
