"""Running a Python function of a symbol's arguments (a grad rule, an execution transform) into bound symbols."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fulmen.core.errors import TraceError
from fulmen.core.symbol import BoundSymbol, iter_proxies
from fulmen.core.trace import TraceBuilder, mismatch


def run_recorded(run: Callable[[], Any], builder: TraceBuilder, interpreter: Any, source: Any) -> Any:
    """Runs `run` as a rule runs (torch calls on proxies record symbols, attributed to `source`) and gives its
    result; the calls it recorded join the current scope unless it declines (returns NotImplemented)."""
    builder.source = source
    builder.scopes.append([])
    builder.rules_running += 1
    try:
        with interpreter.rule_mode(source):
            result = run()
    finally:
        builder.rules_running -= 1
        recorded = builder.scopes.pop()
    if result is not NotImplemented:
        builder.scopes[-1].extend(recorded)
    return result


def record_call(fn: Callable[..., Any], bsym: BoundSymbol, builder: TraceBuilder, interpreter: Any, what: str,
                *, may_return_inputs: bool) -> list[BoundSymbol] | None:
    """Runs `fn(*bsym.args, **bsym.kwargs)` and returns the calls it made, its results named as `bsym`'s outputs.

    None when `fn` returns NotImplemented (it declines these arguments). Torch calls on proxies inside `fn`
    record symbols, attributed to `bsym`'s source line.
    """
    builder.scopes.append([])
    builder.source = bsym.source
    builder.checkpoint_region = bsym.checkpoint_region  # a checkpointed op's replacement stays checkpointed
    builder.rules_running += 1
    try:
        with interpreter.rule_mode(bsym.source):
            result = fn(*bsym.args, **bsym.kwargs)
            if result is not NotImplemented:
                result = interpreter.current_values(result)  # a result the rule updated in place: its new value
    except TraceError:
        raise
    except Exception as error:
        raise TraceError(f"{what} failed: {type(error).__name__}: {error}", bsym.source) from error
    finally:
        builder.rules_running -= 1
        recorded = builder.scopes.pop()
        builder.checkpoint_region = 0
    if result is NotImplemented:
        return None
    results, outputs = list(iter_proxies(result)), bsym.proxy_outputs()
    differs = mismatch(results, outputs)
    if differs is not None:
        raise TraceError(f"{what} returned {differs[0]} where {bsym.sym.printed} gives {differs[1]}", bsym.source)
    produced = {name for b in recorded for name in b.output_names()}
    for res in results:
        if res.pname not in produced and not may_return_inputs:
            raise TraceError(f"{what} must compute its outputs, not return its input {res.pname}", bsym.source)
    builder.adopt_results(recorded, results, outputs, bsym.source)
    return recorded
