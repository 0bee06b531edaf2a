"""Reverse-mode autodiff on a trace: running the grad rules, and the joint forward-backward program.

Grad rules are written with fulmen.ops.rules.grad (`get_grad`, `put_grad`) and registered in the GRAD table of
fulmen.ops.rules.tables. Running each rule over the forward trace gives a joint program. Everything that does not
depend on a `get_grad` is forward work; the rest forms one backward `Chunk` per differentiated symbol. The backward
trace is the chunks in reverse order, with the cotangents that several uses of a value put summed on the way.

A symbol without a rule is differentiated through its decomposition: the forward keeps the symbol itself (the
one torch call eager makes) and its backward recomputes whatever parts of the decomposition it needs. A leaf
without a rule falls back to torch autograd on its own callable (`impls.torch_vjp`), as its family declares
(`rules.grad.differentiated_by_eager`). A call on complex values that carry grads takes only rules that hold for
them (fulmen.ops.complex: torch's conjugate convention), else eager's backward of the call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fulmen.core.errors import ExecutorContractError, TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Tag, iter_proxies
from fulmen.core.trace import Trace, TraceBuilder
from fulmen.ops.complex import complex_rule, complex_values, through_parts
from fulmen.ops.registry import SYMBOLS
from fulmen.ops.rules import tables
from fulmen.ops.rules.grad import ACTIVE_RULES, GET_GRAD, PUT_GRAD, GradRule, RuleScope, eager_grad_rule
from fulmen.ops.rules.tables import RuleKind
from fulmen.transforms.recording import record_call

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
    # Eager's backward, as the symbol's family declares (rules.grad.differentiated_by_eager); a symbol that declares
    # nothing takes it too, as every leaf did before the declarations: tests/ops/test_rule_coverage.py lists those.
    return eager_grad_rule(bsym.sym)


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
    token = ACTIVE_RULES.set((*ACTIVE_RULES.get(), RuleScope(bsym, {p.pname for p in bsym.proxy_args()}, interpreter)))
    try:
        return record_call(rule, bsym, builder, interpreter, f"the grad rule of {bsym.sym.printed}",
                           may_return_inputs=False)
    finally:
        ACTIVE_RULES.reset(token)


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
        registered = tables.rule(RuleKind.GRAD, bsym.sym)
        if registered is not None:
            # register_grad on an operator of an executor (fulmen.extend): the user's rule too
            yield registered, bsym.sym.executor

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
        if bsym.sym.executor is None and not bsym.sym.tags & Tag.REGION and complex_values(bsym, _differentiable):
            self._augment_complex(bsym, forward, chunks)
            return
        if any(self._apply(rule, bsym, forward, chunks, owner) for rule, owner in self._rules(bsym)):
            return
        if bsym.subsymbols and not bsym.draws_random():
            self._through_parts(bsym, forward, chunks)
            return
        if bsym.subsymbols:  # random draws must happen once: the decomposition itself becomes forward work
            for sub in bsym.subsymbols:
                self._augment(sub, forward, chunks)
            return
        self._apply(_fallback_rule(bsym), bsym, forward, chunks)

    def _through_parts(self, bsym: BoundSymbol, forward: list[BoundSymbol], chunks: list[Chunk]) -> None:
        """Differentiates `bsym` through its decomposition, keeping the composite itself in the forward."""
        sub_forward: list[BoundSymbol] = []
        children: list[Chunk] = []
        for sub in bsym.subsymbols:
            self._augment(sub, sub_forward, children)
        forward.append(bsym)
        chunks.append(Chunk(bsym.output_names(), recompute=sub_forward, children=children))

    def _augment_complex(self, bsym: BoundSymbol, forward: list[BoundSymbol], chunks: list[Chunk]) -> None:
        """A call of fulmen's on complex values that carry grads: fulmen's real rules would miss the conjugations of
        torch's convention, so it takes a rule that holds for complex values, its parts where each has one, or
        eager's backward of the call (fulmen.ops.complex)."""
        rule = complex_rule(bsym, RuleKind.COMPLEX_GRAD)
        if rule is not None and self._apply(rule, bsym, forward, chunks):
            return
        if through_parts(bsym, RuleKind.COMPLEX_GRAD, _differentiable):
            self._through_parts(bsym, forward, chunks)
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
