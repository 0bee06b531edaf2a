"""Buffers the traced program registers (`module.register_buffer(name, tensor)` in forward), made by every call.

A module may create a buffer lazily, on its first call (LitGPT's LoRA `lora_ind`, a running statistic made when it
is first needed); eager's module holds it from then on, in `named_buffers()` and, when persistent, in `state_dict()`,
and later calls read it (or update it in place). `register_buffer` writes the module's `_buffers` dict and its
`_non_persistent_buffers_set` directly, not through `__setattr__`, so neither the shadow's store report
(module_inputs.py) nor state_writes.py sees it:

- on a shadow (the jitted module's tree), the buffer landed in the shadow's own copy of `_buffers` and was lost, so
  the module never held it: every call made it afresh, and a buffer the program then updated in place started
  from its initial value on every call;
- on a real module (one the program was given or captured), the trace's stand-in tensor stayed in the module's
  `_buffers`, which broke the module for eager use too.

Each such registration is now the trace's to make: the value the program registered is one of the trace's outputs
(`rebinds`, stored into `_buffers` after each call as a reassigned tensor is) and `Registration.apply` sets its
persistence. The module's `_buffers` names are guarded (observer.py), so the call after the one that registered it
misses the cache and traces anew, reading the buffer as eager's second call does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fulmen.core.proxies import TensorProxy


@dataclass(frozen=True, slots=True)
class Registration:
    """`module.register_buffer(name, value, persistent)`, made again by every call that uses the trace. A value the
    trace computed is one of its outputs, stored after this (a rebind); `value` holds any other (None, a tensor the
    program did not compute)."""

    module: nn.Module
    name: str
    persistent: bool
    traced: bool
    value: torch.Tensor | None = None

    def apply(self) -> None:
        if not self.traced:
            self.module._buffers[self.name] = self.value
        if self.persistent:
            self.module._non_persistent_buffers_set.discard(self.name)
        else:
            self.module._non_persistent_buffers_set.add(self.name)


@dataclass(frozen=True, slots=True)
class Registered:
    """A buffer the program registered: on `module` (the user's), now holding `value` (a proxy when traced)."""

    module: nn.Module
    name: str
    value: Any
    persistent: bool

    def registration(self) -> Registration:
        traced = type(self.value) is TensorProxy
        return Registration(self.module, self.name, self.persistent, traced, None if traced else self.value)


def registered(module: nn.Module, buffers: dict[str, Any], before: Iterable[str], non_persistent: set[str],
               non_persistent_before: set[str]) -> list[Registered]:
    """The buffers of `buffers` (the `_buffers` the program wrote) that are new, or whose persistence changed, with
    respect to `before` and `non_persistent_before` (what `module` held when the call began)."""
    held = set(before)
    found = []
    for name, value in buffers.items():
        persistent = name not in non_persistent
        if name not in held or persistent == (name in non_persistent_before):
            found.append(Registered(module, name, value, persistent))
    return found


class RealModules:
    """The `_buffers` names and non-persistent names of the modules the program can reach, so that a buffer it
    registers with a traced value in one that is not a shadow is found, taken out again (the trace's stand-in must
    not stay there, also when the acquisition fails) and made the trace's to register on every call."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self._saved: dict[int, tuple[nn.Module, tuple[str, ...], set[str]]] = {}
        for module in modules:
            if id(module) not in self._saved and "_buffers" in module.__dict__:
                self._saved[id(module)] = (module, tuple(module._buffers), set(module._non_persistent_buffers_set))
        self.found: list[Registered] = []

    @contextlib.contextmanager
    def watching(self) -> Iterator[RealModules]:
        """Around the program's run: afterwards (or when it fails) no module holds a buffer it registered with a
        traced value."""
        try:
            yield self
        finally:
            self._restore()

    def _restore(self) -> None:
        for module, names, non_persistent in self._saved.values():
            buffers = module._buffers
            if tuple(buffers) == names:
                continue
            # Only new names holding a stand-in: a buffer the program replaced is a rebind's or refused
            # (state_writes.py)
            new = [r for r in registered(module, buffers, names, module._non_persistent_buffers_set, non_persistent)
                   if r.name not in names and type(r.value) is TensorProxy]
            self.found += new
            for entry in new:
                del buffers[entry.name]
                if entry.name not in non_persistent:
                    module._non_persistent_buffers_set.discard(entry.name)
