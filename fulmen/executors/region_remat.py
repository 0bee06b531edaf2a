"""Planning fusion regions beyond runs of consecutive calls: merging regions across independent calls, and
recomputing cheap values inside the regions that read them instead of materialising them.

A region that reads nothing the calls before it (since the previous region) compute moves up and joins the previous
region: the SwiGLU backward's two regions around the weight-gradient matmul (one recomputes the activation the
matmul reads, the other computes the gradients of fc_1 and fc_2) become one kernel reading fc_1 and fc_2 once.

Regions are runs of consecutive calls, so a value one region computes and a later region reads is written to memory
and read back, and lives in between; an elementwise call left alone between matmuls (the sum of two matmuls'
outputs) is a kernel of its own. When such a value is elementwise work on values that exist anyway (the SwiGLU's
`silu(fc_1)` the backward's next region reads beside `fc_1`, a normalised activation read beside the activation and
its saved statistics, the sum of the two MLP input gradients read by the norm's backward), every region reading it
can recompute it from those values in registers, as Inductor does inside one graph; the producer stops writing it
(a region, or a lone call, left with no output disappears).

Peak memory never rises: the trace's live bytes are tracked per position (every value that allocates, from its producer
to its last reader; the inputs too when the trace frees them as it goes, as a backward does with its saved values), plus
the workspace of a call that declares one (`Symbol.scratch`: fused attention's backward accumulates the query gradient
in fp32). Dropping a value frees its bytes over its lifetime; the values its recomputation reads live on to the last
region reading it. A value is dropped only when, at every position in between, the new live bytes stay at most the
trace's peak. Only cheap calls are recomputed (`remat.recomputable`: elementwise, shape and conversion ops, never
reductions or random draws), from values materialised before the reading region, and only when the readers read no
more bytes for it than materialising it moves (its write, one read per reader): a residual stream whose sums are all
elementwise on layer outputs that live on is not re-added from every layer in every region.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Symbol, Tag, iter_proxies
from fulmen.transforms.regions import last_uses, region_io
from fulmen.transforms.remat import allocated_bytes, held_bytes, nbytes, recomputable

# A region being planned: its subsymbols are its calls, args its inputs, output its outputs.
REGION = Symbol(name="region", printed="region", impl=None)
MAX_RECOMPUTED = 32  # calls recomputed per value and reader, at most
LOOKBACK = 4  # earlier regions a region may move up into, at most


@dataclass
class _Plan:
    bsyms: list[BoundSymbol]
    members: dict[int, list[BoundSymbol]]  # region position -> its calls
    materialised: set[str]  # values that exist in memory: trace inputs and the outputs of top-level calls
    position: dict[str, int]  # value -> position of the top-level call producing it (-1: a trace input)
    producer: dict[str, BoundSymbol]  # value -> the fusible call computing it (inside a region or alone)
    readers: dict[str, set[int]]  # value -> positions of the top-level calls reading it
    last_use: dict[str, int]
    proxies: dict[str, TensorProxy]
    held: set[str]  # values the caller holds anyway (a forward's inputs): free to keep alive
    live: list[int] = field(default_factory=list)  # bytes alive at each position
    recomputed: dict[int, set[str]] = field(default_factory=dict)  # region position -> values it recomputes
    dropped: set[int] = field(default_factory=set)  # positions of lone calls whose outputs are all recomputed
    is_view: Callable[[BoundSymbol], bool] = lambda bsym: False  # the executor's: a call that only views its input

    @property
    def peak(self) -> int:
        return max(self.live, default=0)


def _chain(name: str, reader: int, plan: _Plan) -> tuple[list[BoundSymbol], set[str]] | None:
    """The calls that recompute `name` in the region at `reader` from values materialised before it, in order,
    and those values; None when it takes a call that is not cheap or too many calls."""
    chain: list[BoundSymbol] = []
    leaves: set[str] = set()
    done: set[str] = set()

    def visit(value: str, top: bool) -> bool:
        if value in done:
            return True
        done.add(value)
        if not top and value in plan.materialised and plan.position.get(value, -1) < reader:
            leaves.add(value)
            return True
        call = plan.producer.get(value)
        if call is None or not recomputable(call) or len(chain) >= MAX_RECOMPUTED:
            return False
        for arg in call.proxy_args():  # in order: the same regions get the same source
            if not visit(arg.pname, False):
                return False
        chain.append(call)
        done.update(call.output_names())  # the call's other outputs come with it
        return True

    return (chain, leaves) if visit(name, True) else None


def _in_order(calls: list[BoundSymbol]) -> list[BoundSymbol]:
    """`calls` with each one after the calls computing its arguments, otherwise in the given order (a chain added
    to a region may read values an earlier chain put there)."""
    produced_by = {name: i for i, call in enumerate(calls) for name in call.output_names()}
    placed: list[bool] = [False] * len(calls)
    ordered: list[BoundSymbol] = []

    def place(i: int) -> None:
        if placed[i]:
            return
        placed[i] = True
        for arg in calls[i].proxy_args():
            producer = produced_by.get(arg.pname)
            if producer is not None and producer != i:
                place(producer)
        ordered.append(calls[i])

    for i in range(len(calls)):
        place(i)
    return ordered


def _try_drop(value: TensorProxy, plan: _Plan) -> bool:
    readers = plan.readers.get(value.pname, set())
    if not readers or not all(reader in plan.members for reader in readers):
        return False
    for reader in readers:  # a reader that only views it for a later call would write it out again, one per reader
        for call in plan.members[reader]:
            if value.pname in call.arg_names() and plan.is_view(call) \
                    and any(plan.readers.get(name, set()) - {reader} for name in call.output_names()):
                return False
    chains = {}
    for reader in readers:
        found = _chain(value.pname, reader, plan)
        if found is None:
            return False
        chains[reader] = found
    if _traffic_after(chains, plan) > _traffic_before(value, readers, plan):
        return False
    last_reader = max(readers)
    start, end = plan.position[value.pname], plan.last_use[value.pname]
    change = [0] * (end - start + 1)  # bytes alive at positions start..end, after the change, minus before
    for offset in range(len(change)):
        change[offset] -= allocated_bytes(value)
    leaves = {leaf for _, found in chains.values() for leaf in found}
    for leaf in leaves:
        if leaf not in plan.held and plan.last_use.get(leaf, -1) < last_reader:
            for position in range(max(plan.last_use[leaf] + 1, start), last_reader + 1):
                change[position - start] += held_bytes(plan.proxies[leaf])
    peak = plan.peak
    if any(plan.live[start + offset] + delta > peak for offset, delta in enumerate(change) if delta > 0):
        return False
    for offset, delta in enumerate(change):
        plan.live[start + offset] += delta
    for reader, (chain, leaf_names) in chains.items():
        members = plan.members[reader]
        computed = {name for call in members for name in call.output_names()}
        added = [call for call in chain if not set(call.output_names()) <= computed]
        plan.members[reader] = _in_order(added + members)
        plan.recomputed.setdefault(reader, set()).update(name for call in added for name in call.output_names())
        for leaf in leaf_names:
            plan.readers.setdefault(leaf, set()).add(reader)
            plan.last_use[leaf] = max(plan.last_use.get(leaf, -1), reader)
    plan.materialised.discard(value.pname)
    plan.readers.pop(value.pname)
    if start not in plan.members:  # a lone call: gone once none of its outputs is read
        plan.dropped.add(start)
    return True


def _traffic_before(value: TensorProxy, readers: set[int], plan: _Plan) -> int:
    """Bytes moved for `value` while it is materialised: its write, one read per reader, and the reads of a lone
    call computing it (gone once `value` is recomputed)."""
    moved = nbytes(value) * (1 + len(readers))
    start = plan.position[value.pname]
    if start not in plan.members:
        moved += sum(nbytes(p) for p in plan.bsyms[start].proxy_args())
    return moved


def _traffic_after(chains: dict[int, tuple[list[BoundSymbol], set[str]]], plan: _Plan) -> int:
    """Bytes the readers read to recompute the value: the leaves each reader does not read already. A chain through
    values recomputed before (a residual stream whose every sum is dropped) reads more at each step, and stops here
    before its recomputation grows with the depth of the model."""
    moved = 0
    for reader, (_, leaves) in chains.items():
        members = plan.members[reader]
        computed = {name for call in members for name in call.output_names()}
        read = {name for call in members for name in call.arg_names()} - computed
        moved += sum(nbytes(plan.proxies[leaf]) for leaf in leaves - read)
    return moved


def _plan(bsyms: list[BoundSymbol], inputs: list[TensorProxy], output: tuple, inputs_held: bool,
          fusible, is_view: Callable[[BoundSymbol], bool] = lambda bsym: False) -> _Plan:
    plan = _Plan(bsyms, members={}, materialised={p.pname for p in inputs}, position={p.pname: -1 for p in inputs},
                 producer={}, readers={}, last_use={}, proxies={p.pname: p for p in inputs},
                 held={p.pname for p in inputs} if inputs_held else set(), is_view=is_view)
    for position, bsym in enumerate(bsyms):
        for proxy in bsym.proxy_args():
            plan.readers.setdefault(proxy.pname, set()).add(position)
            plan.last_use[proxy.pname] = position
            plan.proxies.setdefault(proxy.pname, proxy)
        for proxy in bsym.proxy_outputs():
            plan.materialised.add(proxy.pname)
            plan.position[proxy.pname] = position
            plan.proxies.setdefault(proxy.pname, proxy)
        if bsym.sym is REGION:
            plan.members[position] = list(bsym.subsymbols)
            for call in bsym.subsymbols:
                for name in call.output_names():
                    plan.producer[name] = call
        elif len(bsym.proxy_outputs()) == 1 and fusible(bsym):
            plan.producer[bsym.output_names()[0]] = bsym
    for proxy in iter_proxies(output):
        plan.last_use[proxy.pname] = len(bsyms)
    # bytes alive at each position: a value from its producer to its last reader
    delta = [0] * (len(bsyms) + 2)
    for name, proxy in plan.proxies.items():
        if name in plan.held or name not in plan.position:
            continue
        size = held_bytes(proxy) if plan.position[name] < 0 else allocated_bytes(proxy)
        start, end = max(plan.position[name], 0), plan.last_use.get(name, plan.position[name])
        delta[start] += size
        delta[min(end, len(bsyms) - 1) + 1] -= size
    running = 0
    for position, bsym in enumerate(bsyms):
        running += delta[position]
        scratch = bsym.sym.scratch(*bsym.args, **bsym.kwargs) if bsym.sym.scratch is not None else 0
        plan.live.append(running + scratch)
    return plan


def _merge_once(bsyms: list[BoundSymbol], inputs: list[TensorProxy], output: tuple,
                inputs_held: bool) -> list[BoundSymbol] | None:
    """`bsyms` with the first region that can move up past the calls since an earlier region merged into it, or
    None. A region does when the two read a value in common (then read once) or it is the only reader of a value the
    earlier one computes (then never materialised), it reads nothing the calls in between compute and none of
    them has a side effect, and moving it keeps the live bytes between the two places under the trace's peak (its
    outputs exist earlier, the inputs it reads last die earlier). The earlier region is the nearest such one among
    the `LOOKBACK` before it: in the SwiGLU backward the activation's gradient reads what the region before the two
    weight-gradient matmuls computed, with another region in between."""
    plan = _plan(bsyms, inputs, output, inputs_held, lambda bsym: False)
    regions: list[int] = []
    for position, bsym in enumerate(bsyms):
        if bsym.sym is not REGION:
            continue
        computed: set[str] = set()
        impure = False
        end = position
        for previous in reversed(regions[-LOOKBACK:]):
            for call in bsyms[previous + 1 : end]:
                computed.update(call.output_names())
                impure |= bool(call.sym.tags & Tag.IMPURE)
            end = previous
            if impure or bsym.arg_names() & computed:
                break
            if _shares(bsyms[previous], bsym, position, plan) and _hoist_fits(bsym, previous, position, plan):
                merged = bsyms[previous].from_bsym(subsymbols=plan.members[previous] + plan.members[position])
                return [*bsyms[:previous], merged, *bsyms[previous + 1 : position], *bsyms[position + 1 :]]
            computed.update(bsyms[previous].output_names())
        regions.append(position)
    return None


def _shares(first: BoundSymbol, second: BoundSymbol, position: int, plan: _Plan) -> bool:
    """Whether merging saves reading a value twice, or writing one that only the second region reads."""
    if first.arg_names() & second.arg_names():
        return True
    return any(plan.readers.get(name) == {position} for name in first.output_names() if name in second.arg_names())


def _hoist_fits(region: BoundSymbol, to: int, position: int, plan: _Plan) -> bool:
    change = sum(allocated_bytes(p) for p in region.proxy_outputs())
    change -= sum(held_bytes(p) for p in region.proxy_args()
                  if plan.last_use.get(p.pname) == position and p.pname not in plan.held)
    return change <= 0 or all(plan.live[q] + change <= plan.peak for q in range(to + 1, position))


def _refresh(bsyms: list[BoundSymbol], output: tuple) -> list[BoundSymbol]:
    """Regions' inputs and outputs from their calls and from what later calls and the trace read."""
    drafts = []
    for bsym in bsyms:
        if bsym.sym is REGION:
            region_inputs, _ = region_io(bsym.subsymbols, {}, 0)
            bsym = bsym.from_bsym(args=tuple(region_inputs))
        drafts.append(bsym)
    last_use = last_uses(drafts, output)
    result = []
    for position, bsym in enumerate(drafts):
        if bsym.sym is REGION:
            _, region_outputs = region_io(bsym.subsymbols, last_use, position + 1)
            bsym = bsym.from_bsym(output=tuple(region_outputs))
        result.append(bsym)
    return result


def plan_regions(bsyms: list[BoundSymbol], inputs: list[TensorProxy], output: tuple, inputs_held: bool,
                 fusible, is_view: Callable[[BoundSymbol], bool] = lambda bsym: False) -> list[BoundSymbol]:
    """`bsyms` (regions as REGION placeholders) with regions merged across independent calls, then cheap values
    recomputed by the regions reading them (see the module docstring). `inputs_held`: the caller keeps the trace's
    inputs alive (a forward; a backward frees its saved values as it goes). `fusible(bsym)`: whether a call
    outside the regions may move into one."""
    while (merged := _merge_once(bsyms, inputs, output, inputs_held)) is not None:
        bsyms = _refresh(merged, output)
    return recompute_region_inputs(bsyms, inputs, output, inputs_held, fusible, is_view)


def recompute_region_inputs(bsyms: list[BoundSymbol], inputs: list[TensorProxy], output: tuple,
                            inputs_held: bool, fusible,
                            is_view: Callable[[BoundSymbol], bool] = lambda bsym: False) -> list[BoundSymbol]:
    """`bsyms` (regions as REGION placeholders) with cheap values recomputed by the regions reading them; regions'
    inputs and outputs follow from their calls again."""
    plan = _plan(bsyms, inputs, output, inputs_held, fusible, is_view)
    outputs = {p.pname for p in iter_proxies(output)}
    changed = False
    for bsym in bsyms:
        lone = len(bsym.proxy_outputs()) == 1 and plan.producer.get(bsym.output_names()[0]) is bsym
        if bsym.sym is REGION or lone:
            for value in bsym.proxy_outputs():
                if value.pname not in outputs:
                    changed |= _try_drop(value, plan)
    if not changed:
        return bsyms
    return _rebuild(plan, output)


def _rebuild(plan: _Plan, output: tuple) -> list[BoundSymbol]:
    """Regions with their new calls; inputs from the calls, outputs from what later calls and the trace read."""
    kept: list[tuple[int, BoundSymbol]] = []  # (position in the plan, call)
    for position, bsym in enumerate(plan.bsyms):
        if position in plan.dropped:
            continue
        if bsym.sym is REGION:
            members = plan.members[position]
            region_inputs, _ = region_io(members, {}, 0)
            bsym = bsym.from_bsym(args=tuple(region_inputs), subsymbols=members)
        kept.append((position, bsym))
    last_use = last_uses([bsym for _, bsym in kept], output)
    result = []
    for index, (position, bsym) in enumerate(kept):
        if bsym.sym is REGION:
            _, region_outputs = region_io(bsym.subsymbols, last_use, index + 1)
            recomputed = plan.recomputed.get(position, set())
            region_outputs = [p for p in region_outputs if p.pname not in recomputed]  # another call computes them
            if not region_outputs:
                continue  # everything it computed is recomputed where it is read
            bsym = bsym.from_bsym(output=tuple(region_outputs))
        result.append(bsym)
    return result
