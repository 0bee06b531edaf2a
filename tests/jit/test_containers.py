"""Python containers the program changes in place (fulmen/observation/container_writes.py), against eager: replayed
by every call when the change is exactly repeatable, refused naming the container and the line otherwise."""

from __future__ import annotations

import collections
import importlib
import logging
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fulmen

LOG: list = []
TABLE: dict = {}
COUNTS: collections.defaultdict = collections.defaultdict(int)


def _calls(fn: Callable[..., Any], args: Callable[[int], tuple], n: int = 3) -> list[torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fulmen.CacheLimitWarning)
        return [fn(*args(i)) for i in range(n)]


# --- refused: what a cached trace could not do again, or a copy the caller never sees --------------------------------
def _append_sum(x, log):
    log.append(x.sum())
    return x * 2


def _append_len(x, log):
    log.append(x.shape[0])
    return x * 2


def _set_item(x, table):
    table["k"] = 3
    return x * 2


def _add(x, seen):
    seen.add(len(seen))
    return x * 2


def _nested(x, state):
    state["log"].append(1)
    return x * 2


def _iadd(x, log):
    log += [1]
    return x * 2


def _pop(x, log):
    log.pop()
    return x * 2


def _delete(x, table):
    del table["a"]
    return x * 2


def _sort(x, log):
    log.sort()
    return x * 2


@pytest.mark.parametrize(("program", "make", "name"), [
    (_append_sum, list, "log"), (_append_len, list, "log"), (_set_item, dict, "table"), (_add, set, "seen"),
    (_nested, lambda: {"log": []}, "state['log']"), (_iadd, list, "log"), (_pop, lambda: [3, 1, 2], "log"),
    (_delete, lambda: {"a": 1}, "table"), (_sort, lambda: [3, 1, 2], "log"),
])
def test_a_container_passed_as_argument_that_the_program_changes_is_refused(program, make, name):
    eager, given = make(), make()
    program(torch.ones(2), eager)
    assert eager != make()  # eager changes the caller's container
    with pytest.raises(fulmen.TraceError, match=rf"changes the \w+ passed as argument `{re.escape(name)}`"):
        fulmen.jit(program)(torch.ones(2), given)
    assert given == make()  # the refused call changed nothing


def test_the_refusal_names_the_line_that_changes_the_container():
    with pytest.raises(fulmen.TraceError, match=r"test_containers.py:\d+ in _append_sum") as error:
        fulmen.jit(_append_sum)(torch.ones(2), [])
    assert error.value.location is not None and "log.append(x.sum())" in str(error.value)


def _log_global(x):
    LOG.append(x.sum())
    return x * 2


class _History(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.history: list = []

    def forward(self, x):
        self.history.append(x.sum())
        return self.lin(x)


def _closure_logging() -> Callable[[torch.Tensor], torch.Tensor]:
    log: list = []

    def program(x):
        log.append(x.sum())
        return x * 2

    return program


def _count_defaultdict(x):
    COUNTS["calls"] += 1
    return x * 2


@pytest.mark.parametrize(("make", "what"), [
    (lambda: _log_global, "list global LOG"), (_History, "list attribute history of _History module"),
    (_closure_logging, "list closure variable log"), (lambda: _count_defaultdict, "defaultdict global COUNTS"),
])
def test_a_tensor_or_an_unguarded_container_stored_in_place_is_refused(make, what):
    LOG.clear()
    COUNTS.clear()
    with pytest.raises(fulmen.TraceError, match=f"changes the {what}"):
        fulmen.jit(make())(torch.ones(2))
    assert LOG == [] and COUNTS == {}  # put back: the refused call did not run


def test_a_refused_module_keeps_its_history_as_it_was():
    module = _History()
    with pytest.raises(fulmen.TraceError):
        fulmen.jit(module)(torch.ones(2))
    assert module.history == []


def test_a_list_attribute_of_a_module_argument_is_refused_when_it_gets_a_tensor():
    def program(x, module):
        module.history.append(x * 2)
        return x + 1

    module = _History()
    with pytest.raises(fulmen.TraceError, match="changes the list attribute history"):
        fulmen.jit(program)(torch.ones(2), module)


# --- replayed: immutable values, a function of what the trace is guarded on -------------------------------------------
def _log_length(x):
    LOG.append(x.shape[0])
    return x * len(LOG)


def test_immutable_values_appended_to_a_global_list_are_appended_by_every_call():
    results = {}
    for mode in ("eager", "jit"):
        LOG.clear()
        fn = _log_length if mode == "eager" else fulmen.jit(_log_length, options=fulmen.JitOptions(cache_limit=8))
        results[mode] = (_calls(fn, lambda i: (torch.ones(2),)), list(LOG))
    assert results["jit"][1] == results["eager"][1] == [2, 2, 2]
    for got, want in zip(results["jit"][0], results["eager"][0]):
        torch.testing.assert_close(got, want)


def _cache_size(x):
    TABLE["size"] = x.shape[0]
    return x * 2


def test_a_replayed_change_runs_on_cache_hits():
    # cleared between calls: every call finds the content the trace was made with and hits, and must store again
    jitted = fulmen.jit(_cache_size)
    for _ in range(3):
        TABLE.clear()
        jitted(torch.ones(2))
        assert TABLE == {"size": 2}
    assert (fulmen.cache_hits(jitted), fulmen.cache_misses(jitted)) == (2, 1)


def test_a_replayed_change_follows_the_container_the_program_finds():
    class Holder:
        log: list

    holder = Holder()

    def program(x):
        holder.log.append(x.shape[0])
        return x * 2

    jitted = fulmen.jit(program)
    for _ in range(3):
        holder.log = []  # an equal list, not the same one: the call appends to this one, as eager does
        first = holder.log
        jitted(torch.ones(2))
        assert first is holder.log and first == [2]


def test_a_module_history_of_immutable_values_matches_eager():
    class Steps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.shapes: list = []
            self.seen: set = set()

        def forward(self, x):
            self.shapes.append(tuple(x.shape))
            self.seen.add(x.shape[0])
            return self.lin(x)

    torch.manual_seed(0)
    eager = Steps()
    jitted_model = Steps()
    jitted_model.load_state_dict(eager.state_dict())
    jitted = fulmen.jit(jitted_model)
    for n in (2, 3, 2):
        x = torch.randn(n, 2)
        torch.testing.assert_close(jitted(x), eager(x))
    assert (jitted_model.shapes, jitted_model.seen) == (eager.shapes, eager.seen)


def test_containers_the_program_creates_are_its_own():
    def program(x):
        found: list = []
        found.append(x.sum())
        table = {"a": x}
        table["b"] = x * 2
        return found[0] + table["b"]

    jitted = fulmen.jit(program)
    for _ in range(3):
        x = torch.randn(3)
        torch.testing.assert_close(jitted(x), program(x))
    assert fulmen.cache_hits(jitted) == 2


def _logs_then_reads_a_value(x):
    LOG.append(1)
    if torch.compiler.is_compiling():  # what a library does under a tracer
        return x * 2
    return x * 2 if x.sum() > 0 else x * 2  # eager's path reads a value: fulmen acquires again (rerun.py)


def test_a_change_made_by_an_abandoned_acquisition_is_undone():
    LOG.clear()
    _logs_then_reads_a_value(torch.ones(2))
    assert LOG == [1]
    LOG.clear()
    fulmen.jit(_logs_then_reads_a_value)(torch.ones(2))
    assert LOG == [1]  # once, as eager: not once per acquisition


def test_a_lazy_import_inside_the_program_is_the_interpreters_not_refused(tmp_path, monkeypatch):
    # the import fills sys.modules once, as in eager: Python's state, not the program's
    (tmp_path / "fulmen_lazily_imported.py").write_text("SCALE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fulmen_lazily_imported", raising=False)

    def program(x):
        if "fulmen_lazily_imported" not in sys.modules:
            importlib.import_module("fulmen_lazily_imported")
        return x * sys.modules["fulmen_lazily_imported"].SCALE

    jitted = fulmen.jit(program)
    for _ in range(2):
        torch.testing.assert_close(jitted(torch.ones(2)), torch.full((2,), 3.0))


def test_a_record_the_program_logs_reaches_the_handlers_unobserved():
    """A handler keeping records in a list (as pytest's log capture does) is not the program's state: the traced
    call logs as eager's, and a cache hit does not log again (no compiled call does)."""
    records: list = []

    class Keeping(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger, handler = logging.getLogger("tests.jit.logging_program"), Keeping()
    logger.addHandler(handler)

    def program(x):
        logger.warning("scaling by %s", 2)
        return x * 2

    try:
        fn = fulmen.jit(program)
        torch.testing.assert_close(fn(torch.ones(2)), torch.full((2,), 2.0))
        torch.testing.assert_close(fn(torch.ones(2)), torch.full((2,), 2.0))
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in records] == ["scaling by 2"]
    assert fulmen.cache_hits(fn) == 1
