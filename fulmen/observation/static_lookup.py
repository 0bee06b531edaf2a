"""Static attribute lookup: the value Python would find for `obj.name`, found without running the program's code.

The observer names what a read site reads (read_sites.py) by evaluating its source in the running frame; it must not run
descriptors, `__getattr__` or `__repr__` of the program (they would run twice, or import modules mid-trace), so
properties and dynamic attributes are left to the observer of the code that computes them.
"""

from __future__ import annotations

import _string
import functools
import itertools
import string
import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fulmen.observation import read_sites
from fulmen.observation.value_checks import MISSING

IMMUTABLE = (int, float, bool, str, bytes, complex, tuple, frozenset, range, slice, torch.device, torch.dtype,
              torch.Size, type(None))


def class_lookup(cls: type, name: str) -> tuple[int, Any] | None:
    for index, klass in enumerate(cls.__mro__):
        namespace = klass.__dict__
        if name in namespace:
            return index, namespace[name]
    return None


def is_data_descriptor(raw: Any) -> bool:
    kind = type(raw)
    return class_lookup(kind, "__set__") is not None or class_lookup(kind, "__delete__") is not None


def is_descriptor(raw: Any) -> bool:
    return class_lookup(type(raw), "__get__") is not None


def instance_dict(obj: Any) -> dict | None:
    """`obj.__dict__` found without running the program's code (no `__getattr__`)."""
    found = class_lookup(type(obj), "__dict__")
    if found is None or type(found[1]) is not types.GetSetDescriptorType:
        return None
    state = found[1].__get__(obj, type(obj))
    return state if type(state) is dict else None


def slot_value(descriptor: Any, obj: Any) -> Any:
    try:
        return descriptor.__get__(obj, type(obj))
    except AttributeError:  # an empty slot
        return MISSING


def cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return MISSING


MODULE_SLOTS = ("_parameters", "_buffers", "_modules")


def attribute_value(obj: Any, name: str) -> Any:
    """`getattr(obj, name)` where it needs no code of the program to run (else MISSING)."""
    kind = type(obj)
    if issubclass(kind, types.ModuleType):
        return obj.__dict__.get(name, MISSING)
    if issubclass(kind, type):
        found = class_lookup(obj, name)
        if found is None:
            return MISSING
        raw = found[1]
        if type(raw) in (classmethod, staticmethod):
            return raw.__get__(None, obj)
        # a function, or a slot of a C class (`object.__setattr__`), is itself when read off the class
        return raw if type(raw) in (types.FunctionType, types.WrapperDescriptorType) or not is_descriptor(raw) \
            else MISSING
    found = class_lookup(type(obj), name)
    if found is not None and is_data_descriptor(found[1]):
        return slot_value(found[1], obj) if type(found[1]) is types.MemberDescriptorType else MISSING
    state = instance_dict(obj)
    if state is not None and name in state:
        return state[name]
    if found is not None:
        raw = found[1]
        return raw.__get__(obj, type(obj)) if type(raw) is types.FunctionType else (
            raw if not is_descriptor(raw) else MISSING)
    if issubclass(type(obj), nn.Module) and state is not None:
        for slot in MODULE_SLOTS:
            if name in state.get(slot, ()):
                return state[slot][name]
    return MISSING


EMPTY: Mapping[Any, Any] = types.MappingProxyType({})
_PLAIN_KEYS = frozenset({str, int, bool, bytes, float, type(None)})


def evaluate(source: read_sites.Source, frame: types.FrameType, results: Mapping[tuple[int, int], Any] = EMPTY) -> Any:
    """The value `source` names in `frame`, found without running any of the program's code (else MISSING).
    `results`: what Python code the observer expected gave at an instruction of a frame (read_sites.Capture), by
    (id(frame), offset)."""
    kind = type(source)
    if kind is read_sites.Local or kind is read_sites.Cell:
        return frame.f_locals.get(source.name, MISSING)
    if kind is read_sites.Global:
        value = frame.f_globals.get(source.name, MISSING)
        return frame.f_builtins.get(source.name, MISSING) if value is MISSING else value
    if kind is read_sites.Const:
        return source.value
    if kind is read_sites.Result:
        return results.get((id(frame), source.offset), MISSING)
    base = evaluate(source.base, frame, results)
    if base is MISSING:
        return MISSING
    if kind is read_sites.Attr or kind is read_sites.Method:
        value = attribute_value(base, source.name)
        if value is MISSING and kind is read_sites.Attr and source.offset >= 0:
            return results.get((id(frame), source.offset), MISSING)  # a getter's (a property's) answer
        return value
    key = evaluate(source.key, frame, results)
    if type(base) is dict and (type(key) in _PLAIN_KEYS or type(key) is tuple and all(type(k) in _PLAIN_KEYS
                                                                                           for k in key)):
        # hashed and compared by C code only
        return base.get(key, MISSING)
    if type(base) in (list, tuple) and type(key) is int and -len(base) <= key < len(base):
        return base[key]
    return MISSING


def owner_name(obj: Any) -> str:
    if issubclass(type(obj), types.ModuleType):
        return f"module {obj.__name__}"
    if issubclass(type(obj), type):
        return f"class {obj.__qualname__}"
    return f"{type(obj).__qualname__} object"


def object_state(obj: Any) -> tuple[dict | None, tuple]:
    """All an object holds, as a copy reads it: its `__dict__` (None without one) and the values of its slots."""
    return instance_dict(obj), tuple(slot_value(slot, obj) for slot in _slots(type(obj)))


@functools.lru_cache(maxsize=1024)  # bounded: classes made at run time (the descriptors hold them: not weak)
def _slots(cls: type) -> tuple[Any, ...]:
    return tuple(value for klass in cls.__mro__ for value in vars(klass).values()
                 if type(value) is types.MemberDescriptorType)


def is_shadow(obj: Any) -> bool:
    """A shadow module of module_inputs.py (its reads are reported by the module tap)."""
    state = instance_dict(obj)
    return state is not None and "_fulmen_original" in state


def python_code(function: Any) -> types.CodeType | None:
    """The code a call of `function` runs first, if it is a Python function or a method of one (behind an
    lru_cache, on a miss)."""
    if type(function) is types.MethodType:
        function = function.__func__
    if type(function) is functools._lru_cache_wrapper:
        function = getattr(function, "__wrapped__", None)
    return function.__code__ if type(function) is types.FunctionType else None


def getter_code(receiver: Any, name: str) -> types.CodeType | None:
    """The Python code that answers `receiver.name`, where none of the program's code can be skipped to read it
    (attribute_value): a property's getter, a Python descriptor's `__get__`, the class's `__getattr__`."""
    if receiver is MISSING or issubclass(type(receiver), type):
        return None
    cls = type(receiver)
    found = class_lookup(cls, name)
    raw = None if found is None else found[1]
    if type(raw) is property:
        return python_code(raw.fget)
    state = instance_dict(receiver)
    if raw is not None and (is_data_descriptor(raw) or state is None or name not in state):
        return python_code(getattr(type(raw), "__get__", None))
    if raw is None and (state is None or name not in state):
        fallback = class_lookup(cls, "__getattr__")
        return None if fallback is None else python_code(fallback[1])
    return None


@functools.lru_cache(maxsize=1024)  # bounded: a program may build its templates at run time
def template_fields(template: str) -> tuple[tuple[int, tuple[tuple[bool, Any], ...]], ...]:
    """The positional fields of a `str.format` template that read more than the argument itself: (argument index,
    (is an attribute, name or key) steps), nested fields of format specs included; keyword fields are left out (no
    read site names keyword arguments)."""
    found: list[tuple[int, tuple[tuple[bool, Any], ...]]] = []
    automatic = itertools.count()  # `{}` fields are numbered in order, a spec's nested fields after their own field

    def scan(text: str) -> None:
        for _, field, spec, _ in string.Formatter().parse(text):
            if field is not None:
                first, rest = _string.formatter_field_name_split(field)
                first = next(automatic) if first == "" else first
                steps = tuple(rest)
                if type(first) is int and steps:
                    found.append((first, steps))
            if spec and "{" in spec:
                scan(spec)

    try:
        scan(template)
    except ValueError:
        return ()  # format raises on it: nothing is read
    return tuple(found)
