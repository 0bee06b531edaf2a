"""The unsloth executor without a GPU.

- It imports without a GPU or Triton, and naming "unsloth" in an executor list finds it.
- Its checkers decline CPU tensors and every call they cannot serve: on CPU a LitGPT Llama-family model runs as
  without the executor (loss and grads equal eager's), and LitGPT's own code is left as it was.
- Under Triton's interpreter (TRITON_INTERPRET=1) the kernels themselves run on CPU: each matches eager forward and
  backward, and every shrunk LitGPT architecture trains through them with eager's loss and gradients.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import litgpt.model
import pytest
import torch
import torch.nn.functional as F
from litgpt.args import EvalArgs

import fulmen
from fulmen import TensorProxy
from fulmen.unsloth import UNSLOTH_SYMBOLS, executor
from tests.models.litgpt_configs import representative_names, shrunk
from tests.unsloth.helpers import (
    CROSS_ENTROPY,
    ROPE,
    SWIGLU,
    assert_grads_close,
    batch,
    check_architecture,
    forward_and_loss,
    llama,
    loss_and_grads,
    printed_unsloth_calls,
    unsloth_calls,
)

ORIGINAL_APPLY_ROPE = litgpt.model.apply_rope
ORIGINAL_MLP_FORWARD = litgpt.model.LLaMAMLP.__dict__["forward"]


def test_symbol_names_follow_thunder():
    assert UNSLOTH_SYMBOLS == CROSS_ENTROPY | SWIGLU | ROPE


def test_imports_without_gpu_or_triton():
    script = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # `import triton` raises ImportError
        import torch, fulmen
        unsloth = fulmen.get_executor("unsloth")  # the name alone imports fulmen.unsloth
        import fulmen.unsloth
        assert unsloth is fulmen.unsloth.unsloth_ex
        assert not any(name in sys.modules for name in ("fulmen.unsloth.cross_entropy", "fulmen.unsloth.rope"))
        f = fulmen.jit(lambda x, t: torch.nn.functional.cross_entropy(x, t), executors=["unsloth"])
        print(f(torch.zeros(2, 3), torch.tensor([0, 2])).item(), sorted(fulmen.unsloth.UNSLOTH_SYMBOLS)[0])
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [f"{torch.log(torch.tensor(3.0)).item()}", "unsloth_apply_rope"]


def _unfused_step_matches_eager(model, idx, targets):
    """A training step through "unsloth", unfused (so the cross-entropy is a call of its own: by default the lm_head
    and the loss are one fused op), with eager's loss and gradients; gives the jitted step."""
    unfused = fulmen.JitOptions(fuse_linear_cross_entropy=False)
    jitted = fulmen.jit(forward_and_loss, executors=["unsloth", "sdpa", "torch"], options=unfused)
    loss, grads = loss_and_grads(jitted, model, idx, targets)
    expected_loss, expected = loss_and_grads(forward_and_loss, model, idx, targets)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    assert_grads_close(grads, expected)
    return jitted


def test_cpu_tensors_are_declined_and_results_match_eager(monkeypatch):
    monkeypatch.setattr(executor, "_interpreted", lambda: False)  # as without Triton's interpreter
    model = llama()
    idx, targets = batch(model)
    jitted = _unfused_step_matches_eager(model, idx, targets)
    assert unsloth_calls(jitted) == set()
    # While "unsloth" is active, LitGPT's apply_rope and SwiGLU are acquired as its operators, which the checkers
    # then decline: they run as their torch parts.
    acquired = {bsym.sym.name for bsym in fulmen.last_traces(jitted)[0].bound_symbols}
    assert {"litgpt_apply_rope", "litgpt_swiglu"} <= acquired
    plain = fulmen.jit(forward_and_loss, executors=["sdpa", "torch"])
    plain(model, idx, targets)
    assert not {name for name in acquired if name.startswith("litgpt_")} & {
        bsym.sym.name for bsym in fulmen.last_traces(plain)[0].bound_symbols}
    # LitGPT's code is as it was, for everyone else
    assert litgpt.model.apply_rope is ORIGINAL_APPLY_ROPE
    assert litgpt.model.CausalSelfAttention.forward.__globals__["apply_rope"] is ORIGINAL_APPLY_ROPE
    assert litgpt.model.LLaMAMLP.__dict__["forward"] is ORIGINAL_MLP_FORWARD


# ---- the checkers, on CUDA proxies --------------------------------------------------------------------------------


def cuda(*shape: int, dtype: torch.dtype = torch.float32, requires_grad: bool = False, index: int | None = None):
    meta = torch.empty(shape, dtype=dtype, device="meta")
    return TensorProxy("p", meta, torch.device("cuda", index) if index is not None else torch.device("cuda"),
                       requires_grad)


def cpu(*shape: int, dtype: torch.dtype = torch.float32):
    return TensorProxy("p", torch.empty(shape, dtype=dtype, device="meta"), torch.device("cpu"))


@pytest.fixture
def triton_present(monkeypatch):
    monkeypatch.setattr(executor, "_interpreted", lambda: False)
    monkeypatch.setattr(executor, "_triton_missing", lambda: False)


LOGITS, TARGET = cuda(8, 70000, dtype=torch.bfloat16), cuda(8, dtype=torch.int64)


@pytest.mark.parametrize(("args", "kwargs", "accepted"), [
    ((LOGITS, TARGET), {}, True),
    ((cuda(8, 70000), TARGET), {"reduction": "none", "ignore_index": 0}, True),
    ((cuda(8, 5, dtype=torch.float16), TARGET), {"reduction": "sum"}, True),
    ((cpu(8, 70000), cpu(8, dtype=torch.int64)), {}, False),
    ((LOGITS, cpu(8, dtype=torch.int64)), {}, False),
    ((LOGITS, cuda(8, dtype=torch.int64, index=1)), {}, False),
    ((cuda(8, 5, dtype=torch.float64), TARGET), {}, False),
    ((LOGITS, cuda(8, dtype=torch.int32)), {}, False),
    ((cuda(2, 4, 5), cuda(2, 5, dtype=torch.int64)), {}, False),  # class dimension 1 of a 3-D input
    ((LOGITS, cuda(7, dtype=torch.int64)), {}, False),
    ((cuda(0, 5), cuda(0, dtype=torch.int64)), {}, False),
    ((LOGITS, TARGET), {"weight": cuda(70000)}, False),
    ((LOGITS, TARGET), {"label_smoothing": 0.1}, False),
    ((LOGITS, TARGET), {"size_average": True}, False),
    ((cuda(8, 0), TARGET), {}, False),  # no classes
    ((LOGITS, TARGET), {"ignore_index": True}, False),
    ((LOGITS, TARGET), {"reduction": "batchmean"}, False),
])
def test_cross_entropy_checker(triton_present, args, kwargs, accepted):
    assert executor._cross_entropy_checker(*args, **kwargs) is accepted


X = cuda(3, 4, 13, 8, dtype=torch.bfloat16)
COS = cuda(1, 13, 8)


@pytest.mark.parametrize(("args", "accepted"), [
    ((X, COS, COS), True),
    ((X, cuda(3, 13, 8), cuda(3, 13, 8)), True),  # one cos/sin row per sequence
    ((cuda(3, 13, 8), cuda(3, 13, 8), cuda(3, 13, 8)), True),  # (B, T, n)
    ((cuda(3, 4, 13, 7), cuda(1, 13, 7), cuda(1, 13, 7)), False),  # an odd number of rotated dims
    ((cuda(3, 4, 13, 1), cuda(1, 13, 1), cuda(1, 13, 1)), False),
    ((X, cuda(1, 13, 1), cuda(1, 13, 1)), False),  # LitGPT broadcasts a cos of width 1
    ((X, cuda(2, 13, 8), cuda(2, 13, 8)), False),
    ((X, cuda(1, 12, 8), cuda(1, 12, 8)), False),
    ((X, cuda(13, 8), cuda(13, 8)), False),
    ((X, COS, cuda(1, 13, 8, dtype=torch.float64)), False),
    ((X, cuda(1, 13, 8, requires_grad=True), COS), False),
    ((cuda(2, 3, 4, 13, 8), COS, COS), False),
    ((cpu(3, 4, 13, 8), cpu(1, 13, 8), cpu(1, 13, 8)), False),
])
def test_apply_rope_checker(triton_present, args, accepted):
    assert executor._apply_rope_checker(*args) is accepted


@pytest.mark.parametrize(("args", "accepted"), [
    ((cuda(2, 13, 88, dtype=torch.bfloat16), cuda(2, 13, 88, dtype=torch.bfloat16)), True),
    ((cuda(5), cuda(5)), True),
    ((cuda(2, 13, 88), cuda(2, 13, 88, dtype=torch.bfloat16)), False),
    ((cuda(2, 13, 88), cuda(1, 13, 88)), False),
    ((cuda(5, dtype=torch.int64), cuda(5, dtype=torch.int64)), False),
    ((cpu(5), cpu(5)), False),
])
def test_swiglu_checker(triton_present, args, accepted):
    assert executor._swiglu_checker(*args) is accepted


def test_without_triton_the_checkers_decline_with_a_warning(monkeypatch):
    monkeypatch.setattr(executor, "_interpreted", lambda: False)
    monkeypatch.setitem(sys.modules, "triton", None)
    executor._triton_missing.cache_clear()
    try:
        with pytest.warns(UserWarning, match="needs Triton"):
            assert not executor._swiglu_checker(cuda(5), cuda(5))
        assert not executor._cross_entropy_checker(LOGITS, TARGET)
    finally:
        executor._triton_missing.cache_clear()


def test_register_lookaside_errors():
    with pytest.raises(ValueError, match="torch function"):
        executor.unsloth_ex.register_lookaside(F.silu, executor.swiglu)
    with pytest.raises(ValueError, match="already"):
        executor.unsloth_ex.register_lookaside(litgpt.model.LLaMAMLP.forward, executor.llama_mlp_forward)
    with pytest.raises(ValueError, match="already replaces"):
        executor.unsloth_ex.register_lookaside(executor.swiglu, executor.swiglu)


# ---- the kernels under Triton's interpreter ------------------------------------------------------------------------


def _reference_cross_entropy(logits, target, **kwargs):
    leaf = logits.detach().float().requires_grad_()
    return F.cross_entropy(leaf, target, **kwargs), leaf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab", "reduction", "ignore_index"), [
    (7, 1000, "mean", -100), (5, 3001, "none", -100), (6, 513, "sum", 0), (3, 70000, "mean", -100),
])
def test_cross_entropy_matches_eager(interpreted, dtype, rows, vocab, reduction, ignore_index):
    logits = (torch.randn(rows, vocab) * 4).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (rows,))
    target[1] = ignore_index
    kwargs = {"reduction": reduction, "ignore_index": ignore_index}
    jitted = fulmen.jit(lambda x, t: F.cross_entropy(x, t, **kwargs), executors=["unsloth"])
    loss = jitted(logits, target)
    cotangent = torch.randn_like(loss)
    loss.backward(cotangent)
    assert unsloth_calls(jitted) == CROSS_ENTROPY
    expected, leaf = _reference_cross_entropy(logits, target, **kwargs)  # fp32 maths on the same values
    expected.backward(cotangent.float())
    assert loss.dtype == dtype and logits.grad.dtype == dtype
    torch.testing.assert_close(loss, expected.to(dtype), rtol=1e-5 if dtype == torch.float32 else 1.6e-2, atol=1e-6)
    torch.testing.assert_close(logits.grad, leaf.grad.to(dtype))
    assert (logits.grad[1] == 0).all()  # the ignored row


def test_cross_entropy_chunks_combine(interpreted):
    kernels = interpreted["cross_entropy"]
    logits = torch.randn(4, 5000) * 3
    target = torch.tensor([0, 4999, -100, 2500])
    for chunk in (512, 1024, 8192):  # 10, 5 and 1 chunks a row
        losses, lse = kernels.forward(logits, target, -100, chunk=chunk)
        torch.testing.assert_close(lse, torch.logsumexp(logits, dim=1))
        torch.testing.assert_close(losses, F.cross_entropy(logits, target, reduction="none"))


def test_cross_entropy_masked_chunk(interpreted):
    """A whole chunk of -inf logits (a masked vocabulary above 64k) has no share of the log-sum-exp."""
    logits = torch.randn(2, 70000, requires_grad=True)
    masked = logits.detach().clone()
    masked[:, 65536:] = float("-inf")
    masked.requires_grad_()
    f = fulmen.jit(lambda x, t: F.cross_entropy(x, t), executors=["unsloth"])
    target = torch.tensor([5, 60000])
    loss = f(masked, target)
    loss.backward()
    assert unsloth_calls(f) == CROSS_ENTROPY
    leaf = masked.detach().requires_grad_()
    expected = F.cross_entropy(leaf, target)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(masked.grad, leaf.grad)


def test_cross_entropy_edge_cases(interpreted):
    f = fulmen.jit(lambda x, t: F.cross_entropy(x, t), executors=["unsloth"])
    logits, ignored = torch.randn(3, 10), torch.full((3,), -100)
    assert torch.isnan(f(logits, ignored)) and torch.isnan(F.cross_entropy(logits, ignored))  # 0 / 0, as torch
    # A target outside the vocabulary: torch raises (on CUDA, a device-side assert); the kernel returns NaN.
    losses, _ = interpreted["cross_entropy"].forward(logits, torch.tensor([1, 10, -5]), -100)
    assert not torch.isnan(losses[0]) and torch.isnan(losses[1:]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (3, 5, 77), (2, 13, 1031)])
def test_swiglu_matches_eager(interpreted, dtype, shape):
    e, g = (torch.randn(shape).to(dtype).requires_grad_() for _ in range(2))
    jitted = fulmen.jit(lambda a, b: executor.swiglu(a, b) * 2, executors=["unsloth"])  # * 2: exact in bf16
    out = jitted(e, g)
    cotangent = torch.randn_like(out)
    out.backward(cotangent)
    assert unsloth_calls(jitted) == SWIGLU
    e_ref, g_ref = e.detach().float().requires_grad_(), g.detach().float().requires_grad_()
    expected = F.silu(e_ref) * g_ref * 2
    expected.backward(cotangent.float())
    torch.testing.assert_close(out, expected.to(dtype))
    torch.testing.assert_close(e.grad, e_ref.grad.to(dtype))
    torch.testing.assert_close(g.grad, g_ref.grad.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch_size", "heads", "head_size", "n_elem", "cos_batch"), [
    (1, 4, 16, 16, 1), (3, 2, 16, 8, 1), (3, 4, 24, 12, 3), (2, 1, 8, 8, 2),
])
def test_apply_rope_matches_eager(interpreted, dtype, batch_size, heads, head_size, n_elem, cos_batch):
    seq_len = 11
    cos, sin = litgpt.model.build_rope_cache(seq_len, n_elem)
    cos = (cos + 0.01 * torch.randn(cos_batch, seq_len, n_elem)).to(dtype)  # a distinct row per sequence
    sin = (sin + 0.01 * torch.randn(cos_batch, seq_len, n_elem)).to(dtype)
    qkv = torch.randn(batch_size, seq_len, heads, head_size).to(dtype).requires_grad_()

    def rope(qkv, cos, sin):  # as LitGPT calls it: a transposed view, sliced to the rotated dims
        return litgpt.model.apply_rope(qkv.transpose(1, 2)[..., :n_elem], cos, sin) * 2  # exact in bf16

    jitted = fulmen.jit(rope, executors=["unsloth"])
    out = jitted(qkv, cos, sin)
    cotangent = torch.randn_like(out)
    out.backward(cotangent)
    assert unsloth_calls(jitted) == ROPE
    leaf = qkv.detach().float().requires_grad_()
    expected = rope(leaf, cos.float(), sin.float())
    expected.backward(cotangent.float())
    torch.testing.assert_close(out, expected.to(dtype))
    torch.testing.assert_close(qkv.grad, leaf.grad.to(dtype))


def test_apply_rope_three_dims(interpreted):
    x = torch.randn(2, 9, 8, requires_grad=True)
    cos, sin = (t.unsqueeze(0) for t in litgpt.model.build_rope_cache(9, 8))
    jitted = fulmen.jit(lambda *args: litgpt.model.apply_rope(*args), executors=["unsloth"])
    out = jitted(x, cos, sin)
    out.sum().backward()
    assert unsloth_calls(jitted) == ROPE
    leaf = x.detach().requires_grad_()
    expected = ORIGINAL_APPLY_ROPE(leaf, cos, sin)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, leaf.grad)


def test_apply_rope_broadcasting_x_is_declined_and_runs(interpreted):
    """LitGPT's apply_rope broadcasts x of batch 1 against cos of batch B: the kernels do not, so torch runs it."""
    x = torch.randn(1, 9, 8, requires_grad=True)
    cos, sin = (t.expand(2, 9, 8) for t in litgpt.model.build_rope_cache(9, 8))
    jitted = fulmen.jit(lambda *args: litgpt.model.apply_rope(*args), executors=["unsloth"])
    out = jitted(x, cos, sin)
    torch.testing.assert_close(out, ORIGINAL_APPLY_ROPE(x, cos, sin))
    assert out.shape == (2, 9, 8) and unsloth_calls(jitted) == set()


def test_the_restated_llama_mlp_forward_is_litgpts():
    """The lookaside restates LLaMAMLP.forward; it is used only for the forwards it is known to restate."""
    assert executor.forward_fingerprint(ORIGINAL_MLP_FORWARD) in executor.KNOWN_LLAMA_MLP_FORWARDS
    assert executor.unsloth_ex.lookasides[ORIGINAL_MLP_FORWARD] is executor.llama_mlp_forward

    def changed(self, x):
        return self.proj(F.gelu(self.fc_1(x)) * self.fc_2(x))

    assert executor.forward_fingerprint(changed) not in executor.KNOWN_LLAMA_MLP_FORWARDS
    mlp = litgpt.model.LLaMAMLP(shrunk("Llama-3.2-1B"))
    x = torch.randn(2, 3, mlp.fc_1.in_features)
    torch.testing.assert_close(executor.llama_mlp_forward(mlp, x), mlp(x), rtol=0, atol=0)


def test_llama_traces_call_the_kernels_and_match_eager(interpreted):
    model = llama()
    idx, targets = batch(model, batch_size=3)
    jitted = _unfused_step_matches_eager(model, idx, targets)
    assert unsloth_calls(jitted) == printed_unsloth_calls(jitted) == UNSLOTH_SYMBOLS
    # SwiGLU is recomputable: the backward reruns it for proj's weight gradient instead of the forward saving it
    backward = {bsym.sym.name for bsym in fulmen.last_backward_traces(jitted)[-1].bound_symbols}
    assert "unsloth_swiglu" in backward
    # a jitted module as well (its parameters are the trace's inputs)
    module = fulmen.jit(model, executors=["unsloth"])
    torch.testing.assert_close(module(idx), model(idx), rtol=1e-5, atol=1e-6)
    forward = {bsym.sym.name for bsym in fulmen.last_traces(module)[-1].bound_symbols}
    assert {"unsloth_apply_rope", "unsloth_swiglu"} <= forward


@pytest.mark.parametrize("name", representative_names())
def test_every_litgpt_architecture_matches_eager(interpreted, name):
    check_architecture(name, "cpu")


def test_pretrain_with_unsloth_trains_as_without(interpreted, tmp_path, monkeypatch):
    from fulmen.pretrain import cli
    from tests.pretrain.test_pretrain import short

    calls = []
    for name in ("cross_entropy", "swiglu", "rope"):
        kernels = interpreted[name]
        monkeypatch.setattr(kernels, "forward", lambda *a, _f=kernels.forward, _n=name, **k: (calls.append(_n),
                                                                                              _f(*a, **k))[1])
    no_eval = EvalArgs(interval=0, final_validation=False)
    train = short(max_steps=3, micro_batch_size=2, global_batch_size=2, max_seq_length=32)
    with_unsloth = cli.setup(out_dir=tmp_path / "a", train=train, eval=no_eval,
                             executors=["unsloth", "sdpa", "torch"])
    # pretraining's loss reads the lm_head's output alone: fused with it (fulmen.transforms.fused_loss)
    assert set(calls) == {"swiglu", "rope"}
    without = cli.setup(out_dir=tmp_path / "b", train=train, eval=no_eval, executors=["sdpa", "torch"])
    torch.testing.assert_close(with_unsloth["losses"], without["losses"], rtol=1e-5, atol=0)


def test_pretrain_cli_takes_the_unsloth_executor_list(capsys):
    from fulmen.pretrain import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--executors", "[unsloth, sdpa, torchcompile, torch]", "--print_config"])
    assert exit_info.value.code == 0
    assert "- unsloth\n- sdpa\n- torchcompile\n- torch" in capsys.readouterr().out
