"""The global state a program changes while it is acquired (grad mode, autocast), as it was before a compilation.

Acquisition applies the program's changes of global state for real (acquire.STATE), so that the ops after them are
recorded under that state. A program that changes it with bare calls (`torch.set_grad_enabled(False)`, or the
`_set_grad_enabled` and autocast nodes of a graph Dynamo captured) and is refused after the change left it changed:
the code that ran next (the user's eager fallback, fulmen.dynamo's fallback for the graph, the second acquisition of
a program that reads a tensor value or shares memory between inputs) ran without grad or under autocast. A
compilation that fails, and each acquisition made again, starts from the state the call began with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DEVICES = ("cpu", "cuda")  # the autocast devices the cache key reads (guards.global_state_key)


def _autocast_nesting() -> int:
    level = torch.autocast_increment_nesting() - 1  # torch offers no plain read of the level
    torch.autocast_decrement_nesting()
    return level


@dataclass(frozen=True, slots=True)
class GlobalState:
    grad: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    cache: bool
    nesting: int

    @staticmethod
    def current() -> GlobalState:
        autocast = tuple((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                         for device in _DEVICES)
        return GlobalState(torch.is_grad_enabled(), autocast, torch.is_autocast_cache_enabled(), _autocast_nesting())

    def restore(self) -> None:
        torch._C._set_grad_enabled(self.grad)
        for device, enabled, dtype in self.autocast:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(self.cache)
        level = _autocast_nesting()
        while level > self.nesting:  # autocast regions the program entered and did not leave
            level = torch.autocast_decrement_nesting()
            if level == 0:  # as torch.autocast's __exit__ does when the outermost region ends
                torch.clear_autocast_cache()


@dataclass(frozen=True, slots=True)
class StateLeftChanged:
    """The grad mode and autocast a program leaves changed (bare calls it does not undo), set again by every call (a
    cache entry's writes): eager's program sets them on each call, where a cache hit runs only the trace, so from the
    second call on grad stayed on after a program that turned it off for its caller."""

    state: GlobalState

    def apply(self) -> None:
        self.state.restore()
