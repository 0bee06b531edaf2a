"""The fused, chunked linear + cross-entropy (fulmen.transforms.fused_loss) against eager.

- Loss and grads of h, W (and the bias) equal eager's (fp32, rtol 1e-5) for vocabularies that do and do not divide
  the chunk, ignore_index rows, every row ignored, reductions mean/sum/none, label smoothing, W frozen, h without
  grad, a tied embedding, gradient accumulation across calls, no grad mode.
- No trace (forward or backward) holds a tensor of the full logits' size, and the forward saves neither the logits
  nor h; on a small LitGPT model the saved bytes drop by more than the logits' size.
- LitGPT's chunked_cross_entropy, `.float()` upcasts and autocast are recognised with eager's dtypes; logits that are
  returned or read elsewhere, class weights and logits from elsewhere are declined with the reason in the trace.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from litgpt.model import GPT as LitGPT
from litgpt.utils import chunked_cross_entropy

import fulmen
from fulmen.memory import PeakMemory, SavedTensors
from fulmen.ops import fused_loss
from fulmen.transforms.fused_loss import PROVENANCE
from tests.models.gpt2_seed import GPT, tiny_config
from tests.models.litgpt_configs import shrunk

FUSED = {fused_loss.LINEAR_CROSS_ENTROPY, fused_loss.LINEAR_CROSS_ENTROPY_FORWARD,
         fused_loss.LINEAR_CROSS_ENTROPY_BACKWARD, fused_loss.LINEAR_CROSS_ENTROPY_ROWS_BACKWARD}
CE = "torch.nn.functional.cross_entropy"


def _options(chunk_rows: int | None = None, fuse: bool = True) -> fulmen.JitOptions:
    return fulmen.JitOptions(fuse_linear_cross_entropy=fuse, cross_entropy_chunk_rows=chunk_rows)


def _symbols(jitted) -> set[str]:
    traces = [fulmen.last_traces(jitted)[-1], *fulmen.last_backward_traces(jitted)[-1:]]
    return {bsym.sym.printed for trace in traces for bsym in trace.bound_symbols}


def _fusion_note(jitted) -> str:
    notes = [t.provenance for t in fulmen.last_traces(jitted) if t.provenance.startswith(PROVENANCE)]
    assert len(notes) == 1
    return notes[0]


def _largest(jitted) -> int:
    """The most elements of any tensor the final forward and backward traces compute or read."""
    traces = [fulmen.last_traces(jitted)[-1], *fulmen.last_backward_traces(jitted)[-1:]]
    sizes = [p.numel() for trace in traces for bsym in trace.bound_symbols
             for p in bsym.proxy_args() + bsym.proxy_outputs()]
    return max(sizes)


def _leaves(*tensors, grads=None):
    grads = grads or [True] * len(tensors)
    return [t.detach().clone().requires_grad_(g and t.is_floating_point()) for t, g in zip(tensors, grads)]


def _run(fn, tensors, cotangent=None):
    out = fn(*tensors)
    out.backward(cotangent if cotangent is not None else torch.ones_like(out))
    return out.detach(), [t.grad for t in tensors if t.requires_grad]


def check(fn, tensors, options, grads=None, cotangent_like=False, executors=None, grad_atol=1e-6):
    """fn jitted with `options` against eager on the same inputs: output, and grads of the inputs requiring them."""
    jitted = fulmen.jit(fn, executors=executors, options=options)
    ours = _leaves(*tensors, grads=grads)
    out = jitted(*ours)
    cotangent = torch.randn_like(out) if cotangent_like else torch.ones_like(out)
    out.backward(cotangent)
    theirs = _leaves(*tensors, grads=grads)
    expected, expected_grads = _run(fn, theirs, cotangent)
    torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-7, equal_nan=True)
    assert len([t for t in ours if t.requires_grad]) == len(expected_grads)
    for got, want in zip((t.grad for t in ours if t.requires_grad), expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=grad_atol)
    return jitted


def _head(reduction="mean", label_smoothing=0.0, bias=False):
    def loss(h, w, t, *b):
        logits = F.linear(h, w, b[0] if bias else None)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1), reduction=reduction,
                               label_smoothing=label_smoothing)

    return loss


def _inputs(vocab=37, rows=(3, 7), hidden=16, ignored=True):
    h, w = torch.randn(*rows, hidden), torch.randn(vocab, hidden) / 4
    t = torch.randint(0, vocab, rows)
    if ignored:
        t[0, ::3] = -100
    return h, w, t


@pytest.mark.parametrize("chunk_rows", [4, 7, 21, 64])  # 21 rows: chunks that do and do not divide them
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("vocab", [37, 48])
def test_loss_and_grads_equal_eagers(chunk_rows, reduction, vocab):
    h, w, t = _inputs(vocab)
    jitted = check(_head(reduction), [h, w, t], _options(chunk_rows), cotangent_like=reduction == "none")
    used = _symbols(jitted)
    assert CE not in used and "torch.nn.functional.linear" not in used
    if reduction == "none":  # a cotangent per row: the backward recomputes the logits
        assert {"fused_loss.linear_cross_entropy", "fused_loss.linear_cross_entropy_rows_backward"} <= used
    else:
        assert {"fused_loss.linear_cross_entropy_forward", "fused_loss.linear_cross_entropy_backward"} <= used
    assert f"chunks of {min(chunk_rows, 21)} rows" in _fusion_note(jitted)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_label_smoothing_and_bias(reduction):
    h, w, t = _inputs(41)
    check(_head(reduction, label_smoothing=0.1, bias=True), [h, w, t, torch.randn(41)], _options(5),
           cotangent_like=reduction == "none")


def test_every_row_ignored_gives_eagers_nan_and_zero_grads():
    h, w, t = _inputs()
    t.fill_(-100)
    jitted = check(_head("mean"), [h, w, t], _options(4))
    assert torch.isnan(jitted(h, w, t))
    check(_head("sum"), [h, w, t], _options(4))


def test_empty_logits_are_declined():
    jitted = check(_head(), [torch.randn(0, 3, 4), torch.randn(5, 4), torch.zeros(0, 3, dtype=torch.long)], _options())
    assert "the logits are empty" in _fusion_note(jitted)


@pytest.mark.parametrize("grads", [(False, True, False), (True, False, False)], ids=["h_without_grad", "W_frozen"])
def test_only_the_inputs_that_require_grad_get_one(grads):
    h, w, t = _inputs()
    jitted = check(_head(), [h, w, t], _options(6), grads=grads)
    forward = fulmen.last_traces(jitted)[-1].python()
    assert f"wants=({grads[0]}, {grads[1]}, False)" in forward  # only the wanted grads are computed and saved
    saved = jitted.last_entry.program.plan.saved
    assert len([p for p in saved if p.shape in (h.shape, w.shape)]) == 1


def _saved_activations(jitted, inputs: set[str]) -> list[tuple[int, ...]]:
    return sorted(tuple(p.shape) for p in jitted.last_entry.program.plan.saved if p.pname not in inputs)


def test_no_tensor_of_the_logits_size_and_neither_logits_nor_h_saved():
    rows, vocab, hidden = (4, 1024), 512, 8
    h, w, t = _inputs(vocab, rows, hidden)

    def model_and_loss(x, w1, w, t):
        return _head()(x @ w1, w, t)

    args = [torch.randn(*rows, hidden), torch.randn(hidden, hidden), w, t]
    jitted = check(model_and_loss, args, fulmen.JitOptions())  # chunks chosen from memory: half the rows
    assert "chunks of 2048 rows" in _fusion_note(jitted)
    assert _largest(jitted) == 4096 * hidden  # h: the chunks' logits exist inside the fused op only
    inputs = {"x", "w1", "w", "t"}
    assert _saved_activations(jitted, inputs) == [(4, 1024, 8), (512, 8)]  # the grads of h and W, not h or logits
    unfused = check(model_and_loss, args, _options(fuse=False))
    assert _largest(unfused) == 4096 * vocab
    assert (4096, vocab) in _saved_activations(unfused, inputs)


def test_automatic_chunks_are_a_fraction_of_the_logits():
    assert fused_loss.chunk_rows_for(8192, 128256, torch.bfloat16) == 2048  # Llama 3 at 4 x 2048: 4 chunks
    assert fused_loss.chunk_rows_for(8192, 32000, torch.bfloat16) == 4096  # TinyLlama: 2 chunks (half the logits)
    assert fused_loss.chunk_rows_for(500, 32000, torch.float32) == 500  # fewer rows: one chunk
    assert fused_loss.chunk_rows_for(2**16, 1000, torch.float32) == 2**15  # half of the logits
    assert fused_loss.chunk_rows_for(4096, 10, torch.float32) == 2048  # at least 1024 rows, at most half
    rows = fused_loss.chunk_rows_for(65536, 128256, torch.bfloat16)  # 512 MiB of logits at most
    assert rows % 64 == 0 and rows * 128256 * 2 <= fused_loss.CHUNK_BYTES
    # balanced: 8300 rows in 5 chunks of 1664 (the last 1644), not 4 of 2048 and a last one of 108
    assert fused_loss.chunk_rows_for(8300, 128256, torch.bfloat16) == 1664


def test_options_are_validated_and_the_flag_turns_the_fusion_off():
    with pytest.raises(ValueError, match="cross_entropy_chunk_rows"):
        fulmen.JitOptions(cross_entropy_chunk_rows=0)
    with pytest.raises(TypeError, match="fuse_linear_cross_entropy"):
        fulmen.JitOptions(fuse_linear_cross_entropy=1)
    h, w, t = _inputs()
    jitted = check(_head(), [h, w, t], _options(fuse=False))
    assert "torch.nn.functional.linear" in _symbols(jitted) and not _symbols(jitted) & {s.printed for s in FUSED}
    assert not any(t.provenance.startswith(PROVENANCE) for t in fulmen.last_traces(jitted))


def test_no_grad_runs_the_chunked_forward_only():
    h, w, t = _inputs(vocab=300, rows=(8, 16))
    jitted = fulmen.jit(_head(), options=_options(16))
    with torch.no_grad():
        with PeakMemory() as ours:
            loss = jitted(h, w, t)
        with PeakMemory() as eager:
            expected = _head()(h, w, t)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    assert {b.sym for b in fulmen.last_traces(jitted)[-1].bound_symbols} & FUSED == {fused_loss.LINEAR_CROSS_ENTROPY}
    logits_bytes = 128 * 300 * 4
    assert eager.peak >= logits_bytes > 2 * ours.peak


def test_reduction_none_read_by_other_ops_and_the_sum_of_none():
    h, w, t = _inputs()
    weights = torch.rand(21)

    def weighted(h, w, t, weights):
        losses = F.cross_entropy(F.linear(h, w).flatten(0, 1), t.flatten(), reduction="none")
        return (losses * weights).sum() / weights.sum()

    jitted = check(weighted, [h, w, t, weights], _options(8))
    assert "fused_loss.linear_cross_entropy_rows_backward" in _symbols(jitted)

    def summed(h, w, t):  # per-row losses only summed: the sum reduction, grads in the forward
        return F.cross_entropy(F.linear(h, w).flatten(0, 1).float(), t.flatten(), reduction="none").sum()

    jitted = check(summed, [h, w, t], _options(8))
    assert "fused_loss.linear_cross_entropy_forward" in _symbols(jitted)
    assert "sum, chunks of 8 rows" in _fusion_note(jitted)


def test_litgpt_chunked_cross_entropy_is_one_fused_loss():
    h, w, t = _inputs(vocab=50, rows=(2, 23))

    def loss(h, w, t):
        return chunked_cross_entropy(F.linear(h, w), t, chunk_size=10)

    jitted = check(loss, [h, w, t], _options(16))
    used = _symbols(jitted)
    assert CE not in used and "torch.Tensor.split" not in used and "torch.cat" not in used
    assert "(46 rows x 50 classes, sum, chunks of 16 rows)" in _fusion_note(jitted)
    t.fill_(-100)  # its max(1, n) denominator: 0, not NaN
    assert check(loss, [h, w, t], _options(16))(h, w, t) == 0


@pytest.mark.parametrize("case", ["returned", "read", "weights", "softcapped", "split_columns", "two_roundings"])
def test_declines_with_the_reason_and_computes_eagers_values(case):
    h, w, t = _inputs()

    def returned(h, w, t):
        logits = F.linear(h, w)
        return F.cross_entropy(logits.flatten(0, 1), t.flatten()), logits

    def read(h, w, t):
        logits = F.linear(h, w).flatten(0, 1)
        return F.cross_entropy(logits, t.flatten()) + logits.logsumexp(1).mean()

    def weights(h, w, t):
        return F.cross_entropy(F.linear(h, w).flatten(0, 1), t.flatten(), weight=torch.linspace(0.5, 1, w.shape[0]))

    def softcapped(h, w, t):
        return F.cross_entropy(torch.tanh(F.linear(h, w) / 30).flatten(0, 1) * 30, t.flatten())

    def split_columns(h, w, t):
        a, b = F.linear(h, w).flatten(0, 1).split([20, 17], dim=1)
        return F.cross_entropy(a, t.flatten() % 20) + F.cross_entropy(b, t.flatten() % 17)

    def two_roundings(h, w, t):
        return F.cross_entropy(F.linear(h, w).bfloat16().flatten(0, 1).double(), t.flatten())

    reasons = {"returned": "also returned by the program", "read": "also read by torch.logsumexp at test_fused",
               "weights": "class weights", "softcapped": "from torch.mul at test_fused_loss.py",
               "split_columns": "not into row chunks", "two_roundings": "converted through several dtypes"}
    fn = locals()[case]
    jitted = fulmen.jit(fn, options=_options(4))
    ours, theirs = _leaves(h, w, t), _leaves(h, w, t)
    out, expected = jitted(*ours), fn(*theirs)
    loss, expected_loss = (out[0], expected[0]) if case == "returned" else (out, expected)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    assert loss.dtype == expected_loss.dtype
    loss.backward()
    expected_loss.backward()
    torch.testing.assert_close(ours[1].grad, theirs[1].grad, rtol=1e-5, atol=1e-6)
    assert reasons[case] in _fusion_note(jitted) and "declined at test_fused_loss.py" in _fusion_note(jitted)
    assert not _symbols(jitted) & {s.printed for s in FUSED}
    assert reasons[case] in "\n".join(fulmen.examine(fn, *_leaves(h, w, t)).fused_losses)


def test_tied_embedding_and_gradient_accumulation_across_calls():
    torch.manual_seed(0)
    model = GPT(tiny_config()).train()
    assert model.lm_head.weight is model.transformer.wte.weight
    jitted = fulmen.jit(lambda idx, targets: model(idx, targets)[1], options=_options(24))
    batches = [(torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))) for _ in range(2)]
    batches[1][1][:, :5] = -1  # the model's ignore_index
    for idx, targets in batches:
        (jitted(idx, targets) / 2).backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for idx, targets in batches:
        (model(idx, targets)[1] / 2).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert "fused_loss.linear_cross_entropy_forward" in _symbols(jitted)


def _litgpt(vocab: int = 2048) -> LitGPT:
    config = shrunk("Llama-3.2-1B")
    config.vocab_size = config.padded_vocab_size = vocab
    torch.manual_seed(0)
    return LitGPT(config).train()


def _saved(model, step, jitted_step, idx, targets):
    results = []
    for fn in (step, jitted_step):
        fn(idx, targets).backward()  # compile outside the measurement
        model.zero_grad(set_to_none=True)
        with SavedTensors(*model.parameters(), *model.buffers(), idx, targets) as saved:
            loss = fn(idx, targets)
        loss.backward()
        results.append((loss.detach(), saved, {n: p.grad.clone() for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    return results


def test_litgpt_saved_bytes_drop_by_more_than_the_logits():
    """Autocast bf16 (Fabric's "bf16-mixed"): eager keeps the float32 log-softmax of every logit; the fused loss
    keeps the bf16 grads of h and of the (bf16 copy of the) lm_head weight instead."""
    model = _litgpt()
    vocab = model.config.padded_vocab_size
    idx, targets = torch.randint(0, vocab, (4, 32)), torch.randint(0, vocab, (4, 32))

    def step(idx, targets):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(idx)
            return chunked_cross_entropy(logits, targets)

    jitted = fulmen.jit(step)
    (eager_loss, eager, eager_grads), (loss, ours, grads) = _saved(model, step, jitted, idx, targets)
    logits_bytes = 4 * 32 * vocab * 2  # bf16 logits
    print(f"\nsaved activations: eager {eager.activation_bytes} B, fused {ours.activation_bytes} B, "
          f"logits {logits_bytes} B")
    assert eager.activation_bytes - ours.activation_bytes >= logits_bytes
    assert loss.dtype == eager_loss.dtype == torch.float32
    torch.testing.assert_close(loss, eager_loss, rtol=2e-3, atol=0)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=5e-2, atol=2e-3, msg=name)
    assert "fused_loss.linear_cross_entropy_forward" in _symbols(jitted)


def test_litgpt_fp32_saves_less_and_matches_eager():
    """fp32: the forward saves grads of h and W instead of h and the log-softmax; that is the logits' size less
    the weight's, and everything else the same."""
    model = _litgpt()
    vocab, hidden = model.config.padded_vocab_size, model.config.n_embd
    idx, targets = torch.randint(0, vocab, (4, 32)), torch.randint(0, vocab, (4, 32))
    targets[:, -3:] = -100

    def step(idx, targets):
        logits = model(idx)
        return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

    (eager_loss, eager, eager_grads), (loss, ours, grads) = _saved(model, step, fulmen.jit(step), idx, targets)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    logits_bytes, weight_bytes = 128 * vocab * 4, vocab * hidden * 4
    assert eager.activation_bytes - ours.activation_bytes >= logits_bytes - weight_bytes


def test_bf16_upcast_keeps_eagers_dtypes():
    h, w, t = (x.to(torch.bfloat16) if x.is_floating_point() else x for x in _inputs(vocab=64))

    def loss(h, w, t):
        return F.cross_entropy(F.linear(h, w).float().flatten(0, 1), t.flatten())

    jitted = fulmen.jit(loss, options=_options(5))
    ours, theirs = _leaves(h, w, t), _leaves(h, w, t)
    got, expected = jitted(*ours), loss(*theirs)
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)  # the same bf16 logits, the same fp32 maths
    got.backward()
    expected.backward()
    for ours_grad, eager_grad in ((ours[0].grad, theirs[0].grad), (ours[1].grad, theirs[1].grad)):
        assert ours_grad.dtype == eager_grad.dtype == torch.bfloat16
        torch.testing.assert_close(ours_grad, eager_grad, rtol=1.6e-2, atol=1e-4)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_written_for_inductor_equals_the_in_place_step(label_smoothing, dtype):
    # The compiled chunk step is a scatter-free form of the eager one: the same values, bit for bit.
    logits = torch.randn(37, 101, dtype=dtype)
    target = torch.randint(0, 101, (37,))
    target[::4] = -100
    row_scale = torch.rand(37)
    ours = fused_loss.fusible_chunk_step(logits.clone(), target, row_scale, -100, label_smoothing, torch.float32, True)
    theirs = fused_loss.chunk_step(logits.clone(), target, row_scale, -100, label_smoothing, torch.float32, True)
    assert ours[1].dtype == dtype
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    # both return the gradient in the logits' own buffer: a chunk never holds the two at once
    given = logits.clone()
    assert fused_loss.chunk_step(given, target, row_scale, -100, label_smoothing, torch.float32, True)[1] is given
    given = logits.clone()
    assert fused_loss.fusible_chunk_step(given, target, row_scale, -100, label_smoothing, torch.float32,
                                         True)[1] is given
    assert torch.equal(given, theirs[1])
    assert ours[1][::4].abs().sum() == 0 and ours[1][1].abs().sum() > 0  # ignored rows get no gradient


def test_torchcompile_executor_compiles_the_chunk_step():
    from torch._dynamo.utils import counters

    h, w, t = _inputs(vocab=40, rows=(2, 9))
    jitted = fulmen.jit(_head(), executors=["torchcompile"], options=_options(5))
    ours, theirs = _leaves(h, w, t), _leaves(h, w, t)
    fused_loss._compiled_step.cache_clear()  # steps an earlier test of this process compiled count no variants here
    counters.clear()
    loss = jitted(*ours)
    loss.backward()
    expected = _head()(*theirs)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(ours[1].grad, theirs[1].grad, rtol=1e-5, atol=1e-6)
    assert "compiled=True" in fulmen.last_traces(jitted)[-1].python()
    # compiled without Dynamo (no guards per chunk): one variant per chunk length, 18 rows in chunks of 5 and 3
    assert counters["stats"]["unique_graphs"] == 0
    step = fused_loss._compiled_step(-100, 0.0, torch.float32, True, None)  # a static trace: by chunk layout
    assert sorted(shape[0][0][0] for shape in step.variants) == [3, 5]


# ---- CUDA (run on the device machine: pytest -m cuda tests/transforms) -------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("executors", [["torch"], ["torchcompile", "torch"]], ids=["torch", "torchcompile"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cuda_fp32_equals_eager(executors, reduction):
    h, w, b = torch.randn(4, 500, 128, device="cuda"), torch.randn(5000, 128, device="cuda") / 8, \
        torch.randn(5000, device="cuda")
    t = torch.randint(0, 5000, (4, 500), device="cuda")
    t[:, ::3] = -100
    # cuBLAS adds the weight gradient's per-chunk partials in another order than one matmul over all rows does
    jitted = check(_head(reduction, bias=True), [h, w, t, b], _options(384), cotangent_like=True,
                   executors=executors, grad_atol=1e-5)
    assert ("compiled=True" in fulmen.last_traces(jitted)[-1].python()) == ("torchcompile" in executors)


@pytest.mark.cuda
@pytest.mark.parametrize("cotangent_dtype", [torch.bfloat16, torch.float32])
def test_cuda_backward_scales_gradients_as_a_product_by_the_cotangent_does(cotangent_dtype):
    grads = (torch.randn(128256, 256, device="cuda", dtype=torch.bfloat16),
             torch.randn(8192, 256, device="cuda", dtype=torch.bfloat16))
    g = torch.tensor(0.3712, device="cuda", dtype=cotangent_dtype)
    scaled = fused_loss.linear_cross_entropy_backward(g, grads)
    assert all(torch.equal(ours, grad * g) for ours, grad in zip(scaled, grads, strict=True))


def _cuda_step(fuse: bool, rows=8192, vocab=128256, hidden=1024, executors=None):
    torch.manual_seed(0)
    h = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda") / 32).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, vocab, (rows,), device="cuda")

    def loss(h, w, t):  # LitGPT's way: bf16 logits upcast for the loss
        return F.cross_entropy(F.linear(h, w).float(), t)

    jitted = fulmen.jit(loss, options=_options(fuse=fuse), executors=executors)
    jitted(h, w, t).backward()  # compile outside the measurement
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    value = jitted(h, w, t)
    value.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return value.detach(), h.grad, w.grad, peak


@pytest.mark.cuda
def test_cuda_bf16_peak_drops_by_more_than_the_logits_and_values_stay_eagers():
    """Llama 3's vocabulary at 8192 tokens: the unfused step holds bf16 logits, their fp32 upcast and gradients."""
    fused_loss_value, fused_h, fused_w, fused_peak = _cuda_step(True)
    loss, grad_h, grad_w, peak = _cuda_step(False)
    logits_bytes = 8192 * 128256 * 2
    print(f"\npeak above the inputs: unfused {peak / 2**30:.2f} GiB, fused {fused_peak / 2**30:.2f} GiB")
    assert peak - fused_peak >= logits_bytes
    torch.testing.assert_close(fused_loss_value, loss, rtol=1e-4, atol=0)  # same bf16 logits, fp32 maths both
    torch.testing.assert_close(fused_h.float(), grad_h.float(), rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(fused_w.float(), grad_w.float(), rtol=2 ** -6, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("executors", [None, ["torch"]], ids=["compiled", "torch"])
def test_cuda_chunk_gradients_overwrite_their_logits(executors):
    """A chunk's gradient is written over its logits (by Inductor's kernel, or by copy_ after the uncompiled step's
    fp32 work), so the fused call's transients are one chunk of logits (plus, uncompiled, their fp32 copy and
    torch.logsumexp's fp32 temporary) and the fp32 weight-gradient accumulator; the bf16 weight gradient follows
    the accumulator."""
    rows, vocab, hidden = 8192, 128256, 1024
    chunk = fused_loss.chunk_rows_for(rows, vocab, torch.bfloat16) * vocab
    transients = chunk * (2 if executors is None else 2 + 4 + 4) + vocab * hidden * 4 + (vocab + rows) * hidden * 2
    _, _, _, peak = _cuda_step(True, rows, vocab, hidden, executors)
    print(f"\npeak above the inputs {peak / 2**20:.0f} MiB, bound {transients / 2**20:.0f} MiB")
    # a gradient beside the logits would add a chunk's bf16 bytes (512 MiB here) to this bound
    assert peak <= transients + 32 * 2**20


def test_the_chunk_buffers_are_declared_as_the_calls_workspace():
    # Memory planning counts them at the call (Symbol.scratch): a chunk's logits (which then hold their gradient),
    # the uncompiled step's fp32 copy of them and torch.logsumexp's fp32 temporary, and the fp32 weight-gradient
    # accumulator of bf16 weights.
    h = torch.randn(4, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(100, 32, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 100, (64,))
    jitted = fulmen.jit(lambda h, w, t: F.cross_entropy(F.linear(h, w).reshape(-1, 100), t),
                        options=fulmen.JitOptions(cross_entropy_chunk_rows=16))
    jitted(h, w, t)
    (call,) = [b for b in fulmen.last_traces(jitted)[-1].bound_symbols if b.sym.scratch is not None]
    assert call.sym is fused_loss.LINEAR_CROSS_ENTROPY_FORWARD
    assert call.sym.scratch(*call.args, **call.kwargs) == 16 * 100 * (2 + 4 + 4) + 100 * 32 * 4
    assert call.sym.scratch(*call.args, **call.kwargs | {"compiled": True}) == 16 * 100 * 2 + 100 * 32 * 4
