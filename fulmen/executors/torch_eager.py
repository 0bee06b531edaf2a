"""The torch executor: runs every symbol fulmen defines with the torch callable it was acquired from.

It is always last in the executor list, so every torch-level symbol and prim has an implementation. Symbols print
as their torch callable (`torch.nn.functional.linear`), so what it runs is plain PyTorch.

Where a symbol's callable is Python wrapped around one torch function, the torch executor's call of it runs that
function itself: a shape prim (`prims.reshape(x, shape)` runs `Symbol.__call__`, which looks for a trace being built,
then the prim's lambda) runs as the tensor method it calls (`torch.Tensor.reshape(x, shape)`; `direct_calls`, after
fusion, as regions compile prims), and `torch.split` / `Tensor.split` with a list of sizes (Python functions choosing
by the argument's type) as `torch.Tensor.split_with_sizes` (an execution transform). The same torch function runs on
the same arguments, so results are identical; a backward of a deep model runs thousands of these calls, and on a
host-bound step each wrapper's frames cost about as much as the op they wrap. Elementwise prims stay as they print
(`prims.exp`): a trace shows which of its calls fulmen's rules made.
"""

from __future__ import annotations

from typing import Any

import torch

from fulmen.core.symbol import BoundSymbol, Symbol, Tag
from fulmen.core.trace import Trace
from fulmen.executors.base import DIRECT, Executor, Implementation
from fulmen.ops import prims
from fulmen.ops.registry import SYMBOLS


class TorchExecutor(Executor):
    def claims(self, bsym: BoundSymbol) -> Implementation | None:
        if bsym.sym.executor is not None or bsym.sym.tags & Tag.REGION:
            return None
        direct = _DIRECT.get(bsym.sym)
        return direct if direct is not None and direct.accepts(bsym) else DIRECT


def _sizes(args: tuple, kwargs: dict[str, Any]) -> Any:
    """A split's second argument, however it was spelled (`torch.split`'s name for it, or `Tensor.split`'s)."""
    return args[1] if len(args) > 1 else kwargs.get("split_size_or_sections", kwargs.get("split_size"))


def _split_with_sizes(x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """`torch.split(x, sizes, dim)` as the call it makes with a list of sizes, `x.split_with_sizes(sizes, dim)`."""
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    return x.split_with_sizes(_sizes((x, *args), kwargs), dim=dim)


# Split with a list of sizes (an int, the size of every piece, makes another call).
_SPLIT_WITH_SIZES = Implementation(
    checker=lambda *args, **kwargs: isinstance(_sizes(args, kwargs), (list, tuple)),
    execution_transform=_split_with_sizes,
)
# symbol -> the torch call it makes, recorded in its place; each shape prim's lambda calls that tensor method
_DIRECT: dict[Symbol, Implementation] = {
    SYMBOLS["torch.functional.split"]: _SPLIT_WITH_SIZES,
    SYMBOLS["torch.Tensor.split"]: _SPLIT_WITH_SIZES,
}
# shape prim -> the tensor method its lambda calls, with the same arguments. A rename rather than an execution
# transform: the transform's call would be claimed again, and an executor that decomposes the method (into this
# prim) would leave the prim to nobody.
_METHODS: dict[Symbol, Symbol] = {
    prim: SYMBOLS[f"torch.Tensor.{prim.name}"]
    for prim in (prims.reshape, prims.expand, prims.permute, prims.squeeze, prims.unsqueeze)
}


def direct_calls(trace: Trace) -> Trace:
    """`trace` with the torch executor's shape prims called as the tensor methods they wrap."""
    if not any(bsym.executor is torch_executor and bsym.sym in _METHODS for bsym in trace.bound_symbols):
        return trace
    bsyms = [bsym.from_bsym(sym=_METHODS[bsym.sym]) if bsym.executor is torch_executor and bsym.sym in _METHODS
             else bsym for bsym in trace.bound_symbols]
    return trace.from_trace(trace.provenance, bound_symbols=bsyms)


torch_executor = TorchExecutor("torch")
