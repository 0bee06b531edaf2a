"""Views the torch executor need not take: an `expand` read by a broadcasting op, a `reshape` of a `reshape`.

Grad rules spell broadcasting out (RMSNorm's weight grad: `reshape` the weight to (1, 1, C), `expand` it to the
activation's shape, multiply) and reshape in steps (a reduction's keepdim shape, then the parameter's), where eager's
autograd formulas do the same work inside one C++ call. Each view is a Python-level call of the trace, about a
microsecond of host time on the CPU: a deep model's backward holds hundreds. Where the torch executor runs both
calls, `fold_views` lets the reader read the view's input instead: `torch.mul(g, w.expand(shape))` becomes
`torch.mul(g, w)` when the other operand has the expanded shape, and `x.reshape(a).reshape(b)` becomes
`x.reshape(b)`. A call is rewritten only when running its new arguments on meta tensors gives its output's metadata
exactly (shape, strides, storage offset, dtype: type promotion and the output's layout are the same), so the kernel
that runs is eager's on the same elements and the result is identical; the views nothing reads any more go.
"""

from __future__ import annotations

from typing import Any

from fulmen.core import symbolic
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, iter_proxies
from fulmen.core.trace import Trace
from fulmen.executors.torch_eager import torch_executor
from fulmen.ops.registry import SYMBOLS

_EXPAND = SYMBOLS["torch.Tensor.expand"]
_RESHAPE = SYMBOLS["torch.Tensor.reshape"]
_BROADCASTING = frozenset(SYMBOLS[name] for name in ("torch.add", "torch.sub", "torch.mul", "torch.div"))


def fold_views(trace: Trace) -> Trace:
    """`trace` with the torch executor's broadcasting calls reading unexpanded operands and its reshapes of reshapes
    reading the first reshape's input (see the module docstring); the same trace where none applies."""
    producers: dict[str, BoundSymbol] = {}
    bsyms: list[BoundSymbol] = []
    folded = False
    for bsym in trace.bound_symbols:
        if bsym.executor is torch_executor:
            new = _folded(bsym, producers)
            if new is not None:
                bsym, folded = new, True
        for proxy in bsym.proxy_outputs():
            producers[proxy.pname] = bsym
        bsyms.append(bsym)
    if not folded:
        return trace
    return trace.from_trace(trace.provenance, bound_symbols=_without_unread_views(bsyms, trace.output))


def _folded(bsym: BoundSymbol, producers: dict[str, BoundSymbol]) -> BoundSymbol | None:
    if bsym.sym in _BROADCASTING and len(bsym.args) == 2 and not bsym.kwargs:
        args, changed = bsym.args, False
        for position, arg in enumerate(bsym.args):
            view = _torch_view(arg, _EXPAND, producers)
            if view is not None and view.args[0].device == arg.device:
                candidate = (*args[:position], view.args[0], *args[position + 1 :])
                if _same_output(bsym, candidate):
                    args, changed = candidate, True
        return bsym.from_bsym(args=args) if changed else None
    if bsym.sym is _RESHAPE:
        view = _torch_view(bsym.args[0], _RESHAPE, producers)
        if view is not None and _same_output(bsym, (view.args[0], *bsym.args[1:])):
            return bsym.from_bsym(args=(view.args[0], *bsym.args[1:]))
    return None


def _torch_view(arg: Any, sym: Any, producers: dict[str, BoundSymbol]) -> BoundSymbol | None:
    """The torch executor's call of `sym` that made `arg`, if that is where `arg` comes from."""
    if type(arg) is not TensorProxy:
        return None
    producer = producers.get(arg.pname)
    if producer is None or producer.sym is not sym or producer.executor is not torch_executor:
        return None
    return producer


def _same_output(bsym: BoundSymbol, args: tuple) -> bool:
    """Whether `bsym`'s symbol run on `args` gives exactly the metadata of `bsym`'s output (on meta tensors)."""
    outputs = bsym.proxy_outputs()
    if len(outputs) != 1 or any(symbolic.has_symbolic_sizes(p.meta) for p in (*outputs, *iter_proxies(args))):
        return False
    metas = tuple(arg.meta if type(arg) is TensorProxy else arg for arg in args)
    try:
        result = bsym.sym.impl(*metas, **bsym.kwargs)
    except Exception:  # noqa: BLE001 - arguments the call does not take: not rewritten
        return False
    expected = outputs[0].meta
    # a view where the calls it replaces made one (a reshape copies what it cannot view): the same aliasing
    return (
        result.shape == expected.shape
        and result.stride() == expected.stride()
        and result.storage_offset() == expected.storage_offset()
        and result.dtype == expected.dtype
        and result._is_view() == expected._is_view()
    )


def _without_unread_views(bsyms: list[BoundSymbol], output: Any) -> list[BoundSymbol]:
    """`bsyms` less the torch executor's expands and reshapes whose outputs nothing reads (views: no effect)."""
    read = {proxy.pname for proxy in iter_proxies(output)}
    kept: list[BoundSymbol] = []
    for bsym in reversed(bsyms):
        if (
            bsym.sym in (_EXPAND, _RESHAPE)
            and bsym.executor is torch_executor
            and not any(name in read for name in bsym.output_names())
        ):
            continue
        read.update(bsym.arg_names())
        kept.append(bsym)
    return kept[::-1]
