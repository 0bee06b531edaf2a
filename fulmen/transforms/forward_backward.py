"""Splitting a differentiated program into a forward trace and backward traces.

The forward trace returns the program's outputs followed by the values saved for the backward (chosen by
`fulmen.transforms.remat`). A backward trace takes `(saved, cotangents)` as two lists, unpacks and clears
them, so each saved tensor is freed right after its last use; it recomputes what was not saved just before
the first op that reads it. Backward traces are built per pattern of present cotangents (outputs the caller
did not differentiate get no cotangent, and their chunks are skipped rather than fed zeros).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol
from fulmen.core.symbolic import size_carriers, symbolic_trace
from fulmen.core.trace import Trace, TraceBuilder
from fulmen.ops import prims
from fulmen.ops.registry import SYMBOLS
from fulmen.transforms.autodiff import BackwardAssembler, Chunk, GradTransform
from fulmen.transforms.common import dce
from fulmen.transforms.regions import last_uses
from fulmen.transforms.remat import allocated_bytes, choose_saved, nbytes


@dataclass
class GradPlan:
    forward: Trace  # returns the program's outputs, then `saved`
    saved: list[TensorProxy]
    differentiable: tuple[bool, ...]  # per program output: whether it gets a cotangent
    grad_inputs: tuple[bool, ...]  # per trace input: whether the backward returns its grad
    chunks: list[Chunk] = field(repr=False)
    producers: dict[str, BoundSymbol] = field(repr=False)
    source: Trace = field(repr=False)
    _assembled: dict[tuple[bool, ...], tuple] = field(default_factory=dict, repr=False)

    @property
    def n_outputs(self) -> int:
        return len(self.differentiable)

    def assemble(self, present: tuple[bool, ...]) -> tuple[list[BoundSymbol], list[TensorProxy], tuple]:
        """The backward ops for the outputs whose cotangent is present, their cotangent inputs and the grads."""
        if present in self._assembled:
            return self._assembled[present]
        builder = TraceBuilder(namespace=self.source.namespace)
        cotangents: list[TensorProxy] = []
        with builder:
            assembler = BackwardAssembler(builder)
            for out, wanted in zip(self.source.output, present):
                if not wanted:
                    continue
                grad = builder.make_proxy(torch.empty_like(out.meta), out.device, name=f"grad_{out.pname}")
                cotangents.append(grad)
                assembler.accumulate(out, grad)
            assembler.run(self.chunks)
        grads = tuple(
            assembler.cot.get(p.pname) if wanted else None for p, wanted in zip(self.source.inputs, self.grad_inputs)
        )
        live = dce(Trace("backward", cotangents, builder.bound_symbols, grads, "", self.source.namespace))
        self._assembled[present] = live.bound_symbols, cotangents, grads
        return self._assembled[present]

    def backward(self, present: tuple[bool, ...]) -> Trace:
        """The backward trace for the outputs whose cotangent is present (a subset of the differentiable ones)."""
        bsyms, cotangents, grads = self.assemble(present)
        available = {p.pname for p in self.saved} | {p.pname for p in cotangents}
        bsyms = _with_recomputation(bsyms, grads, available, self.producers)
        return Trace("backward", self.saved + cotangents, bsyms, grads, "Backward (fulmen grad transform)",
                     self.source.namespace, input_groups=(("saved", len(self.saved)), ("cotangents", len(cotangents))))


def _with_recomputation(bsyms: list[BoundSymbol], outputs: tuple, available: set[str],
                        producers: dict[str, BoundSymbol]) -> list[BoundSymbol]:
    """`bsyms` with each unsaved forward value recomputed right before the first op that reads it."""
    result: list[BoundSymbol] = []
    produced = set(available)

    def ensure(name: str) -> None:
        if name in produced:
            return
        producer = producers.get(name)
        if producer is None:
            raise AssertionError(f"internal error: the backward reads {name}, which the forward neither saves nor "
                                 "computes")
        # in argument order, not a set's (hash) order: the repeated layers of a model then get the same backward
        # code, and their fusion regions the same source (compiled once)
        for arg in producer.proxy_args():
            ensure(arg.pname)
        result.append(producer)
        produced.update(producer.output_names())

    for bsym in bsyms:
        for arg in bsym.proxy_args():
            ensure(arg.pname)
        result.append(bsym)
        produced.update(bsym.output_names())
    for out in outputs:
        if out is not None:
            ensure(out.pname)
    return result


def _live_peak(bsyms: list[BoundSymbol], output: tuple, inputs: list[TensorProxy]) -> int:
    """The most bytes alive while `bsyms` run: `inputs` (freed after their last reader) and what the calls allocate
    (freed after their last reader, or kept when `output` holds them)."""
    last_use = last_uses(bsyms, output)
    freed: dict[int, int] = defaultdict(int)
    for proxy in inputs:
        freed[last_use.get(proxy.pname, -1)] += nbytes(proxy)
    live = peak = sum(nbytes(p) for p in inputs) - freed.pop(-1, 0)
    for position, bsym in enumerate(bsyms):
        for out in bsym.proxy_outputs():
            size = allocated_bytes(out)
            live += size
            freed[last_use.get(out.pname, position)] += size
        peak = max(peak, live)
        live -= freed.pop(position, 0)
    return peak


def _external_reads(bsyms: list[BoundSymbol], outputs: tuple, given: set[str]) -> set[str]:
    """Names `bsyms` read before producing them, other than `given`."""
    produced, reads = set(given), set()
    for bsym in bsyms:
        reads.update(name for name in bsym.arg_names() if name not in produced)
        produced.update(bsym.output_names())
    reads.update(p.pname for p in outputs if p is not None and p.pname not in produced)
    return reads


def plan_grad(trace: Trace, interpreter_factory: Callable[[TraceBuilder], Any],
              executors: tuple[Any, ...] = (), memory_budget: float = 1.0) -> GradPlan:
    """Differentiates `trace` with respect to its inputs that require grad, and splits it; `memory_budget`: see
    `fulmen.transforms.remat.choose_saved`."""
    joint = GradTransform(trace, interpreter_factory, executors).joint()
    input_names = {p.pname for p in trace.inputs}
    differentiable = tuple(
        type(out) is TensorProxy and out.requires_grad and out.pname not in input_names for out in trace.output
    )
    grad_inputs = tuple(p.requires_grad for p in trace.inputs)
    producers = {name: bsym for bsym in joint.forward for name in bsym.output_names()}
    draft = GradPlan(trace, [], differentiable, grad_inputs, joint.chunks, producers, trace)
    bsyms, cotangents, grads = draft.assemble(differentiable)
    needed = _external_reads(bsyms, grads, {p.pname for p in cotangents})
    computed = dce(trace.from_trace("", bound_symbols=joint.forward))
    forward_needs = {name for b in computed.bound_symbols for name in b.output_names()}
    outputs = {p.pname for p in trace.output if type(p) is TensorProxy}
    proxies = {p.pname: p for p in trace.inputs} | {p.pname: p for b in joint.forward for p in b.proxy_outputs()}

    def peak(saved_names: set[str]) -> int:
        """The step's estimated peak bytes (beyond the program's inputs) when the forward saves `saved_names`."""
        saved = [proxies[name] for name in saved_names if name not in input_names]
        forward = dce(trace.from_trace("", bound_symbols=joint.forward, output=(*trace.output, *saved)))
        recomputing = _with_recomputation(bsyms, grads, saved_names | {p.pname for p in cotangents}, producers)
        return max(_live_peak(forward.bound_symbols, forward.output, []),
                   _live_peak(recomputing, grads, saved))

    overwritten = frozenset(b.args[1].pname for b in trace.bound_symbols if b.sym is prims.copy_)
    saved_names = choose_saved(joint.forward, trace.inputs, outputs, needed, forward_needs, memory_budget, peak,
                               overwritten)
    if symbolic_trace(trace):  # the backward binds its symbolic sizes from what it takes: an input gives a missing one
        given = [proxies[name] for name in saved_names] + cotangents
        recomputing = _with_recomputation(bsyms, grads, saved_names | {p.pname for p in cotangents}, producers)
        saved_names |= {p.pname for p in size_carriers(recomputing, given, [*trace.inputs, *proxies.values()])}
    order = list(trace.inputs) + [o for b in joint.forward for o in b.proxy_outputs()]
    saved, seen = [], set()
    for proxy in order:
        if proxy.pname in saved_names and proxy.pname not in seen:
            seen.add(proxy.pname)
            saved.append(proxy)
    bsyms, saved_values = _copies_of_overwritten_views(joint.forward, saved, trace, overwritten)
    forward = dce(trace.from_trace("", bound_symbols=bsyms, output=tuple(trace.output) + tuple(saved_values)))
    # The final plan reuses the draft's assembly of the full backward.
    return GradPlan(forward.from_trace("Forward (fulmen grad transform)"), saved, differentiable, grad_inputs,
                    joint.chunks, producers, trace, draft._assembled)


def _meta_root(proxy: TensorProxy) -> torch.Tensor:
    return proxy.meta._base if proxy.meta._is_view() else proxy.meta


def _copies_of_overwritten_views(bsyms: list[BoundSymbol], saved: list[TensorProxy], trace: Trace,
                                 overwritten: frozenset[str]) -> tuple[list[BoundSymbol], list[TensorProxy]]:
    """The forward's calls and the values it returns for `saved`: a saved value that is a view of an input the
    forward then updates in place (`x[None].clamp_(...)` saves `x[None]` for clamp's mask) is copied right after it
    is computed, else the write-back would change it under the backward (which read the new value, and failed its
    version check naming a tensor eager never saved). So is a saved `.detach()` alias of such an input, or a view of
    one (`t = x.detach(); t *= x * 2` saves t for the grad of `x * 2`: the backward read t's new value, where eager's
    mul_ saves the old one): a detached tensor's meta is not a view, though it shares the input's memory. An input
    saved itself is the bridge's (trace_function.py: originals)."""
    roots = {id(_meta_root(p)) for p in trace.inputs if p.pname in overwritten}
    detached = set()
    for bsym in bsyms:
        arg = bsym.args[0] if bsym.args else None
        if bsym.sym is SYMBOLS["torch.detach"] and type(arg) is TensorProxy and id(_meta_root(arg)) in roots:
            detached.update(p.pname for p in bsym.proxy_outputs())
            roots.update(id(p.meta) for p in bsym.proxy_outputs())
    names = {p.pname for p in saved if (p.meta._is_view() or p.pname in detached) and id(_meta_root(p)) in roots}
    if not names:
        return bsyms, saved
    copies: dict[str, TensorProxy] = {}
    out: list[BoundSymbol] = []
    with TraceBuilder(trace.namespace) as builder:
        for bsym in bsyms:
            out.append(bsym)
            for proxy in bsym.proxy_outputs():
                if proxy.pname in names and proxy.pname not in copies:
                    builder.source = bsym.source
                    copies[proxy.pname] = prims.clone(proxy)
                    out.extend(builder.bound_symbols)
                    builder.bound_symbols.clear()
    return out, [copies.get(p.pname, p) for p in saved]
