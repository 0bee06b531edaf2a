"""Values known while tracing: small integer tensors the program makes from Python numbers alone.

`torch.arange(n)`, and what integer and boolean ops compute from such tensors only, hold values fixed by the shapes and
Python numbers the trace is specialised on (and guarded by): fulmen computes them on the side, on the CPU, so a read
of their values (`if (mask[:, -1] == 0).all()`, `.item()`, `.tolist()`) is answered as eager answers it. Transformers
builds `position_ids` so when none is given, and reads them to find packed sequences (`find_packed_sequence_indices`,
with `use_cache=False`, as training and gradient checkpointing run): that read made fulmen trace the program again
as a compiler (is_compiling.py), where transformers takes another attention path than eager's (an explicit mask and
repeated keys instead of `is_causal` and grouped heads), whose grads round otherwise in bfloat16.

Floating-point values are never known (a device's kernels may round otherwise), nor random draws, uninitialised
memory, what a device may order or pick otherwise (sorts with ties, scatters with repeated indices), or anything read
from an argument, a parameter or a captured tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import Symbol, Tag, iter_proxies, map_proxies
from fulmen.core.symbolic import free_symbols, has_symbolic_sizes
from fulmen.ops.registry import lookup

_LIMIT = 1 << 16  # elements: larger values are not worth computing twice
_FACTORIES = frozenset(lookup(f).symbol for f in (torch.arange, torch.zeros, torch.ones, torch.full, torch.tensor,
                                                  torch.as_tensor, torch.eye) if lookup(f) is not None)
_EXACT = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
_CPU = torch.device("cpu")
# Ops whose results another device's kernels may order or pick otherwise (ties, duplicate indices): the CPU's answer
# would not be the device's (of CPU tensors it is: pack_padded_sequence sorts its lengths there).
_DEVICE_DEPENDENT = ("sort", "topk", "kthvalue", "mode", "median", "max", "min", "scatter", "index_put", "index_copy",
                     "put", "unique", "histc", "bincount")
# Reads of a tensor's values that return Python values.
READS = frozenset({torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__index__,
                   torch.Tensor.__float__, torch.Tensor.tolist})


def _on_cpu(obj: Any) -> Any:
    return _CPU if isinstance(obj, (torch.device, str)) and str(obj).startswith(("cuda", "cpu", "meta")) else obj


class KnownValues:
    """The values of the program's tensors that are known while tracing (see above)."""

    def __init__(self) -> None:
        self._values: dict[int, tuple[TensorProxy, torch.Tensor]] = {}  # id(value) -> (it, its contents)

    def record(self, sym: Symbol, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        """Notes the contents of what `sym(*args, **kwargs)`, just recorded as `output`, computes, when known."""
        outputs = list(iter_proxies(output))
        if not outputs or sym.tags & (Tag.RANDOM | Tag.IMPURE):
            return
        if any(part in sym.printed for part in _DEVICE_DEPENDENT) and any(
                p.device.type != "cpu" for p in (*outputs, *iter_proxies((args, kwargs)))):
            return
        if any(has_symbolic_sizes(out.meta) for out in outputs) or free_symbols((args, kwargs)):
            return  # contents that depend on a symbolic size (fulmen.core.symbolic) are not fixed by the trace
        if any(out.dtype not in _EXACT or out.numel() > _LIMIT for out in outputs):
            return
        read = list(iter_proxies((args, kwargs)))
        if not read and sym not in _FACTORIES or any(id(p) not in self._values for p in read):
            return
        real_args, real_kwargs = map_proxies((args, kwargs), lambda p: self._values[id(p)][1])
        if sym in _FACTORIES:
            real_kwargs = {key: _on_cpu(value) for key, value in real_kwargs.items()}
        try:
            with torch.no_grad():
                result = sym.impl(*real_args, **real_kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError):
            return  # arguments only the trace's own call can take (a symbol's meta decides): not known
        results = [result] if isinstance(result, torch.Tensor) else list(result) if isinstance(result, (tuple, list)) \
            else []
        if len(results) != len(outputs):
            return
        for out, value in zip(outputs, results):
            if not isinstance(value, torch.Tensor) or value.dtype != out.dtype or value.shape != out.shape:
                return
        for out, value in zip(outputs, results):
            self._values[id(out)] = (out, value)

    def read(self, func: Any, value: Any) -> tuple[bool, Any]:
        """(True, what `func(value)` gives in eager) where `value`'s contents are known; (False, None) otherwise."""
        known = self._values.get(id(value))
        if known is None:
            return False, None
        with torch._C.DisableTorchFunction():
            return True, func(known[1])
