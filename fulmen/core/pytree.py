"""Nested values: fulmen's one container rule, the walks over it, and the flattening of program inputs and outputs.

The rule (a `Node` per type, made once by `_make_node`) says which objects are containers, how to open and rebuild
them and what their items' keys are:
- a dataclass instance: its fields, keyed by name, rebuilt by calling the class with them. Dataclasses come first:
  transformers registers its ModelOutput dataclasses with torch's pytree too, and their fields are what a program
  names;
- whatever torch's pytree opens (`torch.utils._pytree`: tuples, lists, dicts, OrderedDict, defaultdict, deque,
  namedtuples, torch.return_types structseqs, torch.Size, ... and whatever a library registered there), rebuilt as
  torch rebuilds it (torch.Size as a plain tuple); keyed by position in a sequence (namedtuples too), by key in a
  mapping, else by torch's keys;
- another tuple or list subclass: walked as the plain sequence, and rebuilt as one.
Nothing else is a container (another dict subclass included). Walks that give back the types they were given
(program inputs and outputs, checkpoints) keep a tuple, list or dict that the rule does not rebuild as its own type
whole (`kept_whole`: torch.Size, a library's dict), and refuse it when it holds tensors (kept whole, its tensors would
be captured as they are).

The walks: `children`, `leaves` and `tree_map` (hot: the proxies of every call's arguments and outputs, the symbols
passed as data, the real tensors a program captured); `leaves_with_paths` and `tree_map_with_paths`, which carry the
keys from the root (the names of a program's inputs, a checkpoint's tensors); `flatten` and `unflatten`.

A flattened structure is (leaves, spec). Tensors are leaves; every other leaf (ints, strings, dtypes, ...) is
kept in the spec, so the spec is a hashable cache key that specialises on Python values. Floats are kept by their
exact bits (`float.hex`), so `-0.0` and `0.0` are different keys and `nan` is equal to itself; unhashable values by
identity.

Outputs may also hold other objects with tensors in their attributes (a KV cache): flattened with `objects`, such an
object becomes an OBJECT spec, and unflattening copies it with the new tensors in place of the old ones, so every
call returns a fresh object holding its own tensors.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree

KeyPath = tuple  # the keys from the root to an item: positions, mapping keys, field names


@dataclasses.dataclass(frozen=True, slots=True)
class Node:
    """How the rule opens and rebuilds the containers of one type."""

    flatten: Callable[[Any], tuple[list[Any], Any]]  # container -> (items, context)
    unflatten: Callable[[list[Any], Any], Any]  # (items, context) -> a new container
    keys: Callable[[Any, list[Any], Any], Iterable[Any]]  # (container, items, context) -> the items' keys
    same_type: bool = True  # False: rebuilt as another type (torch.Size as a tuple, a tuple subclass as a tuple)
    fields: bool = False  # a dataclass


def _positions(obj: Any, items: list[Any], context: Any) -> Iterable[int]:
    return range(len(items))


def _mapping_keys(obj: Any, items: list[Any], context: Any) -> Iterable[Any]:
    return obj.keys()


def _field_names(obj: Any, items: list[Any], names: tuple[str, ...]) -> Iterable[str]:
    return names


def _torch_keys(handler: Any, obj: Any, items: list[Any], context: Any) -> Iterable[Any]:
    """Torch's key entries (`MappingKey`, `SequenceKey`, `GetAttrKey`) as the plain keys they hold."""
    entries = (entry for entry, _ in handler.flatten_with_keys_fn(obj)[0])
    return [getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", entry))) for entry in entries]


def _make_node(kind: type, sample: Any) -> Node | None:
    """`sample`: an instance, to see whether torch's pytree rebuilds the type as itself (it rebuilds torch.Size as a
    plain tuple); None: assumed so (only rebuilding a spec asks without an instance)."""
    if dataclasses.is_dataclass(kind):
        names = tuple(field.name for field in dataclasses.fields(kind))
        return Node(lambda obj: ([getattr(obj, name) for name in names], names),
                    lambda items, names: kind(**dict(zip(names, items))), _field_names, fields=True)
    handler = _pytree.SUPPORTED_NODES.get(_pytree.namedtuple if _pytree.is_namedtuple_class(kind) else kind)
    if handler is not None:
        if issubclass(kind, (tuple, list)):
            keys: Callable[[Any, list[Any], Any], Iterable[Any]] = _positions
        elif issubclass(kind, dict):
            keys = _mapping_keys
        elif handler.flatten_with_keys_fn is not None:
            keys = functools.partial(_torch_keys, handler)
        else:
            keys = _positions
        same_type = sample is None or type(handler.unflatten_fn(*handler.flatten_fn(sample))) is kind
        return Node(handler.flatten_fn, handler.unflatten_fn, keys, same_type)
    if issubclass(kind, (tuple, list)):
        plain = tuple if issubclass(kind, tuple) else list
        return Node(lambda obj: (list(obj), None), lambda items, _: plain(items), _positions, same_type=False)
    return None


class _Nodes(dict):
    """type -> its Node (None: not a container), made once per type (the walks are hot) and made again after a
    library registers a new node type with torch's pytree."""

    registered = 0

    def of(self, obj: Any) -> Node | None:
        kind = type(obj)
        if self.registered != len(_pytree.SUPPORTED_NODES):
            self.clear()
            self.registered = len(_pytree.SUPPORTED_NODES)
        try:
            return self[kind]
        except KeyError:
            found = self[kind] = _make_node(kind, obj)
            return found


_NODES = _Nodes()


def children(obj: Any) -> Sequence[Any] | None:
    """The items of `obj` if it is a container, else None."""
    kind = type(obj)
    if kind is tuple or kind is list:
        return obj
    if kind is dict:
        return list(obj.values())
    found = _NODES.of(obj)
    return None if found is None else found.flatten(obj)[0]


def keyed_children(obj: Any) -> list[tuple[Any, Any]] | None:
    """The (key, item) pairs of `obj` if it is a container, else None."""
    found = _NODES.of(obj)
    if found is None:
        return None
    items, context = found.flatten(obj)
    return list(zip(found.keys(obj, items, context), items))


def is_leaf(obj: Any) -> bool:
    """Not a container."""
    return type(obj) in _ATOMS or children(obj) is None


_ATOMS = frozenset({int, float, bool, str, complex, type(None), torch.dtype, torch.device})  # never containers


def kept_whole(obj: Any) -> bool:
    """A tuple, list or dict the rule does not rebuild as its own type (torch.Size, an unregistered subclass)."""
    if not isinstance(obj, (tuple, list, dict)):
        return False
    found = _NODES.of(obj)
    return found is None or not found.same_type


def refuse_tensors_kept_whole(obj: Any, who: str) -> None:
    """Raises when `obj` is kept whole (see above) and holds tensors."""
    if kept_whole(obj) and holds_tensors(obj):
        plain = next(kind for kind in (dict, list, tuple) if isinstance(obj, kind))
        raise TypeError(f"{who} takes tensors inside dicts (OrderedDict, defaultdict), lists, tuples (namedtuples), "
                        f"dataclasses and the types registered with torch's pytree, not inside a "
                        f"{type(obj).__qualname__}; pass {plain.__name__}(value)")


def leaves(obj: Any, is_leaf: Callable[[Any], bool]) -> Iterator[Any]:
    """The objects inside `obj` for which `is_leaf` holds, depth first (a leaf is not looked into). Collected into
    a list by plain recursion, then iterated: nested generators cost a frame resumption per level and leaf, and every
    recorded call's arguments and outputs are walked (a third of autodiff's own time for a 22-layer model)."""
    found: list[Any] = []
    _collect(obj, is_leaf, found)
    return iter(found)


def _collect(obj: Any, is_leaf: Callable[[Any], bool], found: list[Any]) -> None:
    if is_leaf(obj):
        found.append(obj)
        return
    kind = type(obj)
    if kind is tuple or kind is list:
        items: Any = obj
    elif kind is dict:
        items = obj.values()
    elif kind in _ATOMS or (items := children(obj)) is None:
        return
    for item in items:
        _collect(item, is_leaf, found)


def leaves_with_paths(obj: Any, is_leaf: Callable[[Any], bool], path: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """(path, leaf) for the objects inside `obj` for which `is_leaf` holds, depth first."""
    if is_leaf(obj):
        yield path, obj
        return
    for key, item in keyed_children(obj) or ():
        yield from leaves_with_paths(item, is_leaf, (*path, key))


def _rebuilt(found: Node, obj: Any, items: list[Any], mapped: list[Any], context: Any,
             is_leaf: Callable[[Any], bool]) -> Any:
    if found.fields and list(map(id, leaves(mapped, is_leaf))) == list(map(id, leaves(items, is_leaf))):
        return obj  # a dataclass (a model's config passed to a call) keeps its identity unless a leaf in it changed
    return found.unflatten(mapped, context)


def tree_map(fn: Callable[[Any], Any], obj: Any, is_leaf: Callable[[Any], bool]) -> Any:
    """`obj` with each leaf replaced by `fn(leaf)`, every container rebuilt as the rule rebuilds it."""
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
    found = _NODES.of(obj)
    if found is None:
        return obj
    items, context = found.flatten(obj)
    return _rebuilt(found, obj, items, [tree_map(fn, item, is_leaf) for item in items], context, is_leaf)


def tree_map_with_paths(fn: Callable[[KeyPath, Any], Any], obj: Any, is_leaf: Callable[[Any], bool],
                        path: KeyPath = ()) -> Any:
    """`obj` with each leaf replaced by `fn(path, leaf)`."""
    if is_leaf(obj):
        return fn(path, obj)
    found = _NODES.of(obj)
    if found is None:
        return obj
    items, context = found.flatten(obj)
    mapped = [tree_map_with_paths(fn, item, is_leaf, (*path, key))
              for key, item in zip(found.keys(obj, items, context), items)]
    return _rebuilt(found, obj, items, mapped, context, is_leaf)


TENSOR = "T"  # marks a tensor leaf's position inside a spec
OBJECT = "object"  # (OBJECT, id of the template object, attribute names, their specs)


# Containers a spec holds whole (sets; list and dict subclasses without a pytree registration): the program reads
# them through C methods (`in`, `len`, `.get`) that no guard observes, so their content is part of the spec too.
_CONTENT_KINDS = (set, list, dict, collections.deque, bytearray)


def _const(obj: Any, kept: dict[int, Any] | None, within: frozenset[int] = frozenset()) -> Any:
    kind = type(obj)
    if kind is float:
        return ("f", obj.hex())
    if kind is complex:
        return ("c", obj.real.hex(), obj.imag.hex())
    if _hashable(obj):
        return ("v", kind, obj)
    if kept is not None:  # unhashable: specialised on the object's identity (and a container's content)
        kept[id(obj)] = obj
    return ("id", id(obj), kind.__qualname__, _content(obj, within))


def _content(obj: Any, within: frozenset[int]) -> Any:
    """The content of a container held whole, as spec parts (None for other objects and a container inside itself)."""
    if not isinstance(obj, _CONTENT_KINDS) or id(obj) in within:
        return None
    within = within | {id(obj)}
    if isinstance(obj, dict):
        return tuple((_const(key, None, within), _const(value, None, within)) for key, value in obj.items())
    parts = [_const(item, None, within) for item in obj]
    return frozenset(parts) if isinstance(obj, set) else tuple(parts)


def _frozen(context: Any) -> Any:
    """A container's context as part of a hashable spec: torch's pytree gives a mapping's keys as a list."""
    return tuple(_frozen(part) for part in context) if type(context) is list else context


def _hashable(obj: Any) -> bool:
    try:
        hash(obj)
    except TypeError:
        return False
    return True


def flatten(obj: Any, leaves: list[torch.Tensor], kept: dict[int, Any] | None = None, objects: bool = False,
            given: frozenset[int] = frozenset()) -> Any:
    """Appends the tensors in `obj` to `leaves`; returns the spec. `kept` receives, by id, the objects the spec
    refers to by identity (unhashable values; with `objects`, other objects holding tensors in their attributes,
    flattened too and kept as templates, except those in `given`, by id: returned as themselves)."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return TENSOR
    kind = type(obj)
    if kind is tuple or kind is list:
        return (kind, None, tuple(flatten(item, leaves, kept, objects, given) for item in obj))
    if kind is dict:
        return (kind, tuple(obj), tuple(flatten(value, leaves, kept, objects, given) for value in obj.values()))
    found = _NODES.of(obj)
    if found is not None and found.same_type:
        items, context = found.flatten(obj)
        context = _frozen(context)
        if _hashable(context):
            return (kind, context, tuple(flatten(item, leaves, kept, objects, given) for item in items))
    # kept by identity, its tensors would be captured as they are now and go stale on the next call
    refuse_tensors_kept_whole(obj, "fulmen.jit")
    if objects and holds_tensors(obj) and id(obj) not in given:
        assert kept is not None, "objects are kept as templates"
        if id(obj) in kept:
            raise TypeError(f"fulmen cannot return a {kind.__qualname__} (an object holding tensors) that appears "
                            "twice in the outputs or refers to itself")
        names = tuple(name for name, value in attributes(obj) if holds_tensors(value))
        kept[id(obj)] = obj
        return (OBJECT, id(obj), names, tuple(flatten(getattr(obj, name), leaves, kept, objects, given)
                                              for name in names))
    return _const(obj, kept)


def tensor_places(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(where, tensor) for the tensors `flatten(obj, ..., objects=True)` takes, in its order: `where` as a program
    names it (`['hidden_states'][1]`, `.layers[0].keys` inside an object holding tensors), for messages."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    pairs = keyed_children(obj) if type(obj) not in _ATOMS else None
    if pairs is not None:
        for key, item in pairs:
            yield from tensor_places(item, f"{path}[{key!r}]")
    elif not isinstance(obj, (tuple, list, dict)) and holds_tensors(obj):
        for name, value in attributes(obj):
            if holds_tensors(value):
                yield from tensor_places(value, f"{path}.{name}")


def identified(spec: Any) -> frozenset[int]:
    """The ids of the objects `spec` (of arguments: no OBJECT parts) holds by identity: an equal spec holds the very
    same objects (an object of a class with an `__eq__` of its own may be equal to another)."""
    if spec == TENSOR or type(spec) is not tuple or not spec:
        return frozenset()
    kind = spec[0]
    if kind == "v":
        return frozenset((id(spec[2]),)) if type(spec[2]).__eq__ is object.__eq__ else frozenset()
    if kind == "id":
        return frozenset((spec[1],))
    if isinstance(kind, type) and len(spec) == 3 and type(spec[2]) is tuple:
        return frozenset().union(*(identified(item) for item in spec[2]))
    return frozenset()


def spec_difference(old: Any, new: Any, path: str = "") -> tuple[str, str, str] | None:
    """Where two specs first differ: (the path from the root, `[0]['key']`, the item there in `old`, in `new`)."""
    if old == new:
        return None
    if (_is_container_spec(old) and _is_container_spec(new) and old[:2] == new[:2]
            and len(old[2]) == len(new[2])):
        keys = old[1] if old[0] is dict else range(len(old[2]))
        for key, was, now in zip(keys, old[2], new[2], strict=True):
            found = spec_difference(was, now, f"{path}[{key!r}]")
            if found is not None:
                return found
    return path, _describe_spec(old), _describe_spec(new)


def _is_container_spec(spec: Any) -> bool:
    return type(spec) is tuple and len(spec) == 3 and isinstance(spec[0], type)


def _describe_spec(spec: Any) -> str:
    if spec == TENSOR:
        return "a tensor"
    if _is_container_spec(spec) and spec[0] is dict:
        return f"a dict with keys {list(spec[1])}"
    if _is_container_spec(spec):
        return f"a {spec[0].__qualname__} of {len(spec[2])} items"
    kind = spec[0] if type(spec) is tuple and spec else None
    if kind == "v":
        return repr(spec[2])[:80]
    if kind == "f":
        return repr(float.fromhex(spec[1]))
    if kind == "c":
        return repr(complex(float.fromhex(spec[1]), float.fromhex(spec[2])))
    if kind == "id":
        return f"a {spec[2]} (by identity)"
    if kind == OBJECT:
        return f"an object holding tensors in {', '.join(spec[2])}"
    return f"{spec} tensors"  # the spec of a call with tensor arguments only (their count)


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
    with `modules`, module attributes) that satisfies `predicate`. Wider than the container rule on purpose: it asks
    what is reachable at all (any tuple, list or dict, every attribute), e.g. whether a value the rule keeps whole
    holds a tensor."""
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
    items = [_build(item, leaves, originals) for item in spec[2]]
    if kind is tuple or kind is list:
        return kind(items)
    if kind is dict:
        return dict(zip(spec[1], items))
    found = _NODES.get(kind) or _make_node(kind, None)  # flatten made it, unless a registration cleared the cache
    return found.unflatten(items, spec[1])
