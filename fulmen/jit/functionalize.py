"""Functionalization: in-place updates and views become pure trace values plus final write-backs.

User code holds Python tensor objects; the trace holds immutable values. `Functionalizer` maps each object to its
current value. An in-place update rebinds the object; when the object is a view, the new value is scattered into
its base (recursively up to the root), and every other view of that base is recomputed from the new base the next
time it is read. Program inputs (arguments, parameters, buffers) that changed are written back with
`prims.copy_` at the end of the trace, so the trace has the same side effects as eager.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import Symbol, iter_proxies, map_proxies
from fulmen.ops import prims, shape


@dataclass(slots=True)
class ViewInfo:
    base: TensorProxy  # the user-visible object this view was taken from
    sym: Symbol
    args: tuple  # the arguments after the base
    kwargs: dict[str, Any]
    index: int | None  # which output, for ops returning several views (split, unbind)
    base_version: int

    def replay(self, base_value: TensorProxy) -> TensorProxy:
        out = self.sym(base_value, *self.args, **self.kwargs)
        return out[self.index] if self.index is not None else out


class Functionalizer:
    def __init__(self) -> None:
        self._current: dict[int, TensorProxy] = {}
        self._views: dict[int, ViewInfo] = {}
        self._versions: dict[int, int] = {}
        self._alive: list[TensorProxy] = []  # keeps ids unique while they are dictionary keys

    def resolve(self, obj: TensorProxy) -> TensorProxy:
        """The value `obj` holds now."""
        key = id(obj)
        info = self._views.get(key)
        if info is not None:
            base_version = self._versions.get(id(info.base), 0)
            if base_version != info.base_version:  # the base changed since this view was read
                self._current[key] = info.replay(self.resolve(info.base))
                info.base_version = base_version
        return self._current.get(key, obj)

    def resolve_all(self, obj: Any) -> Any:
        if not self._current and not self._views:
            return obj
        return map_proxies(obj, self.resolve)

    def record_views(self, sym: Symbol, args: tuple, kwargs: dict[str, Any], values: tuple, output: Any) -> None:
        """Notes which outputs alias the first argument's storage (read off torch's meta view tracking)."""
        if not args or type(args[0]) is not TensorProxy:
            return
        base_obj, base_meta = args[0], values[0].meta
        root = base_meta._base if base_meta._is_view() else base_meta
        outputs = [output] if type(output) is TensorProxy else list(iter_proxies(output))
        for index, out in enumerate(outputs):
            meta = out.meta
            if meta._is_view() and meta._base is root:
                self._alive.append(out)
                self._alive.append(base_obj)
                self._views[id(out)] = ViewInfo(
                    base=base_obj,
                    sym=sym,
                    args=values[1:],
                    kwargs=kwargs,
                    index=None if type(output) is TensorProxy else index,
                    base_version=self._versions.get(id(base_obj), 0),
                )

    def write(self, obj: TensorProxy, value: TensorProxy) -> None:
        """`obj` now holds `value`; views propagate the update into their bases."""
        key = id(obj)
        self._alive.append(obj)
        self._current[key] = value
        self._versions[key] = self._versions.get(key, 0) + 1
        info = self._views.get(key)
        if info is not None:
            base_value = self.resolve(info.base)
            new_base = shape.view_scatter(base_value, value, info.sym.impl, info.args, info.kwargs, info.index)
            self.write(info.base, new_base)
            info.base_version = self._versions[id(info.base)]

    def was_written(self, obj: TensorProxy) -> bool:
        return self._versions.get(id(obj), 0) > 0

    def write_back(self, inputs: list[TensorProxy]) -> None:
        """Records the copies of changed inputs' final values into the inputs themselves."""
        for obj in inputs:
            if self.was_written(obj):
                value = self.resolve(obj)
                if value is not obj:
                    prims.copy_(value, obj)
