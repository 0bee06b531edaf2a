"""What the observer (observer.py) does with what the frame tap (frame_tap.py) reports: before each read site of a
frame of the program's code runs (read_sites.py), the object it reads is named in that frame (static_lookup.py,
without running any of the program's code) and guarded; the attributes and globals it stores are logged to be stored
again (state_writes.py); the values read through no attribute (torch's switches, the environment, Python's random
draws and clocks, torch's global setters) are guarded or refused (`_special`)."""


from __future__ import annotations

import functools
import gc
import operator
import os
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fulmen.core.errors import TraceError
from fulmen.core.proxies import type_refusal
from fulmen.core.source import frame_location
from fulmen.observation import global_setters, program_caches, read_sites
from fulmen.observation.container_writes import MUTATORS, is_container
from fulmen.observation.state_guards import (
    empty_hooks,
)
from fulmen.observation.static_lookup import (
    IMMUTABLE,
    MODULE_SLOTS,
    attribute_value,
    cell_value,
    class_lookup,
    evaluate,
    getter_code,
    instance_dict,
    is_data_descriptor,
    is_shadow,
    object_state,
    owner_name,
    python_code,
    slot_value,
    template_fields,
)
from fulmen.observation.threads import building_thread
from fulmen.observation.value_checks import MISSING, immutable, unrepeatable

_MODULE_GETATTR = nn.Module.__getattr__.__code__
# The functions of read_sites.AttrCall sites by id (a user's own `getattr` is none of them): what each does to the
# attribute
_ATTRIBUTE_CALLS = {id(getattr): "reads", id(hasattr): "reads", id(vars): "reads", id(object.__getattribute__): "reads",
                    id(setattr): "stores", id(object.__setattr__): "stores", id(delattr): "deletes",
                    id(object.__delattr__): "deletes"}
# What a copy shares with the original, left alone by `read_state` (tensors are the trace's inputs)
_COPIED_AS_THEMSELVES = (torch.Tensor, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                         types.MethodType)


class FrameReads:
    """The frame tap's side of `Observer` (observer.py), which this class is a base of: the guards go through its
    recording (`_add`, `_add_raw`, `dict_entry`, `class_attribute`, `_still_unset`) into its state."""

    def read_global(self, frame: types.FrameType, name: str) -> None:
        namespace = frame.f_globals
        if (id(namespace), name) in self._written:
            return
        module = namespace.get("__name__", "?")
        self.dict_entry(namespace, name, f"global {name} of module {module}")
        if name not in namespace:
            self.dict_entry(frame.f_builtins, name, f"builtin {name}")
            return
        value = namespace[name]
        if self._tensors_at_start.get(id(value)) is value:
            self._global_tensors[id(value)] = value

    def held_by_global(self, tensor: torch.Tensor) -> bool:
        """The program read `tensor` from a global, and a global of the entry's module held it when the call began:
        a tensor of the caller's, not one the call made (also through a write no site names: `globals()[name] = `,
        `setattr(module, ...)`), which the guard on the global it was read from finds there again on every call, so
        its memory is the same on every call (numpy_inputs.py). A tensor only another module's globals held is not
        known to be held (not snapshotted: each namespace costs a scan on every miss)."""
        return self._global_tensors.get(id(tensor)) is tensor

    def read_cell(self, frame: types.FrameType, name: str) -> None:
        code = frame.f_code
        value = frame.f_locals.get(name, MISSING)
        index = code.co_freevars.index(name)
        functions = self._closures_reading(code, index, value)
        for fn in functions:
            cell = fn.__closure__[index]
            place = lambda e, c=cell: f"{e.bind(cell_value)}({e.bind(c)})"  # noqa: E731
            self._add(("cell", id(cell)), f"closure variable {name} of {fn.__qualname__}", place, value)
            self._containers.watch(value, f"closure variable {name} of {fn.__qualname__}", place)

    def _closures_reading(self, code: types.CodeType, index: int, value: Any) -> list[types.FunctionType]:
        def matching() -> list[types.FunctionType]:
            return [fn for fn in self._functions.get(code, ()) if cell_value(fn.__closure__[index]) is value]

        found = matching()
        # A function we have not seen read: find it among the functions of this code. Most are closures the program
        # just made (a generator expression reading `self`), found among the youngest objects; scanning the whole
        # heap (gc.get_referrers) costs tens of milliseconds each time.
        for search in (lambda: gc.get_objects(generation=0), lambda: gc.get_objects(generation=1),
                       lambda: gc.get_referrers(code)):
            if found:
                break
            for candidate in search():
                if type(candidate) is types.FunctionType and candidate.__code__ is code:
                    self._note_function(candidate)
            found = matching()
        return found

    def created(self, obj: Any) -> None:
        """`obj` is being initialised by the program: it did not exist before this call."""
        if id(obj) not in self._created:
            self._pinned.append(obj)
            self._created.add(id(obj))

    def read_state(self, obj: Any, reader: str) -> None:
        """`reader` (a copy, `dataclasses.asdict`, `vars`) reads all the object `obj` holds, in code no read site
        names: the trace holds while that content does. Shallowly: a deep reader's recursion reads each nested
        object in turn. A container is left alone: one that predates the call was found through a guarded place,
        whose check compares its content (values.value_check); one the program built is its own."""
        if immutable(obj) or is_container(obj) or isinstance(obj, _COPIED_AS_THEMSELVES) \
                or id(obj) in self._created or is_shadow(obj):
            return  # tensors: trace inputs; shadows: the module tap
        self._pinned.append(obj)
        self._add(("state", id(obj)), f"the content of {owner_name(obj)}, read whole by {reader}",
                  lambda e: f"{e.bind(object_state)}({e.bind(obj)})", object_state(obj))

    def read_attribute(self, obj: Any, name: str) -> None:
        if name == "__dict__":
            self.read_state(obj, "`__dict__`")
            return
        cls = type(obj)
        if type(class_lookup(cls, "__getattribute__")[1]) is types.FunctionType:
            # the class's own lookup may answer from anything the object holds (transformers' configs map names
            # through `attribute_map` with `super().__getattribute__`, which no read site names)
            self.read_state(obj, f"{cls.__qualname__}.__getattribute__")
        if (name.startswith("__") and name.endswith("__")) or issubclass(cls, (torch.Tensor, *IMMUTABLE)) \
                or is_shadow(obj) or id(obj) in self._created or (id(obj), name) in self._written:
            # tensors: trace inputs; immutable values: guarded where read; shadows: the module tap; objects the
            # program created, attributes it assigned: derived from what it read
            return
        what = f"attribute {name} of {owner_name(obj)}"
        if cls.__module__.startswith("torch.backends.") and self._switch(obj, name):
            return
        if issubclass(cls, types.ModuleType):
            self.dict_entry(obj.__dict__, name, what)
            return
        if issubclass(cls, type):
            self.class_attribute(obj, name, what)
            return
        found = class_lookup(cls, name)
        state = instance_dict(obj)
        if found is not None and is_data_descriptor(found[1]):
            if type(found[1]) is types.MemberDescriptorType:
                self._add(("slot", id(obj), name), what,
                          lambda e: f"{e.bind(slot_value)}({e.bind(found[1])}, {e.bind(obj)})",
                          slot_value(found[1], obj))
            else:  # a property: its getter is observed when it runs
                self.class_attribute(cls, name, what)
                if state is not None:  # the getter is the class's
                    self._still_unset(state, owner_name(obj), obj)
        elif state is not None and name in state:
            if issubclass(cls, nn.Module) and name in MODULE_SLOTS:
                self._module_slot(obj, name, None, inputs=False)
            elif issubclass(cls, nn.Module) and empty_hooks(name, state[name]):
                self._still_unset(state, f"{cls.__qualname__} module").empty.add(name)
            else:
                self.dict_entry(state, name, what)
        elif issubclass(cls, nn.Module) and found is None and self._module_member(obj, name, inputs=False):
            pass
        else:  # a class attribute, or none at all (`getattr(obj, name, default)`, `hasattr`)
            self.class_attribute(cls, name, what, obj)

    def _switch(self, switches: Any, name: str) -> bool:
        """Torch's backend switches (`torch.backends.cudnn.allow_tf32`, `torch.backends.cuda.matmul.allow_tf32`) are
        properties or `__getattr__` of torch's own modules: guarded on the value they give."""
        value = getattr(switches, name, MISSING)
        if value is MISSING or not immutable(value):
            return False
        self._add(("switch", id(switches), name), f"torch switch {type(switches).__module__}.{name}",
                  lambda e: f"{e.bind(getattr)}({e.bind(switches)}, {name!r}, None)", value)
        return True

    def read(self, site: read_sites.Read, frame: types.FrameType) -> None:
        kind = type(site)
        if kind is read_sites.Capture:
            self._expect(site, frame)
            if site.then is not None:
                self.read(site.then, frame)
        elif kind is read_sites.GlobalRead:
            self.read_global(frame, site.name)
            self._special(evaluate(read_sites.Global(site.name), frame), frame)
        elif kind is read_sites.CellRead:
            self.read_cell(frame, site.name)
            self._special(frame.f_locals.get(site.name), frame)
        elif kind is read_sites.AttrRead:
            receiver = evaluate(site.receiver, frame, self._results)
            if receiver is not MISSING and site.name == "__dict__" and frame.f_code is _MODULE_GETATTR:
                self._module_getattr(receiver, frame.f_locals.get("name"))
            elif receiver is not MISSING:
                self.read_attribute(receiver, site.name)
                self._special(attribute_value(receiver, site.name), frame)
                if global_setters.method_changes_generators(receiver, site.name):  # C code: its call is unseen
                    self.changing_generators()
                if self._refused is None and isinstance(receiver, global_setters.SETTER_OWNERS):
                    self._refused = global_setters.attribute_refusal(receiver, site.name, frame)
                if site.name in MUTATORS:
                    self._containers.changing(receiver, frame)
        elif kind is read_sites.AttrWrite:
            receiver = evaluate(site.receiver, frame, self._results)
            if receiver is not MISSING:
                self._write_attribute(receiver, site.name, site.deletes, frame)
        elif kind is read_sites.GlobalWrite:
            if site.deletes:  # eager's `del` fails where it is gone: the trace holds where it is there, as it was
                self.read_global(frame, site.name)
            self._written.add((id(frame.f_globals), site.name))
            self._stores.global_(frame.f_globals, site.name, frame)
        elif kind is read_sites.CallRead:
            self._call_read(site, frame)
        elif kind is read_sites.ItemWrite:
            container = evaluate(site.container, frame, self._results)
            if container is not MISSING:
                self._containers.changing(container, frame)
        else:
            function = evaluate(site.function, frame, self._results)
            receiver, name = evaluate(site.receiver, frame, self._results), evaluate(site.name, frame, self._results)
            if receiver is MISSING or type(name) is not str:
                return
            does = _ATTRIBUTE_CALLS.get(id(function))
            if does == "reads":
                self.read_attribute(receiver, name)
            elif does is not None:
                self._write_attribute(receiver, name, does == "deletes", frame)

    def _expect(self, site: read_sites.Capture, frame: types.FrameType) -> None:
        """The instruction about to run in `frame` gives a value a later site reads from: find the Python code that
        will give it (the function called, a property's getter, a descriptor's `__get__`, a class's `__getattr__`),
        whose return the frame tap then catches (`returning`). Other callables (classes, C functions, caches) give
        values no site can name."""
        self._results.pop((id(frame), frame.f_lasti), None)
        self.expecting.pop(id(frame), None)
        if site.getter is None:
            code = python_code(evaluate(site.callee, frame, self._results))
        else:
            code = getter_code(evaluate(site.getter.base, frame, self._results), site.getter.name)
        if code is not None:
            self.expecting[id(frame)] = (frame.f_lasti, code)

    def returning(self, frame: types.FrameType) -> tuple[int, int] | None:
        """`frame` just started: the key its return value is kept under, if it is the code `_expect` waits for (a
        frame runs one instruction at a time, and the one waited for starts the frame that gives its value)."""
        caller = frame.f_back
        waited = None if caller is None else self.expecting.get(id(caller))
        if waited is None or waited[1] is not frame.f_code:
            return None
        del self.expecting[id(caller)]
        return id(caller), waited[0]

    def returned(self, key: tuple[int, int], value: Any) -> None:
        self._results[key] = value

    def kept(self, value: Any, keeper: str, caller: types.FrameType, drop: Callable[[], None],
             objects: bool) -> None:
        """`keeper` (a cache) keeps `value` beyond the call (program_caches.py): what it must not keep is refused, and
        `drop` removes it from the keeper once the program ran."""
        refused = program_caches.refusal(value, keeper, caller, self._created if objects else frozenset())
        if refused is not None:
            self._dropped.append(drop)
            self._refused = self._refused or refused

    def _call_read(self, site: read_sites.CallRead, frame: types.FrameType) -> None:
        """What C code reads of the arguments of a call it makes: the attributes an `operator.attrgetter` names, the
        class `isinstance` and `type` look at, the attributes and items a template's fields name."""
        arguments = [MISSING if argument is None else evaluate(argument, frame, self._results)
                     for argument in site.arguments]
        function = site.function
        if type(function) is read_sites.Attr and type(function.base) is read_sites.Const:  # `"{0.lr}".format(...)`
            for index, path in template_fields(function.base.value):
                if index < len(arguments):
                    self._read_path(arguments[index], path)
            return
        function = evaluate(function, frame, self._results)
        if type(function) is operator.attrgetter:
            for dotted in function.__reduce__()[1]:
                self._read_path(arguments[0], tuple((True, name) for name in dotted.split(".")))
        elif function is type and self._refused is None and (why := type_refusal(arguments[0])) is not None:
            self._refused = TraceError(why, frame_location(frame))
        elif function is isinstance or function is type:
            self._read_class(arguments[0])

    def _read_path(self, obj: Any, path: tuple[tuple[bool, Any], ...]) -> None:
        """C code reads `obj`, then each (is an attribute, name or key) step of `path` from what the last gave. Items
        of lists and dicts need no guard (a container found through a guarded place is compared by content)."""
        for is_attribute, key in path:
            if obj is MISSING:
                return
            if is_attribute:
                self.read_attribute(obj, key)
                obj = attribute_value(obj, key)
            elif type(obj) is dict or type(obj) is list and type(key) is int and -len(obj) <= key < len(obj):
                obj = obj.get(key, MISSING) if type(obj) is dict else obj[key]
            else:
                return

    def _read_class(self, obj: Any) -> None:
        """The program asked for the class of `obj` (`isinstance`, `type`): it stays the class (`obj.__class__ = ...`
        changes it in place)."""
        if obj is MISSING or immutable(obj) or is_container(obj) or isinstance(obj, torch.Tensor) or is_shadow(obj) \
                or id(obj) in self._created:
            return  # values: guarded by value; tensors: trace inputs; shadows: the module tap
        cls = type(obj)
        self._pinned.append(obj)
        self._add_raw(("class", id(obj)), f"the class of {owner_name(obj)}",
                      lambda e: f"type({e.bind(obj)}) is {e.bind(cls)}")

    def _write_attribute(self, receiver: Any, name: str, deletes: bool, frame: types.FrameType) -> None:
        if deletes:  # eager's `del` fails where it is gone: the trace holds where it is there, as it was
            self.read_attribute(receiver, name)
        self._pinned.append(receiver)
        self._written.add((id(receiver), name))
        if not is_shadow(receiver):  # a shadow reports its stores itself (module_write)
            self._stores.attribute(receiver, name, frame)


    def _special(self, value: Any, frame: types.FrameType) -> None:
        """Values whose reading reads state no attribute holds. Torch's global switches the program asks for
        (`torch.are_deterministic_algorithms_enabled()`) are guarded on their answer, the environment on all of it.
        A program that calls a function giving a new value on each call (Python's random draws, a clock) is refused
        once it has run: a trace would repeat the value it gave while tracing. (Not raised here: the program could
        catch it, and would run on unobserved.) Where it is got, but for a C function got by a thread's `__init__`
        (tqdm's monitor thread is given `time.time`, to call in its own thread): that one is refused where the
        program's thread calls it (`called`), from then on. (Handed on to other code, a function could be called by
        C code no frame shows: `functools.partial(time.time)()`.)"""
        kind = type(value)
        if (kind is types.FunctionType or kind is types.BuiltinMethodType) and global_setters.changes_generators(value):
            self.changing_generators()
        if kind is functools._lru_cache_wrapper and type(getattr(value, "__wrapped__", None)) is types.FunctionType \
                and value.cache_info().maxsize != 0:
            self._watches.setdefault(value.__wrapped__.__code__, program_caches.Memoized(self, value))
            return
        if (kind is types.FunctionType or kind is types.BuiltinFunctionType) and value in global_setters.SWITCHES:
            self._add(("switch", id(value)), f"torch.{value.__name__}()", lambda e: f"{e.bind(value)}()", value())
            return
        if value is os.environ or value is os.getenv:
            environ = os.environ._data  # what os.environ reads and writes
            self._add_raw(("environ",), "the environment (os.environ)",
                          lambda e: f"{e.bind(environ)} == {e.bind(dict(environ))}")
            return
        if self._refused is None:  # a setter of torch's that no call of the trace could set again
            self._refused = global_setters.refusal(value, frame)
        name = unrepeatable(value)
        if name is not None and self._refused is None and not (kind is types.BuiltinFunctionType
                                                                and building_thread(frame) and self._tap is not None
                                                                and self._tap.watch_calls()):
            self._refuse_unrepeatable(name, frame)

    def called(self, function: Any, frame: types.FrameType) -> None:
        """The program's code calls the C function `function` (the tap watches its calls once it got a clock)."""
        name = unrepeatable(function)
        if name is not None and self._refused is None:
            self._refuse_unrepeatable(name, frame)

    def _refuse_unrepeatable(self, name: str, frame: types.FrameType) -> None:
        fix = ("Draw it with torch (torch.rand, torch.randint, torch.bernoulli), which the trace draws anew on "
               "every call, or pass it in as an argument" if "random" in name else
               "Read it outside the jitted program and pass it in as an argument, or leave it out")
        location = frame_location(frame)
        where = f" ({location.short()})" if location is not None else ""
        self._refused = TraceError(f"fulmen cannot compile a program that calls {name}{where}: it gives a new "
                                   f"value on every call, and a trace would repeat the one it gave while "
                                   f"tracing. {fix}.", location)
