"""Grouping runs of consecutive calls of a trace into regions (fusion regions, CUDA graphs)."""

from __future__ import annotations

from collections.abc import Callable

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, iter_proxies
from fulmen.core.trace import Trace

# Builds the call that replaces a run, from the run, its inputs and its outputs; None keeps the run as it is.
RegionBuilder = Callable[[list[BoundSymbol], list[TensorProxy], list[TensorProxy]], BoundSymbol | None]


def last_uses(bsyms: list[BoundSymbol], output: tuple) -> dict[str, int]:
    """Each value's last reader: a position in `bsyms`, or len(bsyms) for the program's `output`."""
    last_use: dict[str, int] = {}
    for position, bsym in enumerate(bsyms):
        for name in bsym.arg_names():
            last_use[name] = position
    for proxy in iter_proxies(output):
        last_use[proxy.pname] = len(bsyms)
    return last_use


def region_io(run: list[BoundSymbol], last_use: dict[str, int],
              end: int) -> tuple[list[TensorProxy], list[TensorProxy]]:
    """The values `run` reads from before it, and those it computes that are read at or after position `end`."""
    produced: dict[str, TensorProxy] = {}
    inputs: dict[str, TensorProxy] = {}
    for bsym in run:
        for proxy in bsym.proxy_args():
            if proxy.pname not in produced:
                inputs.setdefault(proxy.pname, proxy)
        for proxy in bsym.proxy_outputs():
            produced[proxy.pname] = proxy
    outputs = [proxy for name, proxy in produced.items() if last_use.get(name, -1) >= end]
    return list(inputs.values()), outputs


def form_regions(trace: Trace, selects: Callable[[BoundSymbol], bool], build: RegionBuilder) -> Trace:
    """`trace` with each maximal run of consecutive calls `selects` accepts replaced by `build`'s call. Runs stay
    where they are, so no value is computed earlier or freed later than before."""
    last_use = last_uses(trace.bound_symbols, trace.output)
    bsyms: list[BoundSymbol] = []
    run: list[BoundSymbol] = []

    def flush(end: int) -> None:
        region = None
        if run:
            inputs, outputs = region_io(run, last_use, end)
            region = build(list(run), inputs, outputs)
        bsyms.extend(run if region is None else [region])
        run.clear()

    for position, bsym in enumerate(trace.bound_symbols):
        if selects(bsym):
            run.append(bsym)
        else:
            flush(position)
            bsyms.append(bsym)
    flush(len(trace.bound_symbols))
    return trace.from_trace(trace.provenance, bound_symbols=bsyms)
