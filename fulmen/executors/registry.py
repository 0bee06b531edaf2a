"""Registered executors by name, the default list, and resolving a user's executor list."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Sequence

import torch

from fulmen.executors.base import OWN_EXECUTORS, Executor
from fulmen.executors.torch_eager import torch_executor

EXECUTORS: dict[str, Executor] = {}


class DefaultExecutors:
    """The executor list `fulmen.jit` uses when given none, as `set_default_executors` last chose it."""

    def __init__(self) -> None:
        self.chosen: tuple[Executor, ...] | None = None  # None: the built-in choice (see get_default_executors)
        # whether a fulmen.jit took the default list: a later change of it does not reach that callable
        self.taken = False


DEFAULTS = DefaultExecutors()


def register_executor(executor: Executor) -> Executor:
    """Makes `executor` known by its name, so `fulmen.jit(..., executors=["name"])` finds it."""
    if not isinstance(executor, Executor):
        raise TypeError(f"register_executor expects an executor, got {type(executor).__name__}")
    known = EXECUTORS.get(executor.name)
    if known is not None and known is not executor:
        if executor.name in OWN_EXECUTORS:
            raise ValueError(f"an executor named {executor.name!r} is already registered: fulmen's own")
        # a notebook cell that makes and registers an executor, run again
        warnings.warn(f"register_executor: an executor named {executor.name!r} is registered again; the new one "
                      "replaces the old one for names resolved from now on (callables jitted before keep theirs)",
                      stacklevel=2)
    EXECUTORS[executor.name] = executor
    return executor


# Every executor fulmen ships, by name -> the module that defines (and registers) it: a name is known, and listed
# in errors, before anything imported its module; the module is imported on first use of the name. "torch" is
# registered below. Executors of other packages are registered with `fulmen.extend.register_executor`.
PROVIDERS: dict[str, str] = {
    "sdpa": "fulmen.executors.sdpa",
    "torchcompile": "fulmen.executors.torch_compile",
    "unsloth": "fulmen.unsloth",
    "liger": "fulmen.liger",
}


assert OWN_EXECUTORS == {*PROVIDERS, torch_executor.name}, "fulmen's own executors are named in both places"


def get_executor(name: str) -> Executor:
    if name not in EXECUTORS and name in PROVIDERS:
        importlib.import_module(PROVIDERS[name])
    try:
        return EXECUTORS[name]
    except KeyError:
        known = sorted({*EXECUTORS, *PROVIDERS})
        raise ValueError(f"unknown executor {name!r}; registered executors: {known}") from None


def get_all_executors() -> tuple[Executor, ...]:
    return tuple(EXECUTORS.values())


def get_default_executors() -> tuple[Executor, ...]:
    """The executors `fulmen.jit` uses when given none: SDPA attention, torch.compile fusion regions where CUDA is
    available (on CPU, compiling C++ regions costs more than it saves for most programs; name "torchcompile" to
    have it), then torch."""
    if DEFAULTS.chosen is not None:
        return DEFAULTS.chosen
    names = ["sdpa", "torchcompile"] if torch.cuda.is_available() else ["sdpa"]
    return (*(get_executor(name) for name in names), torch_executor)


def set_default_executors(executors: Sequence[Executor | str] | None) -> None:
    """Replaces the default list (None restores the built-in one) for the `fulmen.jit` calls made after: a jitted
    callable keeps the executors it was jitted with (a warning says so when one took the list this replaces)."""
    before = get_default_executors() if DEFAULTS.taken else None
    # the objects, not their names: an executor need not be registered to be one of the defaults
    DEFAULTS.chosen = None if executors is None else resolve(executors)
    if before is not None and before != get_default_executors():
        warnings.warn("set_default_executors: callables fulmen.jit made earlier with the default executors keep "
                      "the ones they were jitted with; jit them again to use the new list", stacklevel=2)


def resolve(executors: Sequence[Executor | str] | None) -> tuple[Executor, ...]:
    """Executor objects in priority order, without repeats, torch last."""
    if executors is None:
        DEFAULTS.taken = True
        return get_default_executors()
    if isinstance(executors, (str, Executor)):
        raise TypeError("executors must be a list of executors or names, e.g. ['sdpa', 'torchcompile']")
    resolved: list[Executor] = []
    for item in executors:
        executor = get_executor(item) if isinstance(item, str) else item
        if not isinstance(executor, Executor):
            raise TypeError(f"executors must hold executor objects or names, got {item!r}")
        if executor is not torch_executor and executor not in resolved:
            resolved.append(executor)
    return (*resolved, torch_executor)


register_executor(torch_executor)
