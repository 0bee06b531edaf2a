"""LitGPT models trained over many lengths and batch sizes through one trace with symbolic sizes (and the static
trace of the first call): every loss, grad and parameter equal to eager's on the same batches."""

from __future__ import annotations

import copy

import pytest
import torch
from litgpt.model import GPT

import fulmen
from tests.models.litgpt_configs import shrunk

# GPT-NeoX (parallel residual, LayerNorm, partial rotary), Llama 3 (RMSNorm, grouped-query attention, SwiGLU, RoPE),
# Falcon (multi-query attention, parallel residual)
FAMILIES = ["pythia-14m", "Llama-3.1-8B", "falcon-7b"]
# (batch, length): the second batch changes both, so the second trace makes both symbolic; 32 is the block size
BATCHES = [(2, 5), (3, 9), (2, 12), (4, 7), (3, 32), (2, 2), (5, 17)]


def _model(name: str) -> GPT:
    torch.manual_seed(0)
    return GPT(shrunk(name)).train()


def _batch(model: GPT, batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.padded_vocab_size
    idx = torch.randint(0, vocab, (batch, length), generator=generator)
    return idx, torch.randint(0, vocab, (batch, length), generator=generator)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("name", FAMILIES)
def test_trains_over_lengths_and_batch_sizes_in_two_traces_as_eager(name):
    """fulmen.jit(model) with the loss outside (as LitGPT's finetuning scripts): AdamW steps over 7 shapes, losses,
    grads and the parameters after each step equal eager's bit for bit, in 2 traces."""
    eager = _model(name)
    model = copy.deepcopy(eager)
    jitted = fulmen.jit(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model)]
    for step, (batch, length) in enumerate(BATCHES):
        idx, targets = _batch(eager, batch, length, step)
        losses = []
        for m in (eager, jitted):
            loss = _loss(m(idx), targets)
            loss.backward()
            losses.append(loss)
        assert torch.equal(losses[1], losses[0]), (name, batch, length)
        for (key, want), got in zip(eager.named_parameters(), model.parameters()):
            assert torch.equal(got.grad, want.grad), (name, batch, length, key)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for want, got in zip(eager.parameters(), model.parameters()):
        assert torch.equal(got, want)
    assert fulmen.cache_misses(jitted) == 2, fulmen.last_cache_miss_reasons(jitted)
    # the symbolic trace: batch and length are its inputs' symbols, the parameters static
    source = fulmen.last_traces(jitted)[-1].python()
    assert '# idx: "cpu i64[s0, s1]"' in source and "s1 = idx.shape[1]" in source, source[:2000]


def _close_to_eager(jitted, step, model, idx, targets, loss_tol, grad_tol):
    """The jitted step's loss and grads close to `step`'s run eagerly on the same batch ((rtol, atol) each); the
    jitted loss and grads, the model's grads cleared."""
    loss = jitted(idx, targets)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    expected = step(idx, targets)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=loss_tol[0], atol=loss_tol[1])
    for got, (key, p) in zip(grads, model.named_parameters()):
        torch.testing.assert_close(got, p.grad, rtol=grad_tol[0], atol=grad_tol[1], msg=lambda m, k=key: f"{k}: {m}")
    model.zero_grad(set_to_none=True)
    return loss, grads


def test_a_length_past_the_block_size_fails_as_eager_fails():
    model = _model("Llama-3.1-8B")
    jitted = fulmen.jit(model)
    for step, (batch, length) in enumerate([(2, 5), (3, 9), (2, 32)]):
        idx, _ = _batch(model, batch, length, step)
        assert torch.equal(jitted(idx), model(idx))
    idx, _ = _batch(model, 2, 33, 3)
    message = "Cannot forward sequence of length 33, max seq length is only 32"
    with pytest.raises(ValueError, match=message):
        model(idx)
    with pytest.raises(ValueError, match=message):
        jitted(idx)
    idx, _ = _batch(model, 3, 20, 4)
    assert torch.equal(jitted(idx), model(idx))
    assert fulmen.cache_misses(jitted) == 3  # static, symbolic, and the refused call (traced to raise eager's error)


def test_the_jitted_step_with_its_fused_loss_traces_twice():
    """The loss inside the jitted function: the fused linear + cross-entropy chooses its chunks from each call's rows;
    loss and grads close to eager's (its chunks sum in another order) and equal to the static trace's."""
    model = _model("pythia-14m")
    static = _model("pythia-14m")

    def step(idx, targets):
        return _loss(model(idx), targets)

    def static_step(idx, targets):
        return _loss(static(idx), targets)

    jitted = fulmen.jit(step)
    for n, (batch, length) in enumerate(BATCHES[:5]):
        idx, targets = _batch(model, batch, length, n)
        loss, grads = _close_to_eager(jitted, step, model, idx, targets, loss_tol=(1e-5, 0), grad_tol=(1e-5, 1e-7))
        if n == 3:  # the symbolic trace computes what a static trace of this shape computes, bit for bit
            reference = fulmen.jit(static_step, options=fulmen.JitOptions(dynamic=False))
            static_loss = reference(idx, targets)
            static_loss.backward()
            assert torch.equal(loss, static_loss)
            for got, want in zip(grads, static.parameters()):
                assert torch.equal(got, want.grad)
    assert fulmen.cache_misses(jitted) == 2, fulmen.last_cache_miss_reasons(jitted)
    assert any("chunks chosen from the rows per call" in t.provenance for t in fulmen.last_traces(jitted))


def test_the_compiled_chunk_step_of_a_symbolic_trace_compiles_once_for_every_length(monkeypatch):
    """With the torchcompile executor the fused loss's chunk step is compiled by Inductor. A trace of symbolic rows
    chooses its chunks from each call's rows, so a step compiled per chunk length compiled again at nearly every new
    length (1.2-3 s each on the H200 in benchmarks/variable_lengths.py); compiled for symbolic rows it compiles once
    (and once more for a chunk of one row, which specialises), and computes what the static trace computes."""
    from fulmen.ops import fused_loss

    model, static = _model("pythia-14m"), _model("pythia-14m")
    executors = ["sdpa", "torchcompile"]
    jitted = fulmen.jit(lambda idx, targets: _loss(model(idx), targets), executors=executors)
    reference = fulmen.jit(lambda idx, targets: _loss(static(idx), targets), executors=executors,
                           options=fulmen.JitOptions(dynamic=False))
    made = []

    class Recorded(fused_loss.InductorFunction):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(fused_loss, "InductorFunction", Recorded)
    fused_loss._compiled_step.cache_clear()  # steps compiled before this test are not recorded
    for n, (batch, length) in enumerate([(2, 5), (3, 9), (2, 12), (3, 7), (2, 17)]):
        idx, targets = _batch(model, batch, length, n)
        loss, want = jitted(idx, targets), reference(idx, targets)
        loss.backward()
        want.backward()
        assert torch.equal(loss, want), n
        for p, q in zip(model.parameters(), static.parameters()):
            assert torch.equal(p.grad, q.grad), n
    assert fulmen.cache_misses(jitted) == 2, fulmen.last_cache_miss_reasons(jitted)
    assert "compiled=True" in fulmen.last_traces(jitted)[-1].python()
    symbolic = [step for step in made if step._dynamic is not None]
    assert symbolic and all(len(step.guarded) <= 2 for step in symbolic)
    fused_loss._compiled_step.cache_clear()  # no step of the recording class outlives the test


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device machine with -m cuda)")
def test_cuda_default_executors_train_over_lengths_in_two_traces():
    """On CUDA with the default executors (sdpa's fused attention, the torchcompile executor's regions compiled for
    symbolic sizes, the fused loss), in bf16: a Llama step over 5 lengths, loss and grads close to eager's at each,
    2 traces; sdpa runs the symbolic trace's attention and its regions are compiled for symbolic sizes."""
    torch.manual_seed(0)
    config = shrunk("Llama-3.1-8B")
    with torch.device("cuda"):
        model = GPT(config).to(torch.bfloat16)

    def step(idx, targets):
        return _loss(model(idx), targets)

    jitted = fulmen.jit(step)
    # the second batch changes both sizes, so the second trace makes both symbolic (a size becomes symbolic once it
    # changes: a batch size first changing at the fourth call would make a third trace)
    for n, (batch, length) in enumerate([(2, 16), (3, 24), (2, 32), (3, 8), (2, 20)]):
        idx, targets = (t.cuda() for t in _batch(model, batch, length, n))
        _close_to_eager(jitted, step, model, idx, targets, loss_tol=(2e-2, 2e-2), grad_tol=(5e-2, 5e-2))
    assert fulmen.cache_misses(jitted) == 2, fulmen.last_cache_miss_reasons(jitted)
    source = fulmen.last_traces(jitted)[-1].python()
    assert "s1 = idx.shape[1]" in source, source[:2000]
    assert "scaled_dot_product" in source, source[:4000]
    assert "TorchCompile0(" in source, source[:4000]
