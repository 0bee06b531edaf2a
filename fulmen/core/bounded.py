"""Caches of fulmen's own that the user's program fills: one entry per code object, shape or class it meets.

A long-running process keeps meeting new ones (a notebook defining functions again, shapes that change, classes made
at run time), so each such cache is bounded: `LRU` keeps at most `maxsize` entries, `ByIdentity` drops an entry when
its key dies.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most `maxsize` entries; the least recently used goes first. For keys that are values (shapes, dtypes) or
    that the cached value refers to (a subclass made of a class: weak keys would never die)."""

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"an LRU cache holds at least one entry, got maxsize={maxsize}")
        self.maxsize = maxsize
        self._entries: OrderedDict[Hashable, V] = OrderedDict()

    def get(self, key: K, default: Any = None) -> V | Any:
        try:
            value = self._entries[key]
        except KeyError:
            return default
        try:
            self._entries.move_to_end(key)
        except KeyError:  # another thread's insertion evicted it meanwhile: the value is still right
            pass
        return value

    def __setitem__(self, key: K, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


class ByIdentity(Generic[K, V]):
    """Values for objects by identity, not kept alive by the cache: an entry goes when its object dies (before its id
    can be reused). For keys that compare equal to other objects (code objects compare by their contents, so two
    functions' codes can be equal) and must not outlive the program's use of them."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, V]] = {}

    def get(self, key: K, default: Any = None) -> V | Any:
        entry = self._entries.get(id(key))
        return entry[1] if entry is not None and entry[0]() is key else default

    def __setitem__(self, key: K, value: V) -> None:
        ident, entries = id(key), self._entries
        # the callback holds the dict, not the cache: a cache dropped by its owner leaves nothing behind
        entries[ident] = (weakref.ref(key, lambda _, ident=ident: entries.pop(ident, None)), value)

    def __contains__(self, key: object) -> bool:
        entry = self._entries.get(id(key))
        return entry is not None and entry[0]() is key

    def __len__(self) -> int:
        return len(self._entries)
