"""The cache of one jitted callable: entries found by key, admitted by their guards, bounded, and able to say why a
call missed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fulmen.acquisition.aliasing import AliasPlan, StorageGroups, storage_groups, storage_offsets
from fulmen.core.trace import Trace
from fulmen.jit.buffer_registrations import Registration
from fulmen.observation.container_writes import ContainerWrite
from fulmen.observation.global_state import StateLeftChanged
from fulmen.observation.guards import Guard, compile_first_failure, key_difference
from fulmen.observation.shape_guards import ShapeGuards
from fulmen.observation.state_writes import Write
from fulmen.runtime.output_grads import Retained
from fulmen.runtime.trace_function import GradProgram, give_history
from fulmen.runtime.view_outputs import ViewOutput


@dataclass(frozen=True, slots=True)
class ReturnedInput:
    """An output eager returns as an input tensor itself or as a view of one: taken from the input after the trace
    ran, so it shares the input's memory, including an update the trace wrote back, and its autograd history, as
    eager's does (the trace's own value for it would be a view of the functional new value, not of the input)."""

    position: int  # among the trace's inputs: arguments, module tensors, captured tensors
    views: tuple[tuple[Callable[..., Any], tuple, dict[str, Any], int | None], ...] = ()  # (impl, args, kwargs, index)
    grad: bool = True  # the views were taken with grad enabled (else under no_grad, as in the program)
    # a `.detach()` alias (or a view of one) the program updated in place with a value that has an autograd history:
    # it gets the history of the trace's value for it, as eager's update gives the alias (trace_function.give_history)
    history: bool = False

    def take(self, inputs: Sequence[torch.Tensor], value: torch.Tensor | None = None) -> torch.Tensor:
        out = inputs[self.position]
        history = self.history and value is not None and value.requires_grad
        if self.views:
            with torch.set_grad_enabled(history or self.grad and torch.is_grad_enabled()):
                for impl, args, kwargs, index in self.views:
                    out = impl(out, *args, **kwargs)
                    if index is not None:
                        out = out[index]
        return give_history(out, value) if history else out


@dataclass(frozen=True, slots=True)
class CacheEntry:
    fn: Callable[..., tuple]
    traces: tuple[Trace, ...]
    out_spec: Any
    out_objects: dict[int, Any]  # unhashable non-tensor outputs, by id
    n_outputs: int
    returns_input: tuple[ReturnedInput | None, ...]  # per output: an input or a view of one, as eager's
    rebinds: tuple[tuple[nn.Module, str, str], ...]  # trailing outputs reassigned to module attributes
    constants: tuple[torch.Tensor, ...]
    backward_traces: tuple[Trace, ...] = ()
    program: GradProgram | None = None
    key: Any = None
    guards: tuple[Guard, ...] = ()  # the Python state the program read (observer.py)
    check: Callable[[], bool] | None = None  # all guards, compiled
    storage: StorageGroups | None = None  # the inputs' storage groups, for a trace that updates an input
    offsets: tuple[int, ...] | None = None  # the inputs' storage offsets, for a trace that depends on them
    # (input, "is_leaf" or "is_inference", its value) the program read (autograd_facts.py)
    facts: tuple[tuple[int, str, bool], ...] | None = None
    aliases: AliasPlan | None = None
    module_inputs: tuple = ()  # where its module tensors come from (module_inputs.ModuleInput)
    # the Python state the program stores (and the buffers it registers), stored again by every call
    writes: tuple[Write | ContainerWrite | Registration | StateLeftChanged, ...] = ()
    retained: Retained | None = None  # the tensors whose grad each call keeps (the program's retain_grad calls)
    # which outputs (returned, then rebinds) the program gave as one object (distinct_outputs.py); None: at most one
    distinct: tuple[int, ...] | None = None
    views: tuple[ViewOutput, ...] | None = None  # returned views of computed tensors, taken again by the call
    shapes: ShapeGuards | None = None  # the guards on its symbolic sizes (shape_guards.py)
    symbolic: tuple[int, ...] = ()  # the arguments that carry symbolic sizes (its key leaves their shapes out)
    view_sizes: bool = False  # returns_input / views take views by symbolic sizes (dynamic_shapes.SizeOf)
    # constants each call reads anew, (position, how): the .grad a whole step begins with, the learning rate its
    # optimizer step reads (fulmen.jit.grad_slots); `constants` holds None there
    fetched: tuple[tuple[int, Callable[[], torch.Tensor]], ...] = ()

    def current_constants(self) -> tuple:
        """The captured tensors this call passes the trace."""
        if not self.fetched:
            return self.constants
        constants = list(self.constants)
        for position, fetch in self.fetched:
            constants[position] = fetch()
        return tuple(constants)

    def admits(self, tensors: list, module_tensors: list) -> bool:
        if self.shapes is not None and not self.shapes.check(tensors):
            return False
        if self.check is not None and not self.check():
            return False
        constants = self.current_constants()
        if self.offsets is not None and storage_offsets([*tensors, *module_tensors, *constants]) != self.offsets:
            return False
        if self.facts is not None and changed_fact(self.facts, [*tensors, *module_tensors]) is not None:
            return False
        return self.storage is None or self.storage.admits([*tensors, *module_tensors, *constants])


def _fact(tensor: torch.Tensor, fact: str) -> bool:
    return tensor.is_leaf if fact == "is_leaf" else tensor.is_inference()


def changed_fact(facts: Sequence[tuple[int, str, bool]], inputs: Sequence[torch.Tensor]) -> tuple[int, str] | None:
    """The first input whose `is_leaf` or `is_inference` differs from what the trace read, and which."""
    for position, fact, value in facts:
        if _fact(inputs[position], fact) is not value:
            return position, fact
    return None


def sharing(groups: Sequence[int], names: Sequence[str]) -> str:
    """Which inputs share memory, in words."""
    members: dict[int, list[str]] = {}
    for i, first in enumerate(groups):
        members.setdefault(first, []).append(names[i] if i < len(names) else f"#{i}")
    shared = [" and ".join(group) for group in members.values() if len(group) > 1]
    return "; ".join(shared) if shared else "no inputs"


class Cache:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.entries: list[CacheEntry] = []
        self.layouts: dict[tuple, None] = {}  # the distinct module_inputs of the entries, in order
        self._by_key: dict[Any, list[CacheEntry]] = {}
        self._explain: dict[int, Callable[[], int]] = {}  # id(entry) -> its first failing guard, compiled on demand

    def lookup(self, key: Any, tensors: list, module_tensors: list) -> CacheEntry | None:
        for entry in self._by_key.get(key, ()):
            if entry.admits(tensors, module_tensors):
                return entry
        return None

    @property
    def full(self) -> bool:
        return len(self.entries) >= self.limit

    def add(self, entry: CacheEntry) -> None:
        self.entries.append(entry)
        self.layouts[entry.module_inputs] = None
        self._by_key.setdefault(entry.key, []).append(entry)

    def miss_reasons(self, key: Any, tensors: list, module_tensors: list, names: Sequence[str],
                     layout: Sequence[Any], symbolic_key: Callable[[tuple[int, ...]], Any]) -> list[str]:
        """For each cached entry, the first thing this call differs in (`symbolic_key(positions)`: this call's key
        for an entry whose arguments at `positions` carry symbolic sizes)."""
        return [f"trace {i}: {self._reason(entry, key, tensors, module_tensors, names, tuple(layout), symbolic_key)}"
                for i, entry in enumerate(self.entries)]

    def _reason(self, entry: CacheEntry, key: Any, tensors: list, module_tensors: list, names: Sequence[str],
                layout: tuple, symbolic_key: Callable[[tuple[int, ...]], Any]) -> str:
        if entry.module_inputs != layout:
            return "the module's parameters and buffers changed (its structure differs)"
        if entry.symbolic:
            key = symbolic_key(entry.symbolic)
        if entry.key != key:
            return key_difference(entry.key, key, names)
        if entry.shapes is not None and (why := entry.shapes.explain(tensors, names)) is not None:
            return why
        if entry.guards:
            explain = self._explain.get(id(entry))
            if explain is None:
                explain = self._explain[id(entry)] = compile_first_failure(entry.guards)
            failed = explain()
            if failed >= 0:
                return entry.guards[failed].describe()
        inputs = [*tensors, *module_tensors, *entry.current_constants()]
        changed = changed_fact(entry.facts, inputs) if entry.facts is not None else None
        if changed is not None:
            position, fact = changed
            which = names[position] if position < len(names) else f"module tensor #{position - len(names)}"
            if fact == "is_leaf":
                now = "a leaf" if inputs[position].is_leaf else "not a leaf (it has a grad_fn)"
                return f"tensor {which} is {now}; the program read is_leaf or grad_fn of it, traced with the other"
            now = "an inference tensor" if inputs[position].is_inference() else "not an inference tensor"
            return f"tensor {which} is {now}; the program read is_inference() of it, traced with the other"
        if entry.offsets is not None and storage_offsets(inputs) != entry.offsets:
            return (f"the inputs' storage offsets {storage_offsets(inputs)}, traced with {entry.offsets} (the program "
                    "reads them, or updates inputs that share memory)")
        if entry.storage is not None:
            now = storage_groups(inputs)
            return (f"the inputs sharing memory changed: {sharing(now, names)} (traced with "
                    f"{sharing(entry.storage.groups, names)})")
        return "unknown"
