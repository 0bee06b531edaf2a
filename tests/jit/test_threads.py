"""Threads while a program is acquired: fulmen observes the thread that runs the program. A thread started during the
trace (tqdm's monitor, started by the process's first progress bar, which torch.fx.Interpreter makes) is not the
program's, and the outcome does not depend on whether one ran before; a thread the program waits for is refused."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

import fulmen
from fulmen.core.errors import TraceError

# Run in a fresh process: an earlier progress bar (any test that ran torch.fx.Interpreter) has started tqdm's
# monitor already, and the trace then never makes one.
_FX_PROGRAM = """
import sys, threading
import torch, torch.fx
import tqdm
import fulmen

if sys.argv[1] == "bar first":
    tqdm.tqdm(total=1, disable=True).close()
had_monitor = tqdm.tqdm.monitor is not None


class Block(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2 - x.sum()


graph = torch.fx.symbolic_trace(Block())


def program(x):
    return torch.fx.Interpreter(graph).run(x).sin()


x = torch.randn(5, requires_grad=True)
jitted = fulmen.jit(program)
got = jitted(x)
(got_grad,) = torch.autograd.grad(got.sum(), x)
want = program(x)
(want_grad,) = torch.autograd.grad(want.sum(), x)
torch.testing.assert_close(got, want, rtol=0, atol=0)
torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)
torch.testing.assert_close(jitted(x), want, rtol=0, atol=0)  # traced anew if the trace started the monitor
misses = fulmen.cache_misses(jitted)
torch.testing.assert_close(jitted(x), want, rtol=0, atol=0)
assert fulmen.cache_misses(jitted) == misses
monitors = [t.name for t in threading.enumerate() if t.name == "tqdm_monitor"]
print(had_monitor, monitors)
"""


@pytest.mark.parametrize("before", ["bar first", "no bar"])
def test_a_progress_bar_made_while_tracing_is_not_the_programs(before):
    done = subprocess.run([sys.executable, "-c", _FX_PROGRAM, before], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # the monitor thread ran either way: started before the trace, or by the trace's bar
    assert done.stdout.split() == [str(before == "bar first"), "['tqdm_monitor']"]


class Monitor(threading.Thread):
    """As tqdm's TMonitor: a daemon thread given a clock by its `__init__`, which it calls in its own thread."""

    def __init__(self, interval: float) -> None:
        super().__init__(daemon=True)
        self._time = time.time
        self.interval = interval
        self.ticks: list[float] = []
        self.stopping = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            self.ticks.append(self._time())


class Bars:
    monitor: Monitor | None = None  # as tqdm keeps its monitor on its class


def _monitored(x: torch.Tensor) -> torch.Tensor:
    if Bars.monitor is None:
        Bars.monitor = Monitor(0.001)
    return x * 3 + 1


def test_a_clock_a_thread_is_given_to_call_in_its_own_thread_is_not_refused():
    x = torch.randn(4)
    jitted = fulmen.jit(_monitored)
    try:
        torch.testing.assert_close(jitted(x), x * 3 + 1, rtol=0, atol=0)
        monitor = Bars.monitor
        time.sleep(0.05)
        assert isinstance(monitor, Monitor) and monitor.is_alive() and monitor.ticks  # it runs, calling its clock
        torch.testing.assert_close(jitted(x), _monitored(x), rtol=0, atol=0)
        assert Bars.monitor is monitor
    finally:
        if Bars.monitor is not None:
            Bars.monitor.stopping.set()
        Bars.monitor = None


class Stamped(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.clock = time.time
        self.stamp = self.clock() % 1.0  # the program's thread calls the clock here: the trace would keep its value


def test_a_clock_a_threads_init_calls_in_the_programs_thread_is_refused():
    with pytest.raises(TraceError, match=r"calls time.time \(test_threads.py:\d+ in __init__\)"):
        fulmen.jit(lambda x: x * Stamped().stamp)(torch.ones(2))


def test_a_clock_got_and_called_later_is_refused():
    def program(x):
        clock = time.perf_counter
        return x * (clock() % 1.0)

    with pytest.raises(TraceError, match=r"calls time.perf_counter \(test_threads.py:\d+ in program\)"):
        fulmen.jit(program)(torch.ones(2))


counter = {"n": 0}


def _counting(x: torch.Tensor) -> torch.Tensor:
    def work() -> None:
        counter["n"] += 1

    worker = threading.Thread(target=work, name="counting")
    worker.start()
    worker.join()
    return x * counter["n"]


def test_a_thread_the_program_waits_for_is_refused():
    # eager counts once per call (1, 2, ...): a trace would have kept the count it saw
    with pytest.raises(TraceError, match=r"waits for a thread it started: thread 'counting', started at "
                                         r"test_threads.py:\d+ in _counting, is joined \(test_threads.py:\d+ in "
                                         r"_counting\)"):
        fulmen.jit(_counting)(torch.ones(2))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's own failure
def test_a_thread_the_program_waits_for_on_its_tensors_is_refused_before_what_failed_in_it():
    def program(x):
        out = []
        worker = threading.Thread(target=lambda: out.append(x * 2), name="doubling")
        worker.start()
        worker.join()
        return out[0] + 1  # eager: x * 2 + 1; the thread could not compute on fulmen's stand-in for x

    with pytest.raises(TraceError, match="waits for a thread it started: thread 'doubling'"):
        fulmen.jit(program)(torch.ones(2))
