"""Functionalization: in-place updates and views become pure trace values plus final write-backs.

User code holds Python tensor objects; the trace holds immutable values. `Functionalizer` maps each object to its
current value. An in-place update rebinds the object; when the object is a view, the new value is scattered into
its base (recursively up to the root), and every other view of that base is recomputed from the new base the next
time it is read. Program inputs (arguments, parameters, buffers) that changed are written back with
`prims.copy_` at the end of the trace, so the trace has the same side effects as eager.

An update autograd does not see (under `torch.no_grad()`, or through a `.detach()` / `.data` alias, which shares
memory but not autograd history) changes a tensor's value but not its history: the new value is
`impls.keep_history(old, new)`, whose grad goes to the old value, so a parameter clamped through `.data` still
gets its grads. Any other update of an input that requires grad, or one giving an input a value that requires
grad, changes the input's history as eager's does: `write_back` returns those inputs for the caller to give them
their new values' history (the bridge marks them dirty), and notes whether the last such update was through a view
(eager's grad_fn is then CopySlices). Each update bumps the version counter of what it writes (shared by a view and its
base, not by `.data`), and the write-back bumps an input's as many times.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fulmen.acquisition.aliasing import may_overlap
from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.source import SourceLocation
from fulmen.core.symbol import BoundSymbol, Symbol, iter_proxies, map_proxies
from fulmen.ops import prims, shape
from fulmen.ops.registry import SYMBOLS

# The functional forms of in-place updates: they read the old value, but eager's update saves nothing for them.
_FUNCTIONAL_UPDATES = frozenset({shape.keep_history, shape.view_scatter, shape.setitem, shape.copy, shape.fill})


def _meta_root(proxy: TensorProxy) -> torch.Tensor:
    """The meta tensor whose memory `proxy`'s is (its own, or the base it is a view of)."""
    return proxy.meta._base if proxy.meta._is_view() else proxy.meta


@dataclass(slots=True)
class ViewInfo:
    base: TensorProxy  # the user-visible object this view was taken from
    sym: Symbol
    args: tuple  # the arguments after the base
    kwargs: dict[str, Any]
    index: int | None  # which output, for ops returning several views (split, unbind)
    # the base's value this view was computed from: a view of a view is stale when its root was updated since, which
    # the base's own version (bumped only by writes to the base or through its views) does not tell
    base_value: TensorProxy
    detached: bool = False  # `.detach()` / `.data`: a write changes the base's value, not its autograd history
    hidden: bool = False  # `.data`: a write leaves the base's version counter alone too
    grad_enabled: bool = True  # the grad mode it was taken in (eager's view of it made under no_grad refuses updates)

    def replay(self, base_value: TensorProxy) -> TensorProxy:
        out = self.sym(base_value, *self.args, **self.kwargs)
        return out[self.index] if self.index is not None else out


class Functionalizer:
    def __init__(self, source: Callable[[], SourceLocation | None],
                 recorded: Callable[[], list[BoundSymbol]] = list) -> None:
        self._source = source  # the user's line being traced, for errors
        self._recorded = recorded  # the calls the program made so far
        self._current: dict[int, TensorProxy] = {}
        self._views: dict[int, ViewInfo] = {}
        self._versions: dict[int, int] = {}
        self._alive: list[TensorProxy] = []  # keeps ids unique while they are dictionary keys
        self._kept: dict[int, tuple[TensorProxy, TensorProxy]] = {}  # keep_history's output -> (it, old value)
        self._written_at: dict[int, SourceLocation | None] = {}
        self._written: dict[int, TensorProxy] = {}  # every object updated in place
        self._bumps: dict[int, int] = {}  # how many times eager bumps an object's version counter (not via .data)
        self._through_view: dict[int, bool] = {}  # whether the last update autograd saw was through a view of it
        # a leaf of autograd the program made (requires_grad_()) -> (it, that call's line)
        self._leaves: dict[int, tuple[TensorProxy, SourceLocation | None]] = {}
        # the root of a view the program made such a leaf -> (it, that call's line): see set_leaf
        self._shared_leaves: dict[int, tuple[TensorProxy, SourceLocation | None]] = {}

    def resolve(self, obj: TensorProxy) -> TensorProxy:
        """The value `obj` holds now."""
        key = id(obj)
        info = self._views.get(key)
        if info is not None:
            base_value = self.resolve(info.base)
            if base_value is not info.base_value:  # the base changed since this view was read
                self._current[key] = info.replay(base_value)
                info.base_value = base_value
        return self._current.get(key, obj)

    def resolve_all(self, obj: Any) -> Any:
        if not self._current and not self._views:
            return obj
        return map_proxies(obj, self.resolve)

    def record_views(self, sym: Symbol, base_obj: TensorProxy, kwargs: dict[str, Any], values: tuple, output: Any
                     ) -> None:
        """Notes which outputs alias the storage of the first argument, `base_obj` (read off torch's meta view
        tracking)."""
        base_meta = values[0].meta
        root = base_meta._base if base_meta._is_view() else base_meta
        outputs = [output] if type(output) is TensorProxy else list(iter_proxies(output))
        for index, out in enumerate(outputs):
            meta = out.meta
            if not (meta._is_view() and meta._base is root):
                continue
            self._alive.append(out)
            self._alive.append(base_obj)
            self._views[id(out)] = ViewInfo(
                base=base_obj,
                sym=sym,
                args=values[1:],
                kwargs=kwargs,
                index=None if type(output) is TensorProxy else index,
                base_value=values[0],
                grad_enabled=torch.is_grad_enabled(),
            )

    def record_detached(self, detach: Symbol, base_obj: TensorProxy, out: TensorProxy, data: bool) -> None:
        """`out` is `base_obj.detach()` (or `base_obj.data`, with a version counter of its own): the same memory,
        without its autograd history."""
        self._alive += [out, base_obj]
        self._views[id(out)] = ViewInfo(base_obj, detach, (), {}, None, self.resolve(base_obj), True,
                                        data)

    def write(self, obj: TensorProxy, value: TensorProxy, hidden: bool = False, unseen: bool = False,
              through_view: bool = False) -> None:
        """`obj` now holds `value`; views propagate the update into their bases (`hidden`: through `.data`;
        `unseen`: through a detached alias, which autograd does not see at any level above it either: an update of
        `x[None].detach()` leaves x's history alone, where x's new value had the update's and x was refused as a
        leaf that requires grad; `through_view`: the update was of a view of `obj`)."""
        key = id(obj)
        if hidden:
            self._refuse_hidden_write_after_read(obj)
        if unseen or not torch.is_grad_enabled():  # an update autograd does not see
            old = self.resolve(obj)
            value = self._keep_history(old, value)
            if id(old) in self._leaves:  # a leaf stays one
                self._leaves[id(value)] = (value, self._leaves[id(old)][1])
        else:
            self.refuse_leaf_update(obj)
            self._through_view[key] = through_view  # eager's grad_fn of a tensor updated through a view: CopySlices
        self._refuse_shared_leaf_update(obj)
        self._alive.append(obj)
        self._written[key] = obj
        self._current[key] = value
        self._versions[key] = self._versions.get(key, 0) + 1
        self._written_at[key] = self._source()
        if not hidden:  # each update bumps the counter a view shares with its base, .data has its own
            self._bumps[key] = self._bumps.get(key, 0) + 1
        info = self._views.get(key)
        if info is not None:
            if not info.detached and may_overlap(obj.meta):
                raise TraceError(
                    f"the program updates in place a view whose elements share memory (size {tuple(obj.shape)}, "
                    f"stride {obj.stride()}, made by {info.sym.printed}): eager writes each element once into the "
                    "memory they share, which fulmen's functional update of the view's base cannot state; update "
                    "the base, or a view of it without repeated elements", self._source())
            base_value = self.resolve(info.base)
            if info.detached:
                new_base = self._keep_history(base_value, value, tangent=True)
            else:
                new_base = shape.view_scatter(base_value, value, info.sym.impl, info.args, info.kwargs, info.index)
            self.write(info.base, new_base, hidden or info.hidden, unseen or info.detached, through_view=True)
            info.base_value = self.resolve(info.base)
            if not info.detached or not value.requires_grad:
                # the view is a view of its base's new value, as eager's shares the base's memory (with the base's
                # other views, when they are all returned), not the value written into it; it keeps the autograd
                # history it had when the update is one autograd does not see (under no_grad). A detached alias the
                # update gave a history of its own keeps the value written, and that history.
                with torch.set_grad_enabled(torch.is_grad_enabled() or obj.requires_grad):
                    self._current[key] = info.replay(info.base_value)

    def _refuse_hidden_write_after_read(self, obj: TensorProxy) -> None:
        """An update through `.data` (no version bump: no backward notices it) of a tensor that an op with an
        autograd history read or made before: eager's backward reads the updated memory where that op saved the
        tensor (`torch.maximum(b, a)` saves a, `torch.sigmoid(x)` its result), the old values where it saved a value
        computed from it (`a.abs() + 1`), and fulmen cannot tell which (its grads use the old values)."""
        root = _meta_root(self.resolve(obj))
        for bsym in self._recorded():
            if bsym.sym in _FUNCTIONAL_UPDATES:
                continue
            outputs = [o for o in bsym.proxy_outputs() if type(o) is TensorProxy and o.requires_grad]
            reads = any(type(p) is TensorProxy and _meta_root(p) is root for p in bsym.proxy_args()) and any(
                _meta_root(o) is not root for o in outputs)
            if reads or any(o.meta is root for o in outputs):
                where = bsym.source.describe() if bsym.source is not None else "an earlier line"
                raise TraceError(
                    f"the program updates through .data a tensor (size {tuple(obj.shape)}) that {bsym.sym.printed} "
                    f"read or made before with an autograd history (at {where}): eager's grads read the updated "
                    "memory where that op saved the tensor itself and the old values where it saved a value computed "
                    "from it, which fulmen cannot tell; update it before it is read, after the call, or under "
                    "torch.no_grad() (whose update eager's backward checks)", self._source())

    def _keep_history(self, old: TensorProxy, new: TensorProxy, tangent: bool = False) -> TensorProxy:
        """`new` as the next value of a tensor holding `old`, with `old`'s autograd history (`tangent`: and its
        tangent, for fulmen.jvp: forward-mode AD does not see an update through a detached alias either)."""
        if old.requires_grad or tangent and (old.dtype.is_floating_point or old.dtype.is_complex):
            if self._kept.get(id(new), (None, None))[1] is old:
                return new  # already keeps it (an update through a detached alias, under no_grad)
            kept = shape.keep_history(old, new)
            self._kept[id(kept)] = (kept, old)
            return kept
        return SYMBOLS["torch.detach"](new) if new.requires_grad else new

    def keeps_history(self, obj: TensorProxy, value: TensorProxy) -> bool:
        """Whether `value`, what input `obj` holds now, has `obj`'s own autograd history."""
        while value is not obj:
            link = self._kept.get(id(value))
            if link is None:
                return False
            value = link[1]
        return True

    def root(self, obj: TensorProxy) -> TensorProxy:
        """The tensor `obj` is a view of, through any chain of views (`obj` itself when it is none)."""
        info = self._views.get(id(obj))
        while info is not None:
            obj = info.base
            info = self._views.get(id(obj))
        return obj

    def view_path(self, obj: TensorProxy, roots: dict[int, int]) -> tuple[int, list[ViewInfo]] | None:
        """When `obj` is a view of the object at `roots[id(base)]` (through any chain of views), that root and the
        views from it to `obj`, outermost first; None when it is not, or a view takes a traced tensor argument."""
        steps: list[ViewInfo] = []
        key = id(obj)
        while key not in roots:
            info = self._views.get(key)
            if info is None or next(iter(iter_proxies((info.args, info.kwargs))), None) is not None:
                return None
            steps.append(info)
            key = id(info.base)
        return roots[key], steps[::-1]

    def tracked_views(self, obj: TensorProxy) -> tuple[TensorProxy, list[ViewInfo]] | None:
        """The tensor `obj` is a view of as autograd tracks views (its `_base`: the views of a detached alias are views
        of the alias, not of what it was detached from), and the views from it to `obj`, outermost first; None when
        `obj` is no such view, or a view takes a traced tensor argument."""
        steps: list[ViewInfo] = []
        info = self._views.get(id(obj))
        while info is not None and not info.detached:
            if next(iter(iter_proxies((info.args, info.kwargs))), None) is not None:
                return None
            steps.append(info)
            obj = info.base
            info = self._views.get(id(obj))
        return (obj, steps[::-1]) if steps else None

    def aliased(self, obj: TensorProxy) -> bool:
        """Whether `obj` is a view (or detached alias) of another object, or another object is one of it."""
        return id(obj) in self._views or any(info.base is obj for info in self._views.values())

    def set_leaf(self, obj: TensorProxy, requires_grad: bool) -> bool:
        """`obj.requires_grad_(requires_grad)` on a value the program computed, or a view of one or of an input, that
        no view was taken from yet: it holds its data as a leaf of autograd that requires grad (`impls.autograd_leaf`),
        or detached again. Not an update: no version bump, nothing written back. False, and nothing done, where views
        were taken from `obj` (eager's keep the flag they had, which views replayed from the leaf would not).

        A view made a leaf shares its memory with its base, as in eager (Hugging Face's Wav2Vec2 feature encoder
        does it to `input_values[:, None]` in training): it holds the values it had then, so any later in-place update
        of that memory is refused (eager's leaf would read it)."""
        if any(info.base is obj for info in self._views.values()):
            return False
        value = self.resolve(obj)
        if id(obj) in self._views:
            root = self.root(obj)
            self._alive.append(root)
            self._shared_leaves.setdefault(id(root), (root, self._source()))
        if requires_grad:
            value = shape.autograd_leaf(value)
            self._leaves[id(value)] = (value, self._source())
        else:
            value = SYMBOLS["torch.detach"](value)
        self._alive.append(obj)
        self._current[id(obj)] = value
        return True

    def _refuse_shared_leaf_update(self, obj: TensorProxy) -> None:
        shared = self._shared_leaves.get(id(self.root(obj)))
        if shared is None:
            return
        made = shared[1]
        where = f" (at {made.describe()})" if made is not None else ""
        raise TraceError(
            f"the program updates in place a tensor (size {tuple(obj.shape)}) that shares its memory with a view it "
            f"made a leaf of autograd with requires_grad{where}: eager's leaf reads the updated memory, where "
            "fulmen's holds the values it had then; update the tensor before, or make the leaf from a copy "
            "(`.clone()`) of the view", self._source())

    def made_leaf(self, value: TensorProxy) -> SourceLocation | None | bool:
        """The line of the `requires_grad_()` that made `value` a leaf of autograd; False when none did."""
        found = self._leaves.get(id(value))
        return False if found is None else found[1]

    def leaf_lines(self) -> list[SourceLocation | None]:
        """The lines of the `requires_grad_()` calls that made leaves, first made first."""
        return [line for _, line in self._leaves.values()]

    def refuse_leaf_update(self, obj: TensorProxy, through_view: bool = False) -> None:
        """Eager's errors for an update autograd sees of a leaf that requires grad the program made, or of a view of
        one (an input's is refused when the program runs); `through_view`: eager writes into a view of `obj`
        (`obj[1:] = v`)."""
        if id(self.resolve(obj)) in self._leaves:  # eager calls a leaf that is a view of another tensor a view
            view = through_view or id(obj) in self._views
            raise RuntimeError(f"a {'view of a ' if view else ''}leaf Variable that requires grad is being used in "
                               "an in-place operation.")
        info = self._views.get(id(obj))
        while info is not None and not info.detached:
            if id(self.resolve(info.base)) in self._leaves:
                raise RuntimeError("a view of a leaf Variable that requires grad is being used in an in-place "
                                   "operation.")
            info = self._views.get(id(info.base))

    def was_written(self, obj: TensorProxy) -> bool:
        return self._versions.get(id(obj), 0) > 0

    def updated_within(self, made: set[str]) -> list[TensorProxy]:
        """The objects made outside a region of the trace (not among `made`, the names of the values the region
        made) that now hold a value the region made: the tensors it updated in place."""
        return [obj for key, obj in self._written.items()
                if obj.pname not in made and self._current.get(key, obj).pname in made]

    def written_at(self, obj: TensorProxy) -> SourceLocation | None:
        """The line of the last update of `obj`."""
        return self._written_at.get(id(obj))

    def written_seen_by_autograd(self, obj: TensorProxy) -> bool:
        """Whether some update of `obj` was one autograd sees (grad mode on, not through a detached alias)."""
        return id(obj) in self._through_view

    def written_through_view(self, obj: TensorProxy) -> bool:
        """Whether the last update of `obj` that autograd saw was through a view of it (eager's grad_fn is then
        CopySlices)."""
        return self._through_view.get(id(obj), False)

    def write_back(self, inputs: list[TensorProxy]) -> list[tuple[TensorProxy, TensorProxy]]:
        """Records the copies of changed inputs' final values into the inputs themselves. Returns the inputs that
        now hold a value with an autograd history other than their own (`buf[1:] = w * 2`, `y.mul_(w)` on an input
        `y` that requires grad), with that value: eager's in-place update gives the input that history, which the
        caller must too (a leaf that requires grad, which eager refuses, is refused when the program runs: whether
        an input is a leaf is not known here). The copy itself writes the value alone, and leaves the input's
        version counter bumped as many times as eager's updates bump it."""
        dirty = []
        for obj in inputs:
            if not self.was_written(obj):
                continue
            value = self.resolve(obj)
            if value is obj:
                continue
            if obj.requires_grad or value.requires_grad:
                if not (obj.requires_grad and self.keeps_history(obj, value)):
                    dirty.append((obj, value))
                if value.requires_grad:
                    value = SYMBOLS["torch.detach"](value)  # the history goes to the input through `dirty`
            prims.copy_(value, obj, bumps=self._bumps.get(id(obj), 0))
        return dirty
