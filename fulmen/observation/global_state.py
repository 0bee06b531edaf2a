"""The global state a program changes while it is acquired (grad mode, autocast, and what torch's setters set: the
default dtype, the random generators, determinism, matmul precision, backend flags; setters.py), as it was before a
compilation.

Acquisition applies the program's changes of global state for real (acquire.STATE, the setters themselves), so that
the ops after them are recorded under that state. A program that changes it with bare calls
(`torch.set_grad_enabled(False)`, or the `_set_grad_enabled` and autocast nodes of a graph Dynamo captured) and is
refused after the change left it changed: the code that ran next (the user's eager fallback, fulmen.dynamo's fallback
for the graph, the second acquisition of a program that reads a tensor value or shares memory between inputs) ran
without grad or under autocast. A compilation that fails, and each acquisition made again, starts from the state the
call began with. What the trace sets again itself (the replayed setters, at their place among its ops) is also set
back once the program is acquired, so that the first run of the trace, like every later one, starts from the
caller's state. The random generators are not here: acquisition draws nothing from them (draws are recorded), so
only a seed the program sets changes them, and that setter's region puts them back itself (setters.py,
`Setters.put_back`); set back on every miss, they gave the numbers another thread drew meanwhile again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_DEVICES = ("cpu", "cuda")  # the autocast devices the cache key reads (guards.global_state_key)


def _autocast_nesting() -> int:
    level = torch.autocast_increment_nesting() - 1  # torch offers no plain read of the level
    torch.autocast_decrement_nesting()
    return level


def _set_printoptions(options: tuple[tuple[str, Any], ...]) -> None:
    torch.set_printoptions(**dict(options))


def _set_backend(owner: Any, name: str) -> Callable[[Any], None]:
    return lambda value: setattr(owner, name, value)


def _backend(owner: Any, name: str) -> tuple[str, Callable[[], Any], Callable[[Any], None]]:
    return f"{owner.__name__}.{name}", lambda: getattr(owner, name), _set_backend(owner, name)


def _fp32_precision(backend: str, op: str) -> tuple[str, Callable[[], Any], Callable[[Any], None]]:
    return (f"fp32_precision of {backend} {op}", lambda: torch._C._get_fp32_precision_getter(backend, op),
            lambda value: torch._C._set_fp32_precision_setter(backend, op, value))


# The switches torch's setters change (setters.py), each read and set back only where it changed (a backend flag set
# to what it holds may still fail: cuDNN's under disable_global_flags). A legacy allow_tf32 flag cannot be read once
# the new fp32_precision API gave its parts different values (torch raises): it is left to the fp32_precision ones.
_SWITCHES: tuple[tuple[str, Callable[[], Any], Callable[[Any], None]], ...] = (
    ("default dtype", torch.get_default_dtype, torch.set_default_dtype),
    ("deterministic algorithms", lambda: (torch.are_deterministic_algorithms_enabled(),
                                          torch.is_deterministic_algorithms_warn_only_enabled()),
     lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1])),
    ("float32 matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    ("print options", lambda: tuple(torch._tensor_str.get_printoptions().items()), _set_printoptions),
    ("threads", torch.get_num_threads, torch.set_num_threads),
    ("anomaly mode", lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
     lambda value: torch.set_anomaly_enabled(*value)),
    ("warn always", torch.is_warn_always_enabled, torch.set_warn_always),
    *(_backend(torch.backends.cudnn, name) for name in ("enabled", "benchmark", "deterministic", "allow_tf32")),
    *(_backend(torch.backends.mkldnn, name) for name in ("enabled", "deterministic")),
    *(("torch.backends.cuda.matmul." + name, lambda name=name: getattr(torch.backends.cuda.matmul, name),
       _set_backend(torch.backends.cuda.matmul, name)) for name in (
        "allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")),
    *(_fp32_precision(backend, op) for backend, op in (
        ("generic", "all"), ("cuda", "matmul"), ("cuda", "conv"), ("cuda", "rnn"), ("mkldnn", "matmul"),
        ("mkldnn", "conv"), ("mkldnn", "rnn"))),
)
_UNREADABLE = object()


def _read(get: Callable[[], Any]) -> Any:
    try:
        return get()
    except RuntimeError:  # a legacy TF32 flag after the new API set its parts apart
        return _UNREADABLE


@dataclass(frozen=True, slots=True)
class Generators:
    """The states of the default random generators (CPU; CUDA's where CUDA started): a seed the program sets is
    replayed by the trace, before the draws that follow it, so acquiring it must leave them as they were before that
    seed (taken by the seed's region, setters.py)."""

    cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...] | None

    @staticmethod
    def current() -> Generators:
        cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else None
        return Generators(torch.default_generator.get_state(), cuda)

    def restore(self) -> None:
        torch.default_generator.set_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


@dataclass(frozen=True, slots=True)
class GlobalState:
    grad: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    cache: bool
    nesting: int
    switches: tuple[Any, ...]  # the values of _SWITCHES

    @staticmethod
    def current() -> GlobalState:
        autocast = tuple((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                         for device in _DEVICES)
        return GlobalState(torch.is_grad_enabled(), autocast, torch.is_autocast_cache_enabled(), _autocast_nesting(),
                           tuple(_read(get) for _, get, _ in _SWITCHES))

    def restore(self) -> None:
        self.restore_modes()
        self.restore_replayed()

    def restore_replayed(self) -> None:
        """The switches as they were: what the trace sets again itself, where the program set it."""
        for (_, get, set_), value in zip(_SWITCHES, self.switches):
            if value is not _UNREADABLE and _read(get) != value:
                set_(value)

    def restore_modes(self) -> None:
        """The grad mode and autocast as they were."""
        torch._C._set_grad_enabled(self.grad)
        for device, enabled, dtype in self.autocast:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(self.cache)
        level = _autocast_nesting()
        while level > self.nesting:  # autocast watches the program entered and did not leave
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
        self.state.restore_modes()
