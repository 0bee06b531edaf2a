"""Fabric's checkpoint state (a dict of modules, optimizers, objects with `state_dict`, plain values) turned into
what a checkpoint holds, and restored from it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.strategies.strategy import _apply_filter, _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

from fulmen.distributed import checkpoint


def state_of(obj: Any, options: checkpoint.StateDictOptions) -> Any:
    if isinstance(obj, nn.Module):
        return checkpoint.get_model_state_dict(obj, options)
    if isinstance(obj, Optimizer):
        return checkpoint.get_optimizer_state_dict(obj, options)
    if isinstance(obj, _Stateful):
        return obj.state_dict()
    return obj


def collect(state: dict[str, Any], options: checkpoint.StateDictOptions,
            filter: dict[str, Callable[[str, Any], bool]] | None = None) -> dict[str, Any]:
    """Each entry's state (every rank must call it: gathers and DTensors need all of them), filtered as
    `fabric.save(..., filter=)` asks."""
    collected: dict[str, Any] = {}
    for key, obj in state.items():
        _apply_filter(key, filter or {}, state_of(obj, options), collected)
    return collected


def restore_object(obj: nn.Module | Optimizer | _Stateful, value: Any, strict: bool) -> None:
    if isinstance(obj, nn.Module):
        checkpoint.load_model_state_dict(obj, value, strict=strict)
    elif isinstance(obj, Optimizer):
        checkpoint.load_optimizer_state_dict(obj, value)
    else:
        obj.load_state_dict(value)


def restore(state: dict[str, Any], loaded: dict[str, Any], strict: bool) -> dict[str, Any]:
    """Loads `loaded` into the objects of `state` (plain values are replaced in `state`); returns what is left."""
    _validate_keys_for_strict_loading(state.keys(), loaded.keys(), strict=strict)
    for name, obj in list(state.items()):
        if name not in loaded:
            continue
        value = loaded.pop(name)
        if isinstance(obj, nn.Module | Optimizer | _Stateful):
            restore_object(obj, value, strict)
        else:
            state[name] = value
    return loaded
