"""The transform for execution: every call of a trace claimed by an executor, fusion regions formed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fulmen.core.errors import UnsupportedOpError
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Symbol, iter_proxies
from fulmen.core.trace import Trace, TraceBuilder
from fulmen.executors.base import Executor, FusionExecutor
from fulmen.transforms.recording import record_call


class _Claimer:
    def __init__(self, trace: Trace, executors: tuple[Executor, ...],
                 interpreter_factory: Callable[[TraceBuilder], Any]) -> None:
        self.executors = executors
        self.builder = TraceBuilder(namespace=trace.namespace)
        self.interpreter = interpreter_factory(self.builder)
        self.claimed: list[BoundSymbol] = []

    def claim(self, bsym: BoundSymbol, declined: frozenset[tuple[Executor, Symbol]] = frozenset()) -> None:
        for executor in self.executors:
            if (executor, bsym.sym) in declined:
                continue
            impl = executor.claims(bsym)
            if impl is None:
                continue
            if impl.execution_transform is None:
                self.claimed.append(bsym.from_bsym(executor=executor))
                return
            recorded = record_call(impl.execution_transform, bsym, self.builder, self.interpreter,
                                   f"the execution transform of executor {executor.name!r} for {bsym.sym.name}",
                                   may_return_inputs=True)
            if recorded is not None:
                # A transform may call the symbol it replaces (e.g. on reshaped arguments): not itself again.
                for sub in recorded:
                    self.claim(sub, declined | {(executor, bsym.sym)})
                return
        if bsym.subsymbols:  # unclaimed composite: its parts
            for sub in bsym.subsymbols:
                self.claim(sub, declined)
            return
        names = [executor.name for executor in self.executors]
        raise UnsupportedOpError(f"none of the executors {names} can run {bsym.sym.printed}", bsym.source)


def transform_for_execution(trace: Trace, executors: tuple[Executor, ...],
                            interpreter_factory: Callable[[TraceBuilder], Any]) -> Trace:
    claimer = _Claimer(trace, executors, interpreter_factory)
    with claimer.builder:
        for bsym in trace.bound_symbols:
            claimer.claim(bsym)
    result = trace.from_trace(f"Transform for execution ({', '.join(ex.name for ex in executors)})",
                              bound_symbols=claimer.claimed)
    for position, executor in enumerate(executors):
        if isinstance(executor, FusionExecutor):
            result = fuse_regions(result, executor, frozenset(executors[position + 1:]))
    return result


def fuse_regions(trace: Trace, executor: FusionExecutor, later: frozenset[Executor]) -> Trace:
    """Groups runs of consecutive calls `executor` can fuse (among those claimed by executors after it) into its
    regions. Regions are consecutive in the trace, so no value is computed earlier or freed later than before:
    fusing cannot raise peak memory (a region's intermediates are never materialised)."""
    last_use: dict[str, int] = {}
    for position, bsym in enumerate(trace.bound_symbols):
        for name in bsym.arg_names():
            last_use[name] = position
    for proxy in iter_proxies(trace.output):
        last_use[proxy.pname] = len(trace.bound_symbols)
    bsyms: list[BoundSymbol] = []
    run: list[BoundSymbol] = []
    regions = 0

    def flush(end: int) -> None:
        nonlocal regions
        if run and executor.worth_fusing(run):
            produced: dict[str, TensorProxy] = {}
            inputs: dict[str, TensorProxy] = {}
            for bsym in run:
                for proxy in bsym.proxy_args():
                    if proxy.pname not in produced:
                        inputs.setdefault(proxy.pname, proxy)
                for proxy in bsym.proxy_outputs():
                    produced[proxy.pname] = proxy
            outputs = [proxy for name, proxy in produced.items() if last_use.get(name, -1) >= end]
            bsyms.append(executor.fuse(list(run), list(inputs.values()), outputs, regions))
            regions += 1
        else:
            bsyms.extend(run)
        run.clear()

    for position, bsym in enumerate(trace.bound_symbols):
        if bsym.executor in later and executor.can_fuse(bsym):
            run.append(bsym)
        else:
            flush(position)
            bsyms.append(bsym)
    flush(len(trace.bound_symbols))
    return trace.from_trace(f"Fusion ({executor.name})", bound_symbols=bsyms)
