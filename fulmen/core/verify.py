"""Checks of a trace's well-formedness: every value is defined once, before it is read."""

from __future__ import annotations

from fulmen.core.symbol import iter_proxies
from fulmen.core.trace import Trace


def trace_problems(trace: Trace) -> list[str]:
    """What is wrong with `trace` (empty when nothing): reads of undefined values, values defined twice."""
    problems: list[str] = []
    defined = {p.pname for p in trace.inputs}
    if len(defined) != len(trace.inputs):
        problems.append("two inputs have the same name")
    for position, bsym in enumerate(trace.bound_symbols):
        for name in bsym.arg_names():
            if name not in defined:
                problems.append(f"line {position} ({bsym.sym.printed}) reads {name}, which is not defined before it")
        for name in bsym.output_names():
            if name in defined:
                problems.append(f"line {position} ({bsym.sym.printed}) defines {name} a second time")
            defined.add(name)
    for proxy in iter_proxies(trace.output):
        if proxy.pname not in defined:
            problems.append(f"the trace returns {proxy.pname}, which it never defines")
    return problems
