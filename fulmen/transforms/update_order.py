"""Each optimizer update right after its gradient is complete (issue 50: the whole training step in one trace).

Acquisition records a step in the program's order: the whole backward, then every parameter's update (one
`optim.*_update` call each, fulmen.ops.optim), then the write-backs of the new values into the parameters and the
optimizer state at the end. Run so, every gradient and every new value lives until the end of the step. This pass
moves each update, and the calls that carry its results into their tensors (keep_history, detach, the write-back
copy), as early as their inputs allow: an update right after the last call making its gradient, a write-back right
after the new value exists and the last read of the old one (a backward that still reads the weight keeps its
copy waiting). The values are unchanged (the trace is single-assignment; only the write-backs touch memory, and
they stay after every read of what they overwrite), and the deletion pass then frees each gradient at its update.
"""

from __future__ import annotations

from collections import Counter

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
    return trace.from_trace(PROVENANCE, bound_symbols=order)
