"""A function compiled by Inductor without Dynamo: traced once per argument layout, then called directly.

`torch.compile` re-runs Dynamo's guards on every call (about 25 us of host time each, hundreds of calls in a
transformer step). fulmen's callers already know what a guard would check, so each compiled variant is keyed by
what can still vary between calls: `InductorFunction(fn, options, key=...)` traces `fn` to an aten graph (`make_fx`
on fake copies of the arguments) and hands it to `torch._inductor.compile` on the first call with a new key.

* `strides` (the default): a fusion region of a trace, whose shapes, dtypes and devices the trace fixes; Inductor's
  code still indexes with the strides it was compiled for.
* `layouts`: shapes, strides, dtypes and devices, for a helper called with several shapes (chunks of rows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx


def strides(args: tuple[torch.Tensor, ...]) -> tuple:
    return tuple([arg.stride() for arg in args])


def layouts(args: tuple[torch.Tensor, ...]) -> tuple:
    return tuple([(arg.shape, arg.stride(), arg.dtype, arg.device) for arg in args])


class InductorFunction:
    """`fn(*tensors)` compiled by Inductor, one variant per `key(args)`."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any] | None = None,
                 key: Callable[[tuple[torch.Tensor, ...]], tuple] = strides) -> None:
        self._fn = fn
        self._options = options or None
        self._key = key
        self.variants: dict[tuple, Callable[..., Any]] = {}

    def __call__(self, *args: torch.Tensor) -> Any:
        compiled = self.variants.get(self._key(args))
        if compiled is None:
            compiled = self._compile(args)
        return compiled(*args)

    def _compile(self, args: tuple[torch.Tensor, ...]) -> Callable[..., Any]:
        # Callers run where nothing records autograd (inside the autograd bridge, or without grad), so `fn` is
        # traced and compiled as inference on detached arguments.
        with torch.no_grad():
            inputs = [arg.detach() for arg in args]
            graph = make_fx(self._fn, tracing_mode="fake")(*inputs)
            compiled = torch._inductor.compile(graph, inputs, options=self._options)
        self.variants[self._key(args)] = compiled
        return compiled
