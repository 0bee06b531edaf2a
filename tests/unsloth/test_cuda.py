"""The unsloth kernels compiled for the GPU: each forward and backward against eager in fp32 and bf16 across shapes
(odd sizes, vocabularies above 64k, batch > 1, GQA and partial rotary), and LitGPT Llama-family training steps whose
traces call them, with eager's loss and gradients.

bf16 is judged against fp32 maths on the same bf16 values: the kernels' error must be no larger than eager bf16's
own (both round; eager rounds more often), plus one bf16 rounding of the result's scale.
"""

from __future__ import annotations

import litgpt.model
import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.unsloth import UNSLOTH_SYMBOLS, executor
from tests.models.litgpt_configs import representative_names
from tests.unsloth.helpers import (
    batch,
    check_architecture,
    check_training_step,
    forward_and_loss,
    llama,
    unsloth_calls,
)

pytestmark = pytest.mark.cuda
DTYPES = [torch.float32, torch.bfloat16]


def assert_matches(got: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """`got` (the kernels) and `eager` (torch in the same dtype) against `exact` (fp32 maths, same inputs)."""
    assert got.dtype == eager.dtype and got.shape == eager.shape, what
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, eager, rtol=2e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
        return
    scale = exact.abs().max().clamp_min(1e-12).item()
    ours = (got.float() - exact).abs().max().item()
    theirs = (eager.float() - exact).abs().max().item()
    assert ours <= theirs + 2 ** -8 * scale, f"{what}: error {ours:.3g} vs eager's {theirs:.3g} (scale {scale:.3g})"
    # and element by element: fp32 maths rounded once to bf16 is within a bf16 rounding of each value
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -7, atol=1e-6 * scale, msg=lambda m: f"{what}: {m}")


def run(fn, executors, inputs: list[torch.Tensor], differentiable: int, cotangent: torch.Tensor | None = None):
    """(output, grads of the first `differentiable` inputs, cotangent, the function run) of `fn` jitted with
    `executors` (eager when None)."""
    leaves = [x.detach().requires_grad_(i < differentiable) for i, x in enumerate(inputs)]
    jitted = fulmen.jit(fn, executors=executors) if executors is not None else fn
    out = jitted(*leaves)
    if cotangent is None:
        cotangent = torch.randn_like(out)
    out.backward(cotangent)
    return out.detach(), [x.grad for x in leaves[:differentiable]], cotangent, jitted


def compare(fn, inputs, symbols, what, differentiable: int = 1):
    out, grads, cotangent, jitted = run(fn, ["unsloth"], inputs, differentiable)
    assert unsloth_calls(jitted) == symbols, what
    eager_out, eager_grads, _, _ = run(fn, None, inputs, differentiable, cotangent)
    upcast = [x.float() if x.is_floating_point() else x for x in inputs]
    exact_out, exact_grads, _, _ = run(fn, None, upcast, differentiable, cotangent.float())
    assert_matches(out, eager_out, exact_out, f"{what} forward")
    for index, (got, eager, exact) in enumerate(zip(grads, eager_grads, exact_grads)):
        assert_matches(got, eager, exact, f"{what} grad {index}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "vocab"), [(1, 3), (7, 1000), (8192, 32000), (37, 128256), (5, 262147)])
@pytest.mark.parametrize("reduction", ["mean", "none", "sum"])
def test_cross_entropy(dtype, rows, vocab, reduction):
    logits = (torch.randn(rows, vocab, device="cuda") * 3).to(dtype)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    target[1::3] = -100
    compare(lambda x, t: F.cross_entropy(x, t, reduction=reduction), [logits, target],
            {"unsloth_cross_entropy", "unsloth_cross_entropy_backward"}, f"cross_entropy {rows}x{vocab} {reduction}")


def test_cross_entropy_above_two_billion_elements():
    """Offsets past 2**31 elements (int64 indexing): a 131072-wide vocabulary over 16448 rows, bf16."""
    rows, vocab = 16448, 131072
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    target[-1] = vocab - 1
    f = fulmen.jit(lambda x, t: F.cross_entropy(x, t), executors=["unsloth"])
    loss = f(logits, target)
    loss.backward()
    assert unsloth_calls(f) == {"unsloth_cross_entropy", "unsloth_cross_entropy_backward"}
    last = logits.detach()[-2:].float().requires_grad_()  # the rows past 2**31 elements, against eager
    expected = F.cross_entropy(last, target[-2:], reduction="sum") / rows
    expected.backward()
    torch.testing.assert_close(logits.grad[-2:].float(), last.grad, rtol=2 ** -7, atol=1e-12)
    with torch.no_grad():
        whole = F.cross_entropy(logits.detach().float(), target)
    torch.testing.assert_close(loss.float(), whole, rtol=2 ** -8, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7, 1, 1001), (3, 17, 5632), (4, 2048, 5632)])
def test_swiglu(dtype, shape):
    e, g = (torch.randn(shape, device="cuda").to(dtype) for _ in range(2))
    compare(lambda a, b: executor.swiglu(a, b) * 2, [e, g], {"unsloth_swiglu", "unsloth_swiglu_backward"},
            f"swiglu {shape}", differentiable=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("batch_size", "heads", "seq_len", "head_size", "n_elem", "cos_batch"), [
    (1, 32, 2048, 64, 64, 1),  # TinyLlama's queries
    (4, 4, 2048, 64, 64, 1),  # its grouped keys, batch 4
    (3, 8, 37, 80, 20, 3),  # stablelm's 25% rotary, a cos row per sequence
    (2, 3, 5, 128, 96, 1),  # Phi-4-mini's 75%
])
def test_apply_rope(dtype, batch_size, heads, seq_len, head_size, n_elem, cos_batch):
    cos, sin = litgpt.model.build_rope_cache(seq_len, n_elem, device=torch.device("cuda"))
    cos = (cos + 0.01 * torch.randn(cos_batch, seq_len, n_elem, device="cuda")).to(dtype)
    sin = (sin + 0.01 * torch.randn(cos_batch, seq_len, n_elem, device="cuda")).to(dtype)
    qkv = torch.randn(batch_size, seq_len, heads, head_size, device="cuda").to(dtype)

    def rope(qkv, cos, sin):  # as LitGPT calls it: a transposed view of q or k, sliced to the rotated dims
        return litgpt.model.apply_rope(qkv.transpose(1, 2)[..., :n_elem], cos, sin) * 2

    compare(rope, [qkv, cos, sin], {"unsloth_apply_rope", "unsloth_apply_rope_backward"},
            f"rope {qkv.shape} n={n_elem}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("executors", [["unsloth", "sdpa", "torch"], ["unsloth", "sdpa", "torchcompile", "torch"]],
                         ids=["sdpa", "torchcompile"])
def test_llama_training_step(dtype, executors):
    model = llama("cuda", dtype, n_embd=256, n_head=8, n_query_groups=2, head_size=32, intermediate_size=688,
                  vocab_size=32000, padded_vocab_size=32000, block_size=128)
    idx, targets = batch(model, batch_size=3, seq_len=128, ignored=17)
    # unfused, so the cross-entropy is a call of its own (by default the lm_head and the loss are one fused op)
    unfused = fulmen.JitOptions(fuse_linear_cross_entropy=False)
    jitted = fulmen.jit(forward_and_loss, executors=executors, options=unfused)
    check_training_step(jitted, model, idx, targets, grad_atol=1e-6)
    assert unsloth_calls(jitted) == UNSLOTH_SYMBOLS


@pytest.mark.parametrize("name", representative_names())
def test_every_litgpt_architecture(name):
    check_architecture(name, "cuda")
