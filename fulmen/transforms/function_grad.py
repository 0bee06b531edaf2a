"""User autograd Functions in traces: the forward as a recorded region, the Function's own backward as its grad.

Acquisition (`fulmen.acquisition.autograd_functions`) records `Square.apply(x)` as one `autograd_function` call whose
parts are
the ops the Function's `forward` made, run as eager runs it (grad mode off). The call runs as those parts. Its grad
rule replays the parts and traces the Function's `backward` on the cotangents of its outputs, so the backward trace
holds the user's backward where eager's autograd would call it, with the same `ctx`: saved tensors,
`needs_input_grad`, attributes the forward set, non-differentiable outputs and grad materialization.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import FunctionCtx

from fulmen.core.codegen import register_printer, render
from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.source import traceback_location
from fulmen.core.symbol import BoundSymbol, Symbol, Tag, current_builder, iter_proxies, map_proxies
from fulmen.ops.rules.grad import differentiated_call, get_grad, put_grad
from fulmen.ops.rules.tables import RuleKind, register


class FunctionContext(FunctionCtx):
    """The `ctx` a Function's forward and backward see while fulmen traces them (torch's own ctx is an autograd
    node, which proxies cannot enter)."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.to_save: tuple = ()
        self.non_differentiable: tuple = ()
        self.dirty: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors: Any) -> None:
        self.to_save = tensors

    def save_for_forward(self, *tensors: Any) -> None:
        pass  # forward-mode AD only

    def mark_dirty(self, *args: Any) -> None:
        self.dirty = args

    def mark_non_differentiable(self, *args: Any) -> None:
        self.non_differentiable = args

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value

    @property
    def saved_tensors(self) -> tuple:
        return tuple(self.to_save)

    saved_variables = saved_tensors

    def renamed(self, renames: dict[str, TensorProxy]) -> FunctionContext:
        """This ctx reading `renames[name]` wherever it holds the proxy `name` (after CSE renamed a call input)."""
        ctx = copy.copy(self)
        for key, value in vars(self).items():
            setattr(ctx, key, map_proxies(value, lambda p: renames.get(p.pname, p)))
        return ctx


@dataclass(frozen=True, eq=False)
class FunctionCall:
    """One `Function.apply` call, as acquisition saw it."""

    function: type  # the torch.autograd.Function subclass
    ctx: FunctionContext  # as the forward left it
    inputs: tuple[TensorProxy, ...]  # the proxies the call read (captured, then arguments), at acquisition
    tensor_outputs: tuple[bool, ...]  # per output of the forward: whether it is a tensor (backward gets a grad each)

    @property
    def name(self) -> str:
        return f"autograd.Function {self.function.__qualname__}"

    def where(self) -> str:
        code = getattr(self.function.backward, "__code__", None)
        return f" (backward at {code.co_filename}:{code.co_firstlineno})" if code is not None else ""


def _never_called(*args: Any, **kwargs: Any) -> Any:  # pragma: no cover - a region runs as its parts
    raise AssertionError("an autograd_function call runs as its parts")


# Arguments: (FunctionCall, captured proxies, *the Function's arguments); kwargs: the Function's keyword arguments.
AUTOGRAD_FUNCTION = Symbol("autograd_function", "autograd_function", _never_called, tags=Tag.REGION)


def _print_call(bsym: BoundSymbol) -> str:
    call: FunctionCall = bsym.args[0]
    parts = [render(a) for a in bsym.args[2:]] + [f"{k}={render(v)}" for k, v in bsym.kwargs.items()]
    return f"{call.function.__qualname__}.apply({', '.join(parts)})"


register_printer(AUTOGRAD_FUNCTION, _print_call)


def _cotangent(call: FunctionCall, index: int, out: TensorProxy, materialize: bool) -> Any:
    if out.requires_grad:
        if materialize:
            return get_grad(out)
        # The backward is traced once, with a grad for each output: where none reaches one, eager passes None
        return get_grad(out, absent=(
            f"the backward of {call.name}{call.where()} would get None for the grad of its output {index} (the "
            "forward calls ctx.set_materialize_grads(False)), which no grad reaches in this backward; fulmen traces "
            "that backward once, with a grad for every output, and cannot pass None: remove "
            "set_materialize_grads(False) if the backward treats zeros as None, or call the Function outside the "
            "jitted function"))
    # A non-differentiable output: eager hands backward zeros, or None without materialization.
    return torch.zeros_like(out) if materialize else None


def _input_grad(call: FunctionCall, index: int, x: TensorProxy, grad: Any, source: Any) -> Any:
    """`grad` checked and shaped as eager's autograd engine does with a custom backward's result."""
    if type(grad) is not TensorProxy:
        raise TraceError(f"the backward of {call.name} returned {type(grad).__name__} as the grad of argument "
                         f"{index}; expected a tensor or None", source)
    if tuple(grad.shape) != tuple(x.shape):
        try:
            expanded = torch.broadcast_shapes(tuple(x.shape), tuple(grad.shape))
        except RuntimeError:
            expanded = None
        if expanded != tuple(grad.shape):
            raise TraceError(f"the backward of {call.name} returned a grad of shape {tuple(grad.shape)} for argument "
                             f"{index} of shape {tuple(x.shape)}", source)
        grad = grad.sum_to_size(tuple(x.shape))
    return grad.to(x.dtype) if grad.dtype != x.dtype else grad


@register(RuleKind.GRAD, AUTOGRAD_FUNCTION)
def autograd_function_grad(call: FunctionCall, captured: tuple, *args: Any, **kwargs: Any) -> tuple:
    bsym = differentiated_call()
    current_builder().scopes[-1].extend(bsym.subsymbols)  # the forward, exactly as acquired
    produced = {p.pname: p for part in bsym.subsymbols for p in part.proxy_outputs()}
    outputs = [produced[out.pname] for out in bsym.proxy_outputs()]
    now = list(iter_proxies((captured, args, kwargs)))
    ctx = call.ctx.renamed({old.pname: new for old, new in zip(call.inputs, now) if old.pname != new.pname})
    tensors = iter(bsym.proxy_outputs())
    cotangents = [_cotangent(call, index, next(tensors), ctx.materialize_grads) if is_tensor else None
                  for index, is_tensor in enumerate(call.tensor_outputs)]
    try:
        with torch.no_grad():  # eager runs a backward with grad mode off (no create_graph)
            grads = call.function.backward(ctx, *cotangents)
    except TraceError as error:
        location = traceback_location(error.__traceback__) or error.location
        message = str(error).split("\n  at ", 1)[0]
        raise type(error)(f"in the backward of {call.name}{call.where()}: {message}", location) from error
    grads = grads if isinstance(grads, tuple) else (grads,)
    if len(grads) < len(args) or any(g is not None for g in grads[len(args):]):
        raise TraceError(f"the backward of {call.name} returned {len(grads)} grads; its forward takes {len(args)} "
                         "arguments", bsym.source)
    for index, (x, grad) in enumerate(zip(args, grads)):
        if type(x) is TensorProxy and x.requires_grad and grad is not None:
            put_grad(x, _input_grad(call, index, x, grad, bsym.source))
    return tuple(outputs)
