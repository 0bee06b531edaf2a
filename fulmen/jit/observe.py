"""The observer of the acquired Python: what the traced program read, turned into guards.

A trace is specialised on every Python value the program read: globals, closure cells, attributes of objects
(arguments, configs, classes) and of modules. The observer watches the acquisition through two taps that feed one
set of guards:

- the frame tap (`Observer.watching`): while acquiring, `sys.settrace` follows every frame of the user's code
  (everything but fulmen, the standard library and torch, except `torch.nn.modules`, whose module code reads the
  module state and hook registries). Before each read site of a frame (reads.py) runs, the observer names the object
  read in that frame and records a guard on it.
- the module tap (`module_read`, `module_fallback`): the shadow modules of overrides.py report every attribute read
  on them, and the guard is put on the user's module behind the shadow (its attributes, submodules, parameters and
  buffers slots, hooks, and the class attributes it resolves, methods included).

Objects created during the call need no guard (they are derived from what was read); a guard on one is harmless,
since nothing changes it afterwards. Reads that only C code makes of objects the program cannot name (an attribute
of a call's result) are not seen here; the functions the program calls are observed themselves.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import sysconfig
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from fulmen.jit import reads
from fulmen.jit.guards import Guard
from fulmen.jit.values import MISSING, Emitter, describe, value_check

# --- which code is observed ------------------------------------------------------------------------------------------
_FULMEN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_TORCH_MODULES = os.path.join(_TORCH, "nn", "modules") + os.sep
_PATHS = sysconfig.get_paths()
_STDLIB = tuple({os.path.abspath(_PATHS[k]) + os.sep for k in ("stdlib", "platstdlib")})
_PACKAGES = tuple({os.path.abspath(_PATHS[k]) + os.sep for k in ("purelib", "platlib")})


def _observed_file(filename: str) -> bool:
    if filename.startswith(_FULMEN):
        return False
    if filename.startswith(_TORCH):
        return filename.startswith(_TORCH_MODULES)
    return not filename.startswith(_STDLIB) or filename.startswith(_PACKAGES)


def observed(code: types.CodeType, namespace: dict) -> bool:
    """Whether the observer follows frames of `code`: the program's own code, not fulmen's, torch's (but for its
    module classes) or the standard library's. Generated code (`<string>`, e.g. a dataclass's `__init__`) counts as
    the code of the module whose globals it runs in."""
    filename = code.co_filename
    if filename.startswith("<"):
        if filename.startswith(("<frozen", "<fulmen")):
            return False
        module = sys.modules.get(namespace.get("__name__", ""))
        filename = getattr(module, "__file__", None) or ""
        return not filename or _observed_file(os.path.abspath(filename))
    return _observed_file(filename)


_SITES: dict[int, tuple[types.CodeType, dict[int, reads.Read] | None]] = {}  # keeps each code alive: ids stay unique


def _sites_of(frame: types.FrameType) -> dict[int, reads.Read] | None:
    code = frame.f_code
    known = _SITES.get(id(code))
    if known is None:
        known = (code, reads.read_sites(code) if observed(code, frame.f_globals) else None)
        _SITES[id(code)] = known
    return known[1]


# --- static attribute lookup: the value Python would find, without running any of the program's code -----------------
_IMMUTABLE = (int, float, bool, str, bytes, complex, tuple, frozenset, range, slice, torch.device, torch.dtype,
              torch.Size, type(None))


def _class_lookup(cls: type, name: str) -> tuple[int, Any] | None:
    for index, klass in enumerate(cls.__mro__):
        namespace = klass.__dict__
        if name in namespace:
            return index, namespace[name]
    return None


def _is_data_descriptor(raw: Any) -> bool:
    kind = type(raw)
    return _class_lookup(kind, "__set__") is not None or _class_lookup(kind, "__delete__") is not None


def _is_descriptor(raw: Any) -> bool:
    return _class_lookup(type(raw), "__get__") is not None


def _instance_dict(obj: Any) -> dict | None:
    """`obj.__dict__` found without running the program's code (no `__getattr__`)."""
    found = _class_lookup(type(obj), "__dict__")
    if found is None or type(found[1]) is not types.GetSetDescriptorType:
        return None
    state = found[1].__get__(obj, type(obj))
    return state if type(state) is dict else None


def _slot_value(descriptor: Any, obj: Any) -> Any:
    try:
        return descriptor.__get__(obj, type(obj))
    except AttributeError:  # an empty slot
        return MISSING


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return MISSING


_MODULE_SLOTS = ("_parameters", "_buffers", "_modules")
# nn.Module's hook registries (`_forward_hooks`, ...): almost always empty, then checked together per module
_HOOK_REGISTRIES = frozenset(name for name, value in nn.Module().__dict__.items()
                             if "hook" in name and type(value) in (dict, OrderedDict))


def attribute_value(obj: Any, name: str) -> Any:
    """`getattr(obj, name)` where it needs no code of the program to run (else MISSING)."""
    kind = type(obj)
    if issubclass(kind, types.ModuleType):
        return obj.__dict__.get(name, MISSING)
    if issubclass(kind, type):
        found = _class_lookup(obj, name)
        if found is None:
            return MISSING
        raw = found[1]
        if type(raw) in (classmethod, staticmethod):
            return raw.__get__(None, obj)
        return raw if type(raw) is types.FunctionType or not _is_descriptor(raw) else MISSING
    found = _class_lookup(type(obj), name)
    if found is not None and _is_data_descriptor(found[1]):
        return _slot_value(found[1], obj) if type(found[1]) is types.MemberDescriptorType else MISSING
    state = _instance_dict(obj)
    if state is not None and name in state:
        return state[name]
    if found is not None:
        raw = found[1]
        return raw.__get__(obj, type(obj)) if type(raw) is types.FunctionType else (
            raw if not _is_descriptor(raw) else MISSING)
    if issubclass(type(obj), nn.Module) and state is not None:
        for slot in _MODULE_SLOTS:
            if name in state.get(slot, ()):
                return state[slot][name]
    return MISSING


def _evaluate(source: reads.Source, frame: types.FrameType) -> Any:
    kind = type(source)
    if kind is reads.Local or kind is reads.Cell:
        return frame.f_locals.get(source.name, MISSING)
    if kind is reads.Global:
        value = frame.f_globals.get(source.name, MISSING)
        return frame.f_builtins.get(source.name, MISSING) if value is MISSING else value
    if kind is reads.Const:
        return source.value
    base = _evaluate(source.base, frame)
    if base is MISSING:
        return MISSING
    if kind is reads.Attr:
        return attribute_value(base, source.name)
    key = source.key.value
    if type(base) is dict:
        return base.get(key, MISSING)
    if type(base) in (list, tuple) and type(key) is int and -len(base) <= key < len(base):
        return base[key]
    return MISSING


def _is_shadow(obj: Any) -> bool:
    state = _instance_dict(obj)
    return state is not None and "_fulmen_original" in state


def _owner_name(obj: Any) -> str:
    if issubclass(type(obj), types.ModuleType):
        return f"module {obj.__name__}"
    if issubclass(type(obj), type):
        return f"class {obj.__qualname__}"
    return f"{type(obj).__qualname__} object"


class Observer:
    """Collects the guards of one acquisition."""

    def __init__(self, functions: tuple[Callable[..., Any], ...] = ()) -> None:
        self._guards: dict[tuple, Guard] = {}
        self._empty_hooks: dict[int, tuple[dict, list[str]]] = {}  # id(module.__dict__) -> it, hook registries read
        self._pinned: list[Any] = []
        self.active = False  # the program is running (module reads by fulmen itself are not the program's)
        # While acquisition records a symbol (its meta, its decomposition: fulmen's and torch's code only), frames
        # need not be followed: the interpreter enters this around that work (the bulk of the Python calls).
        self.quiet: contextlib.AbstractContextManager = contextlib.nullcontext()
        self._functions: dict[types.CodeType, list[types.FunctionType]] = {}
        for fn in functions:
            self._note_function(fn)

    def guards(self) -> tuple[Guard, ...]:
        guards = []
        for key, guard in self._guards.items():
            if key[0] == "hooks":  # one check for all the empty hook registries of a module
                state, names = self._empty_hooks[key[1]]
                emit = Emitter()
                bound = emit.bind(state)
                guard = Guard(f"{guard.what}: {', '.join(names)}",
                              "not (" + " or ".join(f"{bound}[{n!r}]" for n in names) + ")", emit.bindings)
            guards.append(guard)
        return tuple(guards)

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

    def _note_function(self, value: Any) -> None:
        fn = value.__func__ if type(value) is types.MethodType else value
        if type(fn) is types.FunctionType and fn.__closure__:
            known = self._functions.setdefault(fn.__code__, [])
            if fn not in known:
                known.append(fn)

    def dict_entry(self, namespace: Any, name: str, what: str, owner: Any = None) -> None:
        """`namespace[name]` (a dict, or a class's mapping proxy with its class as `owner`) keeps its value, or stays
        absent."""
        owner = namespace if owner is None else owner
        self._pinned.append(owner)  # the keys below use ids: the objects stay alive while this observer does
        if name in namespace:
            self._add(("dict", id(owner), name), what, lambda e: f"{e.bind(namespace)}[{name!r}]", namespace[name])
        else:
            self._add_raw(("dict", id(owner), name), f"{what} (absent)",
                          lambda e: f"{name!r} not in {e.bind(namespace)}")

    def class_attribute(self, cls: type, name: str, what: str, instance: dict | None = None) -> None:
        """`name` resolves on `cls` (and not in `instance`, the object's own dict) to what it resolves to now."""
        found = _class_lookup(cls, name)
        index, raw = found if found is not None else (len(cls.__mro__), MISSING)
        if instance is not None:
            self._pinned.append(instance)
            self._add_raw(("absent", id(instance), name), f"{what} (not set on the object itself)",
                          lambda e: f"{name!r} not in {e.bind(instance)}")
        self._pinned.append(cls)
        for klass in cls.__mro__[:index]:
            self._add_raw(("absent", id(klass), name), f"{what} (not defined by {klass.__qualname__})",
                          lambda e, k=klass: f"{name!r} not in {e.bind(k.__dict__)}")
        if found is not None:
            definer = cls.__mro__[index]
            self.dict_entry(definer.__dict__, name, what, owner=definer)

    # --- the frame tap -----------------------------------------------------------------------------------------------
    def read_global(self, frame: types.FrameType, name: str) -> None:
        namespace = frame.f_globals
        module = namespace.get("__name__", "?")
        self.dict_entry(namespace, name, f"global {name} of module {module}")
        if name not in namespace:
            self.dict_entry(frame.f_builtins, name, f"builtin {name}")

    def read_cell(self, frame: types.FrameType, name: str) -> None:
        code = frame.f_code
        value = frame.f_locals.get(name, MISSING)
        index = code.co_freevars.index(name)
        functions = self._closures_reading(code, index, value)
        for fn in functions:
            cell = fn.__closure__[index]
            self._add(("cell", id(cell)), f"closure variable {name} of {fn.__qualname__}",
                      lambda e, c=cell: f"{e.bind(_cell_value)}({e.bind(c)})", value)

    def _closures_reading(self, code: types.CodeType, index: int, value: Any) -> list[types.FunctionType]:
        def matching() -> list[types.FunctionType]:
            return [fn for fn in self._functions.get(code, ()) if _cell_value(fn.__closure__[index]) is value]

        found = matching()
        if not found:  # a function we have not seen read: find it among the functions of this code
            for referrer in gc.get_referrers(code):
                if type(referrer) is types.FunctionType and referrer.__code__ is code:
                    self._note_function(referrer)
            found = matching()
        return found

    def read_attribute(self, obj: Any, name: str) -> None:
        cls = type(obj)
        if (name.startswith("__") and name.endswith("__")) or issubclass(cls, (torch.Tensor, *_IMMUTABLE)) \
                or _is_shadow(obj):
            return  # tensors: trace inputs; immutable values: guarded where read; shadows: the module tap
        what = f"attribute {name} of {_owner_name(obj)}"
        if issubclass(cls, types.ModuleType):
            self.dict_entry(obj.__dict__, name, what)
            return
        if issubclass(cls, type):
            self.class_attribute(obj, name, what)
            return
        found = _class_lookup(cls, name)
        state = _instance_dict(obj)
        if found is not None and _is_data_descriptor(found[1]):
            if type(found[1]) is types.MemberDescriptorType:
                self._add(("slot", id(obj), name), what,
                          lambda e: f"{e.bind(_slot_value)}({e.bind(found[1])}, {e.bind(obj)})",
                          _slot_value(found[1], obj))
            else:  # a property: its getter is observed when it runs
                self.class_attribute(cls, name, what)
        elif state is not None and name in state:
            self.dict_entry(state, name, what)
        elif issubclass(cls, nn.Module) and found is None and self.module_fallback(obj, name):
            pass
        else:  # a class attribute, or none at all (`getattr(obj, name, default)`, `hasattr`)
            self.class_attribute(cls, name, what, state)

    def read(self, site: reads.Read, frame: types.FrameType) -> None:
        kind = type(site)
        if kind is reads.GlobalRead:
            self.read_global(frame, site.name)
        elif kind is reads.CellRead:
            self.read_cell(frame, site.name)
        elif kind is reads.AttrRead:
            receiver = _evaluate(site.receiver, frame)
            if receiver is not MISSING:
                self.read_attribute(receiver, site.name)
        elif (function := _evaluate(site.function, frame)) is getattr or function is hasattr:
            receiver, name = _evaluate(site.receiver, frame), _evaluate(site.name, frame)
            if receiver is not MISSING and type(name) is str:
                self.read_attribute(receiver, name)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Observes the frames of user code started inside the block (this thread only)."""
        previous = sys.gettrace()
        tracer = _FrameTap(self, previous)
        sys.settrace(tracer.call)
        self.active = True
        if previous is None:  # with a debugger attached, fulmen's internals stay visible to it
            self.quiet = _Quiet(tracer.call)
        try:
            yield
        finally:
            self.active = False
            self.quiet = contextlib.nullcontext()
            sys.settrace(previous)

    # --- the module tap ----------------------------------------------------------------------------------------------
    # Guards on a module start from its own `__dict__`, which lives as long as the module: `_modules`,
    # `_parameters` and `_buffers` are looked up again on every check (ModuleList.__delitem__ replaces `_modules`).
    def module_read(self, original: nn.Module, shadow_class: type, name: str, value: Any) -> None:
        """The program read `name` on the shadow of `original` and got `value`."""
        if not self.active or (name.startswith("__") and name.endswith("__")):
            return
        state = original.__dict__
        what = f"attribute {name} of {type(original).__qualname__} module"
        if name in state:
            if name in _MODULE_SLOTS:
                self._module_slot(original, name, None)
            elif name in _HOOK_REGISTRIES and type(value) in (dict, OrderedDict) and not value:
                self._pinned.append(state)
                names = self._empty_hooks.setdefault(id(state), (state, []))[1]
                if name not in names:
                    names.append(name)
                self._guards.setdefault(("hooks", id(state)), Guard(f"hooks of a {type(original).__qualname__} "
                                                                    "module", "", {}))
            elif state[name] is value and not issubclass(type(value), torch.Tensor):
                self.dict_entry(state, name, what)
            return
        if name not in shadow_class.__dict__:  # not one of the shadow's own hooks
            self.class_attribute(type(original), name, what, state)

    def module_fallback(self, module: nn.Module, name: str) -> bool:
        """The program read `name` through `nn.Module.__getattr__` (a parameter, buffer or submodule)."""
        if not self.active:
            return False
        state = module.__dict__
        for slot in _MODULE_SLOTS:
            if name in state.get(slot, ()):
                self._module_slot(module, slot, name)
                return True
        return False

    def _module_slot(self, module: nn.Module, slot: str, name: str | None) -> None:
        """Submodules are compared by identity; parameters and buffers (trace inputs, fetched on every call) only
        by whether they are set. `name` None: the whole container (its names and their order)."""
        state = module.__dict__
        self._pinned.append(state)
        kind = type(module).__qualname__
        what = f"{slot[1:]} of a {kind} module" if name is None else f"{slot[1:-1]} {name} of a {kind} module"
        if slot == "_modules" and name is not None:
            self._add(("slot", id(state), slot, name), what,
                      lambda e: f"{e.bind(state)}[{slot!r}].get({name!r}, {e.bind(MISSING)})", state[slot][name])
            return
        summary = _children if slot == "_modules" else _tensor_slots
        self._add_raw(("slot", id(state), slot, None), what,
                      lambda e: f"{e.bind(summary)}({e.bind(state)}[{slot!r}]) == {e.bind(summary(state[slot]))}")


def _tensor_slots(container: dict) -> tuple:
    return tuple((name, value is None) for name, value in container.items())


def _children(container: dict) -> tuple:
    return tuple(container.items())  # modules compare by identity


class _Quiet:
    __slots__ = ("tracer",)

    def __init__(self, tracer: Callable[..., Any]) -> None:
        self.tracer = tracer

    def __enter__(self) -> None:
        sys.settrace(None)

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self.tracer)


class _FrameTap:
    """The `sys.settrace` function of one acquisition; chains a tracer that was already set (a debugger).

    Imports the program triggers (a lazily imported module, with the import system's finders) are not followed:
    what they run defines state rather than reading it for the trace."""

    def __init__(self, observer: Observer, previous: Callable[..., Any] | None) -> None:
        self.observer = observer
        self.previous = previous
        self.importing = 0  # module bodies running now

    def call(self, frame: types.FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        local = self.previous(frame, event, arg) if self.previous is not None else None
        code = frame.f_code
        if code.co_name == "<module>" or code.co_filename.startswith("<frozen importlib"):
            self.importing += 1
            return _ImportTap(self, local).event
        if self.importing:
            return local
        sites = _sites_of(frame)
        if not sites:
            return local
        frame.f_trace_opcodes = True
        if local is None:
            frame.f_trace_lines = False
        return _LocalTap(self.observer, sites, local).event


class _ImportTap:
    __slots__ = ("tap", "previous")

    def __init__(self, tap: _FrameTap, previous: Callable[..., Any] | None) -> None:
        self.tap = tap
        self.previous = previous

    def event(self, frame: types.FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if event == "return":
            self.tap.importing -= 1
        if self.previous is not None:
            self.previous = self.previous(frame, event, arg)
        return self.event


class _LocalTap:
    __slots__ = ("observer", "sites", "previous")

    def __init__(self, observer: Observer, sites: dict[int, reads.Read], previous: Callable[..., Any] | None):
        self.observer = observer
        self.sites = sites
        self.previous = previous

    def event(self, frame: types.FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if event == "opcode":
            site = self.sites.get(frame.f_lasti)
            if site is not None:
                self.observer.read(site, frame)
        elif self.previous is not None:
            self.previous = self.previous(frame, event, arg)
        return self.event
