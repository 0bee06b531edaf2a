"""examples/llmc: the kernels against torch, GPT-2 training parity under the llm.c executor, and its CPU fallback."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from examples.llmc import kernels
from examples.llmc.model import GPTConfig, NewGELU

TOL = dict(rtol=1e-5, atol=1e-5)


def _randn(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).requires_grad_()


# ---- kernels vs torch (odd shapes: nothing divides a block or a warp) -----------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(3, 7, 5, 9), (1, 1, 1, 1), (2, 33, 3, 40)], ids=str)
def test_permute_split(shape):
    B, T, NH, d = shape
    qkv = _randn(B, T, 3 * NH * d)
    expected = tuple(t.view(B, T, NH, d).transpose(1, 2) for t in qkv.split(NH * d, dim=2))
    actual = kernels.permute_split(qkv.detach().view(B, T, 3, NH, d))
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    grads = tuple(torch.randn_like(e) for e in expected)
    (dqkv,) = torch.autograd.grad(expected, qkv, grads)
    torch.testing.assert_close(kernels.permute_split_backward(*grads), dqkv.view(B, T, 3, NH, d), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(3, 5, 7, 9), (2, 4, 64, 32)], ids=str)
def test_unpermute(shape):
    heads = _randn(*shape)
    expected = heads.transpose(1, 2).contiguous()
    torch.testing.assert_close(kernels.unpermute_forward(heads.detach()), expected, rtol=0, atol=0)
    g = torch.randn_like(expected)
    (dheads,) = torch.autograd.grad(expected, heads, g)
    torch.testing.assert_close(kernels.unpermute_backward(g), dheads, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(5, 37), (3, 1000), (2, 50257), (1,), (7, 1)], ids=str)
def test_softmax(shape):
    x = torch.randn(*shape, device="cuda") * 20  # large logits: needs the max subtracted
    torch.testing.assert_close(kernels.softmax_forward(x), torch.softmax(x, dim=-1), **TOL)


@pytest.mark.cuda
def test_softmax_causal_mask_rows():
    T = 17
    scores = torch.randn(2, 3, T, T, device="cuda")
    mask = torch.tril(torch.ones(T, T, device="cuda")) == 0
    scores = scores.masked_fill(mask, float("-inf"))
    actual = kernels.softmax_forward(scores)
    torch.testing.assert_close(actual, torch.softmax(scores, dim=-1), **TOL)
    assert (actual[..., mask] == 0).all()


def _targets(rows, V, ignored_every=0):
    t = torch.randint(0, V, (rows,), device="cuda")
    if ignored_every:
        t[::ignored_every] = -1
    return t


@pytest.mark.cuda
@pytest.mark.parametrize("rows,V", [(37, 101), (256, 50257), (5, 1)])
def test_crossentropy_forward_and_backward(rows, V):
    logits = _randn(rows, V, scale=3.0)
    targets = _targets(rows, V, ignored_every=4)
    expected = F.cross_entropy(logits, targets, ignore_index=-1, reduction="none")
    probs = kernels.softmax_forward(logits.detach())
    losses = kernels.crossentropy_forward(probs, targets)
    torch.testing.assert_close(losses, expected, **TOL)
    assert (losses[targets < 0] == 0).all()
    dlosses = torch.randn(rows, device="cuda")
    (dlogits,) = torch.autograd.grad(expected, logits, dlosses)
    torch.testing.assert_close(kernels.crossentropy_softmax_backward(dlosses, probs, targets), dlogits, **TOL)


@pytest.mark.cuda
def test_crossentropy_takes_int32_and_batched_targets():
    logits = torch.randn(3, 5, 11, device="cuda")
    targets = torch.randint(0, 11, (3, 5), device="cuda")
    probs = kernels.softmax_forward(logits)
    expected = F.cross_entropy(logits.view(-1, 11), targets.view(-1), reduction="none").view(3, 5)
    torch.testing.assert_close(kernels.crossentropy_forward(probs, targets.int()), expected, **TOL)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(3, 333), (4, 64, 512), (1,)], ids=str)
def test_gelu(shape):
    x = _randn(*shape, scale=3.0)
    expected = NewGELU()(x)
    torch.testing.assert_close(kernels.gelu_forward(x.detach()), expected, **TOL)
    torch.testing.assert_close(kernels.gelu_forward(x.detach()), F.gelu(x.detach(), approximate="tanh"), **TOL)
    g = torch.randn_like(expected)
    (dx,) = torch.autograd.grad(expected, x, g)
    torch.testing.assert_close(kernels.gelu_backward(x.detach(), g), dx, **TOL)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(3, 7, 129), (5, 768), (2, 3, 2), (4, 64, 128)], ids=str)
def test_layernorm(shape):
    C = shape[-1]
    x = _randn(*shape, scale=2.0)
    w = _randn(C)
    b = _randn(C)
    eps = 1e-5
    expected = F.layer_norm(x, (C,), w, b, eps)
    out, mean, rstd = kernels.layernorm_forward(x.detach(), w.detach(), b.detach(), eps)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(mean, x.detach().mean(-1), **TOL)
    var = x.detach().var(-1, unbiased=False)
    torch.testing.assert_close(rstd, torch.rsqrt(var + eps), **TOL)
    g = torch.randn_like(expected)
    dx, dw, db = torch.autograd.grad(expected, (x, w, b), g)
    actual = kernels.layernorm_backward(g, x.detach(), w.detach(), mean, rstd)
    for a, e in zip(actual, (dx, dw, db)):
        torch.testing.assert_close(a, e, **TOL)


@pytest.mark.cuda
def test_kernels_make_inputs_contiguous():
    x = torch.randn(9, 6, device="cuda").t()  # (6, 9), not contiguous
    torch.testing.assert_close(kernels.softmax_forward(x), torch.softmax(x, dim=-1), **TOL)
    torch.testing.assert_close(kernels.gelu_forward(x), F.gelu(x, approximate="tanh"), **TOL)


@pytest.mark.cuda
def test_kernels_refuse_other_dtypes():
    with pytest.raises(TypeError, match="float32"):
        kernels.gelu_forward(torch.randn(4, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="int32 or int64"):
        kernels.crossentropy_forward(torch.rand(2, 3, device="cuda"), torch.zeros(2, device="cuda"))


# ---- training parity ------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.slow
def test_gpt2_trains_like_eager_on_llmc_kernels():
    import fulmen
    from examples.llmc.executor import LLMC_SYMBOLS, llmc_executor
    from examples.llmc.train import build_model, random_batch, symbol_names, train_losses

    config = GPTConfig(block_size=64, vocab_size=50257, n_layer=2, n_head=4, n_embd=128)
    x, y = random_batch(config.vocab_size, B=4, T=64, seed=1, device="cuda")
    eager = build_model(config, seed=0, device="cuda")
    model = build_model(config, seed=0, device="cuda")
    jitted = fulmen.jit(model, executors=[llmc_executor])

    expected = train_losses(eager, eager.parameters(), x, y, steps=10, lr=1e-4)
    actual = train_losses(jitted, model.parameters(), x, y, steps=10, lr=1e-4)

    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-4)
    assert expected[-1] < expected[0]  # it trains
    missing = LLMC_SYMBOLS - symbol_names(jitted)
    assert not missing, f"llm.c kernels absent from the final traces: {sorted(missing)}"
    assert model.transformer.wte.weight is model.lm_head.weight  # still tied


# ---- without a GPU --------------------------------------------------------------------------------------------------


def test_importing_kernels_loads_no_cuda_python():
    code = "import sys, examples.llmc.kernels, examples.llmc.model; assert 'cuda.bindings' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_missing_cuda_python_gives_the_install_hint(monkeypatch):
    # Blocking the import stands in for a machine without cuda-python.
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(ImportError, match="pip install cuda-python"):
        kernels._import_cuda()


def test_kernels_refuse_cpu_tensors_before_compiling():
    with pytest.raises(ValueError, match="CUDA tensors"):
        kernels.softmax_forward(torch.randn(2, 3))
    with pytest.raises(ValueError, match="CUDA tensors"):
        kernels.layernorm_forward(torch.randn(2, 3), torch.ones(3), torch.zeros(3))


def test_checkers_decline_cpu_and_the_program_runs_through_torch():
    import fulmen
    from examples.llmc.executor import llmc_executor
    from examples.llmc.train import build_model, random_batch, symbol_names

    config = GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=4, n_embd=32)
    x, y = random_batch(config.vocab_size, B=2, T=16, seed=1, device="cpu")
    y[0, ::3] = -1  # ignored positions take torch's path too
    eager = build_model(config, seed=0, device="cpu")
    model = build_model(config, seed=0, device="cpu")
    jitted = fulmen.jit(model, executors=[llmc_executor])

    _, expected = eager(x, y)
    expected.backward()
    _, actual = jitted(x, y)
    actual.backward()

    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=0)
    assert math.isfinite(actual.item())
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    llmc_names = {name for name in symbol_names(jitted) if name.startswith("llmc_")}
    assert not llmc_names, f"llm.c symbols left in CPU traces: {sorted(llmc_names)}"
