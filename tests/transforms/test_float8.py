"""Float8 matmuls (JitOptions.float8, fulmen.transforms.float8 and fulmen.ops.float8) against eager.

- torch._scaled_mm runs on CPU (the premise of these tests) and `float8.cast` follows the scaling rules stated in
  README.md: amax per tensor or per row, the scale in float64 stored in float32, powers of two for rowwise, saturation.
- For each recipe, a SwiGLU feed-forward (torchao's test model) in bfloat16: the output and every gradient within
  SQNR 20 dB of eager's bfloat16 result (torchao's bar), for a sum loss (as torchao measures) and a random cotangent;
  the forward and backward traces hold float8.scaled_mm with the recipe's casts (e5m2 for the output gradient only
  under tensorwise), and no converted matmul's high-precision input is saved (but for rowwise_with_gw_hp, whose
  weight gradient reads it); each tensor is cast once per scaling.
- Skipped matmuls say why: odd dimensions, the head (by name and by feeding the loss), Float8Options.skip (names,
  prefixes, a predicate), batched matmuls; fulmen.examine lists each matmul.
- It composes with the fused loss (the head fused, the rest float8), autocast (float32 weights cast to float8
  directly), the activation memory budget (recomputed casts give the same grads), no-grad calls; parameters and
  optimizer state keep their dtypes; a short CPU training run of a small LitGPT converges as bfloat16's does.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from litgpt.config import Config
from litgpt.model import GPT

import fulmen
from fulmen.core.proxies import TensorProxy
from fulmen.jit.jitted_module import core
from fulmen.ops import float8, fused_loss
from fulmen.transforms.float8 import PROVENANCE, notes_of

RECIPES = tuple(float8.RECIPES)
SCALED_MM, CAST = "float8.scaled_mm", "float8.cast"


def sqnr(reference: torch.Tensor, value: torch.Tensor) -> float:
    """torchao's compute_error: the signal-to-quantization-noise ratio of `value`, in dB."""
    reference, value = reference.double(), value.double()
    return (20 * torch.log10(reference.norm() / (reference - value).norm())).item()


def _options(**kwargs) -> fulmen.JitOptions:
    budget = kwargs.pop("activation_memory_budget", 1.0)
    return fulmen.JitOptions(float8=fulmen.Float8Options(**kwargs), activation_memory_budget=budget)


def _calls(trace) -> list[str]:
    return [bsym.sym.printed for bsym in trace.bound_symbols]


def _notes(jitted) -> list[str]:
    return notes_of(fulmen.last_traces(jitted))


class FeedForward(torch.nn.Module):
    """torchtitan's Llama feed-forward (torchao's float8 numerics test model), small."""

    def __init__(self, dim: int = 128, hidden: int = 384) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(dim, hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, dim, bias=False)
        self.w3 = torch.nn.Linear(dim, hidden, bias=False)
        for linear in (self.w1, self.w2, self.w3):
            torch.nn.init.trunc_normal_(linear.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _feed_forward_grads(recipe: str, cotangent: str):
    torch.manual_seed(0)
    eager = FeedForward().to(torch.bfloat16)
    model = copy.deepcopy(eager)
    x = torch.randn(2, 256, 128, dtype=torch.bfloat16)
    g = torch.ones(2, 256, 128, dtype=torch.bfloat16) if cotangent == "sum" else torch.randn_like(x)
    x_eager, x_f8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    jitted = fulmen.jit(model, options=_options(recipe=recipe, lm_head=True))
    out = jitted(x_f8)
    out.backward(g)
    want = eager(x_eager)
    want.backward(g)
    grads = {name: (p.grad, dict(model.named_parameters())[name].grad) for name, p in eager.named_parameters()}
    return jitted, (want, out), {"x": (x_eager.grad, x_f8.grad), **grads}


@pytest.mark.parametrize("cotangent", ["sum", "random"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_outputs_and_grads_within_20_db_of_bfloat16(recipe, cotangent):
    jitted, (want, out), grads = _feed_forward_grads(recipe, cotangent)
    assert out.dtype == torch.bfloat16 and sqnr(want, out) > 20
    assert not torch.equal(want, out)  # computed in float8, not in bfloat16
    for name, (reference, value) in grads.items():
        assert value.dtype == reference.dtype
        assert sqnr(reference, value) > 20, name


def test_scaled_mm_runs_on_cpu():
    """The premise of this suite: torch._scaled_mm on CPU is the matmul of the scaled float8 operands."""
    torch.manual_seed(0)
    a = torch.randn(32, 64).to(float8.E4M3)
    b = torch.randn(48, 64).to(float8.E4M3).t()
    for scale_a, scale_b in ((torch.tensor(0.5), torch.tensor(2.0)), (torch.rand(32, 1), torch.rand(1, 48))):
        got = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
        want = (a.float() * scale_a) @ (b.float() * scale_b)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [float8.E4M3, float8.E5M2])
@pytest.mark.parametrize("dim,power_of_2", [(None, False), ((1,), True), ((0,), True), ((0, 1), False)])
def test_cast_follows_the_scaling_rules(dtype, dim, power_of_2):
    torch.manual_seed(0)
    x = (torch.randn(16, 32) * torch.logspace(-3, 3, 32)).to(torch.bfloat16)
    x[3] = 0  # an all-zero row: a finite scale, zero bits
    bits, inverse = float8.cast(x, dtype, dim=dim, power_of_2=power_of_2)
    largest = torch.finfo(dtype).max
    amax = (x.abs().amax() if dim is None else x.abs().amax(dim, keepdim=True)).double()
    scale = (largest / amax.clamp(min=1e-12)).float()
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    assert bits.dtype == dtype and inverse.dtype == torch.float32 and inverse.shape == scale.shape
    torch.testing.assert_close(inverse, scale.reciprocal(), rtol=0, atol=0)
    assert torch.equal(bits.float(), (x.float() * scale).clamp(-largest, largest).to(dtype).float())
    # where the scaled value is a normal float8 number, half a unit of its 3 (e4m3) or 2 (e5m2) mantissa bits
    normal = (x.float() * scale).abs() >= torch.finfo(dtype).tiny
    error = ((bits.float() * inverse - x.float()).abs() / x.float().abs())[normal]
    assert normal.sum() > 100 and error.max() <= (2**-3 if dtype == float8.E5M2 else 2**-4)
    if dim is not None:  # every row (or column) reaches at least half the range, all of it without powers of two
        reached = bits.float().abs().amax(dim, keepdim=True)
        assert ((reached >= largest / (2 if power_of_2 else 1)) | (amax == 0)).all()
    assert torch.isfinite(bits.float()).all()


def test_beyond_the_range_saturates():
    bits, _ = float8.cast(torch.tensor([1.0, -1e30, 3.0]), float8.E5M2)
    assert bits.float().tolist() == [0.0, -torch.finfo(float8.E5M2).max, 0.0]


@pytest.mark.parametrize("recipe", RECIPES)
def test_traces_hold_scaled_matmuls(recipe):
    jitted, _, _ = _feed_forward_grads(recipe, "random")
    forward, backward = fulmen.last_traces(jitted)[-1], fulmen.last_backward_traces(jitted)[-1]
    assert _calls(forward).count(SCALED_MM) == 3 and "torch.nn.functional.linear" not in _calls(forward)
    backward_matmuls = _calls(backward).count(SCALED_MM)
    assert backward_matmuls == (3 if recipe == "rowwise_with_gw_hp" else 6)
    assert _calls(backward).count("torch.matmul") == (3 if recipe == "rowwise_with_gw_hp" else 0)
    # the output gradient, each backward matmul's left operand: e5m2 under tensorwise scaling, e4m3 under rowwise
    gradients = {b.args[0].dtype for b in backward.bound_symbols if b.sym.printed == SCALED_MM}
    assert gradients == ({float8.E5M2} if recipe == "tensorwise" else {float8.E4M3})
    assert {b.args[1].dtype for b in backward.bound_symbols if b.sym.printed == SCALED_MM} == {float8.E4M3}
    assert "float8.cast_weight" not in _calls(backward)  # a weight is cast once, in the forward
    for trace in (forward, backward):  # the layouts torch._scaled_mm's CUDA kernels take
        for bsym in trace.bound_symbols:
            if bsym.sym.printed == SCALED_MM:
                a, b = bsym.args[:2]
                assert a.stride(1) == 1 and b.stride(0) == 1, str(bsym)
    assert all(note.startswith("converted ") for note in _notes(jitted)) and len(_notes(jitted)) == 3


def _saved(jitted) -> list[TensorProxy]:
    """What the forward saves for the backward beyond the program's inputs (which the caller holds anyway)."""
    inputs = {p.pname for p in fulmen.last_traces(jitted)[0].inputs}
    return [p for p in core(jitted).last_entry.program.plan.saved if p.pname not in inputs]


@pytest.mark.parametrize("recipe", RECIPES)
def test_no_extra_copies_are_saved(recipe):
    """A SwiGLU in float8 saves what it saves in bfloat16 (what silu and the product need, from which the backward
    recomputes the casts of the linears' inputs) and one float8 copy of each weight: each weight is cast once per
    scaling, in the forward; the two linears reading one input share its cast."""
    jitted, _, _ = _feed_forward_grads(recipe, "random")
    torch.manual_seed(0)
    plain = fulmen.jit(FeedForward().to(torch.bfloat16))
    plain(torch.randn(2, 256, 128, dtype=torch.bfloat16, requires_grad=True)).sum().backward()
    weights = {p.pname for p in fulmen.last_traces(jitted)[0].inputs[1:]}
    copies = Counter(p.type_string() for p in _saved(jitted) if p.dtype != torch.float32)  # (scales: 4 bytes)
    # one copy per weight, the one its gradient's matmul takes (rowwise: scaled along the other dimension)
    assert sum(n for kind, n in copies.items() if "float8_e4m3fn" in kind) == 3
    assert +(copies - Counter(kind for kind in copies.elements() if "float8" in kind)) == Counter(
        p.type_string() for p in _saved(plain)
    )
    acquired = next(t for t in fulmen.last_traces(jitted) if t.provenance.startswith(PROVENANCE))
    weight_casts = [b for b in acquired.bound_symbols if b.sym is float8.CAST_WEIGHT]
    assert {b.args[0].pname for b in weight_casts} == weights
    assert len(weight_casts) == (3 if recipe == "tensorwise" else 6)  # one per scaling: per tensor, per row, per column
    input_casts = [b.args[0].pname for b in acquired.bound_symbols if b.sym is float8.CAST]
    assert len(input_casts) == (4 if recipe == "rowwise" else 2)  # x (shared by w1 and w3) and w2's input


def test_the_backward_keeps_a_float8_copy_where_it_has_no_other():
    """`w2(w1(x))`: the backward of w2 needs its input, which nothing else keeps; bfloat16 saves it, float8 saves its
    1-byte cast instead."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(128, 64, bias=False))
    model = model.to(torch.bfloat16)
    x = torch.randn(4, 32, 64, dtype=torch.bfloat16)
    saved = {}
    for name, options in (("bf16", None), ("float8", _options(lm_head=True))):
        jitted = fulmen.jit(model, options=fulmen.JitOptions() if options is None else options)
        jitted(x).sum().backward()
        saved[name] = [p.type_string() for p in _saved(jitted) if p.dtype != torch.float32]
    assert saved["bf16"] == ["cpu bf16[4, 32, 128]"]
    assert sorted(saved["float8"]) == ["cpu float8_e4m3fn[128, 128]", "cpu float8_e4m3fn[64, 128]"]  # h8, w2's copy


def _odd_model() -> torch.nn.Module:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(32, 64)
            self.odd = torch.nn.Linear(64, 40)
            self.back = torch.nn.Linear(40, 64, bias=False)
            self.block = torch.nn.ModuleDict({"mlp": torch.nn.Linear(64, 64), "proj": torch.nn.Linear(64, 64)})
            self.lm_head = torch.nn.Linear(64, 48, bias=False)

        def forward(self, x):
            h = self.back(self.odd(self.fc(x)))
            h = self.block["proj"](torch.relu(self.block["mlp"](h)))
            scores = torch.bmm(h, h.transpose(1, 2))  # batched: no float8
            return self.lm_head(scores @ h)

    torch.manual_seed(0)
    return Model().to(torch.bfloat16)


def _run_odd(**options):
    model = _odd_model()
    jitted = fulmen.jit(model, options=_options(**options))
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    out = jitted(x)
    out.float().square().mean().backward()
    torch.testing.assert_close(out.float(), model(x).float(), rtol=0.2, atol=0.2)
    return jitted, x


def test_skipped_matmuls_say_why():
    jitted, x = _run_odd()
    notes = _notes(jitted)
    assert notes[0].startswith("converted fc.weight ") and "(32x32 @ 32x64)" in notes[0]
    assert "kept odd.weight" in notes[1] and "N=40 not a multiple of 16" in notes[1]
    assert "kept back.weight" in notes[2] and "K=40 not a multiple of 16" in notes[2]
    assert notes[3].startswith("converted block.mlp.weight") and notes[4].startswith("converted block.proj.weight")
    assert all("kept torch.matmul" in n and "a batched matmul" in n for n in notes[5:7])  # bmm, scores @ h
    assert "kept lm_head.weight" in notes[-1] and "the model's head (lm_head)" in notes[-1]
    assert "which Float8Options(lm_head=True) converts" in notes[-1]
    report = fulmen.examine(jitted, x)
    assert report.float8 == notes and f"float8: {notes[1]}" in str(report)
    forward = fulmen.last_traces(jitted)[-1]
    assert _calls(forward).count("torch.nn.functional.linear") == 3  # odd, back, lm_head
    assert _calls(forward).count(SCALED_MM) == 3


def test_skip_by_name_prefix_and_predicate():
    for skip in (["block"], ["block.mlp", "block.proj.weight"], lambda name: name.startswith("block.")):
        notes = _notes(_run_odd(skip=skip)[0])
        assert sum("skipped by Float8Options.skip" in n for n in notes) == 2, skip
        assert notes[0].startswith("converted fc.weight")
    notes = _notes(_run_odd(lm_head=True)[0])
    assert "lm_head" not in " ".join(n for n in notes if n.startswith("kept"))


def test_the_rows_of_a_weight_gradient_must_suit_too():
    """M is the contracted dimension of the weight gradient's float8 matmul: with 8 rows the linear stays in high
    precision while its weight needs a gradient, and converts when it is frozen or the recipe computes that gradient in
    high precision."""
    linear = torch.nn.Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    for recipe, frozen, converted in (
        ("tensorwise", False, False),
        ("tensorwise", True, True),
        ("rowwise_with_gw_hp", False, True),
    ):
        linear.weight.requires_grad_(not frozen)
        jitted = fulmen.jit(linear, options=_options(recipe=recipe, lm_head=True))
        jitted(x).sum().backward()
        note = _notes(jitted)[0]
        assert note.startswith("converted") == converted, note
        if not converted:
            assert "M=8 (the weight gradient's contracted dimension) not a multiple of 16" in note


def _tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    config = Config(
        block_size=64,
        vocab_size=96,
        padded_vocab_size=96,
        n_layer=2,
        n_head=4,
        n_query_groups=2,
        n_embd=64,
        intermediate_size=128,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        rotary_percentage=1.0,
        parallel_residual=False,
    )
    return GPT(config).to(torch.bfloat16)


def forward_and_loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def test_composes_with_the_fused_loss():
    model = _tiny_gpt()
    jitted = fulmen.jit(forward_and_loss, options=_options())
    x, y = torch.randint(0, 96, (8, 64)), torch.randint(0, 96, (8, 64))
    loss = jitted(model, x, y)
    loss.backward()
    notes = _notes(jitted)
    assert sum(n.startswith("converted transformer.h.") for n in notes) == 10
    assert "kept lm_head.weight" in notes[-1] and "fused with its loss" in notes[-1]
    forward = fulmen.last_traces(jitted)[-1]
    assert fused_loss.LINEAR_CROSS_ENTROPY_FORWARD.printed in _calls(forward)
    assert _calls(forward).count(SCALED_MM) == 10
    eager = _tiny_gpt()
    want = forward_and_loss(eager, x, y)
    want.backward()
    assert abs(loss.item() - want.item()) < 0.02 * want.item()  # two units of bfloat16 near 4.7
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        assert sqnr(p.grad, q.grad) > 20, name


def test_the_head_feeding_the_loss_stays_unless_asked():
    """Without the fused loss the head is a matmul, found by what its output feeds (whatever it is called)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).to(torch.bfloat16)
    x, y = torch.randn(64, 64, dtype=torch.bfloat16), torch.randint(0, 32, (64,))
    for lm_head in (False, True):
        options = fulmen.JitOptions(fuse_linear_cross_entropy=False, float8=fulmen.Float8Options(lm_head=lm_head))
        jitted = fulmen.jit(lambda x, y: F.cross_entropy(model(x).float(), y), options=options)
        jitted(x, y).backward()
        notes = _notes(jitted)
        assert notes[0].startswith("converted 0.weight")
        assert ("its output feeds the cross-entropy" in notes[1]) != lm_head
        assert notes[1].startswith("converted 2.weight") == lm_head


def test_autocast_casts_float32_weights_to_float8_directly():
    torch.manual_seed(0)
    eager = FeedForward(64, 128)
    model = copy.deepcopy(eager)
    x = torch.randn(2, 64, 64)
    jitted = fulmen.jit(model, options=_options(lm_head=True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = jitted(x)
        want = eager(x)
    out.float().sum().backward()
    want.float().sum().backward()
    assert out.dtype == want.dtype == torch.bfloat16 and sqnr(want, out) > 20
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        assert q.grad.dtype == torch.float32 and sqnr(p.grad, q.grad) > 20, name
    forward = fulmen.last_traces(jitted)[-1]
    weights = {p.pname for p in forward.inputs[1:]}
    casts = [b for b in forward.bound_symbols if b.sym is float8.CAST_WEIGHT and b.args[0].pname in weights]
    assert len(casts) == 3 and all(b.args[0].dtype == torch.float32 for b in casts)
    assert not [b for b in forward.bound_symbols if b.sym.printed == "torch.Tensor.to" and b.args[0].pname in weights]


def test_activation_memory_budget_recomputes_casts():
    """Below a budget of 1 the backward may cast again instead of keeping the float8 copies: the same values."""
    results = []
    for budget in (1.0, 0.0):
        torch.manual_seed(0)
        model = FeedForward(64, 128).to(torch.bfloat16)
        x = torch.randn(2, 64, 64, dtype=torch.bfloat16, requires_grad=True)
        jitted = fulmen.jit(model, options=_options(lm_head=True, activation_memory_budget=budget))
        jitted(x).square().sum().backward()
        plan = core(jitted).last_entry.program.plan
        inputs = {p.pname for p in fulmen.last_traces(jitted)[0].inputs}
        saved = sum(p.numel() * p.element_size() for p in plan.saved if p.pname not in inputs)
        results.append((saved, [x.grad, *(p.grad for p in model.parameters())]))
    (full, grads), (budgeted, regrads) = results
    assert budgeted < full
    for grad, regrad in zip(grads, regrads):
        torch.testing.assert_close(regrad, grad, rtol=0, atol=0)


def test_no_grad_calls_run_in_float8():
    torch.manual_seed(0)
    model = FeedForward(64, 128).to(torch.bfloat16)
    x = torch.randn(2, 64, 64, dtype=torch.bfloat16)
    jitted = fulmen.jit(model, options=_options(lm_head=True))
    with torch.no_grad():
        out = jitted(x)
    assert sqnr(model(x), out) > 20 and _calls(fulmen.last_traces(jitted)[-1]).count(SCALED_MM) == 3
    assert fulmen.last_backward_traces(jitted) == []


def _train(options: fulmen.JitOptions | None, steps: int = 30) -> tuple[list[float], GPT, torch.optim.Optimizer]:
    model = _tiny_gpt()
    step = fulmen.jit(forward_and_loss, options=options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (4, 33), generator=generator)  # a small vocabulary in use: learnable
    losses = []
    for _ in range(steps):
        loss = step(model, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model, optimizer


def test_training_converges_as_bfloat16_does():
    (reference, model, _), (losses, f8_model, optimizer) = _train(None), _train(_options())
    assert losses[-1] < 0.5 * losses[0] and reference[-1] < 0.5 * reference[0]
    # step by step, the float8 curve stays within 2% of the starting loss of bfloat16's
    assert max(abs(a - b) for a, b in zip(losses, reference)) < 0.02 * reference[0]
    # parameters, their gradients and the optimizer's state keep their dtypes
    assert {p.dtype for p in f8_model.parameters()} == {p.dtype for p in model.parameters()} == {torch.bfloat16}
    state = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert state and {t.dtype for t in state} == {torch.bfloat16}


def test_options_are_checked():
    with pytest.raises(ValueError, match="recipe must be one of 'tensorwise', 'rowwise', 'rowwise_with_gw_hp'"):
        fulmen.Float8Options(recipe="blockwise")
    with pytest.raises(TypeError, match="skip must be a list of qualified names"):
        fulmen.Float8Options(skip="lm_head")
    with pytest.raises(ValueError, match="all_gather needs recipe='tensorwise'"):
        fulmen.Float8Options(recipe="rowwise", all_gather=True)
    with pytest.raises(TypeError, match="JitOptions.float8 must be a Float8Options"):
        fulmen.JitOptions(float8="tensorwise")
    assert fulmen.Float8Options(skip=["a", "b"]).skip == ("a", "b")
    pipeline = str(fulmen.pipeline(fulmen.jit(lambda x: x, options=_options())))
    assert "acquired     Float8 matmuls" in pipeline


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_step_fuses_the_casts(recipe):
    """On a GPU with the default executors (sdpa, torchcompile, torch): a 2-layer Llama-style step within 20 dB of
    eager bfloat16, every float8 cast inside a fusion region, each linear's three matmuls float8 (two for
    rowwise_with_gw_hp)."""
    torch.manual_seed(0)
    config = Config.from_name("tiny-llama-1.1b", n_layer=2)
    with torch.device("cuda"):
        eager = GPT(config).to(torch.bfloat16)
    model = copy.deepcopy(eager)
    x, y = (torch.randint(0, config.vocab_size, (2, 1024), device="cuda") for _ in range(2))
    jitted = fulmen.jit(forward_and_loss, options=_options(recipe=recipe))
    loss = jitted(model, x, y)
    loss.backward()
    want = forward_and_loss(eager, x, y)
    want.backward()
    assert abs(loss.item() - want.item()) < 0.02 * want.item()
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        assert sqnr(p.grad, q.grad) > 20, name
    forward, backward = fulmen.last_traces(jitted)[-1], fulmen.last_backward_traces(jitted)[-1]
    for trace, matmuls in ((forward, 10), (backward, 10 if recipe == "rowwise_with_gw_hp" else 20)):
        assert not [b for b in trace.bound_symbols if b.sym.name in ("cast", "cast_weight")], trace.provenance
        assert _calls(trace).count(SCALED_MM) == matmuls
