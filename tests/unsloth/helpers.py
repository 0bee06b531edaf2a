"""What the unsloth tests share: LitGPT Llama-family models, a loss, and eager references."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from litgpt import GPT, Config

import fulmen
from fulmen.unsloth import UNSLOTH_SYMBOLS
from tests.models.litgpt_configs import shrunk

CROSS_ENTROPY = {"unsloth_cross_entropy", "unsloth_cross_entropy_backward"}
SWIGLU = {"unsloth_swiglu", "unsloth_swiglu_backward"}
ROPE = {"unsloth_apply_rope", "unsloth_apply_rope_backward"}


def forward_and_loss(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def llama(device: str = "cpu", dtype: torch.dtype = torch.float32, **overrides) -> GPT:
    """A small Llama-3.2-style model: GQA (4 query heads, 2 key heads), partial rotary, odd sizes."""
    config = Config.from_name(
        "Llama-3.2-1B", **{**dict(n_layer=2, n_embd=64, n_head=4, n_query_groups=2, head_size=16,
                                  rotary_percentage=0.5, intermediate_size=88, vocab_size=301,
                                  padded_vocab_size=301, block_size=32), **overrides},
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config)
    return model.to(dtype)


def batch(model: GPT, batch_size: int = 2, seq_len: int = 13, ignored: int = 3):
    """Random tokens and targets on the model's device, the first `ignored` targets set to -100."""
    device, vocab = model.lm_head.weight.device, model.config.padded_vocab_size
    idx = torch.randint(0, vocab, (batch_size, seq_len), device=device)
    targets = torch.randint(0, vocab, (batch_size, seq_len), device=device)
    targets[0, :ignored] = -100
    return idx, targets


def loss_and_grads(fn, model: GPT, idx: torch.Tensor, targets: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = fn(model, idx, targets)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def trace_symbols(jitted) -> set[str]:
    """The names called in the final forward and backward traces."""
    traces = (fulmen.last_traces(jitted)[-1], fulmen.last_backward_traces(jitted)[-1])
    return {bsym.sym.name for trace in traces for bsym in trace.bound_symbols}


def unsloth_calls(jitted) -> set[str]:
    return trace_symbols(jitted) & UNSLOTH_SYMBOLS


def printed_unsloth_calls(jitted) -> set[str]:
    """The unsloth operators the printed final traces call (as users read them)."""
    text = str(fulmen.last_traces(jitted)[-1]) + str(fulmen.last_backward_traces(jitted)[-1])
    return set(re.findall(r"= (unsloth_\w+)\(", text))


def assert_grads_close(got: dict, expected: dict, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def assert_bf16_step_close(loss, grads: dict, expected_loss, expected: dict, exact_loss, exact: dict) -> None:
    """A bf16 step (`loss`, `grads`) against fp32 maths on the same weights (`exact_*`): no further from it than eager
    bf16 (`expected_*`) is, with some slack."""
    assert abs(loss.float() - exact_loss) <= 2 * abs(expected_loss.float() - exact_loss) + 2e-3, (loss, expected_loss)
    for name, grad in exact.items():
        scale = grad.abs().max().clamp_min(1e-6)
        ours = ((grads[name].float() - grad).abs().max() / scale).item()
        theirs = ((expected[name].float() - grad).abs().max() / scale).item()
        assert ours <= 2 * theirs + 1e-2, f"{name}: relative error {ours:.3g} vs eager's {theirs:.3g}"


def check_training_step(jitted, model: GPT, idx: torch.Tensor, targets: torch.Tensor, grad_atol: float) -> None:
    """A training step of `jitted` against eager's on the same weights: fp32 within rounding; bf16 no further from
    fp32 maths than eager bf16 is (which turns the model to fp32)."""
    loss, grads = loss_and_grads(jitted, model, idx, targets)
    expected_loss, expected = loss_and_grads(forward_and_loss, model, idx, targets)
    if next(model.parameters()).dtype == torch.float32:
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
        assert_grads_close(grads, expected, rtol=1e-4, atol=grad_atol)
        return
    exact_loss, exact = loss_and_grads(forward_and_loss, model.float(), idx, targets)
    assert_bf16_step_close(loss, grads, expected_loss, expected, exact_loss, exact)


def expected_calls(config: Config) -> set[str]:
    """The kernels a training step of this LitGPT architecture calls."""
    calls = set(CROSS_ENTROPY)
    if config.mlp_class_name in ("LLaMAMLP", "LLaMAMoE"):
        calls |= SWIGLU
    if config.rope_n_elem % 2 == 0 and config.rope_n_elem > 0 and not config.rope_interleave:
        calls |= ROPE
    return calls


def check_architecture(name: str, device: str) -> None:
    """LitGPT's configs as the oracle: the architecture, shrunk (fp32), trains through the kernels that apply to it
    with eager's loss and gradients. The module is jitted (LitGPT's mixture of experts needs the module's
    lookaside), the loss apart."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(shrunk(name))
    idx, targets = batch(model, seq_len=9)
    jitted = fulmen.jit(model, executors=["unsloth", "torch"])
    loss_fn = fulmen.jit(lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()), executors=["unsloth"])
    loss, grads = loss_and_grads(lambda m, x, t: loss_fn(jitted(x), t), model, idx, targets)
    expected_loss, expected = loss_and_grads(forward_and_loss, model, idx, targets)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    assert_grads_close(grads, expected, atol=1e-6)
    assert unsloth_calls(jitted) | unsloth_calls(loss_fn) == expected_calls(model.config)
