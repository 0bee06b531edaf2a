"""scaled_dot_product_attention differentiates a float mask (a learned position bias, as T5 passes it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fulmen


@pytest.mark.parametrize("bias_shape", [(1, 2, 5, 5), (3, 2, 5, 5), (5, 5)])
def test_float_mask_gets_its_grad(bias_shape):
    q, k, v = (torch.randn(3, 2, 5, 4, requires_grad=True) for _ in range(3))
    bias = torch.randn(bias_shape, requires_grad=True)

    def attention(q, k, v, bias):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).square().sum()

    attention(q, k, v, bias).backward()
    want = [t.grad.clone() for t in (q, k, v, bias)]
    for t in (q, k, v, bias):
        t.grad = None
    fulmen.jit(attention)(q, k, v, bias).backward()
    for t, w in zip((q, k, v, bias), want):
        torch.testing.assert_close(t.grad, w)


def test_boolean_mask_and_no_mask_still_differentiate_q_k_v():
    q, k, v = (torch.randn(2, 2, 4, 8, requires_grad=True) for _ in range(3))
    keep = torch.rand(4, 4) > 0.3
    keep[:, 0] = True
    for mask in (keep, None):

        def attention(q, k, v, mask=mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()

        attention(q, k, v).backward()
        want = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        fulmen.jit(attention)(q, k, v).backward()
        for t, w in zip((q, k, v), want):
            torch.testing.assert_close(t.grad, w)
            t.grad = None
