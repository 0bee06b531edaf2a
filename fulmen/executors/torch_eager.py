"""The torch executor: runs every torch-level symbol with the torch callable it was acquired from.

It is always last in the executor list, so every symbol has an implementation. Symbols print as their torch
callable (`torch.nn.functional.linear`), so the final trace is plain PyTorch that runs without fulmen.
"""

from __future__ import annotations

from fulmen.core.trace import Trace


def claim_all(trace: Trace) -> Trace:
    missing = [bsym.sym.printed for bsym in trace.bound_symbols if bsym.sym.impl is None]
    if missing:
        raise NotImplementedError(f"the torch executor cannot run {sorted(set(missing))}")
    return trace.from_trace("Transform for execution (torch executor)")
