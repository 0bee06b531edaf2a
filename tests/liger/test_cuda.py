"""The liger executor on CUDA: each Liger kernel against eager, fp32 and bf16, and LitGPT training steps through all
of them (run on the device machine: pytest -m cuda tests/liger)."""

from __future__ import annotations

import litgpt.model
import pytest
import torch
import torch.nn.functional as F
from litgpt import GPT

import fulmen
from fulmen.liger import LIGER_SYMBOLS
from fulmen.liger import executor as liger
from tests.liger.test_liger import liger_calls
from tests.models.litgpt_configs import representative_names, shrunk
from tests.unsloth.helpers import check_training_step, forward_and_loss, llama, loss_and_grads

pytestmark = pytest.mark.cuda
# without liger-kernel the executor declines every call (torch runs them) and there is nothing of Liger's to test
pytest.importorskip("liger_kernel")
DTYPES = [torch.float32, torch.bfloat16]
FLCE = {"liger_fused_linear_cross_entropy"}
CROSS_ENTROPY = {"liger_cross_entropy", "liger_cross_entropy_backward"}
LAYERS = LIGER_SYMBOLS - FLCE - CROSS_ENTROPY


def _close(got, eager, exact, what: str) -> None:
    """fp32: eager's values. bf16: no further from the fp32 maths than eager's bf16 is (with a bf16 rounding's
    slack)."""
    if exact is None:
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")
        return
    scale = exact.abs().max().clamp_min(1e-12).item()
    ours, theirs = (got.float() - exact).abs().max().item(), (eager.float() - exact).abs().max().item()
    assert ours <= 2 * theirs + 2 ** -8 * scale, f"{what}: error {ours:.3g} vs eager's {theirs:.3g}"


def _compare(fn, inputs, differentiable, symbols, what, executors=("liger",)):
    results = {}
    for name, dtype_inputs, run_executors in (("ours", inputs, list(executors)), ("eager", inputs, None),
                                              ("exact", [x.float() if x.is_floating_point() else x for x in inputs],
                                               None)):
        leaves = [x.detach().clone().requires_grad_(i < differentiable) for i, x in enumerate(dtype_inputs)]
        jitted = fulmen.jit(fn, executors=run_executors) if run_executors else fn
        out = jitted(*leaves)
        if name == "ours":
            cotangent = torch.randn_like(out)
            assert liger_calls(jitted) == symbols, (what, liger_calls(jitted))
        out.backward(cotangent.to(out.dtype))
        results[name] = [out.detach(), *(x.grad for x in leaves[:differentiable])]
    low = inputs[0].dtype != torch.float32
    for index, (got, eager, exact) in enumerate(zip(results["ours"], results["eager"], results["exact"])):
        _close(got, eager, exact if low else None, f"{what} output {index}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("add_unit_offset", [False, True])
def test_rms_norm(dtype, add_unit_offset):
    norm = litgpt.model.RMSNorm(1000, add_unit_offset=add_unit_offset).cuda()
    weight = torch.randn(1000, device="cuda").to(dtype)
    x = torch.randn(4, 33, 1000, device="cuda").to(dtype)
    _compare(lambda x, w: liger.rms_norm(x, w, -1, norm.eps, add_unit_offset), [x, weight], 2,
             {"liger_rms_norm", "liger_rms_norm_backward"}, f"rms_norm {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype):
    e, g = (torch.randn(4, 33, 688, device="cuda").to(dtype) for _ in range(2))
    _compare(lambda e, g: liger.swiglu(e, g) * 2, [e, g], 2, {"liger_swiglu", "liger_swiglu_backward"},
             f"swiglu {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cos_batch", [1, 3])
def test_rope(dtype, cos_batch):
    angles = torch.randn(cos_batch, 64, 16, device="cuda").repeat(1, 1, 2)
    qkv = torch.randn(3, 64, 8, 48, device="cuda").to(dtype)

    def rope(qkv, cos, sin):  # as LitGPT calls it: a transposed view of q sliced to the rotated dims
        return litgpt.model.apply_rope(qkv.transpose(1, 2)[..., :32], cos, sin) * 2

    _compare(rope, [qkv, angles.cos().to(dtype), angles.sin().to(dtype)], 1,
             {"liger_apply_rope", "liger_apply_rope_backward"}, f"rope {dtype} cos batch {cos_batch}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(dtype, reduction):
    logits = torch.randn(300, 32000, device="cuda").to(dtype)
    target = torch.randint(0, 32000, (300,), device="cuda")
    target[::7] = -100
    _compare(lambda x, t: F.cross_entropy(x, t, reduction=reduction), [logits, target], 1, CROSS_ENTROPY,
             f"cross_entropy {dtype} {reduction}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_linear_cross_entropy(dtype, reduction):
    h, w, b = torch.randn(2, 300, 256, device="cuda"), torch.randn(32000, 256, device="cuda") / 16, \
        torch.randn(32000, device="cuda")
    target = torch.randint(0, 32000, (2, 300), device="cuda")
    target[:, ::5] = -100

    def loss(h, w, b, t):
        return F.cross_entropy(F.linear(h, w, b).float().flatten(0, 1), t.flatten(), reduction=reduction)

    _compare(loss, [h.to(dtype), w.to(dtype), b.to(dtype), target], 3, FLCE, f"flce {dtype} {reduction}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("executors", [["liger", "sdpa", "torch"], ["liger", "sdpa", "torchcompile", "torch"]],
                         ids=["sdpa", "torchcompile"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused_loss", "unfused_loss"])
def test_llama_training_step(dtype, executors, fuse):
    model = llama("cuda", dtype, n_embd=256, n_head=8, n_query_groups=2, head_size=32, intermediate_size=688,
                  vocab_size=32000, padded_vocab_size=32000, block_size=128)
    idx, targets = (torch.randint(0, 32000, (3, 128), device="cuda") for _ in range(2))
    targets[:, :17] = -100

    jitted = fulmen.jit(forward_and_loss, executors=executors,
                        options=fulmen.JitOptions(fuse_linear_cross_entropy=fuse))
    check_training_step(jitted, model, idx, targets, grad_atol=1e-5)
    assert liger_calls(jitted) == LAYERS | (FLCE if fuse else CROSS_ENTROPY)


@pytest.mark.parametrize("name", representative_names())
def test_every_litgpt_architecture(name):
    """Every LitGPT architecture (shrunk, fp32) trains through the Liger kernels that apply to it with eager's loss
    and gradients."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(shrunk(name))
    vocab = model.config.padded_vocab_size
    idx, targets = (torch.randint(0, vocab, (2, 16), device="cuda") for _ in range(2))

    # the module itself is jitted (LitGPT's mixture of experts is traced through the module's lookaside), the loss apart
    jitted = fulmen.jit(model, executors=["liger", "torch"])
    loss_fn = fulmen.jit(lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()), executors=["liger"])
    loss, grads = loss_and_grads(lambda m, x, t: loss_fn(jitted(x), t), model, idx, targets)
    assert liger.liger_cross_entropy.name in liger_calls(loss_fn)
    expected_loss, expected = loss_and_grads(forward_and_loss, model, idx, targets)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    for key, grad in expected.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
