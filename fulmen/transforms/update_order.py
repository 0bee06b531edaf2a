"""Each optimizer update right after its gradient is complete (issue 50: the whole training step in one trace).

Acquisition records a step in the program's order: the whole backward, then every parameter's update (one
`optim.*_update` call each, fulmen.ops.optim), then the write-backs of the new values into the parameters and the
optimizer state at the end. Run so, every gradient and every new value lives until the end of the step. This pass
moves each update, and the calls that carry its results into their tensors (keep_history, detach, the write-back
copy), as early as their inputs allow: an update right after the last call making its gradient, a write-back right
after the new value exists and the last read of the old one (a backward that still reads the weight keeps its
copy waiting). The values are unchanged (the trace is single-assignment; only the write-backs touch memory, and
they stay after every read of what they overwrite), and the deletion pass then frees each gradient at its update.
Then an update whose results only go back into the tensors it read becomes one in-place call of eager's kernel
(`optim.adam_update_`) where its last write-back stood: no copies of the parameter and its state, nothing held
between the update and its write-backs but the gradient. Last, consecutive in-place updates of one kind join in
buckets of at most `JitOptions.optimizer_bucket_cap_mb` of gradients, one kernel call each (`_batched`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol
from fulmen.core.trace import Trace
from fulmen.ops import optim, prims, shape
from fulmen.ops.registry import SYMBOLS
from fulmen.transforms.remat import nbytes

PROVENANCE = "Optimizer updates right after their gradients"
_UPDATES = frozenset({optim.ADAM_UPDATE, optim.SGD_UPDATE})
_IN_PLACE = frozenset(optim.IN_PLACE.values())


def _carries(bsym: BoundSymbol) -> bool:
    """Calls that only carry an update's result into the tensor it updates."""
    return bsym.sym in (SYMBOLS["torch.detach"], prims.copy_, shape.keep_history)


def updates_early(trace: Trace, bucket_cap_mb: float = 32.0) -> Trace:
    bsyms = trace.bound_symbols
    if not any(b.sym in _UPDATES for b in bsyms):
        return trace
    chain: set[int] = set()
    made: set[str] = set()
    for i, bsym in enumerate(bsyms):
        if bsym.sym in _UPDATES or (_carries(bsym) and bsym.arg_names() & made):
            chain.add(i)
            made.update(bsym.output_names())
    if not chain:
        return trace
    readers: Counter[str] = Counter()  # name -> calls reading it not yet placed
    for bsym in bsyms:
        readers.update(bsym.arg_names())
    available = {p.pname for p in trace.inputs}
    pending = sorted(chain)
    order: list[BoundSymbol] = []

    def place(bsym: BoundSymbol) -> None:
        order.append(bsym)
        available.update(bsym.output_names())
        readers.subtract(bsym.arg_names())

    def ready(bsym: BoundSymbol) -> bool:
        if not bsym.arg_names() <= available:
            return False
        if bsym.sym is prims.copy_:  # overwrites its destination: every other read of it first
            return readers[bsym.args[1].pname] == 1
        return True

    def flush() -> None:
        progress = True
        while progress:
            progress = False
            for i in list(pending):
                if ready(bsyms[i]):
                    pending.remove(i)
                    place(bsyms[i])
                    progress = True

    flush()
    for i, bsym in enumerate(bsyms):
        if i in chain:
            continue
        if not bsym.arg_names() <= available:  # reads a result of the chain: place what it waits for first
            flush()
        place(bsym)
        flush()
    for i in pending:  # not expected: whatever is left keeps the program's order
        place(bsyms[i])
    outputs = {p.pname for p in trace.output if type(p) is TensorProxy}
    bsyms = _in_place(order, outputs)
    return trace.from_trace(PROVENANCE, bound_symbols=_batched(bsyms, int(bucket_cap_mb * 2**20)))


def _updated(bsym: BoundSymbol) -> list[Any]:
    """Per output of an update, the input it is the new value of (None: none there, SGD's first buffer)."""
    args = bsym.args
    if bsym.sym is optim.ADAM_UPDATE:
        return [args[0], args[2], args[3], *([args[4]] if bsym.kwargs["amsgrad"] else []), args[5]]
    return [args[0], *([args[2]] if bsym.kwargs["momentum"] != 0 else [])]


def _chain(bsyms: list[BoundSymbol], readers: dict[str, list[int]], value: TensorProxy, target: Any,
           outputs: set[str]) -> list[int] | None:
    """The calls carrying `value` into `target` and nothing else (keep_history, detach, then the copy into it), by
    position; None when it goes anywhere else too."""
    chain = []
    while True:
        if value.pname in outputs or len(readers[value.pname]) != 1:
            return None
        j = readers[value.pname][0]
        b = bsyms[j]
        chain.append(j)
        if b.sym is shape.keep_history and b.args[1] is value and b.args[0] is target:
            value = b.proxy_outputs()[0]
        elif b.sym is SYMBOLS["torch.detach"]:
            value = b.proxy_outputs()[0]
        elif b.sym is prims.copy_ and b.args[0] is value and b.args[1] is target:
            done = b.proxy_outputs()
            return chain if all(not readers[p.pname] and p.pname not in outputs for p in done) else None
        else:
            return None


def _as_lists(bsym: BoundSymbol) -> tuple:
    """The arguments of an update as its in-place form takes them: a list per tensor argument (of one parameter
    here; `_batched` joins the lists of several)."""
    args = bsym.args
    if bsym.sym is optim.ADAM_UPDATE:
        return ([args[0]], [args[1]], [args[2]], [args[3]], [args[4]] if bsym.kwargs["amsgrad"] else [], [args[5]])
    return ([args[0]], [args[1]], [args[2]])


def _in_place(bsyms: list[BoundSymbol], outputs: set[str]) -> list[BoundSymbol]:
    """An update whose results only go back into the tensors it read, each through its write-back, becomes one
    in-place call of eager's kernel on them (optim.adam_update_), where the last of those write-backs stood: after
    every read of the old values. The copies, and the new values held until them, go."""
    readers: dict[str, list[int]] = defaultdict(list)
    for i, b in enumerate(bsyms):
        for name in b.arg_names():
            readers[name].append(i)
    at: dict[int, BoundSymbol] = {}
    dropped: set[int] = set()
    for i, b in enumerate(bsyms):
        in_place = optim.IN_PLACE.get(b.sym)
        if in_place is None:
            continue
        targets = _updated(b)
        if any(type(t) is not TensorProxy for t in targets) or len({t.pname for t in targets}) != len(targets):
            continue
        chains = [_chain(bsyms, readers, out, target, outputs)
                  for out, target in zip(b.proxy_outputs(), targets, strict=True)]
        if any(c is None for c in chains):
            continue
        last = max(c[-1] for c in chains)
        dropped.update({i, *(j for c in chains for j in c)})
        at[last] = b.from_bsym(sym=in_place, args=_as_lists(b), output=None, subsymbols=[])
    if not at:
        return bsyms
    result = []
    for i, b in enumerate(bsyms):
        if i in at:
            result.append(at[i])
        elif i not in dropped:
            result.append(b)
    return result


def _bucket_key(bsym: BoundSymbol) -> tuple:
    """Updates with the same key can be one kernel call: the same in-place form, hyperparameters and lr."""
    return (bsym.sym, *sorted((k, v.pname if type(v) is TensorProxy else v) for k, v in bsym.kwargs.items()))


def _batched(bsyms: list[BoundSymbol], cap: int) -> list[BoundSymbol]:
    """Consecutive in-place updates of one kind become one call over their lists (eager's kernel over several
    parameters, as eager's step calls it over a whole group): one foreach kernel launch per op for the bucket instead
    of one per parameter, and one Python call. Each update waits, its gradient held, until its bucket's gradients
    reach `cap` bytes, or until another call reads or writes a tensor the bucket updates (or writes one it reads),
    or the trace ends; the bucket then runs where that happens. Two updates may read one gradient (CSE merges the
    identical bias gradients of two branches adding into one residual). `cap` 0: each update alone, where it stood."""
    if cap <= 0:
        return bsyms
    result: list[BoundSymbol] = []
    buckets: dict[tuple, list[BoundSymbol]] = {}  # open, in the order they were opened
    held: dict[tuple, int] = {}
    writes: dict[str, tuple] = {}  # a tensor an open bucket updates -> that bucket
    reads: dict[str, set[tuple]] = defaultdict(set)  # a gradient open buckets read -> those buckets

    def flush(key: tuple) -> None:
        members = buckets.pop(key)
        del held[key]
        for member in members:
            written, read = _tensors(member)
            for name in written:
                writes.pop(name, None)
            for name in read:
                reads[name].discard(key)
        lists = tuple([p for member in members for p in member.args[k]] for k in range(len(members[0].args)))
        result.append(members[0].from_bsym(args=lists))

    for bsym in bsyms:
        key = _bucket_key(bsym) if bsym.sym in _IN_PLACE else None
        written, read = _tensors(bsym) if key is not None else (bsym.arg_names(), bsym.arg_names())
        hit = {writes[n] for n in written | read if n in writes} | {k for n in written for k in reads.get(n, ())}
        for waiting in [k for k in buckets if k in hit]:
            flush(waiting)
        if key is None:
            result.append(bsym)
            continue
        buckets.setdefault(key, []).append(bsym)
        held[key] = held.get(key, 0) + sum(nbytes(g) for g in bsym.args[1])
        writes.update(dict.fromkeys(written, key))
        for name in read:
            reads[name].add(key)
        if held[key] >= cap:
            flush(key)
    for key in list(buckets):
        flush(key)
    return result


def _tensors(update: BoundSymbol) -> tuple[set[str], set[str]]:
    """The tensors an in-place update writes (the parameters and their state) and reads (the gradients); its lr, read
    by every update of its group, is neither."""
    lists = update.args
    written = {p.pname for k, arg in enumerate(lists) if k != 1 for p in arg if type(p) is TensorProxy}
    return written, {p.pname for p in lists[1] if type(p) is TensorProxy}
