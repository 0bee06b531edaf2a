"""Reverse-mode autodiff on a trace: grad rules, `get_grad` / `put_grad`, and the joint forward-backward program.

A grad rule is written like the symbol it differentiates: it takes the same arguments, computes the forward
result with symbols (or plain torch code on the proxies), asks for the cotangent of its outputs with
`get_grad(out)` and hands the cotangents of its inputs back with `put_grad(x, grad)`:

    @register_grad(torch.nn.functional.silu)
    def silu_grad(x, inplace=False):
        y = torch.nn.functional.silu(x)
        s = torch.sigmoid(x)
        put_grad(x, get_grad(y) * s * (1 + x * (1 - s)))
        return y

Running each rule over the forward trace gives a joint program. Everything that does not depend on a
`get_grad` is forward work; the rest forms one backward `Chunk` per differentiated symbol. The backward trace
is the chunks in reverse order, with the cotangents that several uses of a value put summed on the way.

A symbol without a rule is differentiated through its decomposition: the forward keeps the symbol itself (the
one torch call eager makes) and its backward recomputes whatever parts of the decomposition it needs. A leaf
without a rule falls back to torch autograd on its own callable (`impls.torch_vjp`).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from fulmen.core import pytree
from fulmen.core.errors import ExecutorContractError, TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Symbol, Tag, iter_proxies
from fulmen.core.trace import Trace, TraceBuilder
from fulmen.ops import impls
from fulmen.ops.registry import SYMBOLS, impl_symbol, rule_registrar
from fulmen.transforms.recording import record_call

GradRule = Callable[..., Any]

# symbol -> rule. Executors put their own grad_transform ahead of these (fulmen.extend).
GRAD_RULES: dict[Symbol, GradRule] = {}


# @register_grad(target): the decorated function is the grad rule of `target` (a symbol or a torch callable).
register_grad = rule_registrar(GRAD_RULES, "a grad rule")


# --- get_grad / put_grad -------------------------------------------------------------------------------------------
def _get_grad_meta(builder: TraceBuilder, x: TensorProxy, absent: str | None = None) -> TensorProxy:
    return builder.make_proxy(torch.empty_like(x.meta), x.device, False)  # a placeholder: never printed


def _marker_impl(*args: Any) -> Any:  # pragma: no cover - markers never reach a final trace
    raise AssertionError("get_grad/put_grad markers are resolved by the grad transform")


GET_GRAD = Symbol("get_grad", "get_grad", _marker_impl, meta=_get_grad_meta)
PUT_GRAD = Symbol("put_grad", "put_grad", _marker_impl, meta=lambda builder, x, grad: None, tags=Tag.IMPURE)


@dataclass
class _RuleScope:
    bsym: BoundSymbol
    inputs: set[str]
    interpreter: Any  # what the rule's torch calls run under (fulmen.acquisition.acquire.Interpreter)


# The grad rules running now, innermost last (a rule may differentiate a call that has a rule of its own).
_ACTIVE: ContextVar[tuple[_RuleScope, ...]] = ContextVar("fulmen_grad_rules", default=())


def _active(what: str) -> _RuleScope:
    active = _ACTIVE.get()
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


# --- the fallback: torch autograd on the symbol's own callable ------------------------------------------------------
def _torch_vjp_meta(builder: TraceBuilder, fn, args, kwargs, wrt, cotangents) -> tuple[TensorProxy, ...]:
    flat = list(iter_proxies((args, kwargs)))
    return tuple(builder.make_proxy(torch.empty_like(flat[i].meta), flat[i].device) for i in wrt)


torch_vjp = impl_symbol(impls.torch_vjp, meta=_torch_vjp_meta)


# Ops whose result depends on storage layout, which traces do not model: their grads would differ from eager's
# for inputs that are views, so they are refused rather than differentiated.
STORAGE_OPS = frozenset({"torch.as_strided", "torch.Tensor.as_strided", "torch.as_strided_scatter"})


def _fallback_rule(bsym: BoundSymbol) -> GradRule:
    if bsym.sym.executor is not None:
        raise TraceError(f"operator {bsym.sym.name} of executor {bsym.sym.executor.name!r} has no grad: give it a "
                         "grad_transform with register_implementation", bsym.source)
    if bsym.sym.tags & Tag.RANDOM:
        raise TraceError(f"fulmen has no grad rule for the random op {bsym.sym.printed}", bsym.source)
    if bsym.sym.printed in STORAGE_OPS:
        raise TraceError(f"fulmen cannot differentiate {bsym.sym.printed}: it addresses storage, which traces do not "
                         "model", bsym.source)

    return eager_grad_rule(bsym.sym)


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


# --- the joint program ---------------------------------------------------------------------------------------------
@dataclass
class Chunk:
    """The backward work of one differentiated symbol.

    `recompute` are forward ops the backward reruns (the decomposition of a symbol without a rule); `children`
    are then the chunks of that decomposition, and `bsyms` is empty.
    """

    targets: list[str]  # the forward values whose cotangents this chunk reads
    bsyms: list[BoundSymbol] = field(default_factory=list)
    recompute: list[BoundSymbol] = field(default_factory=list)
    children: list[Chunk] | None = None


@dataclass
class Joint:
    forward: list[BoundSymbol]
    chunks: list[Chunk]


def _differentiable(p: Any) -> bool:
    return type(p) is TensorProxy and p.requires_grad


def _run_rule(rule: GradRule, bsym: BoundSymbol, builder: TraceBuilder, interpreter) -> list[BoundSymbol] | None:
    """Runs `rule` on the arguments of `bsym`; returns what it recorded, with its results named as bsym's outputs."""
    token = _ACTIVE.set((*_ACTIVE.get(), _RuleScope(bsym, {p.pname for p in bsym.proxy_args()}, interpreter)))
    try:
        return record_call(rule, bsym, builder, interpreter, f"the grad rule of {bsym.sym.printed}",
                           may_return_inputs=False)
    finally:
        _ACTIVE.reset(token)


def _split(recorded: list[BoundSymbol], targets_from: BoundSymbol) -> tuple[list[BoundSymbol], Chunk]:
    """Forward work (independent of any cotangent) and the backward chunk of a rule's recording."""
    tainted: set[str] = set()
    forward, backward = [], []
    for b in recorded:
        if b.sym is GET_GRAD or b.sym is PUT_GRAD or any(name in tainted for name in b.arg_names()):
            backward.append(b)
            tainted.update(b.output_names())
        else:
            forward.append(b)
    targets = [b.args[0].pname for b in backward if b.sym is GET_GRAD]
    outputs = set(targets_from.output_names())
    stray = [name for name in targets if name not in outputs]
    if stray:
        raise TraceError(f"the grad rule of {targets_from.sym.printed} asked get_grad of {stray}, which are not "
                         "outputs of the symbol; ask for the grads of the outputs the rule returns",
                         targets_from.source)
    return forward, Chunk(targets, backward)


class GradTransform:
    """Builds the joint program of a forward trace."""

    def __init__(self, trace: Trace, interpreter_factory: Callable[[TraceBuilder], Any],
                 executors: tuple[Any, ...] = ()) -> None:
        self.builder = TraceBuilder(namespace=trace.namespace)
        self.interpreter = interpreter_factory(self.builder)
        self.trace = trace
        self.executors = executors

    def _rules(self, bsym: BoundSymbol) -> Iterator[tuple[GradRule, Any]]:
        """The grad rules to try for `bsym`, each with the executor whose user registered it (None for fulmen's
        own): active executors' grad_transforms in priority order, then the registered rule."""
        for executor in self.executors:
            rule = executor.grad_rule(bsym)
            if rule is not None:
                yield rule, executor
        rule = GRAD_RULES.get(bsym.sym)
        if rule is not None:
            # register_grad on an operator of an executor (fulmen.extend): the user's rule too
            yield rule, bsym.sym.executor

    def joint(self) -> Joint:
        forward: list[BoundSymbol] = []
        chunks: list[Chunk] = []
        with self.builder:
            for bsym in self.trace.bound_symbols:
                self._augment(bsym, forward, chunks)
        return Joint(forward, chunks)

    def _augment(self, bsym: BoundSymbol, forward: list[BoundSymbol], chunks: list[Chunk]) -> None:
        if bsym.sym.tags & Tag.IMPURE:
            # A write-back into a program input: the values inside this call are right, but no grad flows through
            # the written tensor into later calls, so writing a value with a history into a tensor that requires
            # grad is refused (acquisition writes the values alone of an update autograd does not see).
            written = bsym.args[-1]
            if _differentiable(written) and _differentiable(bsym.args[0]):
                raise TraceError(f"fulmen cannot differentiate an in-place update of {written.pname}, an input that "
                                 "requires grad", bsym.source)
            forward.append(bsym)
            return
        needs_grad = any(_differentiable(p) for p in bsym.proxy_args()) and any(
            _differentiable(o) for o in bsym.proxy_outputs())
        if not needs_grad:
            forward.append(bsym)
            return
        _refuse_complex(bsym)
        if any(self._apply(rule, bsym, forward, chunks, owner) for rule, owner in self._rules(bsym)):
            return
        if bsym.subsymbols and not bsym.draws_random():
            # Differentiate through the decomposition, keeping the composite itself in the forward.
            sub_forward: list[BoundSymbol] = []
            children: list[Chunk] = []
            for sub in bsym.subsymbols:
                self._augment(sub, sub_forward, children)
            forward.append(bsym)
            chunks.append(Chunk(bsym.output_names(), recompute=sub_forward, children=children))
            return
        if bsym.subsymbols:  # random draws must happen once: the decomposition itself becomes forward work
            for sub in bsym.subsymbols:
                self._augment(sub, forward, chunks)
            return
        self._apply(_fallback_rule(bsym), bsym, forward, chunks)

    def _apply(self, rule: GradRule, bsym: BoundSymbol, forward: list[BoundSymbol], chunks: list[Chunk],
               owner: Any = None) -> bool:
        """Runs `rule` for `bsym`, adding its forward work and its chunk; False when the rule declines. `owner` is the
        executor of a user's rule (fulmen.extend), which must put a grad for each input that requires one."""
        recorded = _run_rule(rule, bsym, self.builder, self.interpreter)
        if recorded is None:
            return False
        if owner is not None:
            _refuse_missing_grads(rule, bsym, recorded, owner)
        fwd, chunk = _split(recorded, bsym)
        forward.extend(fwd)
        chunks.append(chunk)
        return True


def _refuse_missing_grads(rule: GradRule, bsym: BoundSymbol, recorded: list[BoundSymbol], owner: Any) -> None:
    """A user's rule that puts no grad for a floating input that requires grad: the backward would take that grad as
    zero (or, with nothing else reaching the input, fail in torch with 'does not require grad'). fulmen's own rules
    leave out only inputs eager gives no grad (integer or non-differentiable arguments), which are checked by
    tests against eager; a user's rule is not, so a zero must be put explicitly."""
    put = {b.args[0].pname for b in recorded if b.sym is PUT_GRAD}
    missing = next((p for p in bsym.proxy_args() if _differentiable(p) and p.dtype.is_floating_point
                    and p.pname not in put), None)
    if missing is None:
        return
    name = _parameter_name(rule, bsym, missing)
    x = name if name.isidentifier() else "x"
    raise ExecutorContractError(
        f"the grad_transform of {bsym.sym.printed} (executor {owner.name!r}) puts no grad for its input {name} "
        f"({missing.type_string()}), which requires grad: fulmen would take that grad as zero. Call put_grad(x, "
        f"grad) for each floating input x whose .requires_grad is True; where the grad is zero, say so: "
        f"put_grad({x}, torch.zeros_like({x}))",
        bsym.source,
    )


def _parameter_name(rule: GradRule, bsym: BoundSymbol, proxy: TensorProxy) -> str:
    """The name `rule` gives the argument holding `proxy` (the user wrote the rule), else its position or keyword."""
    try:
        signature = inspect.signature(rule)
        bound = signature.bind(*bsym.args, **bsym.kwargs).arguments
    except (TypeError, ValueError):  # a builtin or a signature the call does not fit: the rule ran anyway
        bound = {}
    for name, value in bound.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            bound.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL and any(p is proxy for p in iter_proxies(value)):
            return name
    for key, value in bsym.kwargs.items():
        if any(p is proxy for p in iter_proxies(value)):
            return key
    position = next(i for i, value in enumerate(bsym.args) if any(p is proxy for p in iter_proxies(value)))
    return f"argument {position}"


def _refuse_complex(bsym: BoundSymbol) -> None:
    """fulmen's grad rules are written for real tensors: on complex ones they give the conjugate of eager's grads
    (torch's convention, conjugate Wirtinger derivatives), so differentiating a complex value is refused."""
    complex_value = next(
        (p for p in (*bsym.proxy_args(), *bsym.proxy_outputs()) if _differentiable(p) and p.dtype.is_complex), None
    )
    if complex_value is not None:
        raise TraceError(
            f"fulmen cannot differentiate {bsym.sym.printed} of the complex tensor "
            f"{complex_value.pname} ({complex_value.type_string()}): its grad would not follow torch's "
            "convention for complex grads; compute with real tensors (real and imaginary parts apart), or "
            "call it under torch.no_grad() or on .detach()",
            bsym.source,
        )


# --- backward assembly ---------------------------------------------------------------------------------------------
def _same_layout(a: TensorProxy, b: TensorProxy) -> bool:
    return a.stride() == b.stride() and a.storage_offset() == b.storage_offset()


def substitute(bsym: BoundSymbol, mapping: dict[str, TensorProxy]) -> BoundSymbol:
    """`bsym` (and its subsymbols) reading `mapping[name]` wherever it read `name`."""
    return bsym.with_args_mapped(lambda p: mapping.get(p.pname, p)) if mapping else bsym


class BackwardAssembler:
    """Emits the chunks in reverse order, summing cotangents, into the builder's current scope."""

    def __init__(self, builder: TraceBuilder) -> None:
        self.builder = builder
        self.cot: dict[str, TensorProxy] = {}  # forward value -> its cotangent so far
        self.add = SYMBOLS["torch.add"]
        self.zeros = SYMBOLS["torch.zeros"]

    def run(self, chunks: list[Chunk]) -> None:
        for chunk in reversed(chunks):
            self._emit(chunk)

    def _emit(self, chunk: Chunk) -> None:
        if not any(name in self.cot for name in chunk.targets):
            return
        emitted = self.builder.scopes[-1]
        if chunk.children is not None:
            # The composite's own outputs are forward values (saved, or recomputed by the composite itself).
            outputs = set(chunk.targets)
            emitted.extend(b for b in chunk.recompute if not outputs.issuperset(b.output_names()))
            for child in reversed(chunk.children):
                self._emit(child)
            return
        mapping: dict[str, TensorProxy] = {}
        for b in chunk.bsyms:
            if b.sym is GET_GRAD:
                x = b.args[0]
                grad = self.cot.get(x.pname)
                if grad is None:
                    self.builder.source = b.source
                    if b.kwargs.get("absent") is not None:
                        raise TraceError(b.kwargs["absent"], b.source)
                    grad = self.zeros(tuple(x.shape), dtype=x.dtype, device=x.device)
                mapping[b.output.pname] = grad
            elif b.sym is PUT_GRAD:
                x, grad = b.args
                grad = mapping.get(grad.pname, grad)
                if x.requires_grad:
                    self.accumulate(x, grad, b)
            else:
                self._replay(b, mapping, emitted)

    def _replay(self, b: BoundSymbol, mapping: dict[str, TensorProxy], emitted: list[BoundSymbol]) -> None:
        """Emits `b` reading the cotangents that arrived. The rule ran on placeholders laid out as the forward
        values; a cotangent laid out otherwise changes the strides of what `b` gives (a permute of it, and whether a
        reshape after that copies), so `b` is bound again and its outputs take their real layouts: region planning
        and memory planning read them."""
        new = substitute(b, mapping)
        if all(_same_layout(p, mapping.get(p.pname, p)) for p in b.proxy_args()):
            emitted.append(new)
            return
        self.builder.source = b.source
        result = b.sym(*new.args, **new.kwargs)
        for old, fresh in zip(b.proxy_outputs(), iter_proxies(result), strict=True):
            mapping[old.pname] = fresh

    def accumulate(self, x: TensorProxy, grad: TensorProxy, where: BoundSymbol | None = None) -> None:
        earlier = self.cot.get(x.pname)
        if earlier is None:
            self.cot[x.pname] = grad
        else:
            self.builder.source = where.source if where is not None else None
            self.cot[x.pname] = self.add(earlier, grad)
