"""The liger executor without a GPU.

- Importing fulmen does not import liger-kernel; naming "liger" finds the executor, even without liger-kernel.
- On CPU its checkers decline every kernel with a reason (a warning per kernel): a LitGPT training step runs as without
  the executor, with eager's loss and gradients.
- Under Triton's interpreter (TRITON_INTERPRET=1, set by the root conftest) Liger's fused linear + cross-entropy,
  cross-entropy and RoPE kernels run on CPU through the executor and match eager's losses and gradients; its RMSNorm
  and SwiGLU kernels do not run there and are declined.
- The restatements of LitGPT's code the lookasides trace equal LitGPT's own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import litgpt.model
import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.liger import LIGER_SYMBOLS, decline_reason
from fulmen.liger import executor as liger
from fulmen.unsloth.executor import forward_fingerprint
from tests.transforms.test_fused_loss import check
from tests.unsloth.helpers import forward_and_loss, llama, loss_and_grads

FLCE = {"liger_fused_linear_cross_entropy"}
CROSS_ENTROPY = {"liger_cross_entropy", "liger_cross_entropy_backward"}
ROPE = {"liger_apply_rope", "liger_apply_rope_backward"}
ORIGINAL_APPLY_ROPE = litgpt.model.apply_rope


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=environ,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_imports_without_liger_kernel_and_declines_with_the_reason():
    result = _run("""
        import sys, warnings
        sys.modules["liger_kernel"] = None  # `import liger_kernel` raises ImportError
        import torch, fulmen
        assert "fulmen.liger" not in sys.modules
        liger = fulmen.get_executor("liger")  # the name alone imports fulmen.liger
        import fulmen.liger
        assert liger is fulmen.liger.liger_ex
        f = fulmen.jit(lambda x, t: torch.nn.functional.cross_entropy(x, t), executors=["liger"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print(f(torch.zeros(2, 3), torch.tensor([0, 2])).item())
        print([str(w.message) for w in caught])
    """, TRITON_INTERPRET="1")
    assert result.returncode == 0, result.stderr
    value, messages = result.stdout.splitlines()
    assert float(value) == pytest.approx(1.0986123)  # log 3
    assert "does not run cross-entropy: liger-kernel is not importable" in messages
    assert "pip install 'fulmen[liger]'" in messages


def test_on_cpu_every_checker_declines_with_a_reason():
    """Without Triton's interpreter: a LitGPT Llama step with the liger executor is eager's, with a warning per
    kernel saying why it did not run."""
    result = _run("""
        import warnings, torch, fulmen
        import torch.nn.functional as F
        from litgpt import GPT
        from tests.liger.test_liger import liger_calls
        from tests.unsloth.helpers import llama, loss_and_grads
        model = llama()
        idx, targets = torch.randint(0, 301, (2, 12)), torch.randint(0, 301, (2, 12))
        for fuse in (True, False):
            options = fulmen.JitOptions(fuse_linear_cross_entropy=fuse)
            step = fulmen.jit(lambda m, x, t: F.cross_entropy(m(x).flatten(0, 1), t.flatten()),
                              executors=["liger", "sdpa", "torch"], options=options)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss, grads = loss_and_grads(step, model, idx, targets)
            expected_loss, expected = loss_and_grads(lambda m, x, t: F.cross_entropy(m(x).flatten(0, 1), t.flatten()),
                                                     model, idx, targets)
            torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
            for name in expected:
                torch.testing.assert_close(grads[name], expected[name], rtol=1e-5, atol=1e-6)
            assert not liger_calls(step), liger_calls(step)
            for message in sorted({str(w.message) for w in caught}):
                print(message)
        import sys
        assert "liger_kernel" not in sys.modules  # nothing ran: never imported
        from fulmen.liger import decline_reason
        print(decline_reason("RoPE", torch.zeros(1)))
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for kernel in ("fused linear + cross-entropy", "cross-entropy", "RMSNorm", "RoPE", "SwiGLU"):
        assert f"the liger executor does not run {kernel}: Liger's kernels run on CUDA tensors, these are on ['cpu']; "\
               "torch runs it instead" in lines
    assert lines[-1] == "Liger's kernels run on CUDA tensors, these are on ['cpu']"


# ---- under Triton's interpreter -------------------------------------------------------------------------------------
def liger_calls(jitted) -> set[str]:
    traces = (fulmen.last_traces(jitted)[-1], fulmen.last_backward_traces(jitted)[-1])
    return {bsym.sym.name for trace in traces for bsym in trace.bound_symbols} & LIGER_SYMBOLS


@pytest.fixture
def interpreted():
    if torch.cuda.is_available():
        pytest.skip("Triton's CPU interpreter is for machines without a GPU; -m cuda tests the compiled kernels")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET=1 was not set before triton was imported")
    from fulmen.liger import kernels

    assert kernels.interpreted()


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_litgpt_step_through_the_interpreted_kernels(interpreted, fuse):
    model = llama()
    idx, targets = torch.randint(0, 301, (3, 12)), torch.randint(0, 301, (3, 12))
    targets[1, :4] = -100
    step = fulmen.jit(forward_and_loss, executors=["liger", "sdpa", "torch"],
                      options=fulmen.JitOptions(fuse_linear_cross_entropy=fuse))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grads = loss_and_grads(step, model, idx, targets)
    expected_loss, expected = loss_and_grads(forward_and_loss, model, idx, targets)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert liger_calls(step) == (FLCE if fuse else CROSS_ENTROPY) | ROPE
    declined = {str(w.message) for w in caught}
    assert {"the liger executor does not run RMSNorm: Liger's kernels run on CUDA tensors, these are on ['cpu']; "
            "torch runs it instead"} <= declined
    assert litgpt.model.apply_rope is ORIGINAL_APPLY_ROPE  # LitGPT's code is left as it was


def _head(reduction, label_smoothing=0.0):
    def loss(h, w, b, t):
        logits = F.linear(h, w, b).flatten(0, 1)
        return F.cross_entropy(logits, t.flatten(), reduction=reduction, label_smoothing=label_smoothing)

    return loss


@pytest.mark.parametrize("case", ["mean", "sum", "none", "smoothing", "all_ignored", "frozen_weight"])
def test_fused_linear_cross_entropy(interpreted, case):
    h, w, b = torch.randn(2, 9, 16), torch.randn(45, 16) / 4, torch.randn(45)
    t = torch.randint(0, 45, (2, 9))
    t[0, ::2] = -100
    if case == "all_ignored":
        t.fill_(-100)
    reduction = case if case in ("mean", "sum", "none") else "mean"
    fn = _head(reduction, 0.1 if case == "smoothing" else 0.0)
    jitted = check(fn, [h, w, b, t], fulmen.JitOptions(cross_entropy_chunk_rows=4), cotangent_like=True,
                   grads=[True, case != "frozen_weight", True, False], executors=["liger"])
    forward = {bsym.sym.name for bsym in fulmen.last_traces(jitted)[-1].bound_symbols}
    # Liger's kernel gives the loss (and for mean and sum the gradients; for none fulmen's chunks do, backward)
    assert "liger_fused_linear_cross_entropy" in forward
    with torch.no_grad():
        torch.testing.assert_close(jitted(h, w, b, t), fn(h, w, b, t), rtol=1e-5, atol=0, equal_nan=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(interpreted, reduction):
    logits, t = torch.randn(11, 37), torch.randint(0, 37, (11,))
    t[3] = -100
    fn = lambda x, t: F.cross_entropy(x, t, reduction=reduction)  # noqa: E731
    jitted = fulmen.jit(fn, executors=["liger"])
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss, expected = jitted(ours, t), fn(theirs, t)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    cotangent = torch.randn_like(loss)
    loss.backward(cotangent)
    expected.backward(cotangent)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=0)  # the kernel wrote into a copy
    assert liger_calls(jitted) == CROSS_ENTROPY


@pytest.mark.parametrize("cos_batch", [1, 2])
def test_rope_leaves_its_input_alone(interpreted, cos_batch):
    qkv = torch.randn(2, 6, 4, 8)
    angles = torch.randn(cos_batch, 6, 4).repeat(1, 1, 2)  # halves that repeat, as LitGPT's rope cache
    cos, sin = angles.cos(), angles.sin()

    def rope(qkv, cos, sin):  # as LitGPT calls it: a transposed view, read again afterwards
        q = qkv.transpose(1, 2)
        return litgpt.model.apply_rope(q, cos, sin) * 2 + q

    jitted = fulmen.jit(rope, executors=["liger"])
    ours, theirs = qkv.clone().requires_grad_(), qkv.clone().requires_grad_()
    out, expected = jitted(ours, cos, sin), rope(theirs, cos, sin)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    cotangent = torch.randn_like(out)
    out.backward(cotangent)
    expected.backward(cotangent)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6)
    assert liger_calls(jitted) == ROPE
    # Liger's kernel reads the first halves only: other cos/sin stop the program rather than give other values
    with pytest.raises(RuntimeError, match="cos/sin whose two halves differ"):
        jitted(qkv, torch.randn_like(cos), sin)


# ---- LitGPT's code ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("add_unit_offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_restated_rms_norm_is_litgpts(add_unit_offset, dtype):
    norm = litgpt.model.RMSNorm(24, add_unit_offset=add_unit_offset).to(dtype)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 5, 24, dtype=dtype)
    torch.testing.assert_close(liger.rms_norm_forward(norm, x), norm(x), rtol=0, atol=0)
    assert forward_fingerprint(litgpt.model.RMSNorm.forward) in liger.KNOWN_RMS_NORM_FORWARDS


def test_checkers_decline_what_the_kernels_do_not_take(interpreted):
    cpu = torch.zeros(2, 4)
    assert decline_reason("RMSNorm", cpu) == "Liger's kernels run on CUDA tensors, these are on ['cpu']"
    assert decline_reason("RoPE", cpu) is None  # interpreted
    assert decline_reason("RoPE", cpu, torch.zeros(2, device="meta")).startswith("its tensors are on several devices")
    with pytest.warns(UserWarning, match="does not run RoPE: it takes x"):
        assert not liger._apply_rope_checker(torch.zeros(2, 3, 4), torch.zeros(1, 3, 4), torch.zeros(1, 3, 4))
    with pytest.warns(UserWarning, match="does not run cross-entropy: it takes 2-D logits"):
        assert not liger._ce_checker(torch.zeros(3, 4), torch.zeros(3, 4))
