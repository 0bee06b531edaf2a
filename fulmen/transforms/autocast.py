"""Autocast during acquisition: the conversions `torch.autocast` would make become explicit ops in the trace.

Which ops autocast runs in lower precision, which in float32 and which it promotes is decided by torch itself:
each op is probed once per dtype signature on fake tensors of the real device type, with autocast on and off.
Where the result dtype differs, the floating inputs are converted to autocast's result dtype before the op is
recorded, so the trace states every conversion and runs the same with autocast off (as fulmen runs it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import Symbol, iter_proxies, map_proxies
from fulmen.ops.registry import SYMBOLS

DEVICE_TYPES = ("cpu", "cuda")
_PROBES: dict[Any, torch.dtype | None] = {}


def active_device_type(values: Any) -> str | None:
    """The device type whose autocast applies to an op on these arguments, if autocast is on for it."""
    for proxy in iter_proxies(values):
        kind = proxy.device.type
        return kind if kind in DEVICE_TYPES and torch.is_autocast_enabled(kind) else None
    return None


def _first_floating(out: Any) -> torch.dtype | None:
    for item in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(item, torch.Tensor) and item.dtype.is_floating_point:
            return item.dtype
    return None


def _probe(sym: Symbol, args: tuple, kwargs: dict[str, Any], device_type: str) -> torch.dtype | None:
    """The dtype autocast gives `sym` on these arguments, when it differs from the dtype without autocast."""
    with torch._C.DisableTorchFunction(), FakeTensorMode(allow_non_fake_inputs=True):
        def fake(p: TensorProxy) -> torch.Tensor:
            return torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device)

        fake_args, fake_kwargs = map_proxies(args, fake), map_proxies(kwargs, fake)
        try:
            on = _first_floating(sym.impl(*fake_args, **fake_kwargs))
        except Exception:  # noqa: BLE001 - an op the probe cannot run is left as it is
            return None
        try:
            with torch.autocast(device_type, enabled=False):
                off = _first_floating(sym.impl(*fake_args, **fake_kwargs))
        except Exception:  # noqa: BLE001 - e.g. mixed dtypes that only autocast reconciles
            off = None
    return on if on is not None and on != off else None


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


def autocast_arguments(sym: Symbol, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """`args` and `kwargs` with the conversions autocast makes for `sym` recorded in front of it."""
    device_type = active_device_type((args, kwargs))
    if device_type is None:
        return args, kwargs
    key = _signature(sym, args, kwargs, device_type)
    if key not in _PROBES:
        _PROBES[key] = _probe(sym, args, kwargs, device_type)
    target = _PROBES[key]
    if target is None:
        return args, kwargs
    to = SYMBOLS["torch.Tensor.to"]

    def cast(p: TensorProxy) -> TensorProxy:
        return to(p, dtype=target) if p.dtype.is_floating_point and p.dtype != target else p

    return map_proxies(args, cast), map_proxies(kwargs, cast)
