"""The prologue: what a call must match to reuse a compiled trace.

Two levels. The cache key is built from cheap reads only: the input structure (with its Python values), each
tensor's metadata including its layout (`tensor_key`), the grad mode, the default dtype, the autocast state
and the attention backend switches. After the key matched, an entry checks its guards: the Python state the traced
program read (globals, closure cells, attributes of objects and modules, recorded by observer.py), compiled into one
function, and, for a trace that updates inputs in place, which inputs share memory (aliasing.py).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fulmen.core import pytree
from fulmen.core.proxies import CLASS_MARKERS
from fulmen.observation.value_checks import compile_statements, immutable

try:  # torch's C++ check of tensors' metadata (Dynamo's guards)
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - a torch built without Dynamo: the key is computed every call
    _TensorGuards = None


def tensor_key(tensors: Sequence[torch.Tensor]) -> tuple:
    """Each tensor's shape, strides, dtype, device and requires_grad: views, reshape, in-place updates and kernel
    choices depend on the layout. Where a tensor starts in its storage matters only to a program that reads it (or
    to inputs sharing memory): such a trace checks the offsets itself (CacheEntry.offsets)."""
    return tuple([(t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors])


def argument_key(tensors: Sequence[torch.Tensor]) -> tuple:
    """`tensor_key` of the arguments, with each one's Python attributes (`x.scale = 4.0`), which the program may read
    (the trace's proxy carries them): immutable values by value, others by identity. Tensors rarely have any. Then
    its class, which `isinstance(x, nn.Parameter)` reads (the proxy answers with it: proxies.stand_for)."""
    return tuple([(t.shape, t.stride(), t.dtype, t.device, t.requires_grad, _attributes(d) if (d := t.__dict__) else (),
                   type(t)) for t in tensors])


def symbolic_argument_key(tensors: Sequence[torch.Tensor], positions: Sequence[int]) -> tuple:
    """`argument_key` for a trace whose arguments at `positions` carry symbolic sizes: their sizes and strides are
    left to the trace's shape guards (shape_guards.py), their number of dimensions stays in the key."""
    key = list(argument_key(tensors))
    for p in positions:
        kept = key[p]
        key[p] = (f"{tensors[p].dim()} dims, symbolic", "symbolic", *kept[2:])
    return tuple(key)


def module_key(tensors: Sequence[torch.Tensor]) -> tuple:
    """`tensor_key` of the module's tensors, with what `isinstance` reads of each: the markers torch's classes read
    (a Buffer's) and its class. Other Python attributes stay on the module's tensor, unread by the trace. A Parameter
    carries no marker that changes an answer (nn.Buffer(p) marks a detached plain tensor), and parameters are most of
    a module's tensors: theirs are not looked for (the cost of a cache hit grows with them)."""
    return tuple([(t.shape, t.stride(), t.dtype, t.device, t.requires_grad,
                   _markers(d) if (kind := type(t)) is not nn.Parameter and (d := t.__dict__) else (), kind)
                  for t in tensors])


class ModuleKeys:
    """`module_key` of a module's tensors, computed again only when they changed: while a call fetches the same
    tensor objects as the last, torch's C++ tensor check (Dynamo's `TensorGuards`: class, dtype, device,
    requires_grad, sizes, strides and dispatch keys, ~0.1 us a tensor) stands for the key's tensor fields (~0.7 us a
    tensor in Python), and the markers of the tensors that are not Parameters are read again. A check that fails
    (a tensor changed, or the thread's dispatch state did: autocast, inference mode) computes the key and records
    anew; after `_MISSES` failures in a row the memo stops recording."""

    _MISSES = 3

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor] | None = None
        self._key: tuple | None = None
        self._check: Any = None
        self._marked: tuple[tuple[int, tuple], ...] = ()  # (position, markers) of the tensors not Parameters
        self._misses = 0

    def __call__(self, tensors: list[torch.Tensor]) -> tuple:
        if not tensors:
            return ()
        last = self._tensors
        if (last is not None and len(last) == len(tensors) and all(map(operator.is_, tensors, last))
                and self._check.check(*tensors)
                and all(_markers(tensors[i].__dict__) == markers for i, markers in self._marked)):
            self._misses = 0
            return self._key
        key = module_key(tensors)  # raises AttributeError for a module tensor that is no longer a tensor
        self._misses += last is not None
        if _TensorGuards is not None and self._misses < self._MISSES:
            self._tensors, self._key = list(tensors), key
            self._check = _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                        dynamic_dims_strides=[list(t.stride()) for t in tensors])
            self._marked = tuple((i, _markers(t.__dict__)) for i, t in enumerate(tensors)
                                 if type(t) is not nn.Parameter)
        else:
            self._tensors = None
        return key


def _attributes(attributes: dict[str, Any]) -> tuple:
    return tuple([(name, value if immutable(value) else ("object", id(value))) for name, value in attributes.items()])


def _markers(attributes: dict[str, Any]) -> tuple:
    return tuple([(name, attributes[name]) for name in CLASS_MARKERS if name in attributes])


def global_state_key() -> tuple:
    # the sdpa executor picks its attention kernel by torch's backend switches (torch.nn.attention.sdpa_kernel)
    attention = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled(),
                 torch.backends.cuda.mem_efficient_sdp_enabled())
    # factory calls without a dtype take the default dtype, fixed in the trace
    state = (torch.is_grad_enabled(), torch.get_default_dtype(), attention)
    if not torch._C._is_any_autocast_enabled():
        return state
    autocast = tuple(
        (device, torch.get_autocast_dtype(device))
        for device in ("cpu", "cuda")
        if torch.is_autocast_enabled(device)
    )
    # its cache decides which conversions are shared (fulmen.transforms.autocast.CastCache)
    return (*state, autocast, torch.is_autocast_cache_enabled())


KEY_PARTS = ("the inputs' structure or Python values", "argument tensor metadata", "module tensor metadata",
             "grad mode, default dtype, attention switches or autocast",
             "its executors' registrations (register_implementation, register_operator or register_lookaside since "
             "the trace was built)")
TENSOR_FIELDS = ("shape", "strides", "dtype", "device", "requires_grad", "Python attributes", "class")


def key_difference(old: tuple | None, new: tuple | None, names: Sequence[str]) -> str:
    """Why two cache keys differ, in words (the first difference)."""
    if old is None or new is None:
        return "a module tensor was removed or replaced by a non-tensor"
    for part, (was, now) in enumerate(zip(old, new)):
        if was == now:
            continue
        if part in (1, 2) and len(was) == len(now):
            for i, (meta_was, meta_now) in enumerate(zip(was, now)):
                for name, a, b in zip(TENSOR_FIELDS, meta_was, meta_now):
                    if a != b:
                        which = names[i] if part == 1 and i < len(names) else f"#{i}"
                        kind = "tensor argument" if part == 1 else "module tensor"
                        return f"{kind} {which}: {name} {_short(b)}, traced with {_short(a)}"
        if part == 0:
            return _arguments_difference(was, now)
        return f"{KEY_PARTS[part]} changed"
    return "the key matched"


def _arguments_difference(old: Any, new: Any) -> str:
    """Which Python value or structure of the arguments changed, from the specs of `(args, kwargs)`."""
    path, was, now = pytree.spec_difference(old, new)
    if not path:
        return f"the arguments: {now}, traced with {was}"
    # "[0][2]..." is positional argument 2, "[1]['name']..." the keyword argument `name`
    keyword, inner = path.startswith("[1]"), path[3:]
    if not inner:
        return f"the {'keyword' if keyword else 'positional'} arguments: {now}, traced with {was}"
    where, _, rest = inner[1:].partition("]")
    argument = f"argument {where.strip(chr(39))}" if keyword else f"positional argument {where}"
    return f"{argument}{rest}: {now}, traced with {was}"


def _short(value: Any) -> str:
    if isinstance(value, torch.Size):
        return str(tuple(value))
    return str(value)


@dataclass(frozen=True, slots=True)
class Guard:
    """One fact about Python state a trace depends on: a boolean expression over `bindings` (see value_checks.py)."""

    what: str  # e.g. "global SCALE of module train", shown when the guard fails
    source: str
    bindings: dict[str, Any] = field(hash=False, compare=False)
    traced: str = ""  # the value seen while tracing, described
    explain: Callable[[], str] | None = field(default=None, hash=False, compare=False)  # what changed, once failed

    def describe(self) -> str:
        if self.explain is not None:
            return self.explain()
        return f"{self.what} changed (traced with {self.traced})" if self.traced else f"{self.what} changed"


def compile_check(guards: Sequence[Guard]) -> Callable[[], bool] | None:
    """One function checking all `guards` (None when there are none)."""
    if not guards:
        return None
    bindings: dict[str, Any] = {}
    for guard in guards:
        bindings.update(guard.bindings)
    return compile_statements(["return " + " and ".join(f"({guard.source})" for guard in guards)], bindings)


def compile_first_failure(guards: Sequence[Guard]) -> Callable[[], int]:
    """A function giving the index of the first of `guards` that fails now (-1 when all hold)."""
    bindings: dict[str, Any] = {}
    lines = []
    for i, guard in enumerate(guards):
        bindings.update(guard.bindings)
        lines += ["try:", f"    if not ({guard.source}): return {i}", "except KeyError:", f"    return {i}"]
    return compile_statements(lines + ["return -1"], bindings)
