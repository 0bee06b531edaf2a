"""`replaces=`: while an executor is active, calls of a replaced function are acquired as its operator, and calls of
a function it has a lookaside for (`register_lookaside`) are traced through the lookaside instead.

A torch callable (`F.layer_norm`) is swapped in the acquisition's own dispatch table. A Python function or method
of the user's program is swapped where the program finds it while acquisition runs: on its class (a method such
as `NewGELU.forward`) or in every loaded module namespace that holds it (a module-level helper, also where it
was imported by name), then restored; other threads calling it meanwhile run the original. Calls that reach the
function another way (a closure, a saved bound method) are traced as plain code. Where several active executors
replace one function, the first in priority order does; if its checker declines, the function's own code runs.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from fulmen.core.symbol import Symbol
from fulmen.jit.lookasides import resolve_attribute
from fulmen.ops import lookup


def replacement_table(executors: tuple[Any, ...]) -> dict[Callable[..., Any], Symbol | Callable[..., Any]]:
    """Replaced callable -> the operator recorded or the function traced in its place (a lookaside), the first
    executor in priority order winning."""
    table: dict[Callable[..., Any], Symbol | Callable[..., Any]] = {}
    for executor in executors:
        for original, sym in getattr(executor, "replacements", {}).items():
            table.setdefault(original, sym)
        for original, function in getattr(executor, "lookasides", {}).items():
            table.setdefault(original, function)
    return table


def _sites(originals: list[Callable[..., Any]]) -> dict[int, list[tuple[Any, str]]]:
    """id(original) -> the (namespace object, attribute) pairs that hold it: its class attribute for a method,
    and every module global bound to it (one pass over the loaded modules for all of them)."""
    sites: dict[int, list[tuple[Any, str]]] = {id(original): [] for original in originals}
    for original in originals:
        qualname = getattr(original, "__qualname__", "")
        if "." in qualname and "<locals>" not in qualname:
            target = resolve_attribute(getattr(original, "__module__", None) or "", qualname)
            if target is not None and isinstance(target[0], type) and target[0].__dict__.get(target[1]) is original:
                sites[id(original)].append(target)
    for loaded in list(sys.modules.values()):
        namespace = getattr(loaded, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if id(value) in sites:  # the originals are alive, so an equal id is the same object
                sites[id(value)].append((loaded, name))
    return sites


# Patches are process-wide: one acquisition patches at a time (others wait here), and while it does, a patched
# function called from any other thread (eager code, say) runs the original.
_PATCHING = threading.RLock()


def _patched(original: Callable[..., Any], target: Symbol | Callable[..., Any], interpreter: Any,
             acquiring: int) -> Callable[..., Any]:
    def replacement(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != acquiring:
            return original(*args, **kwargs)
        if isinstance(target, Symbol):
            return interpreter.record_replacement(target, lambda: original(*args, **kwargs), args, kwargs)
        return target(*args, **kwargs)

    return functools.update_wrapper(replacement, original)


@contextlib.contextmanager
def replacements(executors: tuple[Any, ...], interpreter: Any) -> Iterator[list[tuple[Any, str, Any]]]:
    """Swaps the replaced functions while acquiring; gives the (owner, name, original) it swapped."""
    functions = []  # the user's functions and methods; torch's callables go to the interpreter's dispatch table
    for original, target in replacement_table(executors).items():
        if lookup(original) is not None:
            interpreter.replaced[original] = target
        else:
            functions.append((original, target))
    patches: list[tuple[Any, str, Any]] = []
    with _PATCHING if functions else contextlib.nullcontext():
        sites = _sites([original for original, _ in functions]) if functions else {}
        acquiring = threading.get_ident()
        for original, target in functions:
            replacement = _patched(original, target, interpreter, acquiring)
            for owner, name in sites[id(original)]:
                patches.append((owner, name, getattr(owner, name)))
                setattr(owner, name, replacement)
        try:
            yield patches
        finally:
            for owner, name, value in reversed(patches):
                setattr(owner, name, value)
            interpreter.replaced.clear()
