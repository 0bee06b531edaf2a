"""The Python containers the traced program changes in place: replayed by every call that uses the trace, or refused.

A trace keeps the program's tensor ops only, so `log.append(...)`, `cache[key] = ...`, `seen.add(...)` on a list,
dict or set that outlives the call would happen on the first call only (and a list the program was given as an
argument is a copy the program receives, which no call ever hands back). The observer therefore watches every
container the program can reach before it runs: the containers among its arguments, and each list, dict or set it
reads through a guarded global, closure cell, attribute or default (with the containers nested in them). It keeps a
shallow copy of each, taken before the program can change it (a container is obtained before it is changed), and
compares them when the program has run; the work is the acquisition's only, a call that uses the trace pays nothing.

A changed container is replayed (its final content stored into it by every call, `ContainerWrite`) when that is
exactly what eager does: it was read through a guarded place whose check compares its whole content (so a call that
uses the trace finds the content the program found), the check is extended to the container's identity (the call
changes that very object), and its final content is immutable values (the same whichever call made them; see
state_writes.py). Any other change is refused, naming the container and the line that changed it: a tensor stored in it
(the trace's stand-in, not the call's value), an object, a change of a container given as an argument.

Mutation sites found in the bytecode (read_sites.ItemWrite, read_sites.InplaceWrite, a mutating method read off a named
container) give the line; a change no such site names (C code, an unnamed receiver) is still found by the comparison
and refused without one. Known limits: containers reached only through a call's result or an iterator, and those
past `_BUDGET` nested in one value, are not watched; their changes happen once, on the acquisition.
"""

from __future__ import annotations

import collections
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fulmen.core.errors import TraceError
from fulmen.core.source import SourceLocation, frame_location
from fulmen.observation.guards import Guard
from fulmen.observation.value_checks import Emitter, describe, immutable

# Containers whose content a guard compares item by item (values.value_check): their changes may be replayed.
_COMPARED = (list, dict, collections.OrderedDict, set)
_KINDS = (list, dict, set, collections.deque, bytearray)  # subclasses too (defaultdict, OrderedDict, ...)
# Methods that change a container in place: reading one off a watched container names the line that changes it.
MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "add", "discard",
                      "update", "setdefault", "popitem", "appendleft", "extendleft", "popleft", "rotate",
                      "intersection_update", "difference_update", "symmetric_difference_update", "move_to_end",
                      "__setitem__", "__delitem__", "__iadd__", "__ior__", "__imul__"})
_BUDGET = 256  # containers watched inside one value read


def is_container(value: Any) -> bool:
    return isinstance(value, _KINDS)


def _content(container: Any) -> tuple:
    """What the program could observe of the container, shallowly: its items (a dict's keys and values in turn), in
    order, by identity."""
    if isinstance(container, dict):
        return tuple(part for pair in container.items() for part in pair)
    return tuple(container)


def _same(before: tuple, after: tuple) -> bool:
    return len(before) == len(after) and all(a is b or (type(a) is type(b) and immutable(a) and a == b)
                                             for a, b in zip(before, after))


def _store(container: Any, content: tuple) -> None:
    """Makes `container` hold `content` (as `_content` gives it), in place, through the methods of its built-in
    base: a subclass may refuse its own (transformers' ModelOutput raises on `update`)."""
    base = next(klass for klass in type(container).__mro__ if klass in _BASES)
    if issubclass(base, dict):
        base.clear(container)
        base.update(container, zip(content[::2], content[1::2]))
    elif base is set:
        set.clear(container)
        set.update(container, content)
    elif base is collections.deque:
        collections.deque.clear(container)
        collections.deque.extend(container, content)
    else:
        base.__setitem__(container, slice(None), content)


# the built-in classes of the containers watched (_KINDS), most derived first: an OrderedDict keeps its own order
_BASES = (collections.OrderedDict, dict, set, collections.deque, list, bytearray)


@dataclass(frozen=True, slots=True)
class ContainerWrite:
    """Stores the content the program left in `container`, by every call that uses the trace."""

    container: Any
    content: tuple

    def apply(self) -> None:
        _store(self.container, self.content)


@dataclass(slots=True)
class _Watched:
    container: Any
    what: str  # e.g. "global LOG of module train", "argument `log`"
    before: tuple
    place: Callable[[Emitter], str] | None  # how a guard reaches it; None: not replayable (an argument's copy)
    changed_at: SourceLocation | None = None


class ContainerLog:
    """The containers one acquisition watches, by id (they stay alive: the log holds them)."""

    def __init__(self) -> None:
        self._watched: dict[int, _Watched] = {}

    def watch(self, value: Any, what: str, place: Callable[[Emitter], str] | None) -> None:
        """`value` (read through `place`, a guarded expression comparing its content, or given as an argument when
        None) and the containers nested in it, before the program can change them."""
        budget = [_BUDGET]
        self._watch(value, what, place, budget)

    def _watch(self, value: Any, what: str, place: Callable[[Emitter], str] | None, budget: list[int]) -> None:
        if not isinstance(value, _KINDS) or id(value) in self._watched or budget[0] <= 0:
            if type(value) is tuple:  # immutable itself, it may hold lists
                for i, item in enumerate(value):
                    self._watch(item, _nested(what, i), _item(place, i), budget)
            return
        budget[0] -= 1
        self._watched[id(value)] = _Watched(value, what, _content(value), place if type(value) in _COMPARED
                                            else None)
        if isinstance(value, dict):
            items: Any = value.items()
        elif isinstance(value, (list, collections.deque)):
            items = enumerate(value)
        else:
            return  # a set's items are hashable, a bytearray's are ints
        for key, item in items:
            if isinstance(item, (*_KINDS, tuple)):
                self._watch(item, _nested(what, key), _item(place, key), budget)

    def arguments(self, names: list[str], values: list[Any]) -> None:
        for name, value in zip(names, values):
            self.watch(value, f"passed as argument `{name}`", None)

    def changing(self, container: Any, frame: types.FrameType) -> None:
        """The frame is about to change `container` in place (a mutation site of its bytecode)."""
        watched = self._watched.get(id(container))
        if watched is not None and watched.container is container and watched.changed_at is None:
            watched.changed_at = frame_location(frame)

    def finish(self, created: set[int]) -> tuple[tuple[ContainerWrite, ...], list[Guard]]:
        """The changes to replay and the identity guards they need, or a TraceError for the first change that
        cannot be replayed (every watched container is put back first: the call fails, as if it never ran)."""
        writes, guards = [], []
        for watched in self._watched.values():
            if id(watched.container) in created:
                continue
            after = _content(watched.container)
            if _same(watched.before, after):
                continue
            if watched.place is None or not all(immutable(item) for item in after):
                self.undo()
                _refuse(watched, after)
            writes.append(ContainerWrite(watched.container, after))
            emit = Emitter()
            guards.append(Guard(f"the {type(watched.container).__qualname__} {watched.what} (the object itself)",
                                f"{watched.place(emit)} is {emit.bind(watched.container)}", emit.bindings))
        return tuple(writes), guards

    def undo(self) -> None:
        """Puts back the content of every watched container (the acquisition is abandoned, see undo.py)."""
        for watched in self._watched.values():
            if not _same(watched.before, _content(watched.container)):
                _store(watched.container, watched.before)


def _nested(what: str, key: Any) -> str:
    """`what`'s item `key`: "argument `d`" -> "argument `d['log']`"."""
    return f"{what[:-1]}[{key!r}]`" if what.endswith("`") else f"{what}[{key!r}]"


def _item(place: Callable[[Emitter], str] | None, key: Any) -> Callable[[Emitter], str] | None:
    if place is None:
        return None
    return lambda e: f"{place(e)}[{e.bind(key)}]"


def _refuse(watched: _Watched, after: tuple) -> None:
    kind = type(watched.container).__qualname__
    where = f" ({watched.changed_at.short()})" if watched.changed_at is not None else ""
    if watched.place is None and watched.what.startswith("passed as argument"):
        why = ("a cached trace does not change Python containers, so later calls would not change it as eager "
               "does (and the program receives copies of the lists, tuples and dicts among its arguments, so no call "
               "would). Return the new values from the program instead, or change the container outside it")
    elif watched.place is None:
        why = (f"fulmen can only store again the content of a list, dict or set whose content it guards, not a "
               f"{kind}. Keep this state outside the jitted program, or return the values")
    else:
        stored = next((item for item in after if not immutable(item)), None)
        what = "a tensor" if type(stored).__name__ == "TensorProxy" else describe(stored, 40)
        why = (f"it now holds {what}, which a cached trace cannot store again on each call (only numbers, strings, "
               "None, dtypes, devices, enum members and tuples of those can be). Return the values from the program "
               "instead, or keep this state outside it")
    raise TraceError(f"fulmen cannot compile a program that changes the {kind} {watched.what}{where}: {why}.",
                     watched.changed_at)
