"""Memory of a jitted step against eager's (bytes saved for backward, allocation peak on CPU), activation
checkpointing, and autocast."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from litgpt.model import GPT as LitGPT

import fulmen
from fulmen.memory import PeakMemory, SavedTensors
from tests.models.gpt2_seed import GPT, tiny_config
from tests.models.litgpt_configs import shrunk
from tests.training_steps import assert_backward_matches_eager


def _litgpt_4_layers() -> LitGPT:
    config = shrunk("Llama-3.1-8B")
    config.n_layer = 4
    torch.manual_seed(0)
    return LitGPT(config).train()


def _measure(step, existing):
    step().backward()  # warm up: compile outside the measurement
    with SavedTensors(*existing) as saved:
        loss = step()
    del loss
    with PeakMemory() as peak:
        step().backward()
    return saved, peak.peak


def test_litgpt_saved_bytes_and_peak_are_at_most_eagers():
    model = _litgpt_4_layers()
    vocab = model.config.padded_vocab_size
    idx, targets = torch.randint(0, vocab, (4, 32)), torch.randint(0, vocab, (4, 32))
    jitted = fulmen.jit(model)
    results = {}
    for name, net in (("eager", model), ("fulmen", jitted)):
        def step(net=net):
            return F.cross_entropy(net(idx).flatten(0, 1), targets.flatten())

        results[name] = _measure(step, [*model.parameters(), *model.buffers(), idx, targets])
        model.zero_grad(set_to_none=True)
    (eager_saved, eager_peak), (ours_saved, ours_peak) = results["eager"], results["fulmen"]
    print(f"\nsaved activations: eager {eager_saved.activation_bytes} B, fulmen {ours_saved.activation_bytes} B; "
          f"peak: eager {eager_peak} B, fulmen {ours_peak} B")
    assert 0 < ours_saved.activation_bytes <= eager_saved.activation_bytes
    assert ours_saved.total_bytes <= eager_saved.total_bytes
    assert 0 < ours_peak <= eager_peak
    # examine reports the same saved tensors, with their sizes
    report = fulmen.examine(lambda i: F.cross_entropy(model(i).flatten(0, 1), targets.flatten()), idx)
    assert report.saved and all(nbytes > 0 for _, _, nbytes in report.saved)
    assert "saved for backward" in str(report)


class CheckpointedGPT(GPT):
    def forward(self, idx, targets):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def test_activation_checkpointing_saves_less_and_keeps_gradients():
    config = tiny_config()
    config.n_layer = 4
    torch.manual_seed(0)
    checkpointed = CheckpointedGPT(config).train()
    plain = copy.deepcopy(checkpointed)
    plain.forward = lambda idx, targets: GPT.forward(plain, idx, targets)[1]
    x, y = torch.randint(0, 96, (4, 32)), torch.randint(0, 96, (4, 32))
    saved, grads = {}, {}
    for name, model in (("checkpointed", checkpointed), ("plain", plain)):
        jitted = fulmen.jit(model)
        with SavedTensors(*model.parameters(), *model.buffers(), x, y) as record:
            loss = jitted(x, y)
        loss.backward()
        saved[name] = record.activation_bytes
        grads[name] = [p.grad for p in model.parameters()]
    assert saved["checkpointed"] < saved["plain"] / 4
    for got, want in zip(grads["checkpointed"], grads["plain"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # eager checkpointing gives the same grads
    checkpointed.zero_grad(set_to_none=True)
    checkpointed(x, y).backward()
    for got, want in zip(grads["checkpointed"], [p.grad for p in checkpointed.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_checkpointed_region_is_recomputed_in_the_backward():
    def f(x, w):
        h = torch.utils.checkpoint.checkpoint(lambda a: torch.tanh(a @ w) @ w, x, use_reentrant=False)
        return h.sum()

    x, w = torch.randn(8, 8), torch.randn(8, 8, requires_grad=True)
    jitted = fulmen.jit(f)
    jitted(x, w).backward()
    saved = [p.pname for p in jitted.last_entry.program.plan.saved]
    assert set(saved) <= {"x", "w"}  # the region's inside (the matmul, the tanh) is recomputed, not saved
    backward = fulmen.last_backward_traces(jitted)[-1].python()
    assert "torch.tanh" in backward and backward.count("torch.matmul") >= 3
    got = w.grad.clone()
    w.grad = None
    f(x, w).backward()
    torch.testing.assert_close(got, w.grad)


def test_autocast_bf16_matches_eager_dtypes_and_values():
    torch.manual_seed(0)
    model = GPT(tiny_config()).train()
    jitted = fulmen.jit(model)
    x, y = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = jitted(x, y)
        eager_logits, eager_loss = model(x, y)
    assert (logits.dtype, loss.dtype) == (eager_logits.dtype, eager_loss.dtype) == (torch.bfloat16, torch.float32)
    torch.testing.assert_close(logits, eager_logits, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(loss, eager_loss, rtol=1.6e-2, atol=1e-3)
    assert_backward_matches_eager(model, loss, eager_loss, dtype=torch.float32)
    forward = fulmen.last_traces(jitted)[-1].python()
    assert "dtype=torch.bfloat16" in forward  # autocast's conversions are explicit in the trace
    # outside autocast, the same model is a different cache entry in float32
    logits32, _ = jitted(x, y)
    assert logits32.dtype == torch.float32 and fulmen.cache_misses(jitted) == 2


def test_autocast_region_inside_the_program():
    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x @ w
        return y.float().softmax(-1).sum(0), y

    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    (total, y), (expected_total, expected_y) = fulmen.jit(f)(x, w), f(x, w)
    assert y.dtype == expected_y.dtype == torch.bfloat16
    torch.testing.assert_close(total, expected_total)


def test_activation_memory_budget_trades_saved_bytes_for_recomputed_matmuls():
    """Below 1, the backward recomputes linears (the cheapest per byte first) until the saved activations fit the
    budget; grads stay eager's, and the peak falls. At 0, recomputing every linear would keep more alive than
    saving (the residual stream recomputed for the last layer's backward, then kept for the others'): fewer are."""
    model = _litgpt_4_layers()
    vocab = model.config.padded_vocab_size
    idx, targets = torch.randint(0, vocab, (4, 32)), torch.randint(0, vocab, (4, 32))

    def loss_fn(net):
        return F.cross_entropy(net(idx).flatten(0, 1), targets.flatten())

    loss_fn(model).backward()
    want = [p.grad.clone() for p in model.parameters()]
    saved, peaks, recomputed = {}, {}, {}
    for budget in (1.0, 0.5, 0.0):
        model.zero_grad(set_to_none=True)
        jitted = fulmen.jit(loss_fn, options=fulmen.JitOptions(activation_memory_budget=budget))
        record, peaks[budget] = _measure(lambda jitted=jitted: jitted(model), [*model.parameters(),
                                                                               *model.buffers(), idx, targets])
        saved[budget] = record.activation_bytes
        for got, expected in zip([p.grad for p in model.parameters()], want, strict=True):
            torch.testing.assert_close(got, 2 * expected)  # the warm-up's grads and the measured step's
        backward = fulmen.last_backward_traces(jitted)[-1].python()
        recomputed[budget] = backward.count("torch.nn.functional.linear(")
    print(f"\nsaved {saved}, peak {peaks}, linears in the backward {recomputed}")
    assert saved[0.5] <= 0.5 * saved[1.0] and saved[0.0] < saved[0.5]
    assert recomputed[1.0] < recomputed[0.5] < recomputed[0.0]
    assert peaks[0.5] < peaks[1.0] and peaks[0.0] < peaks[1.0]


def test_activation_memory_budget_over_lengths_is_decided_once():
    """A symbolic trace's saved-for-backward choice is made once, at its traced call's sizes: it recomputes what a
    static trace of that call recomputes, and serves every length with eager's loss and grads (bit for bit)."""
    torch.manual_seed(0)
    model = LitGPT(shrunk("Llama-3.1-8B")).train()
    vocab = model.config.padded_vocab_size
    options = fulmen.JitOptions(activation_memory_budget=0.5)

    def step(net, idx):
        loss = F.cross_entropy(net(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return loss, grads

    jitted = fulmen.jit(model, options=options)
    for batch, length in [(2, 8), (3, 12), (2, 16), (4, 9), (2, 30)]:
        idx = torch.randint(0, vocab, (batch, length))
        (loss, grads), (want, want_grads) = step(jitted, idx), step(model, idx)
        assert torch.equal(loss, want), (batch, length)
        for got, expected in zip(grads, want_grads, strict=True):
            assert torch.equal(got, expected), (batch, length)
    assert fulmen.cache_misses(jitted) == 2
    static = fulmen.jit(model, options=dataclasses.replace(options, dynamic=False))
    step(static, torch.randint(0, vocab, (3, 12)))  # the call the symbolic trace was made for
    unbudgeted = fulmen.jit(model)
    step(unbudgeted, torch.randint(0, vocab, (3, 12)))

    def plan(j):
        backward = fulmen.last_backward_traces(j)[-1]
        return len(backward.inputs), str(backward).count("torch.nn.functional.linear(")

    assert '"cpu i64[s0, s1]"' in str(fulmen.last_traces(jitted)[-1])
    assert plan(jitted) == plan(static) and plan(static)[1] > plan(unbudgeted)[1]


def test_activation_memory_budget_is_a_share():
    for budget in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="activation_memory_budget must be a number in"):
            fulmen.JitOptions(activation_memory_budget=budget)
