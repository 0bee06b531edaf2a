"""How a guard compares a value read during acquisition with the value a later call finds: one rule per kind (and
`unrepeatable`: the functions whose value no later call could find again, clocks and global random draws).

The cheapest exact check per kind: identity for objects whose identity is what the program sees (modules,
functions, classes, tensors, user objects), type plus equality for plain values, with floats compared so that
`-0.0` differs from `0.0` and `nan` equals `nan`. Containers are compared item by item, so a list changed in place
fails its guard. A tensor read as a Python value (a global weight) is compared by identity and metadata; its
values are trace inputs. A NumPy array by identity, dtype, shape and (up to 64 KiB) its bytes. Proxies are the
trace's own values and need no guard.

Checks are emitted as Python expressions over bound names (see `Emitter`) and compiled into one function per
cache entry (guards.compile_check), so a hit evaluates them without interpretive overhead.
"""

from __future__ import annotations

import collections
import enum
import itertools
import math
import os
import random
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fulmen.core.proxies import TensorProxy

MISSING = type("Missing", (), {"__repr__": lambda self: "<missing>"})()
_EQUAL_TYPES = (int, str, bytes, range, slice, torch.device, complex)
_SEQUENCES = (tuple, list, torch.Size)
_MAPPINGS = (dict, collections.OrderedDict)
_SETS = (set, frozenset)
_LEAF_BUDGET = 256  # items beyond this are compared by a generic function instead of generated code
_names = itertools.count()


def tensor_meta(t: torch.Tensor) -> tuple:
    """What a trace assumes about a tensor beyond its values: layout included (views, reshape, in-place updates and
    kernels choices depend on strides and the storage offset)."""
    return (t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad)


class Emitter:
    """Gives the constants and temporaries of generated checks process-unique names, so checks combine freely."""

    def __init__(self) -> None:
        self.bindings: dict[str, Any] = {}

    def bind(self, value: Any) -> str:
        name = f"_v{next(_names)}"
        self.bindings[name] = value
        return name

    @staticmethod
    def temp() -> str:
        return f"_t{next(_names)}"


def value_check(expr: str, value: Any, emit: Emitter) -> str | None:
    """A boolean expression that holds when `expr` evaluates to a value equivalent to `value`; None when no check
    is needed (a proxy)."""
    budget = [_LEAF_BUDGET]
    return _check(expr, value, emit, budget, set())


def _check(expr: str, value: Any, emit: Emitter, budget: list[int], seen: set[int]) -> str | None:
    kind = type(value)
    budget[0] -= 1
    if kind is TensorProxy:
        return None
    if value is None or kind is bool or value is Ellipsis or value is MISSING:
        return f"{expr} is {emit.bind(value)}"
    if kind is float:
        return _float_check(expr, value, emit)
    if kind in _EQUAL_TYPES:
        t = emit.temp()
        return f"(type({t} := {expr}) is {emit.bind(kind)} and {t} == {emit.bind(value)})"
    if issubclass(kind, torch.Tensor):
        t = emit.temp()
        meta = emit.bind(tensor_meta(value))
        return f"(({t} := {expr}) is {emit.bind(value)} and {emit.bind(tensor_meta)}({t}) == {meta})"
    if kind is types.MethodType:
        t = emit.temp()
        return (f"(type({t} := {expr}) is {emit.bind(kind)} and {t}.__self__ is {emit.bind(value.__self__)} "
                f"and {t}.__func__ is {emit.bind(value.__func__)})")
    if kind in _SEQUENCES or kind in _MAPPINGS or kind in _SETS:
        if id(value) in seen or budget[0] < 0 or len(value) > budget[0]:
            return f"{emit.bind(same_as)}({expr}, {emit.bind(snapshot(value))})"
        return _container_check(expr, value, emit, budget, seen | {id(value)})
    if _is_ndarray(kind):
        return f"{emit.bind(same_array)}({expr}, {emit.bind(value)}, {emit.bind(array_state(value))})"
    return f"{expr} is {emit.bind(value)}"


# A NumPy array is compared by identity, dtype, shape and, up to this size, its bytes (a table the program indexes
# and changes in place); a larger one by the first three only (a known limit: comparing it would cost every call).
_ARRAY_BYTES = 1 << 16


def _is_ndarray(kind: type) -> bool:
    return kind.__name__ == "ndarray" and kind.__module__ == "numpy"  # numpy is not imported unless the program does


def array_state(array: Any) -> tuple:
    content = None if array.dtype.hasobject or array.nbytes > _ARRAY_BYTES else array.tobytes()
    return (array.dtype, array.shape, content)


@dataclass(frozen=True, slots=True)
class _Array:
    """A NumPy array in a snapshot, with what it held."""

    array: Any
    state: tuple


def same_array(current: Any, array: Any, state: tuple) -> bool:
    if current is not array or current.dtype != state[0] or current.shape != state[1]:
        return False
    return state[2] is None or current.tobytes() == state[2]


def _float_check(expr: str, value: float, emit: Emitter) -> str:
    t = emit.temp()
    if math.isnan(value):
        return f"(type({t} := {expr}) is float and {t} != {t})"
    if value == 0.0:
        return (f"(type({t} := {expr}) is float and {t} == 0.0 and "
                f"{emit.bind(math.copysign)}(1.0, {t}) == {math.copysign(1.0, value)!r})")
    return f"(type({t} := {expr}) is float and {t} == {emit.bind(value)})"


def _container_check(expr: str, value: Any, emit: Emitter, budget: list[int], seen: set[int]) -> str:
    t = emit.temp()
    kind = type(value)
    if not value:
        return f"(type({t} := {expr}) is {emit.bind(kind)} and not {t})"
    parts = [f"type({t} := {expr}) is {emit.bind(kind)}", f"len({t}) == {len(value)}"]
    if kind in _SETS:
        parts.append(f"{t} == {emit.bind(frozenset(value))}")
        return "(" + " and ".join(parts) + ")"
    if kind in _MAPPINGS:
        parts.append(f"tuple({t}) == {emit.bind(tuple(value))}")  # key order: iteration order is program-visible
        items = ((f"{t}[{emit.bind(key)}]", item) for key, item in value.items())
    else:
        items = ((f"{t}[{i}]", item) for i, item in enumerate(value))
    for item_expr, item in items:
        check = _check(item_expr, item, emit, budget, seen)
        if check is not None:
            parts.append(check)
    return "(" + " and ".join(parts) + ")"


# --- the same comparison, interpreted: for containers too large to generate a check for ---------------------------
def snapshot(value: Any, seen: frozenset[int] = frozenset()) -> Any:
    """A copy of the container structure of `value` (leaves kept as they are) to compare later values with."""
    kind = type(value)
    if id(value) in seen:
        return value
    inner = seen | {id(value)}
    if kind in _SEQUENCES:
        return (kind, tuple(snapshot(item, inner) for item in value))
    if kind in _MAPPINGS:
        return (kind, tuple((key, snapshot(item, inner)) for key, item in value.items()))
    if kind in _SETS:
        return (kind, frozenset(value))
    if _is_ndarray(kind):
        return _Array(value, array_state(value))
    return value


def same_as(current: Any, snap: Any) -> bool:
    """`current` is equivalent to the value `snapshot` captured (the rules of `value_check`)."""
    if type(snap) is tuple and len(snap) == 2 and isinstance(snap[0], type):
        kind, items = snap
        if type(current) is not kind or len(current) != len(items):
            return False
        if kind in _SETS:
            return current == items
        if kind in _MAPPINGS:
            return tuple(current) == tuple(k for k, _ in items) and all(
                same_as(current[k], item) for k, item in items)
        return all(same_as(c, item) for c, item in zip(current, items))
    return same_value(current, snap)


def same_value(current: Any, value: Any) -> bool:
    kind = type(value)
    if kind is TensorProxy:
        return True
    if kind is float:
        return type(current) is float and (current == value and math.copysign(1.0, current) == math.copysign(1.0, value)
                                           or current != current and value != value)
    if kind in _EQUAL_TYPES:
        return type(current) is kind and current == value
    if issubclass(kind, torch.Tensor):
        return current is value and tensor_meta(current) == tensor_meta(value)
    if kind is types.MethodType:
        return type(current) is kind and current.__self__ is value.__self__ and current.__func__ is value.__func__
    if kind in _SEQUENCES or kind in _MAPPINGS or kind in _SETS:
        return same_as(current, snapshot(value))
    if kind is _Array:
        return same_array(current, value.array, value.state)
    return current is value


_PRINTABLE = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size, range)


# (a symbolic size of a trace is stored again as the int the traced call had: fulmen.jit.dynamic_shapes.settled)
_IMMUTABLE_LEAVES = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size, range,
                     slice, torch.SymInt, torch.SymFloat, torch.SymBool)


def immutable(value: Any) -> bool:
    """Nothing can change the value in place (an enum member counts: it is a singleton)."""
    kind = type(value)
    if kind in _IMMUTABLE_LEAVES or isinstance(value, enum.Enum):
        return True
    return (kind is tuple or kind is frozenset) and all(immutable(item) for item in value)


def describe(value: Any, limit: int = 60) -> str:
    """A short description that runs none of the program's code (no user `__repr__`)."""
    kind = type(value)
    if kind in _PRINTABLE:
        text = repr(value)
    elif kind in _SEQUENCES or kind in _SETS:
        text = f"{kind.__name__} of {len(value)}: " + ", ".join(describe(v, 20) for v in list(value)[:4])
    elif kind in _MAPPINGS:
        text = f"{kind.__name__} of {len(value)} keys"
    elif kind is types.FunctionType or issubclass(kind, type):
        text = f"{kind.__name__} {value.__qualname__}"
    elif issubclass(kind, torch.Tensor):
        text = f"tensor {tuple(value.shape)} {value.dtype}"
    else:
        text = f"<{kind.__qualname__} object at {id(value):#x}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def compile_statements(body: list[str], bindings: dict[str, Any], missing: Any = False) -> Callable[[], Any]:
    """A function of no arguments running `body`, whose free names are closure cells holding `bindings` (a cell
    read costs what a local read does, and nothing is filled in per call). Checks index dicts directly: a key that
    is gone (an attribute deleted) answers `missing`."""
    names = ", ".join(bindings)
    lines = "".join(f"            {line}\n" for line in body)
    code = (f"def _make({names}):\n    def check():\n        try:\n{lines}        except KeyError:\n"
            f"            return {missing!r}\n    return check\n")
    namespace: dict[str, Any] = {}
    exec(compile(code, "<fulmen guards>", "exec"), namespace)  # noqa: S102 - our own generated expression
    return namespace["_make"](**bindings)


# Functions whose every call gives a new value (a trace would repeat one): clocks and entropy.
_CLOCKS = frozenset({time.time, time.time_ns, time.perf_counter, time.perf_counter_ns, time.monotonic,
                     time.monotonic_ns, time.process_time, time.process_time_ns, os.urandom})


def unrepeatable(value: Any) -> str | None:
    """The name of `value` if it is a function giving a new value on every call: a draw from Python's or NumPy's
    global random generator (a generator the program seeds and creates itself repeats its draws), a clock."""
    kind = type(value)
    if kind is not types.BuiltinFunctionType and kind is not types.MethodType:
        return None
    if kind is types.BuiltinFunctionType and value in _CLOCKS:
        return f"{'os' if value is os.urandom else 'time'}.{value.__name__}"
    owner = value.__self__
    if owner is random._inst:
        return f"random.{value.__name__}"
    mtrand = sys.modules.get("numpy.random.mtrand")
    if mtrand is not None and owner is getattr(mtrand, "_rand", None):
        return f"numpy.random.{value.__name__}"
    return None
