"""A whole training step in one trace (issue 50): forward, loss.backward(), optimizer.step() and zero_grad() jitted
together train as eager does, bit for bit on CPU, and reuse their trace across steps.

Each test trains two identical copies, one through `fulmen.jit(train_step)` and one eagerly, on the same batches, and
compares with torch.equal after every step: the loss, every parameter, every tensor of the optimizer's state (Adam's
exp_avg / exp_avg_sq / max_exp_avg_sq and step counter, SGD's momentum buffer) and `.grad` as eager leaves it (None
after zero_grad(set_to_none=True), the zeroed tensor otherwise). They run with the fused linear + cross-entropy off
(EXACT): it computes the loss chunk by chunk, equal to eager's to rounding (tests/transforms/test_fused_loss.py), so a
whole step with it is compared with the jitted forward's path, which fuses the same way.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.core.errors import TraceError
from tests.transforms.test_cudagraphs import simulated_graphs  # noqa: F401 - the CUDA graph simulator fixture

EXACT = fulmen.JitOptions(fuse_linear_cross_entropy=False)


def train_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def lm_loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def lm_step(model, optimizer, x, y):
    loss = lm_loss(model, x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def train_step_zeroing(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return loss


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 5))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=generator), torch.randint(0, 5, (8,), generator=generator)) for _ in range(n)]


def _assert_same(model, eager_model, optimizer, eager_optimizer) -> None:
    for (name, p), q in zip(model.named_parameters(), eager_model.parameters(), strict=True):
        assert torch.equal(p, q), name
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name
        state, eager_state = optimizer.state[p], eager_optimizer.state[q]
        assert state.keys() == eager_state.keys(), name
        for key in state:
            assert torch.equal(state[key], eager_state[key]), (name, key)
            assert state[key].dtype == eager_state[key].dtype and state[key].device == eager_state[key].device


def _train(make_optimizer, steps: int = 4, step_fn=train_step, scheduler=None, options=EXACT):
    model = _model()
    eager_model = copy.deepcopy(model)
    optimizer, eager_optimizer = make_optimizer(model.parameters()), make_optimizer(eager_model.parameters())
    schedulers = (scheduler(optimizer), scheduler(eager_optimizer)) if scheduler is not None else ()
    jitted = fulmen.jit(step_fn, options=options)
    for x, y in _batches(steps):
        loss, eager_loss = jitted(model, optimizer, x, y), step_fn(eager_model, eager_optimizer, x, y)
        assert torch.equal(loss, eager_loss.detach())
        _assert_same(model, eager_model, optimizer, eager_optimizer)
        for s in schedulers:
            s.step()
    return jitted, optimizer


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.05, foreach=False),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, foreach=False),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adam-amsgrad-fused": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, fused=True),
}
UNBATCHED = fulmen.JitOptions(optimizer_bucket_cap_mb=0, fuse_linear_cross_entropy=False)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("options", [EXACT, UNBATCHED], ids=["buckets", "one-by-one"])
def test_adam_family_step_is_eager_and_cached(name, options):
    jitted, _ = _train(OPTIMIZERS[name], steps=5, options=options)
    # the state is made before the first trace (as eager's first step makes it): the second call reuses it
    assert (fulmen.cache_misses(jitted), fulmen.cache_hits(jitted)) == (1, 4)
    trace = str(fulmen.last_traces(jitted)[-1])
    # in-place updates (eager's kernel on the tensors themselves): no copies of the parameters or the state, no
    # write-backs; the 6 parameters' updates in one bucket (the default's 32 MiB of grads), or one call each
    assert trace.count("optim.adam_update_(") == (1 if options is EXACT else 6) and "torch.autograd" not in trace
    assert "prims.copy_" not in trace and "optim.adam_update(" not in trace
    kernel = "fused" if "fused" in name else "multi_tensor" if "foreach" in name else "single_tensor"
    assert trace.count(f"kernel='{kernel}'") == trace.count("optim.adam_update_(")


@pytest.mark.parametrize("kernel", ["single_tensor", "multi_tensor", "fused"])
def test_sgd_momentum_step_is_eager_and_cached(kernel):
    make = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01,  # noqa: E731
                                     foreach=kernel == "multi_tensor", fused=kernel == "fused" or None)
    jitted, optimizer = _train(make, steps=5)
    # the first step makes the momentum buffers (a copy of the grad, as eager): a trace of its own, then one for
    # every later step
    assert (fulmen.cache_misses(jitted), fulmen.cache_hits(jitted)) == (2, 3)
    assert "momentum_buffer" in fulmen.last_cache_miss_reasons(jitted)[0] or "optimizer state" in \
        fulmen.last_cache_miss_reasons(jitted)[0]
    assert all("momentum_buffer" in optimizer.state[p] for p in optimizer.param_groups[0]["params"])
    # the first step's trace makes the buffers (functional updates, written back); every later one updates in place
    later = str(fulmen.last_traces(jitted)[-1])
    assert later.count("optim.sgd_update_(") == 1 and "prims.copy_" not in later
    assert f"kernel='{kernel}'" in later


def test_sgd_nesterov_and_plain():
    _train(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5, nesterov=True), steps=3)
    jitted, _ = _train(lambda p: torch.optim.SGD(p, lr=0.1), steps=3)
    assert (fulmen.cache_misses(jitted), fulmen.cache_hits(jitted)) == (1, 2)


def test_step_lr_scheduler_takes_effect():
    """StepLR halves lr every 2 steps between calls: lr is an input of the trace, read from the param group by each
    call, so the steps stay eager's in one trace."""
    jitted, optimizer = _train(lambda p: torch.optim.AdamW(p, lr=1e-2), steps=6,
                               scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    assert (fulmen.cache_misses(jitted), fulmen.cache_hits(jitted)) == (1, 5)


def test_lr_changing_every_step_reuses_the_trace():
    """A warm-up then cosine schedule (LambdaLR) gives every step another lr, with Adam and with SGD momentum."""
    def schedule(o):
        return torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 3) * (0.5 + 0.5 * math.cos(s / 7)))

    jitted, _ = _train(lambda p: torch.optim.Adam(p, lr=3e-3), steps=6, scheduler=schedule)
    assert (fulmen.cache_misses(jitted), fulmen.cache_hits(jitted)) == (1, 5)
    jitted, _ = _train(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), steps=5, scheduler=schedule)
    assert (fulmen.cache_misses(jitted), fulmen.cache_hits(jitted)) == (2, 3)


def test_other_hyperparameters_are_guarded():
    """A hyperparameter other than lr (here betas, as OneCycleLR's momentum cycle changes them) is a constant of the
    trace: a new value traces again, and the step stays eager's."""
    model = _model()
    eager_model = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    eager_optimizer = torch.optim.Adam(eager_model.parameters(), lr=1e-2)
    jitted = fulmen.jit(train_step, options=EXACT)
    for i, (x, y) in enumerate(_batches(3)):
        for o in (optimizer, eager_optimizer):
            o.param_groups[0]["betas"] = (0.9 - 0.1 * i, 0.99)
        assert torch.equal(jitted(model, optimizer, x, y), train_step(eager_model, eager_optimizer, x, y).detach())
        _assert_same(model, eager_model, optimizer, eager_optimizer)
    assert fulmen.cache_misses(jitted) == 3
    assert "betas=(0.8, 0.99)" in fulmen.last_cache_miss_reasons(jitted)[1]


def test_zero_grad_without_set_to_none():
    jitted, _ = _train(lambda p: torch.optim.Adam(p, lr=1e-2), steps=4, step_fn=train_step_zeroing)
    # the first call begins without grads, the next ones with the zeroed grads (updated in place from then on)
    assert (fulmen.cache_misses(jitted), fulmen.cache_hits(jitted)) == (2, 2)


def test_updates_follow_their_gradients():
    """Each parameter's update runs right after its gradient is complete, and its write-back right after its last
    read: the last layer's update comes before the first layer's gradient is computed."""
    jitted, _ = _train(OPTIMIZERS["adamw"], steps=1, options=UNBATCHED)
    final = fulmen.last_traces(jitted)[-1]
    provenance = [t.provenance for t in fulmen.last_traces(jitted)]
    assert "Optimizer updates right after their gradients" in provenance
    lines = str(final).splitlines()
    updates = [i for i, line in enumerate(lines) if "optim.adam_update_(" in line]
    matmuls = [i for i, line in enumerate(lines) if "torch.matmul(" in line]
    assert updates[0] < matmuls[-1]  # the head's update comes before the first layer's weight gradient


def _update_calls(jitted) -> list[str]:
    return [line for line in str(fulmen.last_traces(jitted)[-1]).splitlines() if "optim.adam_update_(" in line]


def test_updates_run_in_buckets_of_the_cap():
    """A cap of 400 bytes of grads (the model's are 916) splits the 6 updates into several calls, each parameter in
    exactly one, each call's grads deleted right after it."""
    jitted, _ = _train(OPTIMIZERS["adamw-foreach"], steps=3,
                       options=fulmen.JitOptions(optimizer_bucket_cap_mb=400 / 2**20,
                                                  fuse_linear_cross_entropy=False))
    calls = _update_calls(jitted)
    assert 1 < len(calls) < 6
    params = [name for call in calls for name in call.split("([", 1)[1].split("]", 1)[0].split(", ")]
    assert len(params) == len(set(params)) == 6
    lines = str(fulmen.last_traces(jitted)[-1]).splitlines()
    for i, line in enumerate(lines):
        if "optim.adam_update_(" in line:
            grads = line.split("], [", 1)[1].split("]", 1)[0].split(", ")
            assert lines[i + 1].strip().startswith("del ") and set(grads) <= set(lines[i + 1][6:].split(", "))


def train_step_reading_after(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss, model[0].weight.sum(), model[3].bias * 2


def train_two_steps(model, optimizer, x, y):
    for rows in (slice(0, 4), slice(4, 8)):
        loss = F.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("step_fn", [train_step_reading_after, train_two_steps])
def test_a_bucket_runs_before_what_reads_its_new_values(step_fn):
    """Reads of the updated parameters later in the program (the values it returns, a second step's forward) see
    the updates."""
    model = _model()
    eager_model = copy.deepcopy(model)
    optimizer, eager_optimizer = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](eager_model.parameters())
    jitted = fulmen.jit(step_fn, options=EXACT)
    for x, y in _batches(3):
        got, expected = jitted(model, optimizer, x, y), step_fn(eager_model, eager_optimizer, x, y)
        for g, e in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected), strict=True):
            assert torch.equal(g, e.detach())
        _assert_same(model, eager_model, optimizer, eager_optimizer)
    assert fulmen.cache_misses(jitted) == 1
    if step_fn is train_step_reading_after:  # what is returned reads the new values; the other updates: a bucket
        assert len(_update_calls(jitted)) == 1


def test_state_replaced_by_load_state_dict_traces_again():
    model = _model()
    eager_model = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    eager_optimizer = torch.optim.Adam(eager_model.parameters(), lr=1e-2)
    jitted = fulmen.jit(train_step, options=EXACT)
    batches = _batches(4)
    for x, y in batches[:2]:
        jitted(model, optimizer, x, y), train_step(eager_model, eager_optimizer, x, y)
    saved = copy.deepcopy(eager_optimizer.state_dict())
    optimizer.load_state_dict(copy.deepcopy(saved))
    eager_optimizer.load_state_dict(copy.deepcopy(saved))
    for x, y in batches[2:]:
        assert torch.equal(jitted(model, optimizer, x, y), train_step(eager_model, eager_optimizer, x, y).detach())
        _assert_same(model, eager_model, optimizer, eager_optimizer)
    assert fulmen.cache_misses(jitted) == 2


def test_gradient_accumulation_over_calls_is_eager_and_cached():
    """Micro-batches: a jitted forward + backward accumulates into the grads the call before left (eager's
    AccumulateGrad: the first grad, then sums; a frozen parameter gets none), then a jitted step uses them and zeroes
    them. Each call reads the grads it begins with anew, so every kind of call traces once or twice."""

    def forward_backward(model, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    def step(model, optimizer):
        optimizer.step()
        optimizer.zero_grad()

    model = _model()
    model[2].weight.requires_grad_(False)
    eager_model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    eager_optimizer = torch.optim.AdamW([p for p in eager_model.parameters() if p.requires_grad], lr=1e-2)
    jitted, jitted_step = fulmen.jit(forward_backward, options=EXACT), fulmen.jit(step, options=EXACT)
    batches = _batches(9)
    for micro in range(3):
        for x, y in batches[3 * micro : 3 * micro + 3]:
            assert torch.equal(jitted(model, x, y), forward_backward(eager_model, x, y).detach())
            for p, q in zip(model.parameters(), eager_model.parameters()):
                assert (p.grad is None) == (q.grad is None)
                assert p.grad is None or (torch.equal(p.grad, q.grad) and p.grad.stride() == q.grad.stride())
        jitted_step(model, optimizer), step(eager_model, eager_optimizer)
        for p, q in zip(model.parameters(), eager_model.parameters()):
            assert torch.equal(p, q) and p.grad is None and q.grad is None
    # forward + backward: one trace beginning without grads, one accumulating; the step: one trace
    assert (fulmen.cache_misses(jitted), fulmen.cache_hits(jitted)) == (2, 7)
    assert (fulmen.cache_misses(jitted_step), fulmen.cache_hits(jitted_step)) == (1, 2)


def test_unknown_optimizer_is_refused_naming_it():
    model = _model()
    optimizer = torch.optim.RMSprop(model.parameters())
    x, y = _batches(1)[0]
    with pytest.raises(TraceError, match=r"optimizer torch\.optim\.rmsprop\.RMSprop(.|\n)*test_whole_step.py:\d+ in "
                                         r"train_step: \"optimizer\.step\(\)\""):
        fulmen.jit(train_step)(model, optimizer, x, y)
    assert all(p.grad is None for p in model.parameters())  # nothing ran
    assert not optimizer.state


def test_backward_reaching_a_hooked_parameter_is_refused():
    """A hook eager's backward would call (on the parameter, or after its grad accumulates) is refused, not skipped."""
    model = _model()
    model[0].weight.register_hook(lambda grad: grad * 2)
    x, y = _batches(1)[0]
    with pytest.raises(TraceError, match=r"has a hook(.|\n)*train_step: \"loss\.backward\(\)\""):
        fulmen.jit(train_step)(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("cap", [-1, "32", True, float("nan")])
def test_bucket_cap_must_be_a_number_at_least_zero(cap):
    with pytest.raises(ValueError, match="optimizer_bucket_cap_mb"):
        fulmen.JitOptions(optimizer_bucket_cap_mb=cap)


def test_whole_step_under_cuda_graphs_replays_as_eager(simulated_graphs):  # noqa: F811 - the fixture
    """CUDA graphs of a whole step (tests/transforms/test_cudagraphs.py's simulator on the CPU): the forward and
    backward replay as one graph, the in-place updates run between graphs, and 5 steps are eager's bit for bit.
    On a GPU: tests/training/test_cuda_graphs.py."""
    model = _model()
    eager_model = copy.deepcopy(model)
    optimizer, eager_optimizer = OPTIMIZERS["adamw-foreach"](model.parameters()), \
        OPTIMIZERS["adamw-foreach"](eager_model.parameters())
    jitted = fulmen.jit(train_step, executors=["torch"],
                        options=fulmen.JitOptions(cuda_graphs=True, fuse_linear_cross_entropy=False))
    for x, y in _batches(5):
        assert torch.equal(jitted(model, optimizer, x, y), train_step(eager_model, eager_optimizer, x, y).detach())
        _assert_same(model, eager_model, optimizer, eager_optimizer)
    names = [b.sym.name for b in fulmen.last_traces(jitted)[-1].bound_symbols if b.sym.name != "del"]
    assert names[0] == "CUDAGraph0" and "adam_update_" in names and "CUDAGraph1" not in names
    assert [graph.replays for graph in simulated_graphs] == [4]  # warm-up on the first step, captured on the second


def test_float8_with_a_backward_inside_the_program_is_refused():
    """Float8 converts a forward's matmuls with their grad rules before autodiff; a whole step's backward is written
    while it is acquired, so it is refused rather than left in high precision against JitOptions.float8's contract."""
    model = _model()
    x, y = _batches(1)[0]
    options = fulmen.JitOptions(float8=fulmen.Float8Options())
    with pytest.raises(TraceError, match=r"JitOptions\.float8(.|\n)*train_step: \"loss\.backward\(\)\""):
        fulmen.jit(train_step, options=options)(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)
    assert all(p.grad is None for p in model.parameters())


def test_a_hyperparameter_given_as_a_tensor_is_refused_naming_it():
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.999)))
    x, y = _batches(1)[0]
    with pytest.raises(TraceError, match="Adam's step with Python numbers for its hyperparameters; beta1 is a Tensor"):
        fulmen.jit(train_step)(model, optimizer, x, y)


def test_attention_in_a_whole_step_uses_the_executors_backward():
    # loss.backward() inside the program is differentiated with the jit's executors' grad rules, as a jitted
    # forward's backward is: sdpa's forward saves its statistics and its own backward runs, where the operator-level
    # rule re-runs the attention under torch.autograd (on the H200 the TinyLlama whole step ran cuDNN's forward twice)
    from litgpt import GPT

    from tests.models.litgpt_configs import shrunk

    config = shrunk("Llama-3.2-1B")
    torch.manual_seed(0)
    model = GPT(config)
    eager_model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    eager_optimizer = torch.optim.AdamW(eager_model.parameters(), lr=1e-2, foreach=False)
    jitted = fulmen.jit(lm_step, executors=["sdpa"], options=EXACT)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = (torch.randint(0, config.padded_vocab_size, (2, 16), generator=generator) for _ in range(2))
        assert torch.equal(jitted(model, optimizer, x, y), lm_step(eager_model, eager_optimizer, x, y).detach())
        _assert_same(model, eager_model, optimizer, eager_optimizer)
    trace = str(fulmen.last_traces(jitted)[-1])
    assert "sdpa_cpu_flash_backward" in trace and "torch_vjp" not in trace


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_whole_step_fuses_the_loss_and_groups_attention_as_the_jitted_forward(device):
    """With the default options, the head and loss of a whole step are fused (and a grouped-query model's attention
    reads the shared heads where it can) before its backward is written, as a jitted forward's are: the same losses,
    grads, parameters and optimizer state bit for bit as a jitted forward + eager backward and step, and the logits
    the program returns after the step are still computed (the head's linear left for the whole trace's dead-code
    elimination). On CUDA in bfloat16, where torch runs the grouped attention with cuDNN's kernel."""
    from litgpt import GPT

    from tests.models.litgpt_configs import shrunk

    config = shrunk("Llama-3.2-1B")  # grouped-query attention
    assert config.n_query_groups < config.n_head
    torch.manual_seed(0)
    model = GPT(config).to(device, torch.bfloat16 if device == "cuda" else torch.float32)
    split_model = copy.deepcopy(model)

    def step_returning_logits(model, optimizer, x, y):
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss, logits

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    split_optimizer = torch.optim.AdamW(split_model.parameters(), lr=1e-2, foreach=False)
    jitted, jitted_loss = fulmen.jit(lm_step, executors=["sdpa"]), fulmen.jit(lm_loss, executors=["sdpa"])
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = (torch.randint(0, config.padded_vocab_size, (2, 16), generator=generator).to(device)
                for _ in range(2))
        loss = jitted(model, optimizer, x, y)
        split_loss = jitted_loss(split_model, x, y)
        split_loss.backward()
        split_optimizer.step()
        split_optimizer.zero_grad()
        assert torch.equal(loss, split_loss.detach())
        _assert_same(model, split_model, optimizer, split_optimizer)
    trace, forward = str(fulmen.last_traces(jitted)[-1]), str(fulmen.last_traces(jitted_loss)[-1])
    assert "fused_loss.linear_cross_entropy" in forward and "fused_loss.linear_cross_entropy" in trace
    # grouped where torch runs the grouped call with the same kernel (CUDA's; on the CPU both decline): the repeated
    # heads are gone from both (the final traces call the kernels, whose printed calls do not name enable_gqa)
    grouped = [str(t).splitlines()[0] for t in fulmen.last_traces(jitted_loss) if "Grouped-query" in str(t)[:60]]
    assert len(grouped) == 1 and ("Grouped-query attention: grouped" in grouped[0]) == (device == "cuda")
    assert ("repeat_interleave" in trace) == ("repeat_interleave" in forward) == (device != "cuda")
    assert "nll_loss" not in trace and "log_softmax" not in trace

    returning = fulmen.jit(step_returning_logits, executors=["sdpa"])
    eager_model = copy.deepcopy(model)
    eager_optimizer = torch.optim.AdamW(eager_model.parameters(), lr=1e-2, foreach=False)
    eager_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    x, y = (torch.randint(0, config.padded_vocab_size, (2, 16), generator=generator).to(device) for _ in range(2))
    (loss, logits), (eager_loss, eager_logits) = returning(model, optimizer, x, y), \
        step_returning_logits(eager_model, eager_optimizer, x, y)
    torch.testing.assert_close(loss, eager_loss.detach(), rtol=1e-5 if device == "cpu" else 1e-2, atol=0)
    assert torch.equal(logits, eager_logits.detach())  # the head's linear, as eager computes it
    assert "fused_loss.linear_cross_entropy" in str(fulmen.last_traces(returning)[-1])
