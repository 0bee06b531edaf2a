"""`replaces=`: while an executor is active, calls of a replaced function are acquired as its operator.

A torch callable (`F.layer_norm`) is swapped in the acquisition's own dispatch table. A Python function or method
of the user's program is swapped where the program finds it while acquisition runs: on its class (a method such
as `NewGELU.forward`) or in every loaded module namespace that holds it (a module-level helper, also where it
was imported by name), then restored. Calls that reach the function another way (a closure, a saved bound
method) are traced as plain code.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

from fulmen.core.symbol import Symbol
from fulmen.ops import lookup


def replacement_table(executors: tuple[Any, ...]) -> dict[Callable[..., Any], Symbol]:
    """Replaced callable -> operator, the first executor in priority order winning."""
    table: dict[Callable[..., Any], Symbol] = {}
    for executor in executors:
        for original, sym in getattr(executor, "replacements", {}).items():
            table.setdefault(original, sym)
    return table


def _sites(original: Callable[..., Any]) -> list[tuple[Any, str]]:
    """(namespace object, attribute) pairs that hold `original`."""
    sites: list[tuple[Any, str]] = []
    qualname = getattr(original, "__qualname__", "")
    module = sys.modules.get(getattr(original, "__module__", None) or "")
    if "." in qualname and "<locals>" not in qualname and module is not None:
        owner: Any = module
        *path, attribute = qualname.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if isinstance(owner, type) and owner.__dict__.get(attribute) is original:
            sites.append((owner, attribute))
    for loaded in list(sys.modules.values()):
        namespace = getattr(loaded, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if value is original:
                sites.append((loaded, name))
    return sites


@contextlib.contextmanager
def replacements(executors: tuple[Any, ...], interpreter: Any) -> Iterator[None]:
    table = replacement_table(executors)
    patches: list[tuple[Any, str, Any]] = []
    for original, sym in table.items():
        if lookup(original) is not None:
            interpreter.replaced[original] = sym
            continue

        def replacement(*args: Any, _sym: Symbol = sym, _original: Callable[..., Any] = original,
                        **kwargs: Any) -> Any:
            return interpreter.record_replacement(_sym, lambda: _original(*args, **kwargs), args, kwargs)

        functools.update_wrapper(replacement, original)
        for owner, name in _sites(original):
            patches.append((owner, name, getattr(owner, name)))
            setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, value in reversed(patches):
            setattr(owner, name, value)
        interpreter.replaced.clear()
