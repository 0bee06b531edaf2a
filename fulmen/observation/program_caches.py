"""Caches that keep what a call of the program returns beyond the call: `functools.lru_cache` (and `functools.cache`)
and `functools.cached_property`, observed around the calls that fill them (frame_tap.CallWatch).

Later calls get the kept value from the cache, where a trace can neither store it again nor see it change: a tensor
the trace computed is fulmen's stand-in, and an object the program created, handed out by an lru_cache without a
read the observer sees, would change unguarded. Both are refused (`refusal`), and dropped from the cache once the
program ran. A value made before the first call (a cache filled eagerly) is the program's state, read as any other.
A cached_property's object is guarded anyway: the name stays absent from the instance until it is stored.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Protocol

from torch.utils._pytree import tree_leaves

from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.source import frame_location
from fulmen.observation.container_writes import is_container
from fulmen.observation.frame_tap import observed
from fulmen.observation.static_lookup import instance_dict, owner_name
from fulmen.observation.value_checks import immutable


class Keeper(Protocol):
    def kept(self, value: Any, keeper: str, caller: types.FrameType, drop: Any, objects: bool) -> None: ...


def refusal(value: Any, keeper: str, caller: types.FrameType, created: set[int] | frozenset[int]) -> TraceError | None:
    """Why `keeper` must not keep `value`, which the program's call from `caller` returned: a tensor the trace
    computed, or an object among `created` (ids of the objects the program created)."""
    for leaf in tree_leaves(value):
        if isinstance(leaf, TensorProxy):
            kept = "a tensor the program computes"
        elif id(leaf) in created and not immutable(leaf) and not is_container(leaf):
            kept = f"a {type(leaf).__qualname__} object the program creates"
        else:
            continue
        location = frame_location(caller)
        where = f" ({location.short()})" if location is not None else ""
        return TraceError(
            f"fulmen cannot compile a program that keeps {kept} in {keeper}{where}: later calls get it from there, "
            f"where a trace can neither store it nor see it change. Fill the cache before the first jitted call (call "
            f"it once eagerly), or compute the value without a cache. (Dropped from the cache again.)", location)
    return None


CACHED_PROPERTY_GET = functools.cached_property.__get__.__code__


class _Keeping:
    """A frame_tap.CallWatch around a function whose return value something keeps beyond the call (`exit` hands it to
    Observer.kept); nothing is done per line."""

    def line(self, token: Any, frame: types.FrameType) -> None:
        pass


class Memoized(_Keeping):
    """The function behind a `functools.lru_cache` (or `functools.cache`) the program reads: a call the cache misses
    (its `misses` count grew) runs it, and the cache keeps what it returns for later calls."""

    def __init__(self, observer: Keeper, cache: Any) -> None:
        self.observer = observer
        self.cache = cache
        self.misses = cache.cache_info().misses

    def enter(self, frame: types.FrameType) -> Any:
        misses = self.cache.cache_info().misses
        missed, self.misses = misses > self.misses, misses
        return frame.f_back if missed else None

    def exit(self, token: Any, value: Any, raised: bool) -> None:
        if not raised:
            name = getattr(self.cache, "__qualname__", "a function")
            self.observer.kept(value, f"the functools.lru_cache of {name}", token, self.cache.cache_clear,
                               objects=True)


class CachedProperty(_Keeping):
    """`functools.cached_property.__get__` called by the program: it stores what the getter returns in the
    instance's `__dict__`, which later calls read (the observer guards the name absent until then)."""

    def __init__(self, observer: Keeper) -> None:
        self.observer = observer

    def enter(self, frame: types.FrameType) -> Any:
        caller = frame.f_back
        if caller is None or not observed(caller.f_code, caller.f_globals):
            return None
        return caller, frame.f_locals.get("instance"), getattr(frame.f_locals.get("self"), "attrname", None)

    def exit(self, token: Any, value: Any, raised: bool) -> None:
        caller, instance, name = token
        state = instance_dict(instance)
        if raised or state is None or name is None:
            return

        def drop() -> None:
            if state.get(name) is value:
                del state[name]

        self.observer.kept(value, f"functools.cached_property {name} of {owner_name(instance)}", caller, drop,
                           objects=False)
