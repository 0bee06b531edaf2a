"""Choosing what the forward saves for the backward: a minimum cut over the forward's dataflow.

Every forward value the backward reads must either be saved (costing its bytes until the backward frees it)
or be recomputed in the backward from saved values through cheap ops (elementwise, shape, conversions,
non-random factories). The cheapest such set is a minimum s-t cut (the partitioning idea of functorch's
min-cut rematerialisation): each value is split into an "in" and an "out" node joined by an edge of capacity
equal to its bytes; cheap ops connect their inputs' "out" to their outputs' "in"; values that cannot be
recomputed (matmuls, reductions, random draws, unknown ops) hang off the source; the backward's reads flow to
the sink. Program inputs cost nothing to save: the caller holds them anyway.

Ops inside `torch.utils.checkpoint.checkpoint` are recomputable whatever they are and their outputs cannot
be saved, so the cut falls on the checkpointed region's inputs, as eager's checkpointing does.
"""

from __future__ import annotations

import networkx as nx

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Tag
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
    return proxy.numel() * proxy.element_size()


def held_bytes(proxy: TensorProxy) -> int:
    """What saving `proxy` keeps alive: a view holds its whole base."""
    base = proxy.meta._base if proxy.meta._is_view() else None
    return max(nbytes(proxy), base.numel() * base.element_size() if base is not None else 0)


# Saving a value the forward computes only for the backward also costs forward work: at equal bytes, prefer
# saving what the forward computes anyway.
BACKWARD_ONLY_PENALTY = 1.1


_SOURCE, _SINK = "source", "sink"


def choose_saved(forward: list[BoundSymbol], inputs: list[TensorProxy], outputs: set[str], needed: set[str],
                 forward_needs: set[str]) -> set[str]:
    """The names of the forward values to save so that every name in `needed` is available to the backward.

    `forward_needs` are the values the forward computes for its own outputs anyway.
    """
    graph = nx.DiGraph()
    # A checkpointed value read outside its region (by later ops, another region or the outputs) is what eager's
    # checkpointing keeps too; only the values internal to a region are never saved.
    region_of = {name: b.checkpoint_region for b in forward for name in b.output_names()}
    escaping = set(outputs)
    for bsym in forward:
        escaping.update(n for n in bsym.arg_names() if region_of.get(n, 0) not in (0, bsym.checkpoint_region))
    for proxy in inputs:
        graph.add_edge(_SOURCE, ("in", proxy.pname))
        graph.add_edge(("in", proxy.pname), ("out", proxy.pname), capacity=0)
    for bsym in forward:
        cheap = recomputable(bsym)
        for out in bsym.proxy_outputs():
            node = ("in", out.pname)
            if bsym.checkpoint_region and cheap and out.pname not in escaping:
                graph.add_edge(node, ("out", out.pname))  # no capacity: never saved
            else:
                cost = held_bytes(out) * (1 if out.pname in forward_needs else BACKWARD_ONLY_PENALTY)
                graph.add_edge(node, ("out", out.pname), capacity=int(cost) + 1)
            if cheap:
                for arg in bsym.proxy_args():
                    graph.add_edge(("out", arg.pname), node)
            else:
                graph.add_edge(_SOURCE, node)
    for name in needed:
        graph.add_edge(("out", name), _SINK)
    if _SINK not in graph:
        return set()
    _, (reachable, _) = nx.minimum_cut(graph, _SOURCE, _SINK)
    return {
        name
        for (kind, name) in (n for n in reachable if isinstance(n, tuple))
        if kind == "in" and ("out", name) not in reachable
    }
