"""Autocast during acquisition: the conversions `torch.autocast` would make become explicit ops in the trace.

Which ops autocast runs in lower precision, which in float32 and which it promotes is decided by torch itself:
each op is run once per dtype signature on fake tensors of the real device type under autocast, and the
conversions autocast makes of its inputs (they dispatch below it) are recorded. The same conversions are put in
front of the op in the trace, so the trace states every one and runs the same with autocast off (as fulmen runs
it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import Symbol, iter_proxies, map_proxies
from fulmen.ops.registry import SYMBOLS

DEVICE_TYPES = ("cpu", "cuda")
_PROBES: dict[Any, AutocastPlan] = {}


def active_device_type(values: Any) -> str | None:
    """The device type whose autocast applies to an op on these arguments, if autocast is on for it."""
    for proxy in iter_proxies(values):
        kind = proxy.device.type
        return kind if kind in DEVICE_TYPES and torch.is_autocast_enabled(kind) else None
    return None


class _CastRecorder(TorchDispatchMode):
    """Sees the conversions autocast makes (they dispatch below it) and records them per input tensor."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.position = {id(t): i for i, t in enumerate(inputs)}
        self.casts: dict[int, torch.dtype] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and id(args[0]) in self.position and "dtype" in kwargs:
            self.casts[self.position[id(args[0])]] = kwargs["dtype"]
        return func(*args, **kwargs)


@dataclass(frozen=True, slots=True)
class AutocastPlan:
    casts: dict[int, torch.dtype]  # tensor argument (by position among the proxies) -> the dtype it is cast to
    # The output dtype under autocast, where autocast converts inside a composite (cross_entropy's nll_loss)
    # rather than its arguments.
    output: torch.dtype | None


_NOTHING = AutocastPlan({}, None)


def _probe(sym: Symbol, args: tuple, kwargs: dict[str, Any]) -> AutocastPlan:
    fakes: list[torch.Tensor] = []

    with torch._C.DisableTorchFunction(), FakeTensorMode(allow_non_fake_inputs=True):
        def fake(p: TensorProxy) -> torch.Tensor:
            fakes.append(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device))
            return fakes[-1]

        fake_args, fake_kwargs = map_proxies(args, fake), map_proxies(kwargs, fake)
        recorder = _CastRecorder(fakes)
        try:
            with recorder:
                out = sym.impl(*fake_args, **fake_kwargs)
        except Exception:  # noqa: BLE001 - an op the probe cannot run is left as it is
            return _NOTHING
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    output = first.dtype if isinstance(first, torch.Tensor) and first.dtype.is_floating_point else None
    return AutocastPlan(recorder.casts, output)


def _signature(sym: Symbol, args: tuple, kwargs: dict[str, Any], device_type: str) -> Any:
    def describe(obj: Any) -> Any:
        if type(obj) is TensorProxy:
            return (obj.dtype, obj.dim())
        if isinstance(obj, (tuple, list)):
            return tuple(describe(item) for item in obj)
        if isinstance(obj, dict):
            return tuple((key, describe(value)) for key, value in obj.items())
        return obj if isinstance(obj, (int, float, bool, str, torch.dtype, type(None))) else type(obj)

    return (sym, device_type, torch.get_autocast_dtype(device_type), describe(args), describe(kwargs))


def plan(sym: Symbol, args: tuple, kwargs: dict[str, Any]) -> AutocastPlan:
    """What autocast does to a call of `sym` on these arguments (nothing when autocast is off for them)."""
    device_type = active_device_type((args, kwargs))
    if device_type is None:
        return _NOTHING
    key = _signature(sym, args, kwargs, device_type)
    if key not in _PROBES:
        _PROBES[key] = _probe(sym, args, kwargs)
    return _PROBES[key]


def cast_arguments(autocast: AutocastPlan, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """`args` and `kwargs` with autocast's conversions recorded in front of the op."""
    if not autocast.casts:
        return args, kwargs
    to = SYMBOLS["torch.Tensor.to"]
    position = itertools.count()

    def cast(p: TensorProxy) -> TensorProxy:
        dtype = autocast.casts.get(next(position))
        return to(p, dtype=dtype) if dtype is not None and dtype != p.dtype else p

    return map_proxies(args, cast), map_proxies(kwargs, cast)


def cast_output(autocast: AutocastPlan, output: Any) -> Any:
    """The op's output converted to the dtype autocast gives it, where the arguments' conversions did not."""
    if autocast.output is None or type(output) is not TensorProxy or output.dtype == autocast.output:
        return output  # several outputs are left as the op gives them
    return SYMBOLS["torch.Tensor.to"](output, dtype=autocast.output)


def autocast_enabled() -> bool:
    return any(torch.is_autocast_enabled(device) for device in DEVICE_TYPES)


def without_autocast(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run with autocast off: a trace acquired under autocast already holds its conversions."""

    def run(*args: Any) -> Any:
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args)

    return run
