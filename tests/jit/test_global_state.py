"""Grad mode and autocast that a program changes with bare calls (as the graphs Dynamo captures do): a compilation
that fails, and each acquisition made again, starts from the caller's state. Oracle: eager on the same inputs."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import fulmen
from fulmen.core.errors import TraceError, UnsupportedOpError


def grad_off_then_refused(x, w):
    y = x @ w
    torch._C._set_grad_enabled(False)
    j0 = torch.special.bessel_j0(y)  # fulmen has no symbol for torch.special.bessel_j0: refused here
    torch._C._set_grad_enabled(True)
    return y * j0


def autocast_on_then_refused(x, w):
    torch.autocast("cpu", dtype=torch.bfloat16).__enter__()  # left by the refusal below, as a Dynamo graph's node
    return torch.special.bessel_j0(x @ w)


@pytest.mark.parametrize("program", [grad_off_then_refused, autocast_on_then_refused])
def test_a_refused_program_leaves_grad_mode_and_autocast_as_the_caller_had_them(program):
    # left changed: the caller's fallback (eager, or fulmen.dynamo's) ran without grad or under bfloat16 autocast
    x, w = torch.randn(2, 3), torch.randn(3, 2, requires_grad=True)
    with pytest.raises(UnsupportedOpError, match="bessel_j0"):
        fulmen.jit(program)(x, w)
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    assert torch.autocast_increment_nesting() == 1  # no autocast region left open
    torch.autocast_decrement_nesting()
    assert (x @ w).dtype == torch.float32 and (x @ w).requires_grad


def computed_before_a_read_only_eager_makes(x, w):
    y = x @ w
    torch._C._set_grad_enabled(False)
    if not torch.compiler.is_compiling() and bool(x.sum() > 1e9):  # libraries skip such reads under a compiler
        y = y * 0
    torch._C._set_grad_enabled(True)
    return y * 2


def test_a_program_acquired_again_starts_from_the_callers_grad_mode():
    # the second acquisition (as a compiler, after the value read) began with grad off: y had no history, no grad
    x = torch.randn(2, 3)
    grads = []
    for fn in (computed_before_a_read_only_eager_makes, fulmen.jit(computed_before_a_read_only_eager_makes)):
        w = torch.randn(3, 2, generator=torch.Generator().manual_seed(0)).requires_grad_()
        out = fn(x, w)
        assert out.requires_grad
        out.sum().backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[1], grads[0])


def turns_grad_off_for_its_caller(x, w):
    y = x @ w
    torch.set_grad_enabled(False)
    return y


def turns_autocast_on_for_its_caller(x, w):
    y = x @ w
    torch.set_autocast_enabled("cpu", True)
    return y


@pytest.mark.parametrize("program", [turns_grad_off_for_its_caller, turns_autocast_on_for_its_caller])
def test_the_state_a_program_leaves_changed_is_set_by_every_call(program):
    # the first call left it as eager does (acquisition applies it for real); a cache hit ran only the trace
    jitted = fulmen.jit(program)
    for fn in (program, jitted, jitted):
        out = fn(torch.randn(2, 3), torch.randn(3, 2, requires_grad=True))
        after = (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), out.requires_grad)
        torch.set_grad_enabled(True)
        torch.set_autocast_enabled("cpu", False)
        assert after == ((False, False, True) if program is turns_grad_off_for_its_caller else (True, True, True))
    assert fulmen.cache_hits(jitted) == 1


# --- torch's global setters (fulmen/observation/global_setters.py): set again by every call, in program order, or
# refused ---------


def seeded_draw(x):
    torch.manual_seed(0)
    return x + torch.rand(3)


def draws_then_seeds_then_draws(x):
    first = torch.rand(2)  # from the caller's stream: another value on every call
    torch.random.manual_seed(1)
    return x + torch.randn(3), first


def seeded_dropout(x):
    torch.manual_seed(2)
    return torch.nn.functional.dropout(x, 0.5).sum()


def seeded_by_argument(x, seed):
    torch.manual_seed(seed)
    return x * torch.rand(3)


@pytest.mark.parametrize("program", [seeded_draw, draws_then_seeds_then_draws, seeded_dropout, seeded_by_argument])
def test_a_seed_the_program_sets_makes_every_call_draw_as_eagers(program):
    # before: the trace drew from wherever the generator was (the seed ran once, while tracing), and on the first
    # call the draws before the seed came from the seeded stream
    results = []
    for fn in (program, fulmen.jit(program)):
        torch.manual_seed(100)
        calls = []
        for seed in (0, 1, 0):
            x = torch.ones(3, requires_grad=True)
            out = fn(x, seed) if program is seeded_by_argument else fn(x)
            grad = torch.autograd.grad(out, x)[0] if program is seeded_dropout else None
            calls.append((out, grad, torch.rand(4)))  # the generator's state after the call: the next draws
        results.append(calls)
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def sets_the_default_dtype(x):
    before = torch.ones(2)  # the caller's default
    torch.set_default_dtype(torch.float64)
    return x + 1, before, torch.ones(2), torch.arange(3) * 0.5, torch.rand(2).dtype == torch.float64


@pytest.mark.parametrize("caller_resets", [True, False], ids=["caller-resets", "caller-keeps"])
def test_the_default_dtype_the_program_sets_is_set_by_every_call_where_the_program_sets_it(caller_resets):
    # before: a cache hit left the caller's float32 (and computed the later factories in it, against its own
    # metadata); on the first call the factories before the setter already came out float64
    results = []
    try:
        for fn in (sets_the_default_dtype, fulmen.jit(sets_the_default_dtype)):
            calls = []
            for _ in range(3):
                out = fn(torch.ones(3))
                calls.append(([(t.dtype, t.tolist()) if isinstance(t, torch.Tensor) else t for t in out],
                              torch.get_default_dtype()))
                if caller_resets:
                    torch.set_default_dtype(torch.float32)
            results.append(calls)
            torch.set_default_dtype(torch.float32)
    finally:
        torch.set_default_dtype(torch.float32)
    assert results[0][0][1] == torch.float64 and results[0][0][0][1][0] == torch.float32
    assert results[1] == results[0]


def _deterministic() -> tuple:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def deterministic_empty(x):
    torch.use_deterministic_algorithms(True, warn_only=True)
    return x + 1, torch.empty(3)  # eager fills uninitialised memory with NaN under deterministic algorithms


def matmul_precision(x):
    torch.set_float32_matmul_precision("medium")
    return x + 1


def print_options(x):
    torch.set_printoptions(precision=2)
    return x + 1


def cudnn_flag(x):
    torch.backends.cudnn.deterministic = True
    return x + 1


def cublas_flag(x):
    torch.backends.cuda.matmul.allow_tf32 = True
    return x + 1


def fp32_precision_flag(x):
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    return x + 1


def warn_always(x):
    torch.set_warn_always(True)
    return x + 1


SWITCHES = {  # program: (read the state it sets, set the caller's back)
    deterministic_empty: (_deterministic, lambda: torch.use_deterministic_algorithms(False)),
    matmul_precision: (torch.get_float32_matmul_precision, lambda: torch.set_float32_matmul_precision("highest")),
    print_options: (lambda: torch._tensor_str.PRINT_OPTS.precision, lambda: torch.set_printoptions(precision=4)),
    cudnn_flag: (lambda: torch.backends.cudnn.deterministic,
                 lambda: setattr(torch.backends.cudnn, "deterministic", False)),
    cublas_flag: (lambda: torch.backends.cuda.matmul.allow_tf32,
                  lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", False)),
    fp32_precision_flag: (lambda: torch.backends.cudnn.conv.fp32_precision,
                          lambda: setattr(torch.backends.cudnn.conv, "fp32_precision", "tf32")),
    warn_always: (torch.is_warn_always_enabled, lambda: torch.set_warn_always(False)),
}


@pytest.fixture
def assignable_backend_flags(monkeypatch):
    # torch.testing's common_utils, which op_db's tests import, freezes bare assignments of torch.backends flags for
    # the rest of the process (disable_global_flags); the programs here assign them, as a user's program may
    monkeypatch.setitem(torch.backends.flags_frozen.__globals__, "__allow_nonbracketed_mutation_flag", True)


@pytest.mark.parametrize("program", list(SWITCHES), ids=lambda p: p.__name__)
@pytest.mark.usefixtures("assignable_backend_flags")
def test_a_switch_the_program_sets_is_set_by_every_call_before_the_ops_after_it(program):
    # before: set on the first call only (by the acquisition); a caller that set it back kept its own from then on
    read, reset = SWITCHES[program]
    reset()
    initial = read()
    jitted = fulmen.jit(program)
    seen = []
    try:
        for fn in (program, jitted, jitted, jitted):
            out = fn(torch.ones(3))
            seen.append(read())
            if program is deterministic_empty:  # the op after the setter ran under it
                assert torch.isnan(out[1]).all()
            reset()
    finally:
        reset()
    assert seen[0] != initial and seen == [seen[0]] * 4
    assert fulmen.cache_hits(jitted) == 2


def seeds_from_the_clock(x):
    torch.seed()
    return x + torch.rand(3)


def reads_the_generator_state(x):
    return x + torch.rand(3), torch.get_rng_state()


SAVED_STATE = torch.get_rng_state()


def sets_the_generator_state(x):
    torch.set_rng_state(SAVED_STATE)
    return x + torch.rand(3)


def forks_the_generator(x):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return x + torch.rand(3)


def seeds_the_default_generator(x):
    torch.default_generator.manual_seed(0)
    return x + torch.rand(3)


def sets_the_thread_count(x):
    torch.set_num_threads(1)
    return x + 1


def sets_the_default_device(x):
    torch.set_default_device("cpu")
    return x + 1


def detects_anomalies(x):
    torch.autograd.set_detect_anomaly(True)
    return x + 1


def sets_cudnn_flags_for_a_block(x):
    with torch.backends.cudnn.flags(enabled=False):
        return x + 1


def seeds_inside_a_checkpoint(x):
    def seeded(x):
        torch.manual_seed(0)
        return x * torch.rand(3)

    return torch.utils.checkpoint.checkpoint(seeded, x, use_reentrant=False)


REFUSED = {
    seeds_from_the_clock: "torch.seed",
    reads_the_generator_state: "torch.get_rng_state",
    sets_the_generator_state: "torch.set_rng_state",
    forks_the_generator: "torch.random.fork_rng",
    seeds_the_default_generator: "torch.default_generator.manual_seed",
    sets_the_thread_count: "torch.set_num_threads",
    sets_the_default_device: "torch.set_default_device",
    detects_anomalies: "torch.autograd.set_detect_anomaly",
    sets_cudnn_flags_for_a_block: "torch.backends.cudnn.flags",
    seeds_inside_a_checkpoint: r"torch.manual_seed \(test_global_state.py:\d+ in seeded\) inside torch.utils.check",
}


@pytest.mark.parametrize("program", list(REFUSED), ids=lambda p: p.__name__)
def test_a_setter_no_call_could_set_again_is_refused_naming_the_line_and_leaves_the_state_as_it_was(program):
    # before: each ran once, while tracing, and the later calls went on without it (or with its first answer)
    threads, modes = torch.get_num_threads(), torch._C._len_torch_function_stack()
    torch.manual_seed(5)
    want = torch.rand(4)
    torch.manual_seed(5)
    with pytest.raises(TraceError, match=REFUSED[program]) as error:
        fulmen.jit(program)(torch.ones(3, requires_grad=True))
    assert "test_global_state.py" in str(error.value)
    assert torch.equal(torch.rand(4), want)  # no seed the acquisition ran is left behind
    assert torch.get_num_threads() == threads and not torch.is_anomaly_enabled()
    # torch.set_default_device's torch-function mode, left entered, took later programs off eager's fast paths
    assert torch._C._len_torch_function_stack() == modes and torch.get_default_device() == torch.device("cpu")


def test_a_refused_default_device_leaves_the_callers_own_default_device():
    def sets_meta(x):
        torch.set_default_device("meta")
        return x * 2

    torch.set_default_device("cpu")  # the caller's: a mode of its own is entered
    try:
        modes = torch._C._len_torch_function_stack()
        with pytest.raises(TraceError, match="torch.set_default_device"):
            fulmen.jit(sets_meta)(torch.ones(3))
        assert torch._C._len_torch_function_stack() == modes
        assert torch.empty(2).device == torch.device("cpu")
    finally:
        torch.set_default_device(None)
    assert torch._C._len_torch_function_stack() == 0


# --- draws another thread makes while a program is compiled ----------------------------------------------------------
# A program that sets no generator: compiling it draws nothing from torch's generators, so nothing is set back, and
# draws another thread makes meanwhile stay made (set back, the generator gave their numbers again).
class _OtherThread:
    """A thread of the caller's that draws `n` numbers from torch's generator when the program lets it (and the
    program waits until it has): a draw made while the program runs, as eager's, or while fulmen compiles it."""

    def __init__(self, n: int) -> None:
        self.go, self.drawn = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._draw, args=(n,))
        self.thread.start()
        self.numbers: torch.Tensor | None = None

    def _draw(self, n: int) -> None:
        self.go.wait()
        self.numbers = torch.rand(n)
        self.drawn.set()

    def let_it_draw(self) -> None:
        self.go.set()
        self.drawn.wait()


OTHER: _OtherThread | None = None  # the thread of the call running now


def lets_another_thread_draw(x):
    OTHER.let_it_draw()
    return x + torch.rand(3)


def lets_another_thread_draw_then_refused(x):
    OTHER.let_it_draw()
    return torch.special.bessel_j0(x)  # fulmen has no symbol for torch.special.bessel_j0: refused here


@pytest.mark.parametrize("program", [lets_another_thread_draw, lets_another_thread_draw_then_refused])
def test_draws_another_thread_makes_while_a_program_without_setters_is_compiled_stay_made(program, monkeypatch):
    # before: the generator was set back to where the call began, once the program was acquired (or refused), so
    # the next draws gave the other thread's numbers again
    results = []
    for fn in (program, fulmen.jit(program)):
        torch.manual_seed(7)
        calls = []
        for _ in range(3):  # a miss, then hits
            monkeypatch.setattr(sys.modules[__name__], "OTHER", _OtherThread(5))
            try:
                out = fn(torch.ones(3))
            except (TraceError, UnsupportedOpError):
                if fn is program:
                    raise
                OTHER.let_it_draw()  # eager's fallback after the refusal: the program runs again
                out = program(torch.ones(3))
            OTHER.thread.join()
            calls.append((out, OTHER.numbers, torch.rand(4)))  # the generator's state after the call: the next draws
        results.append(calls)
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
