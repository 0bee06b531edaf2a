"""The sdpa and torchcompile executors on CUDA, bf16 LitGPT against eager; the attention kernel eager picks, cuDNN's
gradients against eager's own cuDNN path; peak memory of the default executors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from litgpt import GPT
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

import fulmen
from fulmen.executors.sdpa import sdpa
from fulmen.executors.torch_compile import TorchCompileExecutor, torchcompile
from tests.cuda_memory import cuda_peak
from tests.executors.test_region_remat import no_recompute
from tests.executors.test_torchcompile import matmuls_in_and_out_of_regions
from tests.models.litgpt_configs import shrunk

pytestmark = pytest.mark.cuda

_KERNEL_BY_INT = {int(SDPBackend.CUDNN_ATTENTION): "cudnn", int(SDPBackend.FLASH_ATTENTION): "flash",
                  int(SDPBackend.EFFICIENT_ATTENTION): "efficient"}


class _AttentionArguments(TorchFunctionMode):
    """Records the (q, k, v, is_causal, scale) of the eager program's F.scaled_dot_product_attention calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls.append((args[:3], kwargs.get("is_causal", False), kwargs.get("scale")))
        return func(*args, **kwargs)


def _eager_kernel(model, idx) -> str:
    """The attention kernel eager runs for this model and input: torch's selector on the real q, k and v."""
    with _AttentionArguments() as recorded:
        model(idx)
    (q, k, v), is_causal, scale = recorded.calls[0]
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale)
    return _KERNEL_BY_INT[choice]


def _loss(model, idx, targets):
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _model(name: str = "Llama-3.2-1B", **overrides):
    config = shrunk(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return GPT(config).cuda().to(torch.bfloat16), config


def _grads(model, loss_fn, idx, targets):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, idx, targets)
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("executors", [["sdpa"], ["torchcompile"], None], ids=["sdpa", "torchcompile", "default"])
def test_litgpt_bf16_matches_eager(executors):
    model, config = _model(head_size=64, n_embd=256, n_head=4, block_size=128)
    idx, targets = (torch.randint(0, config.padded_vocab_size, (2, 64), device="cuda") for _ in range(2))
    jitted = fulmen.jit(_loss, executors=executors)
    loss, grads = _grads(model, jitted, idx, targets)
    ref_loss, ref_grads = _grads(model, _loss, idx, targets)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
    for name, grad in grads.items():
        # bf16: compare relative to the grad's scale
        scale = ref_grads[name].abs().max().clamp_min(1e-6)
        assert (grad - ref_grads[name]).abs().max() / scale < 5e-2, name
    forward, backward = fulmen.last_traces(jitted)[-1], fulmen.last_backward_traces(jitted)[-1]
    executors_seen = {b.sym.executor for t in (forward, backward) for b in t.bound_symbols}
    if executors in (["sdpa"], None):
        names = {b.sym.name for t in (forward, backward) for b in t.bound_symbols}
        kernel = _eager_kernel(model, idx)  # the kernel eager picks (cuDNN on an H200 with a recent cuDNN)
        assert {f"sdpa_{kernel}_forward", f"sdpa_{kernel}_backward"} <= names
        assert "torch_vjp" not in names  # attention is not recomputed through autograd
    if executors in (["torchcompile"], None):
        assert torchcompile in executors_seen
    if executors == ["torchcompile"]:
        assert sdpa not in executors_seen


@pytest.mark.parametrize("backend", ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_attention_kernel_matches_eager(backend, dtype):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if dtype == torch.float32 and backend != "EFFICIENT_ATTENTION":
        pytest.skip("cuDNN and flash attention take half precision only (eager has no kernel either)")
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2) * 2

    with sdpa_kernel([getattr(SDPBackend, backend)]):
        jitted = fulmen.jit(f, executors=["sdpa"])
        out = jitted(q, k, v)
        names = {b.sym.name for b in fulmen.last_traces(jitted)[-1].bound_symbols}
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        expected = f(q, k, v)
        want = torch.autograd.grad(expected.float().square().sum(), (q, k, v))
    kernel = backend.split("_")[0].lower()
    assert f"sdpa_{kernel}_forward" in names
    assert f"sdpa_{kernel}_backward" in {b.sym.name for b in fulmen.last_backward_traces(jitted)[-1].bound_symbols}
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, expected, **tol)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, **tol)


def test_default_executors_peak_memory_at_most_eagers():
    model, config = _model(n_layer=4, n_embd=512, n_head=8, head_size=64, intermediate_size=1536,
                           padded_vocab_size=8192, vocab_size=8192, block_size=512)
    idx, targets = (torch.randint(0, 8192, (4, 512), device="cuda") for _ in range(2))
    jitted = fulmen.jit(_loss)
    fulmen_peak = cuda_peak(lambda: jitted(model, idx, targets))
    model.zero_grad(set_to_none=True)
    eager_peak = cuda_peak(lambda: _loss(model, idx, targets))
    print(f"peak forward+backward: eager {eager_peak / 2**20:.1f} MiB, fulmen {fulmen_peak / 2**20:.1f} MiB")
    assert fulmen_peak <= eager_peak


@pytest.mark.parametrize("groups", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("first", ["fulmen", "eager"])
def test_cudnn_gradients_equal_eagers_cudnn(first, groups):
    # PyTorch caches one cuDNN backward graph per q/k/v layout and bakes the output's and its cotangent's layouts
    # into it: whichever of fulmen and eager runs second uses the graph the first built, so both orders must agree.
    # A sequence length no other test uses keeps the first run here the one that builds the graphs.
    seq = {("fulmen", 2): 192, ("eager", 2): 320, ("fulmen", 4): 448, ("eager", 4): 576}[first, groups]
    model, config = _model(head_size=64, n_embd=256, n_head=4, n_query_groups=groups, block_size=seq)
    idx, targets = (torch.randint(0, config.padded_vocab_size, (3, seq), device="cuda") for _ in range(2))
    jitted = fulmen.jit(_loss)
    runs = {}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        for name in (first, "eager" if first == "fulmen" else "fulmen"):
            runs[name] = _grads(model, jitted if name == "fulmen" else _loss, idx, targets)
    names = {b.sym.name for b in fulmen.last_backward_traces(jitted)[-1].bound_symbols}
    assert "sdpa_cudnn_backward" in names
    reference = GPT(config).cuda()  # fp32, torch's math attention: what both must approximate
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with sdpa_kernel([SDPBackend.MATH]):
        ref_loss, ref_grads = _grads(reference, _loss, idx, targets)
    (loss, grads), (eager_loss, eager_grads) = runs["fulmen"], runs["eager"]
    torch.testing.assert_close(loss, eager_loss, rtol=2e-2, atol=2e-2)
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().clamp_min(1e-6)
        assert (grad - eager_grads[name]).abs().max() / scale < 5e-2, f"fulmen vs eager cuDNN: {name}"
        # a backward graph built for another cotangent layout gives errors of the gradients' own size
        assert (eager_grads[name] - ref_grads[name]).abs().max() / scale < 1e-1, f"eager cuDNN vs fp32: {name}"
        assert (grad - ref_grads[name]).abs().max() / scale < 1e-1, f"fulmen cuDNN vs fp32: {name}"


def _recompute_peaks(grouped: bool) -> dict[str, int]:
    """Peak bytes of a forward+backward with the recomputing torchcompile executor and without recomputation."""
    model, config = _model(n_layer=4, n_embd=512, n_head=8, head_size=64, intermediate_size=1536,
                           padded_vocab_size=8192, vocab_size=8192, block_size=512)
    idx, targets = (torch.randint(0, 8192, (4, 512), device="cuda") for _ in range(2))
    options = fulmen.JitOptions(grouped_query_attention=grouped)
    jitted = {executor.name: fulmen.jit(_loss, executors=[sdpa, executor], options=options)
              for executor in (torchcompile, no_recompute)}
    for fn in jitted.values():  # first uses allocate workspaces that stay (cuBLAS, cuDNN): before either peak
        fn(model, idx, targets).backward()
        model.zero_grad(set_to_none=True)
    peaks = {}
    for name, fn in jitted.items():
        peaks[name] = cuda_peak(lambda fn=fn: fn(model, idx, targets))
        model.zero_grad(set_to_none=True)
    return peaks


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-heads", "repeated-heads"])
def test_recomputing_region_inputs_does_not_raise_peak_memory(grouped):
    # Measured in a process of its own: after other tests in the same process both peaks move by 0.5 to 2 MiB, by
    # what lies outside the planner's model (which counts the kernels' declared workspaces, `Symbol.scratch`); on
    # the H200 one run of `pytest -m cuda -n 8` had the recomputing plan over 1 MiB above, where alone it peaks 1.5 MiB
    # lower (grouped heads) or equal (repeated heads).
    code = ("import json; from tests.executors.test_cuda_executors import _recompute_peaks; "
            f"print(json.dumps(_recompute_peaks({grouped})))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    peaks = json.loads(run.stdout.splitlines()[-1])
    print(f"peak forward+backward: recomputing {peaks[torchcompile.name] / 2**20:.1f} MiB, "
          f"not {peaks[no_recompute.name] / 2**20:.1f} MiB")
    assert peaks[torchcompile.name] <= peaks[no_recompute.name]


def test_matmul_regions_match_eager():
    """Matmuls inside Inductor's regions (`fuse_matmuls=True`, cuBLAS): fp32 values and grads equal eager's (TF32
    off, as in eager)."""
    model, config = _model(head_size=64, n_embd=256, n_head=4, block_size=128, n_layer=2)
    model = model.float()
    idx, targets = (torch.randint(0, config.padded_vocab_size, (2, 64), device="cuda") for _ in range(2))
    with_matmuls = TorchCompileExecutor("torchcompile_matmuls", fuse_matmuls=True)
    jitted = fulmen.jit(_loss, executors=["sdpa", with_matmuls])
    loss, grads = _grads(model, jitted, idx, targets)
    ref_loss, ref_grads = _grads(model, _loss, idx, targets)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    # a layer's five linears (qkv, proj, fc_1, fc_2, mlp proj) are in regions, in the forward and, twice each (the
    # input's and the weight's gradients), in the backward; attention stays with the sdpa executor
    for trace, per_layer in ((fulmen.last_traces(jitted)[-1], 5), (fulmen.last_backward_traces(jitted)[-1], 10)):
        assert matmuls_in_and_out_of_regions(trace, with_matmuls) == (per_layer * config.n_layer, 0)


def test_autotuned_matmul_templates_with_fused_neighbours_match_eager():
    """The same with Inductor's Triton matmul templates as the only choice (`max_autotune_gemm`, backend "TRITON"),
    so templates with the SwiGLU product and the residual add fused into them are what runs. Forward only, on a
    SwiGLU block: autotuning its two matmul shapes takes about a minute on an H200, and a backward has three times
    the layouts."""
    torch.manual_seed(0)
    x = torch.randn(256, 128, device="cuda")
    w1, w2, w3 = (torch.randn(n, k, device="cuda") / k**0.5 for n, k in ((256, 128), (256, 128), (128, 256)))

    def block(x, w1, w2, w3):
        return x + (F.silu(x @ w1.t()) * (x @ w2.t())) @ w3.t()

    options = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "TRITON"}
    templates = TorchCompileExecutor("torchcompile_matmul_templates", options, fuse_matmuls=True)
    jitted = fulmen.jit(block, executors=[templates])
    torch.testing.assert_close(jitted(x, w1, w2, w3), block(x, w1, w2, w3), rtol=1e-5, atol=1e-5)
    (region,) = [bsym for bsym in fulmen.last_traces(jitted)[-1].bound_symbols if bsym.sym.executor is templates]
    assert sum(sub.sym.name == "matmul" for sub in region.subsymbols) == 3


@pytest.mark.parametrize(("backend", "dtype"), [
    ("CUDNN_ATTENTION", torch.bfloat16), ("FLASH_ATTENTION", torch.bfloat16), ("EFFICIENT_ATTENTION", torch.bfloat16),
    ("EFFICIENT_ATTENTION", torch.float32),
])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_attention_dropout_grads_equal_eagers_on_the_same_seed(backend, dtype, heads):
    """The fused kernels draw the dropout mask inside themselves; the backward must replay that draw (the seed and
    offset the forward returns), and the draw must be the one eager's call makes from the same generator state."""
    q = torch.randn(2, heads[0], 128, 64, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, heads[1], 128, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True,
                                              enable_gqa=heads[0] != heads[1]) * 2

    def run(fn):
        torch.manual_seed(7)
        out = fn(q, k, v)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        return out, grads, torch.cuda.get_rng_state()

    with sdpa_kernel([getattr(SDPBackend, backend)]):
        try:
            want, want_grads, want_rng = run(f)
        except RuntimeError as error:  # memory-efficient attention takes no grouped heads
            pytest.skip(f"eager has no {backend} kernel for this call: {error}")
        jitted = fulmen.jit(f, executors=["sdpa"])
        got, got_grads, got_rng = run(jitted)
        again = run(jitted)[0]  # a cache hit draws anew, as eager's next call
    kernel = backend.split("_")[0].lower()
    assert f"sdpa_{kernel}_forward_dropout" in {b.sym.name for b in fulmen.last_traces(jitted)[-1].bound_symbols}
    backward = {b.sym.name for b in fulmen.last_backward_traces(jitted)[-1].bound_symbols}
    assert f"sdpa_{kernel}_backward" in backward and f"sdpa_{kernel}_forward_dropout" not in backward  # never redrawn
    assert (want == 0).any() and torch.equal(got, want) and torch.equal(again, want)
    assert torch.equal(got_rng, want_rng)
    for g, w in zip(got_grads, want_grads):
        assert torch.equal(g, w)


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "2d-bool"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_masked_attention_runs_cudnns_forward_once_as_eager(mask_kind, heads):
    """A masked call goes to cuDNN with the additive bias eager hands it (a boolean mask converted as eager converts
    it, fully masked rows included); the backward reuses the forward's output and log-sum-exp: bit for bit eager's."""
    generator = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(2, heads[0], 192, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
    k, v = (torch.randn(2, heads[1], 192, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
            for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    keep = torch.rand(2, 1, 192, 192, device="cuda", generator=generator) > 0.3
    keep[1, :, 5] = False  # a query that sees no key
    mask = {"bool": keep, "additive": torch.where(keep, 0.0, -1e4).to(torch.bfloat16), "2d-bool": keep[0, 0]}[mask_kind]
    cotangent = torch.randn(2, heads[0], 192, 64, device="cuda", dtype=torch.bfloat16, generator=generator)

    def f(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads[0] != heads[1])

    def run(fn):
        out = fn(q, k, v, mask)
        return out, torch.autograd.grad(out, (q, k, v), cotangent)

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        try:
            want, want_grads = run(f)
        except RuntimeError as error:
            pytest.skip(f"eager has no cuDNN kernel for this masked call: {error}")
        again_grads = run(f)[1]  # eager once more: whether its own backward gives the same bits twice
        jitted = fulmen.jit(f, executors=["sdpa"])
        got, got_grads = run(jitted)
    forward = [b.sym.name for b in fulmen.last_traces(jitted)[-1].bound_symbols]
    backward = [b.sym.name for b in fulmen.last_backward_traces(jitted)[-1].bound_symbols]
    assert "sdpa_cudnn_forward" in forward and "sdpa_cudnn_backward" in backward
    assert not [name for name in backward if "forward" in name or name == "torch_vjp"]
    assert torch.equal(got, want)
    for g, w, w2 in zip(got_grads, want_grads, again_grads):
        # eager's cuDNN backward writes NaN where a row sees no key (H200, 2026-12-02): fulmen's must be NaN there
        # and only there, and the rest is compared as below
        assert torch.equal(g.isnan(), w.isnan())
        g, w, w2 = (t.nan_to_num(0.0) for t in (g, w, w2))
        if torch.equal(w, w2):  # eager's backward is deterministic here: fulmen's must be its bits
            assert torch.equal(g, w)
        else:  # cuDNN's backward accumulates in an order of its own from run to run: within eager's own spread
            spread = (w - w2).abs().max().float()
            assert (g - w).abs().max().float() <= 2 * spread, ((g - w).abs().max(), spread)


@pytest.mark.parametrize("budget", [1.0, pytest.param(0.0, marks=pytest.mark.xfail(
    reason="on the H200 a zero budget still saved cuDNN's attention (2026-12-01; on the CPU the backward reruns "
           "the flash forward): the min-cut's choice on CUDA is not yet understood", strict=False))])
def test_masked_hf_llama_saves_cudnns_attention_unless_a_budget_asks(budget):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.transforms.test_attention_not_recomputed import attention_forwards

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 256), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :32] = 0

    def loss_fn(model, ids, mask):
        return model(input_ids=ids, attention_mask=mask, labels=ids).loss

    def grads(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(model, ids, mask)
        loss.backward()
        return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}

    jitted = fulmen.jit(loss_fn, options=fulmen.JitOptions(activation_memory_budget=budget))
    (loss, got), (want_loss, want) = grads(jitted), grads(loss_fn)
    forward, backward = fulmen.last_traces(jitted)[-1], fulmen.last_backward_traces(jitted)[-1]
    assert attention_forwards(forward) == ["sdpa_cudnn_forward"] * 2  # the kernel eager runs for a masked call
    assert ("sdpa_cudnn_forward" in attention_forwards(backward)) == (budget == 0.0)
    torch.testing.assert_close(loss, want_loss, rtol=1e-2, atol=1e-2)
    for name, grad in got.items():
        scale = want[name].abs().max().clamp_min(1e-6)
        assert (grad - want[name]).abs().max() / scale < 5e-2, name
