"""What a grad rule is written with, and how a symbol without one is differentiated.

A grad rule is written like the symbol it differentiates: it takes the same arguments, computes the forward
result with symbols (or plain torch code on the proxies), asks for the cotangent of its outputs with
`get_grad(out)` and hands the cotangents of its inputs back with `put_grad(x, grad)`:

    @register(RuleKind.GRAD, torch.nn.functional.silu)
    def silu_grad(x, inplace=False):
        y = torch.nn.functional.silu(x)
        s = torch.sigmoid(x)
        put_grad(x, get_grad(y) * s * (1 + x * (1 - s)))
        return y

`get_grad` and `put_grad` record markers (`GET_GRAD`, `PUT_GRAD`) that autodiff (fulmen.transforms.autodiff)
resolves when it splits the recording into forward and backward work. A symbol without a rule is differentiated
through its decomposition; a leaf with neither is differentiated by eager's own backward (`eager_grad_rule`, torch
autograd on its callable), which its family declares (`differentiated_by_eager`), or declares it has no grad at all
(`not_differentiable`). `fallback_of` says which; tests/ops/test_rule_coverage.py lists every symbol declaring neither.

This module imports only fulmen.core and the leaves of fulmen.ops, so an op's family module can use it.
"""

from __future__ import annotations

import enum
import itertools
import types
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from fulmen.core import pytree
from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Symbol, Tag, iter_proxies
from fulmen.core.trace import TraceBuilder
from fulmen.ops.kernels import impls
from fulmen.ops.registry import impl_symbol, symbol_of
from fulmen.ops.rules.tables import RuleKind, register

GradRule = Callable[..., Any]
Rule = TypeVar("Rule", bound=GradRule)


def register_grad(target: Symbol | Callable[..., Any]) -> Callable[[Rule], Rule]:
    """`@fulmen.register_grad(target)`: the decorated function becomes the grad rule of `target` (a symbol or a torch
    callable), replacing the one fulmen has: users replace a rule on purpose. fulmen's own rules register with
    `register(RuleKind.GRAD, target)`, which refuses a second rule for one symbol."""
    sym = symbol_of(target, RuleKind.GRAD.value)  # a callable without a symbol is an error here, not when decorating

    def decorator(rule: Rule) -> Rule:
        return register(RuleKind.GRAD, sym, rule, replace=True)

    return decorator


# --- get_grad / put_grad -------------------------------------------------------------------------------------------
def _get_grad_meta(builder: TraceBuilder, x: TensorProxy, absent: str | None = None) -> TensorProxy:
    # a placeholder, never printed; cached by x's layout (with symbolic sizes empty_like costs ~0.7 ms of SymInt
    # arithmetic, once per differentiated output)
    meta = builder.cached_meta(GET_GRAD, (x,), {}, lambda: torch.empty_like(x.meta))
    return builder.make_proxy(meta, x.device, False)


def _marker_impl(*args: Any) -> Any:  # pragma: no cover - markers never reach a final trace
    raise AssertionError("get_grad/put_grad markers are resolved by the grad transform")


GET_GRAD = Symbol("get_grad", "get_grad", _marker_impl, meta=_get_grad_meta)
PUT_GRAD = Symbol("put_grad", "put_grad", _marker_impl, meta=lambda builder, x, grad: None, tags=Tag.IMPURE)


@dataclass
class RuleScope:
    """A grad rule autodiff is running: the call it differentiates and what the rule's torch calls run under."""

    bsym: BoundSymbol
    inputs: set[str]  # the names of the call's tensor inputs: the only ones a rule may put grads for
    interpreter: Any  # fulmen.acquisition.acquire.Interpreter


# The grad rules running now, innermost last (a rule may differentiate a call that has a rule of its own). autodiff
# pushes a scope around each rule it runs.
ACTIVE_RULES: ContextVar[tuple[RuleScope, ...]] = ContextVar("fulmen_grad_rules", default=())


def _active(what: str) -> RuleScope:
    active = ACTIVE_RULES.get()
    if not active:
        raise RuntimeError(f"{what} can only be called inside a grad rule (a grad_transform run by fulmen)")
    return active[-1]


def differentiated_call() -> BoundSymbol:
    """The call whose grad rule is running (for rules that replay the parts a call recorded)."""
    return _active("differentiated_call").bsym


def get_grad(x: TensorProxy, *, absent: str | None = None) -> TensorProxy:
    """The cotangent of `x`, an output of the forward computation of the rule being run: zeros where no grad reaches
    `x`, unless `absent` says why zeros cannot stand for it (a backward that sees None instead): then the backward is
    refused with that message."""
    x = _active("get_grad").interpreter.current_values(x)  # an output the rule updated in place: its new value
    if type(x) is not TensorProxy:
        raise TypeError(f"get_grad expects a tensor of the trace, got {type(x).__name__}")
    return GET_GRAD(x) if absent is None else GET_GRAD(x, absent=absent)


def put_grad(x: Any, grad: Any) -> None:
    """Adds `grad` to the cotangent of `x`, an input of the symbol being differentiated."""
    scope = _active("put_grad")
    if type(x) is not TensorProxy:
        return  # Python numbers and constants have no cotangent
    grad = scope.interpreter.current_values(grad)  # a grad the rule updated in place (`g.scatter_add_(...)`)
    if x.pname not in scope.inputs:
        raise TraceError(
            f"put_grad on {x.pname}, which is not an input of {scope.bsym.sym.printed}; a grad rule may only put "
            "grads for the inputs of the symbol it differentiates",
            scope.bsym.source,
        )
    if type(grad) is not TensorProxy or tuple(grad.shape) != tuple(x.shape) or grad.dtype != x.dtype:
        got = grad.type_string() if type(grad) is TensorProxy else type(grad).__name__
        raise TraceError(
            f"the grad rule of {scope.bsym.sym.printed} put a grad of {got} for {x.pname}: {x.type_string()}",
            scope.bsym.source,
        )
    PUT_GRAD(x, grad)


def wants_grad(x: Any) -> bool:
    """Whether a grad rule should put a grad for `x`: a tensor argument that requires grad."""
    return isinstance(x, torch.Tensor) and x.requires_grad


def put_grads(xs: Any, grads: Any) -> None:
    """`put_grad` over matching structures of inputs and grads."""
    for x, grad in zip(_flat(xs), _flat(grads)):
        put_grad(x, grad)


def _flat(obj: Any) -> list[Any]:
    return list(pytree.leaves(obj, pytree.is_leaf))


# --- eager's backward: torch autograd on the symbol's own callable --------------------------------------------------
def _torch_vjp_meta(builder: TraceBuilder, fn, args, kwargs, wrt, cotangents) -> tuple[TensorProxy, ...]:
    flat = list(iter_proxies((args, kwargs)))
    return tuple(builder.make_proxy(torch.empty_like(flat[i].meta), flat[i].device) for i in wrt)


torch_vjp = impl_symbol(impls.torch_vjp, meta=_torch_vjp_meta)


def reached_inputs(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], wrt: tuple[int, ...]
                   ) -> tuple[int, ...]:
    """The inputs among `wrt` (positions among the proxies) that eager's autograd reaches from `fn`'s outputs: the
    others get no grad in eager (None, not zeros, which an optimizer would step on). Read off the graph `fn` builds
    on meta tensors; all of `wrt` where `fn` cannot run on them."""
    position = itertools.count()
    leaves: dict[int, int] = {}  # id(meta leaf) -> its position

    def leaf(proxy: TensorProxy) -> torch.Tensor:
        meta = proxy.meta.detach()
        i = next(position)
        if i in wrt:
            meta.requires_grad_(True)
            leaves[id(meta)] = i
        return meta

    with torch._C.DisableTorchFunction(), torch.enable_grad():  # fulmen's own computation, not the program's
        meta_args, meta_kwargs = pytree.tree_map(leaf, (args, kwargs), lambda obj: type(obj) is TensorProxy)
        try:
            out = fn(*meta_args, **meta_kwargs)
        except Exception:  # noqa: BLE001  (no meta kernel: assume every input is reached)
            return wrt
        return tuple(i for i in wrt if i in _leaves_reached(out, leaves))


def _leaves_reached(out: Any, leaves: dict[int, int]) -> set[int]:
    """The positions of the `leaves` (id -> position) that the autograd graph of `out` reaches."""
    found: set[int] = set()
    nodes = []
    for o in pytree.leaves(out, lambda obj: isinstance(obj, torch.Tensor)):
        if id(o) in leaves:  # an input returned as it is
            found.add(leaves[id(o)])
        nodes.append(o.grad_fn)
    # Held, not just their ids: the Python object of a node can be freed once it is let go, and a node met later
    # can get its id (torch 2.11 does): taken as seen, its part of the graph was skipped and its leaves got no grad.
    seen: dict[int, Any] = {}
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf the graph reaches
        if variable is not None and id(variable) in leaves:
            found.add(leaves[id(variable)])
        nodes.extend(child for child, _ in node.next_functions)
    return found


def eager_grad_rule(sym: Symbol) -> GradRule:
    """The grad rule that runs eager's own backward of `sym` (torch autograd on its callable, in the backward)."""

    def rule(*args: Any, **kwargs: Any) -> Any:
        out = sym(*args, **kwargs)
        flat = list(iter_proxies((args, kwargs)))
        wrt = reached_inputs(sym.impl, args, kwargs, tuple(i for i, p in enumerate(flat) if p.requires_grad))
        if not wrt:
            return out
        outs = [o for o in iter_proxies(out) if o.dtype.is_floating_point or o.dtype.is_complex]
        grads = torch_vjp(sym, args, kwargs, wrt, tuple(get_grad(o) for o in outs))
        for i, grad in zip(wrt, grads):
            put_grad(flat[i], grad)
        return out

    return rule


# --- how a symbol without a rule or a decomposition is differentiated, as its family declares ----------------------
class Fallback(enum.Enum):
    """How autodiff differentiates a leaf symbol (no grad rule, no decomposition); the value says it, for tables."""

    EAGER_BACKWARD = "eager's backward"  # torch autograd on the op's own callable, in the backward (`eager_grad_rule`)
    NOT_DIFFERENTIABLE = "not differentiable"  # no output ever carries a grad (integer or bool results, factories)


class DuplicateFallbackError(ValueError):
    """A symbol declared twice (`differentiated_by_eager`, `not_differentiable`)."""


_FALLBACKS: dict[Symbol, Fallback] = {}


def differentiated_by_eager(*targets: Symbol | Callable[..., Any]) -> None:
    """Declares that autodiff differentiates each of `targets` (symbols or torch callables bound to one) by eager's
    own backward: eager's grads, recomputing the op in the backward (for ops without a rule worth writing: pooling,
    factorizations, FFTs, less common losses)."""
    _declare(targets, Fallback.EAGER_BACKWARD)


def not_differentiable(*targets: Symbol | Callable[..., Any]) -> None:
    """Declares that no output of each of `targets` ever carries a grad, as in eager: integer and bool results
    (comparisons, indices, counts) and factories that read no tensor."""
    _declare(targets, Fallback.NOT_DIFFERENTIABLE)


def _declare(targets: tuple[Symbol | Callable[..., Any], ...], fallback: Fallback) -> None:
    for target in targets:
        sym = symbol_of(target, f"the fallback {fallback.value!r}")
        existing = _FALLBACKS.get(sym)
        if existing is not None:
            raise DuplicateFallbackError(f"{sym.printed} is declared {existing.value!r} already; declare it once")
        _FALLBACKS[sym] = fallback


def declared_fallback(sym: Symbol) -> Fallback | None:
    """What `sym`'s family declares: `differentiated_by_eager`, `not_differentiable`, or None."""
    return _FALLBACKS.get(sym)


def fallback_of(sym: Symbol) -> Fallback | None:
    """How autodiff differentiates `sym` when it has neither a grad rule nor a decomposition: as declared, or as
    follows from what the symbol is (an impure or NO_GRAD op is never differentiated; an operator bound when a
    program first calls it, registry._operator_binding, is by its own autograd formula). None: nothing says, and
    autodiff takes eager's backward for it all the same (the rule-coverage test lists these)."""
    declared = _FALLBACKS.get(sym)
    if declared is not None:
        return declared
    if sym.tags & (Tag.IMPURE | Tag.NO_GRAD) or (
            sym.differentiable_outputs is not None and not any(sym.differentiable_outputs)):
        return Fallback.NOT_DIFFERENTIABLE
    if isinstance(sym.impl, torch._ops.OpOverload | torch._ops.OpOverloadPacket) and sym.printed.startswith(
            "torch.ops.") and sym.decomposition is None and sym.meta is None:
        return Fallback.EAGER_BACKWARD
    return None


def fallbacks() -> Mapping[Symbol, Fallback]:
    """The declarations, read-only."""
    return types.MappingProxyType(_FALLBACKS)


# eager's backward differentiated again (a grad of a grad, fulmen.jvp of a grad): torch autograd on the backward
differentiated_by_eager(torch_vjp)
