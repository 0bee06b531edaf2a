"""Replacements are consulted when a call happens: nothing of the program is rebound, during acquisition or after.

Eager is the oracle for values; the program's own names (LitGPT's functions, a test module's helpers) are checked
by identity from inside the acquired program and from another thread while the acquisition runs.
"""

from __future__ import annotations

import functools
import itertools
import threading

import litgpt.model
import pytest
import torch
from litgpt.model import CausalSelfAttention, LLaMAMLP

import fulmen
from fulmen import TensorProxy
from fulmen.extend import OperatorExecutor
from fulmen.unsloth import executor
from tests.unsloth.helpers import batch, forward_and_loss, llama

# in a dict, which a rebinding of module globals (what fulmen must not do) would not reach
AS_IMPORTED = {"apply_rope": litgpt.model.apply_rope, "mlp_forward": LLaMAMLP.__dict__["forward"],
               "function_apply": torch.autograd.Function.__dict__["apply"],
               "checkpoint": torch.utils.checkpoint.checkpoint}
_names = itertools.count()


def _litgpt_as_written() -> tuple[bool, bool, bool]:
    return (litgpt.model.apply_rope is AS_IMPORTED["apply_rope"],
            CausalSelfAttention.forward.__globals__["apply_rope"] is AS_IMPORTED["apply_rope"],
            LLaMAMLP.__dict__["forward"] is AS_IMPORTED["mlp_forward"])


def test_litgpt_is_unchanged_while_an_unsloth_acquisition_runs(monkeypatch):
    monkeypatch.setattr(executor, "_interpreted", lambda: False)  # CPU: the checkers decline, eager's numbers
    model = llama()
    idx, targets = batch(model)
    x = torch.randn(2, 4, 9, 8)
    cos, sin = (t.unsqueeze(0) for t in litgpt.model.build_rope_cache(9, 8))
    rope_eager = AS_IMPORTED["apply_rope"](x, cos, sin)
    acquiring, looked = threading.Event(), threading.Event()
    seen: dict[str, tuple[bool, ...]] = {}
    rope_in_thread: list[torch.Tensor] = []

    def other_thread() -> None:
        try:
            assert acquiring.wait(timeout=60)
            seen["thread"] = _litgpt_as_written()
            rope_in_thread.append(litgpt.model.apply_rope(x, cos, sin))  # eager, while the acquisition replaces it
        finally:
            looked.set()

    def step(model, idx, targets):
        seen["program"] = _litgpt_as_written()
        acquiring.set()
        assert looked.wait(timeout=60)
        return forward_and_loss(model, idx, targets)

    thread = threading.Thread(target=other_thread)
    thread.start()
    jitted = fulmen.jit(step, executors=["unsloth", "sdpa", "torch"],
                        options=fulmen.JitOptions(fuse_linear_cross_entropy=False))
    loss = jitted(model, idx, targets)
    thread.join(timeout=60)
    torch.testing.assert_close(loss, forward_and_loss(model, idx, targets))
    acquired = {bsym.sym.name for bsym in fulmen.last_traces(jitted)[0].bound_symbols}
    assert {"litgpt_apply_rope", "litgpt_swiglu"} <= acquired  # both were replaced, in this acquisition
    assert seen == {"program": (True, True, True), "thread": (True, True, True)}
    torch.testing.assert_close(rope_in_thread[0], rope_eager, rtol=0, atol=0)
    assert _litgpt_as_written() == (True, True, True)


def scaled(x):
    return x * 3


def twice(f):
    @functools.wraps(f)
    def wrapper(x):
        return f(x) * 2

    return wrapper


@twice
def decorated_a(x):
    return x + 1


@twice
def decorated_b(x):
    return x - 1


def test_a_replaced_function_is_found_however_it_is_reached():
    """A module global, a saved reference, a closure: each call of the function is its operator. A function
    sharing its code (another closure of the same decorator) is not."""
    n = next(_names)
    ex = OperatorExecutor(f"reach{n}")
    op = ex.register_operator(f"scaled{n}", like=lambda x: TensorProxy(like=x), fn=scaled, replaces=scaled)
    wrapped = ex.register_operator(f"decorated{n}", like=lambda x: TensorProxy(like=x), fn=decorated_a,
                                   replaces=decorated_a)
    saved = scaled

    def fn(x):
        helper = (lambda y: saved(y))
        return scaled(x) + helper(x) + decorated_a(x) + decorated_b(x)

    x = torch.randn(3, 4)
    jitted = fulmen.jit(fn, executors=[ex])
    torch.testing.assert_close(jitted(x), fn(x))
    names = [bsym.sym.name for bsym in fulmen.last_traces(jitted)[0].bound_symbols]
    assert names.count(op.name) == 2 and names.count(wrapped.name) == 1


def test_checkpoint_through_a_name_bound_before_is_a_checkpointed_region():
    from torch.utils.checkpoint import checkpoint as bound_checkpoint

    w = torch.randn(4, 4, requires_grad=True)

    def fn(x):
        return bound_checkpoint(lambda y: torch.tanh(y @ w) * 2, x, use_reentrant=False).sum()

    x = torch.randn(3, 4, requires_grad=True)
    jitted = fulmen.jit(fn)
    jitted(x).backward()
    got = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    fn(x).backward()
    torch.testing.assert_close(got, (x.grad, w.grad))
    regions = {b.sym.name: b.checkpoint_region for b in fulmen.last_traces(jitted)[0].bound_symbols}
    assert regions["tanh"] and not regions["sum"]


class ScaledCube(torch.autograd.Function):
    """With setup_context and a default argument: torch's Function.apply binds them before its super().apply."""

    @staticmethod
    def forward(x, scale=2.0):
        return scale * x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * ctx.scale * 3 * x**2, None


def test_autograd_functions_and_checkpoint_are_recorded_with_torch_unchanged():
    seen = []

    def fn(x):
        seen.append((torch.autograd.Function.__dict__["apply"] is AS_IMPORTED["function_apply"],
                     torch.utils.checkpoint.checkpoint is AS_IMPORTED["checkpoint"]))
        return torch.utils.checkpoint.checkpoint(ScaledCube.apply, x, use_reentrant=True).sum()

    x = torch.randn(5, requires_grad=True)
    jitted = fulmen.jit(fn)
    jitted(x).backward()
    torch.testing.assert_close(x.grad, 6 * x.detach() ** 2)
    assert seen == [(True, True)]
    bsyms = fulmen.last_traces(jitted)[0].bound_symbols
    assert any(b.sym.name == "autograd_function" and b.checkpoint_region for b in bsyms)


def test_a_tensor_hook_is_refused_at_the_users_line():
    def fn(x):
        y = x * 2
        y.register_hook(lambda g: g * 0)
        return y

    with pytest.raises(fulmen.UnsupportedOpError, match=r"(?s)register_hook.*test_replacements.py"):
        fulmen.jit(fn)(torch.randn(3, requires_grad=True))


class Doubler(torch.nn.Module):
    def forward(self, x):
        return x * 2


def test_a_forward_lookaside_applies_to_modules_the_program_receives():
    """A jitted function given the module (not a jitted module): nn.Module.__call__ runs the lookaside, also when the
    module has hooks (torch's slow path); Doubler itself is untouched."""
    n = next(_names)
    ex = OperatorExecutor(f"forward{n}")
    ex.register_lookaside(Doubler.forward, lambda self, x: x * 2 + 0 * torch.sin(x))  # same values, a telltale op
    original = Doubler.__dict__["forward"]
    hooked = Doubler()
    hooked.register_forward_hook(lambda module, args, out: out + 1)
    for module, offset in ((Doubler(), 0), (hooked, 1)):
        x = torch.randn(3, 4)
        jitted = fulmen.jit(lambda m, x: m(x), executors=[ex])
        torch.testing.assert_close(jitted(module, x), x * 2 + offset)
        assert "sin" in {bsym.sym.name for bsym in fulmen.last_traces(jitted)[0].bound_symbols}
    assert Doubler.__dict__["forward"] is original
    with pytest.raises(TypeError, match="not a method of a module class"):
        ex.register_lookaside(scaled, lambda x: x)


def test_litgpts_mixture_of_experts_trains_when_the_program_receives_the_model():
    """The built-in lookaside of LitGPT's LLaMAMoE (its routing's torch.where(mask) is data-dependent) serves a model
    given to a jitted function too: eager's loss and gradients, and LLaMAMoE itself untouched."""
    config = litgpt.Config.from_name("Mixtral-8x7B-v0.1", n_layer=2, n_embd=64, n_head=4, n_query_groups=2,
                                     head_size=16, intermediate_size=96, padded_vocab_size=96, vocab_size=96,
                                     n_expert=4, n_expert_per_token=2)
    model = litgpt.GPT(config)
    original = litgpt.model.LLaMAMoE.__dict__["forward"]
    idx, targets = batch(model, seq_len=9)
    jitted = fulmen.jit(forward_and_loss)
    results = []
    for step in (jitted, forward_and_loss):
        model.zero_grad(set_to_none=True)
        loss = step(model, idx, targets)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss, grads), (want_loss, want_grads) = results
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert litgpt.model.LLaMAMoE.__dict__["forward"] is original


def _checkpointed_dropout(x: torch.Tensor, preserve: bool) -> torch.Tensor:
    return torch.utils.checkpoint.checkpoint(lambda a: torch.nn.functional.dropout(a, 0.5) * 2, x,
                                             use_reentrant=False, preserve_rng_state=preserve)


def test_checkpoint_without_preserving_the_rng_state_around_draws_is_refused_naming_the_line():
    x = torch.randn(50, requires_grad=True)
    for preserve in (True, False):  # eager runs both; without the state its backward draws other masks
        _checkpointed_dropout(x, preserve).sum().backward()
    torch.manual_seed(0)
    want = _checkpointed_dropout(x, True)
    torch.manual_seed(0)
    torch.testing.assert_close(fulmen.jit(_checkpointed_dropout)(x, True), want, rtol=0, atol=0)
    with pytest.raises(fulmen.TraceError, match=r"(?s)preserve_rng_state=False\) around random draws.*"
                                                r"test_replacements\.py.*torch\.utils\.checkpoint\.checkpoint"):
        fulmen.jit(_checkpointed_dropout)(x, False)
    without_draws = lambda x: torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False,  # noqa: E731
                                                                preserve_rng_state=False)
    torch.testing.assert_close(fulmen.jit(without_draws)(x), x.sin(), rtol=0, atol=0)
