"""Choosing what the forward saves for the backward: a minimum cut over the forward's dataflow.

Every forward value the backward reads must either be saved (costing its bytes until the backward frees it)
or be recomputed in the backward from saved values through cheap ops (elementwise, shape, conversions,
non-random factories). The cheapest such set is a minimum s-t cut (the partitioning idea of functorch's
min-cut rematerialisation): each value is split into an "in" and an "out" node joined by an edge of capacity
equal to its bytes; cheap ops connect their inputs' "out" to their outputs' "in"; values that cannot be
recomputed (matmuls, reductions, random draws, unknown ops) hang off the source; the backward's reads flow to
the sink. Program inputs cost nothing to save: the caller holds them anyway, but for those the forward updates in
place (its write-backs): saved, they would hold the updated values, so the cut saves them only where nothing else
serves (the backward reads them directly, where eager's autograd saves them too and raises on the update).

Ops inside `torch.utils.checkpoint.checkpoint` are recomputable whatever they are and their outputs cannot
be saved, so the cut falls on the checkpointed region's inputs, as eager's checkpointing does.

An activation memory budget (`JitOptions.activation_memory_budget`, torch.compile's knob of the same name) below 1
also lets the backward recompute matmuls, reductions and the executor kernels that declare their flops (a fused
attention forward: `register_operator(flops=)`), the cheapest first (fewest flops per byte of output): the
fewest of them, found by bisection over that order, whose recomputation brings the saved bytes within the budget's
share of what the cut saves without them. Each is then an ordinary recomputable call to the cut, which still
minimises bytes; where saving an allowed call's output costs what saving its input would, the output is saved.
At the default budget of 1 none of them is rerun: a fused attention forward saves its output and log-sum-exp, a
few bytes per query next to the forward's T-fold work per byte.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import networkx as nx

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Tag
from fulmen.core.symbolic import hint
from fulmen.ops import prims

_CHEAP_PRIM_NAMES = set(prims.UNARY) | set(prims.BINARY) | {
    "where", "convert_element_type", "alias", "clone", "reshape", "permute", "expand", "squeeze", "unsqueeze",
    "slice", "select", "cat", "flip", "pad", "full", "iota",
}
CHEAP_PRIMS = frozenset(prims.PRIMS[name] for name in _CHEAP_PRIM_NAMES)


def recomputable(bsym: BoundSymbol) -> bool:
    """Whether the backward may rerun `bsym` instead of having its outputs saved."""
    if bsym.sym.tags & (Tag.RANDOM | Tag.IMPURE):
        return False
    if bsym.checkpoint_region or bsym.sym.tags & Tag.RECOMPUTABLE:
        return True
    if bsym.sym.is_prim:
        return bsym.sym in CHEAP_PRIMS
    return bool(bsym.subsymbols) and all(recomputable(sub) for sub in bsym.subsymbols)


def nbytes(proxy: TensorProxy) -> int:
    """Its bytes; for symbolic sizes, those of the traced call (a cost, decided once per trace)."""
    return hint(proxy.numel()) * proxy.element_size()


def allocated_bytes(proxy: TensorProxy) -> int:
    """What computing `proxy` allocates: nothing for a view."""
    return 0 if proxy.meta._is_view() else nbytes(proxy)


def held_bytes(proxy: TensorProxy) -> int:
    """What saving `proxy` keeps alive: a view holds its whole base."""
    base = proxy.meta._base if proxy.meta._is_view() else None
    return max(nbytes(proxy), hint(base.numel()) * base.element_size() if base is not None else 0)


# Saving a value the forward computes only for the backward also costs forward work: at equal bytes, prefer
# saving what the forward computes anyway.
BACKWARD_ONLY_PENALTY = 1.1
# Flops a GPU does in the time it moves one byte (an H200: 989 dense bf16 TFLOP/s over 4.8 TB/s): a reduction's
# recomputation is priced as this many flops per byte it reads.
FLOPS_PER_BYTE = 200
_MATMUL = prims.PRIMS["matmul"]
_REDUCTION_PRIMS = frozenset(prims.PRIMS[name] for name in ("sum", "prod", "amax", "amin", "var"))


def leaf_calls(bsym: BoundSymbol) -> Iterator[BoundSymbol]:
    """The calls without subsymbols that `bsym` decomposes into (itself when it has none)."""
    if not bsym.subsymbols:
        yield bsym
    for sub in bsym.subsymbols:
        yield from leaf_calls(sub)


def recompute_flops(bsym: BoundSymbol) -> int | None:
    """What recomputing `bsym` costs, in flops (a reduction's bytes priced at FLOPS_PER_BYTE), when it is a matmul,
    a reduction or a kernel declaring its flops, which the budget may recompute; None for any other call (and for what
    `recomputable` allows anyway)."""
    if recomputable(bsym) or bsym.sym.tags & (Tag.RANDOM | Tag.IMPURE) or not bsym.proxy_outputs():
        return None
    flops = 0
    for leaf in leaf_calls(bsym):
        if leaf.sym is _MATMUL:
            a, out = leaf.args[0], leaf.output
            flops += hint(2 * out.numel() * a.shape[-1])
        elif leaf.sym in _REDUCTION_PRIMS:
            flops += FLOPS_PER_BYTE * nbytes(leaf.args[0])
        elif leaf.sym.flops is not None:
            flops += hint(leaf.sym.flops(*leaf.args, **leaf.kwargs))
        elif not leaf.sym.is_prim or leaf.sym not in CHEAP_PRIMS:
            return None
    return flops


_SOURCE, _SINK = "source", "sink"
_OVERWRITTEN = 2**62  # the capacity of an input the forward updates in place: above any cut of real bytes


@dataclass
class _Cut:
    """The minimum cut of one forward, for a given set of matmuls and reductions the backward may recompute."""

    forward: list[BoundSymbol]
    inputs: list[TensorProxy]
    outputs: set[str]
    needed: set[str]
    forward_needs: set[str]
    overwritten: frozenset[str] = frozenset()
    proxies: dict[str, TensorProxy] = field(init=False)
    escaping: set[str] = field(init=False)

    def __post_init__(self) -> None:
        self.proxies = {p.pname: p for b in self.forward for p in b.proxy_outputs()}
        # A checkpointed value read outside its region (by later ops, another region or the outputs) is what eager's
        # checkpointing keeps too; only the values internal to a region are never saved.
        region_of = {name: b.checkpoint_region for b in self.forward for name in b.output_names()}
        self.escaping = set(self.outputs)
        for bsym in self.forward:
            self.escaping.update(n for n in bsym.arg_names()
                                 if region_of.get(n, 0) not in (0, bsym.checkpoint_region))

    def saved(self, allowed: frozenset[int] = frozenset()) -> set[str]:
        """The values to save; `allowed`: positions in `forward` of calls recomputable beyond the cheap ones."""
        graph = nx.DiGraph()
        for proxy in self.inputs:
            graph.add_edge(_SOURCE, ("in", proxy.pname))
            capacity = _OVERWRITTEN if proxy.pname in self.overwritten else 0
            graph.add_edge(("in", proxy.pname), ("out", proxy.pname), capacity=capacity)
        for position, bsym in enumerate(self.forward):
            expensive = position in allowed
            cheap = expensive or recomputable(bsym)
            for out in bsym.proxy_outputs():
                node = ("in", out.pname)
                if bsym.checkpoint_region and cheap and out.pname not in self.escaping:
                    graph.add_edge(node, ("out", out.pname))  # no capacity: never saved
                else:
                    cost = held_bytes(out) * (1 if out.pname in self.forward_needs else BACKWARD_ONLY_PENALTY)
                    # one less for an allowed call's output: of two cuts saving as many bytes, the one that does
                    # not recompute it
                    graph.add_edge(node, ("out", out.pname), capacity=int(cost) + (0 if expensive else 1))
                if cheap:
                    for arg in bsym.proxy_args():
                        graph.add_edge(("out", arg.pname), node)
                else:
                    graph.add_edge(_SOURCE, node)
        for name in self.needed:
            graph.add_edge(("out", name), _SINK)
        if _SINK not in graph:
            return set()
        _, (reachable, _) = nx.minimum_cut(graph, _SOURCE, _SINK)
        return {
            name
            for (kind, name) in (n for n in reachable if isinstance(n, tuple))
            if kind == "in" and ("out", name) not in reachable
        }

    def held(self, names: set[str]) -> int:
        """The bytes saving `names` keeps alive (program inputs cost nothing)."""
        return sum(held_bytes(self.proxies[name]) for name in names if name in self.proxies)


def choose_saved(forward: list[BoundSymbol], inputs: list[TensorProxy], outputs: set[str], needed: set[str],
                 forward_needs: set[str], memory_budget: float = 1.0,
                 peak: Callable[[set[str]], int] | None = None, overwritten: frozenset[str] = frozenset()) -> set[str]:
    """The names of the forward values to save so that every name in `needed` is available to the backward.

    `forward_needs` are the values the forward computes for its own outputs anyway. `memory_budget` below 1: the
    saved bytes (program inputs aside) at most this share of what is saved at 1, where recomputing matmuls and
    reductions can get there, at the fewest flops (else as few bytes as recomputing all of them leaves). `peak`
    estimates the step's peak bytes for a choice of saved values: a choice that would raise it above the default
    choice's is not taken (a value recomputed early for one reader stays alive until its last, so recomputing
    everything can keep more alive than saving), and fewer calls are recomputed instead. `overwritten`: the inputs the
    forward updates in place, saved only where the backward reads them directly.
    """
    cut = _Cut(forward, inputs, outputs, needed, forward_needs, overwritten)
    saved = cut.saved()
    if memory_budget >= 1 or not saved:
        return saved
    limit = memory_budget * cut.held(saved)
    costs = [(flops / max(1, sum(nbytes(o) for o in b.proxy_outputs())), position)
             for position, b in enumerate(forward) if (flops := recompute_flops(b)) is not None]
    order = [position for _, position in sorted(costs)]
    # Allowing more calls never saves more bytes (the cut only gains choices): bisect for the shortest prefix.
    low, high = 0, len(order)
    best = cut.saved(frozenset(order))
    if cut.held(best) <= limit:
        while low < high:
            middle = (low + high) // 2
            candidate = cut.saved(frozenset(order[:middle]))
            if cut.held(candidate) <= limit:
                high, best = middle, candidate
            else:
                low = middle + 1
    if peak is not None:
        ceiling = peak(saved)
        while high and peak(best) > ceiling:
            high //= 2
            best = cut.saved(frozenset(order[:high]))
    return best
