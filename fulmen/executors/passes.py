"""The transform for execution: every call of a trace claimed by an executor, fusion regions formed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from fulmen.core.errors import UnsupportedOpError
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Symbol
from fulmen.core.trace import Trace, TraceBuilder
from fulmen.executors.base import Executor, FusionExecutor
from fulmen.executors.region_remat import REGION, plan_regions
from fulmen.executors.torch_eager import direct_calls
from fulmen.executors.view_folding import fold_views
from fulmen.transforms.common import cse
from fulmen.transforms.recording import record_call
from fulmen.transforms.regions import form_regions, region_io


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
                            interpreter_factory: Callable[[TraceBuilder], Any], common: bool = False) -> Trace:
    """`trace` with every call claimed, then (`common`) what claiming made twice computed once (the sdpa
    executor's conversion of a boolean padding mask, the same in every layer), then fusion regions formed."""
    claimer = _Claimer(trace, executors, interpreter_factory)
    with claimer.builder:
        for bsym in trace.bound_symbols:
            claimer.claim(bsym)
    result = trace.from_trace(f"Transform for execution ({', '.join(ex.name for ex in executors)})",
                              bound_symbols=claimer.claimed)
    if common:
        result = cse(result).from_trace(result.provenance)
    for position, executor in enumerate(executors):
        if isinstance(executor, FusionExecutor):
            result = fuse_regions(result, executor, frozenset(executors[position + 1:]))
    return fold_views(direct_calls(result))


def fuse_regions(trace: Trace, executor: FusionExecutor, later: frozenset[Executor]) -> Trace:
    """Groups runs of consecutive calls `executor` can fuse (among those claimed by executors after it) into its
    regions. Regions are consecutive in the trace, so no value is computed earlier or freed later than before:
    fusing cannot raise peak memory (a region's intermediates are never materialised). Then, when the executor
    `recomputes_inputs`, regions merge across independent calls and cheap values a region would hand to later
    regions are recomputed there instead (fulmen.executors.region_remat, which never raises peak memory either)."""

    def plan(run: list[BoundSymbol], inputs: list[TensorProxy], outputs: list[TensorProxy]) -> BoundSymbol | None:
        # When regions are planned further, a lone call is a candidate too: it may join a region or take in the
        # work it reads (the SwiGLU's silu, alone between two matmuls, and its gradient); what is still not worth
        # a compiled call afterwards runs as it was.
        worth = executor.recomputes_inputs or executor.worth_fusing(run)
        return BoundSymbol(REGION, tuple(inputs), {}, tuple(outputs), run) if worth else None

    def fusible(bsym: BoundSymbol) -> bool:
        return bsym.executor in later and executor.can_fuse(bsym)

    bsyms = form_regions(trace, fusible, plan).bound_symbols
    if executor.recomputes_inputs:
        # a trace taking its inputs in groups frees them as it goes (a backward's saved values)
        bsyms = plan_regions(bsyms, trace.inputs, trace.output, not trace.input_groups, fusible, executor.is_view)
    # a value computed in two places is recomputed by a region: that region stays one (its names are its own)
    defined = Counter(name for bsym in bsyms
                      for call in (bsym.subsymbols if bsym.sym is REGION else (bsym,)) for name in call.output_names())
    fused, regions = [], 0
    for bsym in bsyms:
        if (bsym.sym is REGION and not executor.worth_fusing(bsym.subsymbols)
                and all(defined[name] == 1 for call in bsym.subsymbols for name in call.output_names())):
            fused.extend(bsym.subsymbols)
            continue
        if bsym.sym is REGION:
            views, outputs = _views_of_inputs(bsym, executor)
            fused.extend(views)
            if not outputs:
                continue
            calls = _needed(bsym.subsymbols, outputs)
            inputs, _ = region_io(calls, {}, 0)
            bsym = executor.fuse(calls, inputs, outputs, regions)
            regions += 1
        fused.append(bsym)
    return trace.from_trace(f"Fusion ({executor.name})", bound_symbols=fused)


def _views_of_inputs(region: BoundSymbol, executor: FusionExecutor) -> tuple[list[BoundSymbol], list[TensorProxy]]:
    """The calls that view the region's inputs to give one of its outputs, taken out to run before it, and the
    outputs left to the region. A region returns new tensors, so a view it returned would be a copy, in the region's
    layout rather than the viewed value's: eager takes it for free (the attention output's gradient reaches the
    attention's backward as a view of the projection's gradient, in (batch, tokens, heads, dim) memory; each layer
    slices the padding mask)."""
    viewed = {proxy.pname for proxy in region.proxy_args()}
    chain: list[BoundSymbol] = []
    for call in region.subsymbols:
        if executor.is_view(call) and call.arg_names() <= viewed:
            viewed.update(call.output_names())
            chain.append(call)
    taken = {proxy.pname for proxy in region.proxy_outputs()} & (viewed - set(region.arg_names()))
    if not taken:
        return [], list(region.output)
    needed: set[str] = set(taken)
    views: list[BoundSymbol] = []
    for call in reversed(chain):  # only the calls the taken outputs come from
        if set(call.output_names()) & needed:
            needed.update(call.arg_names())
            views.append(call)
    return views[::-1], [proxy for proxy in region.output if proxy.pname not in taken]


def _needed(calls: list[BoundSymbol], outputs: list[TensorProxy]) -> list[BoundSymbol]:
    """The calls of a region that its `outputs` come from."""
    needed = {proxy.pname for proxy in outputs}
    kept: list[BoundSymbol] = []
    for call in reversed(calls):
        if set(call.output_names()) & needed:
            needed.update(call.arg_names())
            kept.append(call)
    return kept[::-1]
