"""The observer of the acquired Python: read sites found in bytecode, reads that run none of the program's code."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

import fulmen
from fulmen.jit.jitted_module import core as jitted_core
from fulmen.observation import read_sites

SCALE = 2.0


RUNS = itertools.count()  # the program's own code counts its runs here (a counter whose state no guard reads)


class Counting:
    """An object with a property and a `__getattr__`: the program's code, which only the program may run."""

    def __init__(self):
        self.s = 3.0

    @property
    def doubled(self):
        next(RUNS)
        return self.s * 2

    def __getattr__(self, name):
        next(RUNS)
        return 1.0


def program(self, cfg, x):
    y = x * SCALE + cfg.s + self.config.n + getattr(cfg, "t", 0.0)
    return y + cfg.items[0]


def test_read_sites_name_what_each_instruction_reads():
    sites = set(read_sites.read_sites(program.__code__).values())
    assert read_sites.GlobalRead("SCALE") in sites and read_sites.GlobalRead("getattr") in sites
    assert read_sites.AttrRead(read_sites.Local("cfg"), "s") in sites
    assert read_sites.AttrRead(read_sites.Attr(read_sites.Local("self"), "config"), "n") in sites
    assert read_sites.AttrCall(read_sites.Global("getattr"), read_sites.Local("cfg"), read_sites.Const("t")) in sites
    assert read_sites.AttrRead(read_sites.Local("cfg"), "items") in sites
    # `(x * SCALE).shape`: unnamed
    assert not any(isinstance(s, read_sites.AttrRead) and s.name == "shape" for s in sites)


def test_closure_reads_are_sites_only_for_free_variables():
    k = 2.0

    def inner(x):
        own = x * 2

        def nested():
            return own

        return nested() * k

    sites = set(read_sites.read_sites(inner.__code__).values())
    assert read_sites.CellRead("k") in sites and read_sites.CellRead("own") not in sites


def test_observing_runs_no_code_of_the_program():
    cfg = Counting()
    fn = fulmen.jit(lambda x, c: x * c.doubled + c.missing)
    x = torch.ones(2)
    start = next(RUNS)
    torch.testing.assert_close(fn(x, cfg), x * 6.0 + 1.0)
    assert next(RUNS) == start + 3  # the property and __getattr__ ran once each, as in eager: the observer ran neither
    fn(x, cfg)
    assert fulmen.cache_misses(fn) == 1
    cfg.s = 4.0  # what the property read is guarded
    torch.testing.assert_close(fn(x, cfg), x * 8.0 + 1.0)


def test_a_tracer_already_set_keeps_its_events():
    seen = []

    def tracer(frame, event, arg):
        if frame.f_code.co_name == "scaled":
            seen.append(event)
        return tracer

    def scaled(x):
        return x * SCALE

    fn = fulmen.jit(scaled)
    sys.settrace(tracer)
    try:
        fn(torch.ones(2))
    finally:
        sys.settrace(None)
    assert "call" in seen and "line" in seen and "return" in seen
    assert any("global SCALE" in g.what for g in jitted_core(fn).last_entry.guards)


class _Settings:
    scale = 2.0


def test_the_first_run_of_a_programs_code_is_observed_from_its_first_instruction():
    """The program's code has never run before the jitted call (Python 3.12 started a new code object's opcode
    events only after its first call inside: the reads before it went unguarded, the stores unreplayed)."""
    namespace = {"SETTINGS": _Settings(), "LOG": [], "torch": torch}
    exec(compile("def program(x):\n    return x * SETTINGS.scale + x.sum() * 0\n", "<fresh>", "exec"), namespace)
    fn = fulmen.jit(namespace["program"])
    torch.testing.assert_close(fn(torch.ones(2)), torch.full((2,), 2.0))
    namespace["SETTINGS"].scale = 3.0
    torch.testing.assert_close(fn(torch.ones(2)), torch.full((2,), 3.0))
    exec(compile("def logging(x):\n    LOG.append(x.sum())\n    return x\n", "<fresh>", "exec"), namespace)
    with pytest.raises(fulmen.TraceError, match="changes the list global LOG"):
        fulmen.jit(namespace["logging"])(torch.ones(2))
    assert namespace["LOG"] == []
