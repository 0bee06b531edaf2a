"""The observer of the acquired Python: what the traced program read, turned into guards.

A trace is specialised on every Python value the program read: globals, closure cells, attributes of objects
(arguments, configs, classes) and of modules. The observer watches the acquisition through two taps that feed one
set of guards:

- the frame tap (`Observer.watching`, frame_tap.py): while acquiring, `sys.settrace` follows every frame of the user's
  code. Before each read site of a frame (read_sites.py) runs, the observer names the object read in that frame
  (static_lookup.py, without running any of the program's code) and records a guard on it (frame_reads.py).
- the module tap (`module_read`, `module_fallback`, `module_absent`): the shadow modules of module_inputs.py report
every
  attribute read on them, and the guard is put on the user's module behind the shadow (its attributes, submodules,
  parameters and buffers slots, hooks, and the class attributes it resolves, methods included; an attribute found
  nowhere stays absent from all of them).

Both taps also report what the program stores (attributes, globals) to be stored again by every call (state_writes.py).
Parameters and buffers of a module outside the jitted module's tree (an argument, a closure's, a global) are the
program's real tensors, captured as constants, and guarded by identity and metadata.

Objects created during the call need no guard (they are derived from what was read); a guard on one is harmless,
since nothing changes it afterwards, unless a cache keeps it beyond the call (`functools.lru_cache`,
`functools.cached_property`: program_caches.py refuses a stand-in or an unguardable object there). Reads off what a
Python
function or getter returned are named from that return (read_sites.Capture); what C code reads is seen only where
read_sites.py names it. Some state is read
through a value rather than an attribute (`_special`): torch's global switches, the environment, Python's random
draws and clocks (refused), torch's global setters that no trace could set again (global_setters.py, refused),
and a function the program runs is guarded on its code and defaults.

Python attributes set on a tensor argument (`x.scale = 2.0`) are copied onto its proxy and held by the cache key
(guards.argument_key). Known limits, with no cheap guard: the content of a mutable value such an attribute holds,
and of a NumPy array over 64 KiB (value_checks.py); a change made between an autograd.Function's forward and its
backward
(autograd_functions.py); writes no bytecode of the program makes (state_writes.py).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections import ChainMap
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.source import frame_location
from fulmen.observation import program_caches
from fulmen.observation.container_writes import ContainerLog, ContainerWrite
from fulmen.observation.frame_reads import FrameReads
from fulmen.observation.frame_tap import CallWatch, FrameTap, Quiet, observed
from fulmen.observation.guards import Guard
from fulmen.observation.state_guards import (
    CalleeGuard,
    Place,
    UnsetNames,
    children,
    empty_hooks,
    tensor_slots,
    tied_guard,
)
from fulmen.observation.state_writes import Write, WriteLog
from fulmen.observation.static_lookup import (
    MODULE_SLOTS,
    class_lookup,
    instance_dict,
    is_shadow,
)
from fulmen.observation.threads import Threads
from fulmen.observation.value_checks import MISSING, Emitter, describe, value_check

# nn.Module's own state (hook registries, `_non_persistent_buffers_set`, ...): torch's to change, not the program's
_MODULE_STATE = frozenset(nn.Module().__dict__)


class Observer(FrameReads):
    """Collects the guards of one acquisition."""

    def __init__(self, functions: tuple[Callable[..., Any], ...] = ()) -> None:
        self._guards: dict[tuple, Guard] = {}
        self._unset: dict[int, UnsetNames] = {}  # id(an object's __dict__) -> what must stay unset in it
        self._pinned: list[Any] = []
        self.active = False  # the program is running (module reads by fulmen itself are not the program's)
        # While acquisition records a symbol (its meta, its decomposition: fulmen's and torch's code only), frames
        # need not be followed: the interpreter enters this around that work (the bulk of the Python calls).
        self.quiet: contextlib.AbstractContextManager = contextlib.nullcontext()
        self._functions: dict[types.CodeType, list[types.FunctionType]] = {}
        self._created: set[int] = set()  # ids of the objects the program created while acquired (kept in _pinned)
        # id(frame) -> (offset, the code whose return gives the value of the instruction there); then by
        # (id(frame), offset), that value (read_sites.Capture, read_sites.Result): what a call or a getter gave, read
        # by a site
        self.expecting: dict[int, tuple[int, types.CodeType]] = {}
        self._results: dict[tuple[int, int], Any] = {}
        # what the observer does around calls of some functions (frame_tap.CallWatch): caches keeping what they return
        self._threads = Threads()  # the threads the program starts: one it waits for is refused
        self._watches: dict[types.CodeType, CallWatch] = {
            program_caches.CACHED_PROPERTY_GET: program_caches.CachedProperty(self), **self._threads.watches}
        self._tap: FrameTap | None = None
        self._dropped: list[Callable[[], None]] = []  # run once the program ran: what a refused cache kept
        # (id(object or globals dict), name) the program assigned while acquired: its later reads read that value
        self._written: set[tuple[int, str]] = set()
        self._stores = WriteLog()
        self._containers = ContainerLog()  # the lists, dicts and sets the program can reach (container_writes.py)
        self._callees: dict[int, CalleeGuard] = {}  # id(function read) -> what guards it, if it runs
        self._entered: set[types.CodeType] = set()  # the code of the program's frames that ran
        self._refused: TraceError | None = None  # why the program cannot be traced, found while it ran
        # what the program stored, to store again on every call (state_writes.py, container_writes.py)
        self.writes: tuple[Write | ContainerWrite, ...] = ()
        # id -> the real tensors the globals of the entry's module held when the call began, and of those, the ones
        # the program read from a global (held_by_global)
        self._tensors_at_start: dict[int, torch.Tensor] = {}
        self._global_tensors: dict[int, torch.Tensor] = {}
        # called before the program can call a function it read that changes the random generators' states
        # (global_setters.changes_generators), to put them back once it ran (the driver sets it: Setters)
        self.changing_generators: Callable[[], None] = _nothing
        for fn in functions:
            self._note_entry(fn)

    def arguments(self, names: list[str], values: list[Any]) -> None:
        """The program's arguments, as it receives them: their containers are watched (container_writes.py)."""
        self._containers.arguments(names, values)

    def guards(self) -> tuple[Guard, ...]:
        found = [self._unset[key[1]].guard() if key[0] == "unset" else guard for key, guard in self._guards.items()]
        callees = (callee.guard() for callee in self._callees.values() if callee.code in self._entered)
        return (*found, *callees)

    def entered(self, code: types.CodeType) -> None:
        self._entered.add(code)

    def _still_unset(self, state: dict, owner: str, obj: Any = MISSING) -> UnsetNames:
        """The check, one per object, that names stay out of its `__dict__`, hook registries stay empty, and (`obj`,
        whose dict `state` is) its class stays the same."""
        unset = self._unset.get(id(state))
        if unset is None:
            self._pinned.append(state)
            unset = self._unset[id(state)] = UnsetNames(state, owner)
            self._guards[("unset", id(state))] = Guard("", "", {})  # its place among the guards
        if obj is not MISSING and unset.typed is None:
            unset.typed = (obj, type(obj))
        return unset

    # --- recording ---------------------------------------------------------------------------------------------------
    def _add(self, key: tuple, what: str, expr: Callable[[Emitter], str], value: Any) -> None:
        if key in self._guards:
            return
        emit = Emitter()
        check = value_check(expr(emit), value, emit)
        if check is not None:
            self._guards[key] = Guard(what, check, emit.bindings, describe(value))
        self._note_function(value)

    def _add_raw(self, key: tuple, what: str, source: Callable[[Emitter], str]) -> None:
        if key not in self._guards:
            emit = Emitter()
            self._guards[key] = Guard(what, source(emit), emit.bindings)

    def _note_entry(self, fn: Callable[..., Any]) -> None:
        """The function handed to fulmen.jit: its code and defaults are checked like those of any function the
        program calls (IPython's autoreload assigns `fn.__code__` in place); a `functools.partial` also keeps what it
        binds (C code reads it, no read site sees it)."""
        while type(fn) is functools.partial:
            what = f"what functools.partial binds to {getattr(fn.func, '__qualname__', 'its function')}"
            self._add(("partial", id(fn)), what, lambda e, p=fn: f"({(b := e.bind(p))}.func, {b}.args, {b}.keywords)",
                      (fn.func, fn.args, fn.keywords))
            fn = fn.func
        self._note_function(fn)
        entry = fn.__func__ if type(fn) is types.MethodType else fn
        if type(entry) is types.FunctionType:  # (the type, not isinstance: a global's __class__ may be user code)
            self._tensors_at_start.update((id(value), value) for value in entry.__globals__.values()
                                          if issubclass(type(value), torch.Tensor) and type(value) is not TensorProxy)

    def _note_function(self, value: Any) -> None:
        """Closures, to find their cells (read_cell); the code and defaults of functions the program may call."""
        kind = type(value)
        fn = value.__func__ if kind is types.MethodType or kind is staticmethod or kind is classmethod else value
        if type(fn) is not types.FunctionType:
            return
        if fn.__closure__:
            known = self._functions.setdefault(fn.__code__, [])
            if fn not in known:
                known.append(fn)
        callee = self._callees.get(id(fn))
        if callee is None:
            self._pinned.append(fn)
            callee = self._callees[id(fn)] = CalleeGuard(fn)
            for i, default in enumerate(fn.__defaults__ or ()):  # checked by the callee's guard, once it runs
                self._containers.watch(default, f"default {i} of function {fn.__qualname__}",
                                       lambda e, i=i: f"{e.bind(fn)}.__defaults__[{i}]")

    def dict_entry(self, namespace: Any, name: str, what: str, owner: Any = None) -> None:
        """`namespace[name]` (a dict, or a class's mapping proxy with its class as `owner`) keeps its value, or stays
        absent."""
        owner = namespace if owner is None else owner
        self._pinned.append(owner)  # the keys below use ids: the objects stay alive while this observer does
        if name in namespace:
            place = lambda e: f"{e.bind(namespace)}[{name!r}]"  # noqa: E731
            self._add(("dict", id(owner), name), what, place, namespace[name])
            if _program_state(namespace, name, owner):
                self._containers.watch(namespace[name], what, place)
        else:
            self._add_raw(("dict", id(owner), name), f"{what} (absent)",
                          lambda e: f"{name!r} not in {e.bind(namespace)}")

    def class_attribute(self, cls: type, name: str, what: str, obj: Any = MISSING) -> None:
        """`name` resolves on `cls` (and not in the own dict of `obj`, an instance of it, which stays one) to what it
        resolves to now."""
        found = class_lookup(cls, name)
        index, raw = found if found is not None else (len(cls.__mro__), MISSING)
        instance = None if obj is MISSING else instance_dict(obj)
        if instance is not None:
            self._still_unset(instance, what.rsplit(" of ", 1)[-1], obj).absent.add(name)
        self._pinned.append(cls)
        for klass in cls.__mro__[:index]:
            self._add_raw(("absent", id(klass), name), f"{what} (not defined by {klass.__qualname__})",
                          lambda e, k=klass: f"{name!r} not in {e.bind(k.__dict__)}")
        if found is not None:
            definer = cls.__mro__[index]
            self.dict_entry(definer.__dict__, name, what, owner=definer)

    # --- the frame tap -----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def watching(self, watches: dict[types.CodeType, CallWatch] | None = None) -> Iterator[None]:
        """Observes the frames of user code started inside the block (this thread only). `watches`: what the
        acquisition does around calls of some functions (replacements.py), by code object."""
        previous = sys.gettrace()
        tracer = self._tap = FrameTap(self, previous, ChainMap(watches or {}, self._watches))
        sys.settrace(tracer.call)
        self.active = True
        if previous is None:  # with a debugger attached, fulmen's internals stay visible to it
            self.quiet = Quiet(tracer)
        try:
            yield
        except BaseException as error:
            if self._threads.refused is not None:  # the program failed on what the thread it waited for did
                raise self._threads.refused from error
            raise
        finally:
            self.active = False
            self.quiet = contextlib.nullcontext()
            tracer.stop()
            sys.settrace(previous)
            for drop in self._dropped:
                drop()
        refused = self._refused or self._threads.refused
        if refused is not None:
            raise refused
        changed, same_objects = self._containers.finish(self._created)
        for guard in same_objects:
            self._guards[("same object", guard.source)] = guard
        self.writes = (*self._stores.finish(self._created), *changed)

    def undo(self) -> None:
        """The acquisition is abandoned: the attributes and globals the program stored hold what they held, the
        containers it changed what they held."""
        self._stores.undo()
        self._containers.undo()

    # --- the module tap ----------------------------------------------------------------------------------------------
    def module_write(self, shadow: nn.Module, original: nn.Module, name: str, writer: types.FrameType,
                     deleted: bool = False) -> None:
        """The code of `writer` stored (or deleted) `name` on the shadow of `original`. Only the program's own code
        counts (frame_tap.observed): what torch's internals store there (a lazily compiled GraphModule's code) is theirs
        to redo, and lands on the shadow only."""
        if self.active and observed(writer.f_code, writer.f_globals):
            self._stores.module(shadow, original, name, frame_location(writer), deleted)

    def module_tensor(self, proxy: TensorProxy, tensor: torch.Tensor) -> None:
        """`proxy` stands for the module's `tensor` while the program runs (a store of it stores `tensor`)."""
        self._stores.stands_for[id(proxy)] = tensor

    def tied(self, place: Place, first: Place) -> None:
        """`place` holds the tensor found first at `first` (tied weights): the trace takes it as one input, fetched
        from `first` only, and holds while both places hold one tensor."""
        self._pinned.append(place.module)
        self._guards[("tied", id(place.module), place.container, place.name)] = tied_guard(place, first)

    # Guards on a module start from its own `__dict__`, which lives as long as the module: `_modules`,
    # `_parameters` and `_buffers` are looked up again on every check (ModuleList.__delitem__ replaces `_modules`).
    def module_read(self, original: nn.Module, shadow_class: type, name: str, value: Any) -> None:
        """The program read `name` on the shadow of `original` and got `value`."""
        if not self.active or (name.startswith("__") and name.endswith("__")):
            return
        state = original.__dict__
        what = f"attribute {name} of {type(original).__qualname__} module"
        if name in state:
            if name in MODULE_SLOTS:
                self._module_slot(original, name, None, inputs=True)
            elif empty_hooks(name, value):
                self._still_unset(state, f"{type(original).__qualname__} module").empty.add(name)
            elif state[name] is value and not issubclass(type(value), torch.Tensor):
                self.dict_entry(state, name, what)
            return
        if name not in shadow_class.__dict__:  # not one of the shadow's own hooks
            self.class_attribute(type(original), name, what, original)

    def _module_getattr(self, module: nn.Module, name: Any) -> None:
        """`nn.Module.__getattr__` of a module outside the jitted module's tree (an argument, a global) looks `name`
        up in its parameters, buffers and submodules through `__dict__`: that lookup is guarded, not the whole
        content of the module (a model passed to a jitted function made a guard of every module's whole state, most
        of a cache hit's checks). It runs only when `name` is not in the module's own dict, which is checked too."""
        if not isinstance(name, str) or not isinstance(module, nn.Module):
            self.read_state(module, "`__dict__`")
            return
        if is_shadow(module) or id(module) in self._created:
            return  # shadows: the module tap; modules the program created: derived from what it read
        state = module.__dict__
        self._pinned.append(state)
        kind = type(module).__qualname__
        self._add_raw(("not in dict", id(state), name), f"attribute {name} of a {kind} module (not its own)",
                      lambda e: f"{name!r} not in {e.bind(state)}")
        if not self._module_member(module, name, inputs=False):
            for slot in MODULE_SLOTS:
                self._add_raw(("no slot", id(state), slot, name), f"{slot[1:-1]} {name} of a {kind} module (absent)",
                              lambda e, slot=slot: f"{name!r} not in {e.bind(state)}[{slot!r}]")

    def module_fallback(self, module: nn.Module, name: str) -> bool:
        """The program read `name` through `nn.Module.__getattr__` (a parameter, buffer or submodule) of a module of
        the jitted module's tree."""
        return self.active and self._module_member(module, name, inputs=True)

    def module_absent(self, module: nn.Module, name: str) -> None:
        """The program looked for `name` on a module of the jitted module's tree (`hasattr`, `getattr` with a
        default) and found it nowhere: it stays out of the module's own dict and its class, and out of its
        parameters, buffers and submodules, where `nn.Module.__getattr__` looks (a submodule assigned later lands
        there, not in the dict)."""
        if not self.active or (name.startswith("__") and name.endswith("__")):
            return
        kind = type(module).__qualname__
        self.class_attribute(type(module), name, f"attribute {name} of {kind} module", module)
        state = module.__dict__
        self._pinned.append(state)
        for slot in MODULE_SLOTS:
            self._add_raw(("no slot", id(state), slot, name), f"{slot[1:-1]} {name} of a {kind} module (absent)",
                          lambda e, slot=slot: f"{name!r} not in {e.bind(state)}[{slot!r}]")

    def _module_member(self, module: nn.Module, name: str, inputs: bool) -> bool:
        state = module.__dict__
        for slot in MODULE_SLOTS:
            if name in state.get(slot, ()):
                self._module_slot(module, slot, name, inputs)
                return True
        return False

    def _module_slot(self, module: nn.Module, slot: str, name: str | None, inputs: bool) -> None:
        """Submodules are compared by identity. `inputs`: the module is in the jitted module's tree, whose
        parameters and buffers that are set are trace inputs, fetched by name on every call and checked by the cache
        key, so only one that is None needs a guard. Any other module (an argument, a global, a closure's) gives
        the program its real tensors, captured as constants: each is checked as a tensor read from a global is.
        `name` None: the whole container (its names and their order, and which are set)."""
        state = module.__dict__
        self._pinned.append(state)
        kind = type(module).__qualname__
        what = f"{slot[1:]} of a {kind} module" if name is None else f"{slot[1:-1]} {name} of a {kind} module"
        if name is not None:
            value = state[slot][name]
            if slot == "_modules" or value is None or not inputs:
                self._add(("slot", id(state), slot, name), what, lambda e: f"{e.bind(state)}[{slot!r}][{name!r}]",
                          value)
            return
        if not inputs:  # its items (its type may change: ModuleList.__delitem__ makes an OrderedDict)
            self._add(("slot", id(state), slot, None), what, lambda e: f"tuple({e.bind(state)}[{slot!r}].items())",
                      tuple(state[slot].items()))
            return
        summary = children if slot == "_modules" else tensor_slots
        self._add_raw(("slot", id(state), slot, None), what,
                      lambda e: f"{e.bind(summary)}({e.bind(state)}[{slot!r}]) == {e.bind(summary(state[slot]))}")


def _nothing() -> None:
    pass


def _program_state(namespace: Any, name: str, owner: Any) -> bool:
    """Whether the program's changes of the container `namespace[name]` are its own to replay or refuse: not those of
    nn.Module's own state (hooks, ...), nor the interpreter's (`sys.modules`, which a lazy import fills once, as in
    eager)."""
    if namespace is sys.__dict__:
        return False
    return name not in _MODULE_STATE or not isinstance(owner, dict) or "_modules" not in owner
