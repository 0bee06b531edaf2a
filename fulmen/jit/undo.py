"""Undoing what an abandoned acquisition did to Python state, before fulmen acquires the program again.

fulmen sometimes runs the user's program twice on a first call: again as a tracer is seen when eager's path reads a
tensor value (is_compiling.py), again with shared storage as one input (aliasing.py). Eager runs it once, so what the
first run changed must not stay behind for the second to do again:

- hooks it registered on modules (Hugging Face installs its `output_hidden_states` / `output_attentions` capturing
  hooks lazily, inside the forward: left in place, each layer's output was collected twice);
- attributes and globals it stored (state_writes.py records the value each held before the program's first store);
- lists, dicts and sets it changed in place (`LOG.append(...)`: container_writes.py keeps what each held).

Hooks are restored on the modules the program can reach by name: the jitted module's tree, modules among the
arguments, and modules the function's closure, defaults and globals hold. Known limit: a hook registered on a module
found some other way, and a change of a container container_writes.py does not watch, happen once per run.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn


class HookSnapshot:
    """The content of every hook registry (`_forward_hooks`, ...) of some modules, restorable in place."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self._saved: list[tuple[dict, list[tuple[Any, Any]]]] = []
        seen: set[int] = set()
        for module in modules:
            if id(module) in seen:
                continue
            seen.add(id(module))
            for name, value in module.__dict__.items():
                if "hook" in name and isinstance(value, dict):
                    self._saved.append((value, list(value.items())))

    def restore(self) -> None:
        for registry, items in self._saved:
            if len(registry) != len(items) or any(k not in registry for k, _ in items):
                registry.clear()  # in place: the module (and a shadow of it) hold this very dict
                registry.update(items)


def reachable_modules(
    fn: Callable[..., Any], module: nn.Module | None, args: tuple, kwargs: dict[str, Any]
) -> list[nn.Module]:
    """Every submodule of the modules the program names directly (see the module docstring)."""
    roots: list[nn.Module] = [module] if module is not None else []
    candidates = _items((args, kwargs))
    function = getattr(fn, "__func__", fn)
    if isinstance(function, types.FunctionType):
        candidates += [cell.cell_contents for cell in function.__closure__ or () if _filled(cell)]
        candidates += list(function.__defaults__ or ())
        candidates += [function.__globals__.get(name) for name in function.__code__.co_names]
    roots += [obj for obj in candidates if isinstance(obj, nn.Module)]
    return [sub for root in roots for sub in root.modules()]


def _items(obj: Any) -> list[Any]:
    """`obj` and what its lists, tuples and dicts hold."""
    if type(obj) in (list, tuple):
        return [found for item in obj for found in _items(item)]
    if type(obj) is dict:
        return [found for item in obj.values() for found in _items(item)]
    return [obj]


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True
