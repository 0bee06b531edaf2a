"""Nested values: one container rule for every walk in fulmen, and flattening of program inputs and outputs.

Which objects are containers is torch's pytree's answer (`torch.utils._pytree`: tuples, lists, dicts, namedtuples,
torch.return_types structseqs, OrderedDict, ... and whatever a library registered there), plus other tuple and list
subclasses (torch.Size), walked as plain sequences. `children`, `leaves` and `tree_map` are the walks over it (the
proxies of a call's arguments and outputs, the symbols passed as data, the real tensors a program captured).

Flattening program inputs and outputs: tuples, lists, dicts (OrderedDict and defaultdict too), namedtuples,
dataclasses, torch structseqs; another dict subclass holding tensors is refused (kept by identity, they would go stale).

A flattened structure is (leaves, spec). Tensors are leaves; every other leaf (ints, strings, dtypes, ...) is
kept in the spec, so the spec is a hashable cache key that specialises on Python values. Floats are kept by their
exact bits (`float.hex`), so `-0.0` and `0.0` are different keys and `nan` is equal to itself.

Outputs may also hold other objects with tensors in their attributes (a KV cache): flattened with `objects`, such an
object becomes an OBJECT spec, and unflattening copies it with the new tensors in place of the old ones, so every
call returns a fresh object holding its own tensors.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree


class _Handlers(dict):
    """type -> torch's pytree node handler (None: not a container), asked once per type (the walks are hot) and
    asked again after a library registers a new node type."""

    registered = 0

    def of(self, obj: Any) -> Any:
        if self.registered != len(_pytree.SUPPORTED_NODES):
            self.clear()
            self.registered = len(_pytree.SUPPORTED_NODES)
        kind = type(obj)
        try:
            return self[kind]
        except KeyError:
            handler = self[kind] = _pytree.SUPPORTED_NODES.get(_pytree._get_node_type(obj))
            return handler


_HANDLERS = _Handlers()


def children(obj: Any) -> Sequence[Any] | None:
    """The items of `obj` if it is a container (see above), else None."""
    kind = type(obj)
    if kind is tuple or kind is list:
        return obj
    if kind is dict:
        return list(obj.values())
    handler = _HANDLERS.of(obj)
    if handler is not None:
        return handler.flatten_fn(obj)[0]
    return obj if isinstance(obj, (tuple, list)) else None


def is_leaf(obj: Any) -> bool:
    """Not a container."""
    return type(obj) in _ATOMS or children(obj) is None


_ATOMS = frozenset({int, float, bool, str, complex, type(None), torch.dtype, torch.device})  # never containers


def leaves(obj: Any, is_leaf: Callable[[Any], bool]) -> Iterator[Any]:
    """The objects inside `obj` for which `is_leaf` holds, depth first (a leaf is not looked into)."""
    if is_leaf(obj):
        yield obj
        return
    kind = type(obj)
    if kind is tuple or kind is list:
        items: Any = obj
    elif kind is dict:
        items = obj.values()
    elif kind in _ATOMS or (items := children(obj)) is None:
        return
    for item in items:
        yield from leaves(item, is_leaf)


def tree_map(fn: Callable[[Any], Any], obj: Any, is_leaf: Callable[[Any], bool]) -> Any:
    """`obj` with each leaf replaced by `fn(leaf)`, every container rebuilt as its own type."""
    if is_leaf(obj):
        return fn(obj)
    kind = type(obj)
    if kind in _ATOMS:
        return obj
    if kind is tuple:
        return tuple([tree_map(fn, item, is_leaf) for item in obj])
    if kind is list:
        return [tree_map(fn, item, is_leaf) for item in obj]
    if kind is dict:
        return {key: tree_map(fn, value, is_leaf) for key, value in obj.items()}
    handler = _HANDLERS.of(obj)
    if handler is not None:
        items, context = handler.flatten_fn(obj)
        return handler.unflatten_fn([tree_map(fn, item, is_leaf) for item in items], context)
    if isinstance(obj, (tuple, list)):  # an unregistered subclass (torch.Size): rebuilt as the plain sequence
        items = [tree_map(fn, item, is_leaf) for item in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj

TENSOR = "T"  # marks a tensor leaf's position inside a spec
OBJECT = "object"  # (OBJECT, id of the template object, attribute names, their specs)


def _const(obj: Any) -> Any:
    kind = type(obj)
    if kind is float:
        return ("f", obj.hex())
    if kind is complex:
        return ("c", obj.real.hex(), obj.imag.hex())
    try:
        hash(obj)
    except TypeError:
        return ("id", id(obj), type(obj).__qualname__)  # unhashable: specialised on the object's identity
    return ("v", type(obj), obj)


def flatten(obj: Any, leaves: list[torch.Tensor], objects: dict[int, Any] | None = None) -> Any:
    """Appends the tensors in `obj` to `leaves`; returns the spec. With `objects`, other objects holding tensors in
    their attributes are flattened too (and kept there by id, as templates)."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return TENSOR
    kind = type(obj)
    if kind is tuple or kind is list:
        return (kind, tuple(flatten(item, leaves, objects) for item in obj))
    if kind is dict or kind is collections.OrderedDict:
        return (kind, tuple(obj.keys()), tuple(flatten(value, leaves, objects) for value in obj.values()))
    if kind is collections.defaultdict:
        return (kind, obj.default_factory, tuple(obj.keys()),
                tuple(flatten(value, leaves, objects) for value in obj.values()))
    if isinstance(obj, tuple) and (hasattr(kind, "_fields") or hasattr(kind, "n_fields")):
        return (kind, tuple(flatten(item, leaves, objects) for item in obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = tuple(f.name for f in dataclasses.fields(obj))
        return (kind, names, tuple(flatten(getattr(obj, name), leaves, objects) for name in names))
    if isinstance(obj, dict) and not dataclasses.is_dataclass(obj) and any(map(holds_tensors, obj.values())):
        # kept by identity, its tensors would be captured as they are now and go stale on the next call
        raise TypeError(f"fulmen.jit takes tensors inside a dict, OrderedDict or defaultdict, not inside a "
                        f"{kind.__qualname__}; pass dict(value)")
    if objects is not None and holds_tensors(obj):
        if id(obj) in objects:
            raise TypeError(f"fulmen cannot return a {kind.__qualname__} (an object holding tensors) that appears "
                            "twice in the outputs or refers to itself")
        names = tuple(name for name, value in attributes(obj) if holds_tensors(value))
        objects[id(obj)] = obj
        return (OBJECT, id(obj), names, tuple(flatten(getattr(obj, name), leaves, objects) for name in names))
    return _const(obj)


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType, torch.nn.Module,
           str, bytes, int, float, bool, complex, torch.dtype, torch.device)


def attributes(obj: Any, modules: bool = False) -> Iterator[tuple[str, Any]]:
    """The instance attributes of a plain Python object (its `__dict__` and `__slots__`); none for classes,
    functions and values, nor for modules unless `modules`."""
    if modules and isinstance(obj, torch.nn.Module):
        for name, value in vars(obj).items():
            if name in ("_parameters", "_buffers", "_modules"):
                yield from value.items()
            else:
                yield name, value
        return
    if isinstance(obj, _OPAQUE) or obj is None:
        return
    yield from getattr(obj, "__dict__", {}).items()
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                yield name, getattr(obj, name)


def holds_tensors(obj: Any) -> bool:
    """Whether a tensor is reachable from `obj` through containers and object attributes (modules excluded)."""
    return find(obj, lambda item: isinstance(item, torch.Tensor), modules=False) is not None


def find(obj: Any, predicate: Any, path: str = "", modules: bool = True, _seen: set[int] | None = None) -> str | None:
    """The path (`.layers[0].keys`) to the first object inside `obj` (through containers, object attributes and,
    with `modules`, module attributes) that satisfies `predicate`."""
    if predicate(obj):
        return path
    seen = set() if _seen is None else _seen
    if id(obj) in seen:
        return None
    seen.add(id(obj))
    if isinstance(obj, (tuple, list)):
        items = ((f"{path}[{i}]", item) for i, item in enumerate(obj))
    elif isinstance(obj, dict):
        items = ((f"{path}[{key!r}]", item) for key, item in obj.items())
    else:
        items = ((f"{path}.{name}", value) for name, value in attributes(obj, modules))
    for where, item in items:
        found = find(item, predicate, where, modules, seen)
        if found is not None:
            return found
    return None


def unflatten(spec: Any, leaves: Any, originals: Any = None) -> Any:
    """Rebuilds a structure from `spec`, taking tensors from the iterator `leaves`."""
    return _build(spec, iter(leaves), originals)


def _build(spec: Any, leaves, originals) -> Any:
    if spec == TENSOR:
        return next(leaves)
    kind = spec[0]
    if kind == "v":
        return spec[2]
    if kind == "f":
        return float.fromhex(spec[1])
    if kind == "c":
        return complex(float.fromhex(spec[1]), float.fromhex(spec[2]))
    if kind == "id":
        return originals[spec[1]]
    if kind == OBJECT:
        made = copy.copy(originals[spec[1]])
        for name, child in zip(spec[2], spec[3]):
            object.__setattr__(made, name, _build(child, leaves, originals))
        return made
    if kind is tuple or kind is list:
        return kind(_build(item, leaves, originals) for item in spec[1])
    if kind is dict or kind is collections.OrderedDict:
        return kind(zip(spec[1], (_build(item, leaves, originals) for item in spec[2])))
    if kind is collections.defaultdict:
        made = collections.defaultdict(spec[1])
        made.update(zip(spec[2], (_build(item, leaves, originals) for item in spec[3])))
        return made
    if hasattr(kind, "n_fields"):
        return kind([_build(item, leaves, originals) for item in spec[1]])
    if hasattr(kind, "_fields"):
        return kind(*(_build(item, leaves, originals) for item in spec[1]))
    return kind(**dict(zip(spec[1], (_build(item, leaves, originals) for item in spec[2]))))


def identity_objects(obj: Any, found: dict[int, Any]) -> None:
    """Collects the unhashable non-tensor leaves of `obj` by id (specs refer to them by identity)."""
    if isinstance(obj, torch.Tensor):
        return
    if isinstance(obj, (tuple, list)):
        for item in obj:
            identity_objects(item, found)
    elif type(obj) in (dict, collections.OrderedDict, collections.defaultdict):
        for item in obj.values():
            identity_objects(item, found)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            identity_objects(getattr(obj, f.name), found)
    else:
        try:
            hash(obj)
        except TypeError:
            found[id(obj)] = obj
