"""Guards the observer builds from more than one read: a function's code and defaults (`CalleeGuard`), the names that
must stay out of an object's `__dict__` and the hook registries of a module that must stay empty (`UnsetNames`), a
tensor tied between two places of a module tree (`tied_guard`), and the summaries a module container's guard
compares (`children`, `tensor_slots`).
"""

from __future__ import annotations

import types
from collections import OrderedDict
from typing import Any, Protocol

from torch import nn

from fulmen.observation.guards import Guard
from fulmen.observation.value_checks import Emitter, immutable, value_check

# nn.Module's hook registries (`_forward_hooks`, ...): almost always empty, then checked together per module
HOOK_REGISTRIES = frozenset(name for name, value in nn.Module().__dict__.items()
                             if "hook" in name and type(value) in (dict, OrderedDict))


def empty_hooks(name: str, value: Any) -> bool:
    return name in HOOK_REGISTRIES and type(value) in (dict, OrderedDict) and not value


class Place(Protocol):
    """Where a module tensor lives: `getattr(module, container)[name]` (module_inputs.ModuleInput)."""

    module: nn.Module
    container: str  # "_parameters", "_buffers" or "__dict__"
    name: str
    qualified: str


def _place_expr(emit: Emitter, place: Place) -> str:
    state = emit.bind(place.module.__dict__)  # lives as long as the module; the containers are looked up anew
    container = "" if place.container == "__dict__" else f"[{place.container!r}]"
    return f"{state}{container}[{place.name!r}]"


def tied_guard(place: Place, first: Place) -> Guard:
    """`place` holds the tensor found first at `first` (tied weights), as when traced."""
    emit = Emitter()
    source = f"{_place_expr(emit, place)} is {_place_expr(emit, first)}"
    return Guard(f"{place.qualified} tied to {first.qualified}", source, emit.bindings, explain=lambda: (
        f"{place.qualified} is no longer the same tensor as {first.qualified} (tied when traced)"))


class CalleeGuard:
    """A function the program read, and may call: when it runs, it must keep its code and its defaults as they were
    before the call (a mutable default the program changes, `fn.__defaults__ = ...`, `fn.__code__ = ...`). Defaults
    are checked only where there are some: defaults a function had none of cannot change a call that ran without."""

    def __init__(self, fn: types.FunctionType) -> None:
        self.fn = fn
        self.code = fn.__code__
        self.emit = Emitter()
        self.terms: list[str] = []  # the defaults' checks, made now: before the program changes them
        bound = self.emit.bind(fn)
        for name, given in (("__defaults__", fn.__defaults__), ("__kwdefaults__", fn.__kwdefaults__)):
            if given is None:
                continue
            defaults = self.emit.bind(given)
            self.terms.append(f"{bound}.{name} is {defaults}")  # a new tuple (or dict) when reassigned
            # the tuple cannot change, its items can; the keyword defaults are a dict
            checks = [value_check(f"{defaults}[{i}]", item, self.emit) for i, item in enumerate(given)
                      if not immutable(item)] if name == "__defaults__" else [value_check(defaults, given, self.emit)]
            self.terms += [check for check in checks if check is not None]

    def guard(self) -> Guard:
        terms = [f"{self.emit.bind(self.fn)}.__code__ is {self.emit.bind(self.code)}", *self.terms]
        return Guard(f"the code or defaults of function {self.fn.__qualname__}", " and ".join(terms),
                     self.emit.bindings)


class UnsetNames:
    """Names that must stay out of one object's `__dict__` (its class provides them: methods, class attributes) and
    hook registries of a module that must stay empty: the most common guards, checked in one expression."""

    def __init__(self, state: dict, owner: str) -> None:
        self.state = state
        self.owner = owner
        self.absent: set[str] = set()
        self.empty: set[str] = set()
        self.typed: tuple[Any, type] | None = None  # the object and its class, when its class provides names

    def guard(self) -> Guard:
        emit = Emitter()
        bound = emit.bind(self.state)
        terms = [f"{n!r} in {bound}" for n in sorted(self.absent)] + [f"{bound}[{n!r}]" for n in sorted(self.empty)]
        source = f"not ({' or '.join(terms)})"
        if self.typed is not None:  # `obj.__class__ = Other` changes what every name resolves to
            source = f"type({emit.bind(self.typed[0])}) is {emit.bind(self.typed[1])} and {source}"
        return Guard(f"attributes and hooks of the {self.owner}", source, emit.bindings, explain=self.explain)

    def explain(self) -> str:
        now_set = sorted(n for n in self.absent if n in self.state)
        filled = sorted(n for n in self.empty if self.state.get(n, True))
        what = []
        if self.typed is not None and type(self.typed[0]) is not self.typed[1]:
            what.append(f"the class of the {self.owner} is now {type(self.typed[0]).__qualname__}")
        what += [f"{', '.join(now_set)} now set on the {self.owner} itself"] if now_set else []
        what += [f"{', '.join(filled)} of the {self.owner} no longer empty (a hook was added)"] if filled else []
        return "; ".join(what) or f"attributes and hooks of the {self.owner} changed"


def tensor_slots(container: dict) -> tuple:
    return tuple((name, value is None) for name, value in container.items())


def children(container: dict) -> tuple:
    return tuple(container.items())  # modules compare by identity
