"""`fulmen.rewrite`: the usual body of a transform hook, replacing chosen calls of a trace by other calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fulmen.acquisition.acquire import Interpreter
from fulmen.core.symbol import BoundSymbol
from fulmen.core.trace import Trace, TraceBuilder
from fulmen.transforms.recording import record_call


def rewrite(trace: Trace, provenance: str, rule: Callable[[BoundSymbol], Any]) -> Trace:
    """A new trace in which each call for which `rule(bsym)` returns a result is replaced by what `rule` computed.

    `rule` runs like a grad rule: torch calls on the call's arguments (`torch.nn.functional.gelu(bsym.args[0],
    approximate="tanh")`) and symbols (`fulmen.torch.gelu`, `prims.mul`) are recorded, attributed to the call's
    source line, and its result (the same structure, shapes and dtypes as the call's outputs) takes their names, so
    the rest of the trace reads it unchanged. A rule returns None to keep the call as it is.
    """
    builder = TraceBuilder(trace.namespace)
    interpreter = Interpreter(builder)
    bsyms: list[BoundSymbol] = []
    with builder:
        for bsym in trace.bound_symbols:
            recorded = record_call(lambda *args, bsym=bsym, **kwargs: _declined(rule(bsym)), bsym, builder,
                                   interpreter, f"the rewrite rule {provenance!r} on {bsym.sym.printed}",
                                   may_return_inputs=True)
            bsyms.extend([bsym] if recorded is None else recorded)
    return trace.from_trace(provenance, bound_symbols=bsyms)


def _declined(result: Any) -> Any:
    return NotImplemented if result is None else result
