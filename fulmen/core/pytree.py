"""Flattening program inputs and outputs: tuples, lists, dicts, namedtuples, dataclasses, torch structseqs.

A flattened structure is (leaves, spec). Tensors are leaves; every other leaf (ints, strings, dtypes, ...) is
kept in the spec, so the spec is a hashable cache key that specialises on Python values. Floats are kept by their
exact bits (`float.hex`), so `-0.0` and `0.0` are different keys and `nan` is equal to itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

TENSOR = "T"  # marks a tensor leaf's position inside a spec


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


def flatten(obj: Any, leaves: list[torch.Tensor]) -> Any:
    """Appends the tensors in `obj` to `leaves`; returns the spec."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return TENSOR
    kind = type(obj)
    if kind is tuple or kind is list:
        return (kind, tuple(flatten(item, leaves) for item in obj))
    if kind is dict:
        return (dict, tuple(obj.keys()), tuple(flatten(value, leaves) for value in obj.values()))
    if isinstance(obj, tuple) and (hasattr(kind, "_fields") or hasattr(kind, "n_fields")):
        return (kind, tuple(flatten(item, leaves) for item in obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = tuple(f.name for f in dataclasses.fields(obj))
        return (kind, names, tuple(flatten(getattr(obj, name), leaves) for name in names))
    return _const(obj)


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
    if kind is tuple or kind is list:
        return kind(_build(item, leaves, originals) for item in spec[1])
    if kind is dict:
        return dict(zip(spec[1], (_build(item, leaves, originals) for item in spec[2])))
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
    elif isinstance(obj, dict):
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
