"""The Python state the traced program writes: replayed by every call that uses the trace, or refused.

A trace keeps the program's tensor ops only; what its Python part stored in objects that outlive the call (an
attribute of a module, of an argument or of a global object, a global of a module) would be stored on the first call
only. So each such write is recorded while acquiring and its final value is stored again by every call that uses the
trace (`Write.apply`), exactly as the program stored it: the value is a function of the Python state the trace is
guarded on (that is what makes the trace reusable), so `self.steps += 1` stores 1 on every call that finds 0 there,
and a call that finds 1 misses the guard on `steps` and traces anew.

Only values that are the same whichever call made them can be stored again: numbers, strings, None, dtypes,
devices, enum members and tuples of those. A write of any other value (a list, an object, a tensor in a place
that held none) is refused, naming the attribute and the user's line. A tensor stored where the module held one is
a rebind (module_inputs.ShadowTree.rebinds), returned by the trace.

Writes to the jitted module's tree land on its shadow (module_inputs.py), which reports those the program's own code
makes (frame_tap.observed: not torch's internals, such as a lazily compiled GraphModule storing its code); writes to
other objects happen for real, seen by the frame tap before they run (read_sites.AttrWrite, read_sites.GlobalWrite), and
are stored again when their value is immutable (any other value may be an object the call created, which fulmen cannot
tell from one that existed before); one holding a tensor the program computed is refused, and the stores undone, where
the object held state before the store (the trace's stand-in would stay there: a KV cache extended in place), or left to
the check of the program's arguments (jitted.py) where it did not. Lists, dicts and sets changed in place are
container_writes.py's. Deletions (`del obj.name`, `delattr`, `del` of a global) are writes of no value: done again by
every call, on a trace guarded on the value being there (eager's `del` fails where it is not). Known limits: writes that
no bytecode of the program names are not seen (C code, `setattr` under another name). """

from __future__ import annotations

import types
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.pytree import find
from fulmen.core.source import SourceLocation, frame_location
from fulmen.observation.static_lookup import MODULE_SLOTS, attribute_value, instance_dict, owner_name
from fulmen.observation.value_checks import MISSING, describe, immutable, same_value


@dataclass(frozen=True, slots=True)
class Write:
    """`target.name = value` (or `target[name] = value` for a module's globals), stored by every call; a `value` of
    MISSING deletes it (where the call finds it: the program may have stored it before deleting it)."""

    target: Any
    name: str
    value: Any
    is_global: bool = False

    def apply(self) -> None:
        if self.value is MISSING:
            if self.is_global:
                self.target.pop(self.name, None)
            elif attribute_value(self.target, self.name) is not MISSING:
                delattr(self.target, self.name)
        elif self.is_global:
            self.target[self.name] = self.value
        else:
            setattr(self.target, self.name, self.value)


@dataclass(slots=True)
class _Store:
    target: Any  # the object written (the original module for a shadow), or a globals dict
    name: str
    before: Any  # the value the program found, MISSING if none
    location: SourceLocation | None
    shadow: nn.Module | None = None  # the shadow the write landed on
    is_global: bool = False
    deleted: bool = False
    existed: bool = True  # held state before the call's first store to it (see WriteLog._existed)


def _module_value(state: dict, name: str) -> Any:
    """What `module.name` finds in the module's `__dict__`: a parameter, buffer or submodule, or a plain attribute."""
    for slot in MODULE_SLOTS:
        if name in state.get(slot, ()):
            return state[slot][name]
    return state.get(name, MISSING)


class WriteLog:
    """The stores of one acquisition, first value found and last value stored."""

    def __init__(self) -> None:
        self._stores: dict[tuple[int, str], _Store] = {}
        self.stands_for: dict[int, torch.Tensor] = {}  # id(proxy) -> the module tensor it stands for
        # id(obj) -> whether the object held state at the program's first store to it. An object the program made
        # without an `__init__` the observer saw (`Box()` of a class with none) is still empty then.
        self._existed: dict[int, bool] = {}

    def attribute(self, obj: Any, name: str, frame: types.FrameType) -> None:
        """The frame is about to store `obj.name` (an object that is not a shadow)."""
        if (id(obj), name) not in self._stores:
            before = attribute_value(obj, name)
            existed = self._existed.setdefault(id(obj), before is not MISSING or bool(instance_dict(obj)))
            self._stores[(id(obj), name)] = _Store(obj, name, before, frame_location(frame), existed=existed)

    def global_(self, namespace: dict, name: str, frame: types.FrameType) -> None:
        if (id(namespace), name) not in self._stores:
            self._stores[(id(namespace), name)] = _Store(namespace, name, namespace.get(name, MISSING),
                                                         frame_location(frame), is_global=True)

    def module(self, shadow: nn.Module, original: nn.Module, name: str, location: SourceLocation | None,
               deleted: bool) -> None:
        """The program stored (or deleted) `name` on the shadow of `original`."""
        store = self._stores.get((id(shadow), name))
        if store is None:
            before = _module_value(original.__dict__, name)
            store = self._stores[(id(shadow), name)] = _Store(original, name, before, location, shadow)
        store.deleted = deleted

    def finish(self, created: set[int]) -> tuple[Write, ...]:
        """The writes to replay, or a TraceError for the first write to the module's tree that cannot be."""
        writes = []
        for store in self._stores.values():
            if id(store.target) in created:
                continue
            final = self._final(store)
            if final is store.before or (immutable(final) and same_value(final, store.before)) \
                    or self._restores(final, store.before):
                continue  # stored what was there
            if store.shadow is None:
                # the store happened: an object that is not replayable may well be one the call created
                if final is MISSING or immutable(final):  # MISSING: deleted (it was there: see above)
                    writes.append(Write(store.target, store.name, final, store.is_global))
                elif store.existed and (path := find(final, _is_traced, modules=False)) is not None:
                    # the trace's stand-in would stay there after the call, where eager leaves a real tensor
                    held = f"{_kind(final)} holding one (`.{store.name}{path}`)" if path else "a tensor"
                    self._refuse(store, f"stores {held} computed by the program in it", _TRACED_HINT)
                continue
            if type(final) is TensorProxy and isinstance(store.before, torch.Tensor):
                continue  # a rebind: the trace returns it
            if store.deleted or final is MISSING:
                self._refuse(store, "deletes it", "")
            if not immutable(final):
                self._refuse(store, f"stores {_kind(final)} in it", _hint(store, final))
            writes.append(Write(store.target, store.name, final))
        return tuple(writes)

    def undo(self) -> None:
        """Puts back what the stores that happened for real replaced (those to a shadow never reached the user's
        objects): the acquisition is abandoned and the program runs again (undo.py)."""
        for store in reversed(self._stores.values()):
            if store.shadow is not None:
                continue
            if store.is_global:
                if store.before is MISSING:
                    store.target.pop(store.name, None)
                else:
                    store.target[store.name] = store.before
            elif store.before is MISSING:
                if attribute_value(store.target, store.name) is not MISSING:
                    delattr(store.target, store.name)
            else:
                setattr(store.target, store.name, store.before)

    def _refuse(self, store: _Store, what: str, hint: str) -> None:
        self.undo()  # the call fails, as if it never ran: the objects it stored into hold what they held
        _refuse(store, what, hint)

    def _restores(self, final: Any, before: Any) -> bool:
        """A new list or tuple of what `before` holds, the module's tensors given as the proxies that stand for them
        (nn.RNNBase refreshes `_flat_weights`, and weak references to them, with its parameters whenever they are not
        the ones it holds, and the program's parameters are proxies)."""
        if type(final) not in (list, tuple) or type(before) is not type(final) or len(final) != len(before):
            return False
        return all(self._same_item(new, old) for new, old in zip(final, before))

    def _same_item(self, new: Any, old: Any) -> bool:
        if type(new) is weakref.ref and type(old) is weakref.ref:  # and its `_flat_weight_refs`
            new, old = new(), old()
            if new is None or old is None:
                return False
        return (new is old or type(new) is TensorProxy and self.stands_for.get(id(new)) is old
                or immutable(new) and same_value(new, old))

    @staticmethod
    def _final(store: _Store) -> Any:
        if store.shadow is not None:
            return _module_value(store.shadow.__dict__, store.name)
        if store.is_global:
            return store.target.get(store.name, MISSING)
        return attribute_value(store.target, store.name)


_TRACED_HINT = ("Return the tensor from the program instead, and store it outside the jitted function (for a Hugging "
                "Face KV cache: use_cache=False, or a cache the model creates and returns)")


def _is_traced(obj: Any) -> bool:
    return type(obj) is TensorProxy


def _hint(store: _Store, final: Any) -> str:
    if not isinstance(final, torch.Tensor):
        return ("Only numbers, strings, None, dtypes, devices, enum members and tuples of those can be stored again "
                "by each call; keep this state outside the jitted program")
    if isinstance(store.before, torch.Tensor):  # a tensor the program did not compute (a global's, say)
        return "A tensor the program computes may replace the module's (the trace returns it); copy into it instead"
    held = _kind(store.before) if store.before is not MISSING else "no such attribute"
    return (f"The module held {held}: give it a tensor before the first call (e.g. module.register_buffer(name, "
            "tensor)), which the program may then replace or update in place")


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "a tensor"
    return f"a {type(value).__qualname__} ({describe(value, 40)})"


def _refuse(store: _Store, what: str, hint: str) -> None:
    if store.is_global:
        owner = f"global `{store.name}` of module {store.target.get('__name__', '?')}"
    elif store.shadow is not None:
        owner = f"attribute `{store.name}` of the {type(store.target).__qualname__} module"
    else:
        owner = f"attribute `{store.name}` of {owner_name(store.target)}"
    where = f" ({store.location.short()})" if store.location is not None else ""
    hint = f" {hint}." if hint else ""
    raise TraceError(f"fulmen cannot compile a program that writes Python {owner}{where}: it {what}, which a "
                     f"cached trace cannot do again on each call.{hint}", store.location)
