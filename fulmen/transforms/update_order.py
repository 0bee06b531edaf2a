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
between the update and its write-backs but the gradient.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol
from fulmen.core.trace import Trace
from fulmen.ops import optim, prims, shape
from fulmen.ops.registry import SYMBOLS

PROVENANCE = "Optimizer updates right after their gradients"
_UPDATES = frozenset({optim.ADAM_UPDATE, optim.SGD_UPDATE})


def _carries(bsym: BoundSymbol) -> bool:
    """Calls that only carry an update's result into the tensor it updates."""
    return bsym.sym in (SYMBOLS["torch.detach"], prims.copy_, shape.keep_history)


def updates_early(trace: Trace) -> Trace:
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
    return trace.from_trace(PROVENANCE, bound_symbols=_in_place(order, outputs))


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
        at[last] = b.from_bsym(sym=in_place, output=None, subsymbols=[])
    if not at:
        return bsyms
    result = []
    for i, b in enumerate(bsyms):
        if i in at:
            result.append(at[i])
        elif i not in dropped:
            result.append(b)
    return result
