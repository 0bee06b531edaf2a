"""Executor objects: who may run which symbols of a final trace.

An executor list is a priority order. For each call in a trace the first executor that can run it claims it:

* an `OperatorExecutor` runs its own operators (`register_operator`) and the symbols it has an implementation
  for (`register_implementation`), when the implementation's checker accepts the call's arguments; an
  implementation with an `execution_transform` replaces the call by the transform's program, whose calls are
  claimed in turn; one with a `grad_transform` is the symbol's grad rule while the executor is active.
* a `FusionExecutor` sees the trace after the calls are claimed and groups the calls it can fuse, among those
  no earlier executor claimed, into regions it compiles.
* the torch executor (always last) runs every symbol fulmen defines with its torch callable.

A call nobody claims descends to its parts (a composite's decomposition); a leaf nobody claims is an error.
"""

from __future__ import annotations

import keyword
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fulmen.core import pytree
from fulmen.core.errors import ExecutorContractError, TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Symbol, Tag, iter_proxies
from fulmen.core.trace import TraceBuilder, infer_device
from fulmen.ops import lookup


class Executor:
    """An executor: a name, unique among registered executors."""

    # How many registrations changed what this executor claims or replaces: part of each trace's cache key, so a
    # trace built before one is built again (as a fresh fulmen.jit would), not reused with the old choices.
    registrations = 0

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"an executor name must be a non-empty string, got {name!r}")
        self.name = name

    def claims(self, bsym: BoundSymbol) -> Implementation | None:
        """How this executor runs `bsym`, or None when it cannot."""
        return None

    def grad_rule(self, bsym: BoundSymbol) -> Callable[..., Any] | None:
        """A grad rule this executor has for `bsym` (its implementation's grad_transform), if any."""
        return None

    def acquiring(self) -> None:
        """Called as fulmen.jit begins to acquire a program this executor may run, before its trace exists: for work
        that can run alongside acquisition (the torchcompile executor starts its compile workers)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    def _registered(self) -> None:
        self.registrations += 1
        REGISTRATIONS.count += 1


@dataclass(frozen=True, slots=True)
class Implementation:
    """How an executor runs a symbol. Without an execution_transform it runs the symbol's own callable."""

    checker: Callable[..., bool] | None = None
    execution_transform: Callable[..., Any] | None = None
    grad_transform: Callable[..., Any] | None = None

    def accepts(self, bsym: BoundSymbol, executor: Executor | None = None) -> bool:
        """Whether the checker accepts `bsym`'s arguments. A checker that fails, or answers other than True or False
        (a tensor, whose truth is data-dependent, or None from a missing return), is the user's mistake: refused,
        naming the symbol, `executor` and the user's line."""
        if self.checker is None:
            return True
        owner = f" (executor {executor.name!r})" if executor is not None else ""
        try:
            verdict = self.checker(*bsym.args, **bsym.kwargs)
        except Exception as error:
            # fulmen's own errors too: a checker computing with its arguments meets "fulmen does not support"
            hint = " (a checker reads its arguments' metadata; it cannot compute with them)" if isinstance(
                error, TraceError) else ""
            raise ExecutorContractError(f"the checker of {bsym.sym.printed}{owner} failed{hint}: "
                                        f"{type(error).__name__}: {error}", bsym.source) from error
        if not isinstance(verdict, bool):
            got = f"a tensor {verdict.type_string()}" if isinstance(verdict, TensorProxy) else type(verdict).__name__
            raise ExecutorContractError(f"the checker of {bsym.sym.printed}{owner} returned {got}, not a bool: a "
                                        "checker answers from its arguments' metadata (shape, dtype, device, "
                                        "requires_grad) with True or False", bsym.source)
        return verdict


DIRECT = Implementation()

# The executors fulmen ships (fulmen.executors.registry.PROVIDERS, and "torch"): neither they nor their operators
# are replaced by a registration under their names.
OWN_EXECUTORS = frozenset({"torch", "sdpa", "torchcompile", "unsloth", "liger"})


class Registrations:
    """What every executor registered: its operators by name, one namespace per executor name (two executors may
    each have an operator `attention`), and how often any registration changed."""

    def __init__(self) -> None:
        # Every registration of any executor: a jitted callable compares this one number on each call, and recounts
        # its own executors' `registrations` only when it changed (fulmen.jit.jitted).
        self.count = 0
        self._operators: dict[str, dict[str, Symbol]] = {}  # executor name -> operator name -> its symbol
        # Operators print as globals of the generated code, so their printed names are unique over all executors.
        self._printed: dict[str, Symbol] = {}

    def operator(self, executor: str, name: str) -> Symbol | None:
        """The operator `name` registered under the executor name `executor`, if any."""
        return self._operators.get(executor, {}).get(name)

    def printed_name(self, executor: str, name: str) -> str:
        """How the trace prints a new operator `name` of `executor`: its name, or, when another executor's operator
        prints so already, the name after the executor's (`myexec_attention`)."""
        if name not in self._printed:
            return name
        base = f"{''.join(c if c.isalnum() else '_' for c in executor)}_{name}"
        printed, suffix = base, 2
        while printed in self._printed:
            printed, suffix = f"{base}_{suffix}", suffix + 1
        return printed

    def add(self, sym: Symbol) -> None:
        self._operators.setdefault(sym.executor.name, {})[sym.name] = sym
        self._printed[sym.printed] = sym

    def remove(self, sym: Symbol) -> None:
        del self._operators[sym.executor.name][sym.name]
        del self._printed[sym.printed]


REGISTRATIONS = Registrations()


def _is_template(obj: Any) -> bool:
    return isinstance(obj, TensorProxy) or (isinstance(obj, torch.Tensor) and obj.device.type == "meta")


def _template_meta(name: str, like: Callable[..., Any]) -> Callable[..., Any]:
    """A symbol meta from a `like` function that returns TensorProxy templates, or meta tensors where the layout
    is not contiguous."""

    def meta(builder: TraceBuilder, *args: Any, **kwargs: Any) -> Any:
        templates = like(*args, **kwargs)
        found = list(pytree.leaves(templates, _is_template))
        if not found:
            raise TypeError(f"the like= function of operator {name} must return TensorProxy templates (or meta "
                            f"tensors), got {templates!r}")
        proxies = [t for t in found if isinstance(t, TensorProxy)]
        device = proxies[0].device if proxies else infer_device(args, kwargs)
        requires_grad = torch.is_grad_enabled() and any(p.requires_grad for p in iter_proxies((args, kwargs)))
        metas = pytree.tree_map(lambda t: t.meta if isinstance(t, TensorProxy) else t, templates, _is_template)
        return builder.wrap_outputs(metas, device, requires_grad)

    return meta


class OperatorExecutor(Executor):
    """An executor of individual operators: custom kernels and replacements of torch symbols or user functions."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.implementations: dict[Symbol, Implementation] = {}
        self.operators: dict[str, Symbol] = {}
        # replaced callable -> the operator recorded in its place while this executor is active
        self.replacements: dict[Callable[..., Any], Symbol] = {}
        # replaced function or method -> the function traced in its place while this executor is active
        self.lookasides: dict[Callable[..., Any], Callable[..., Any]] = {}

    def register_operator(
        self,
        name: str,
        *,
        like: Callable[..., Any] | None = None,
        meta: Callable[..., Any] | None = None,
        fn: Callable[..., Any],
        replaces: Callable[..., Any] | None = None,
        recomputable: bool = False,
        random: bool = False,
        scratch: Callable[..., int] | None = None,
        flops: Callable[..., int] | None = None,
    ) -> Symbol:
        """A new symbol run by this executor with `fn`; its outputs are described by `like` (or `meta`), a function
        of the symbol's arguments returning `TensorProxy(like=x, shape=..., dtype=...)` templates, which are
        contiguous, or meta tensors of the layout `fn` returns (`torch.empty_strided(..., device="meta")`); without
        either, `fn` runs on meta tensors to find them.

        The trace after the call relies on that description (it drops a conversion to the declared dtype, bakes in
        shapes, drops a `.contiguous()` of a contiguous value), so the first run of each call checks that `fn`
        returned what it declares, and that it neither wrote into its tensor arguments nor returned their memory: an
        operator is functional (fulmen.ExecutorContractError says which call broke this, at the user's line).

        `recomputable=True` says the operator is cheap next to its outputs' bytes (an elementwise kernel): where the
        backward needs its outputs, fulmen may rerun it there instead of saving them, as it does for torch's
        elementwise ops.

        `random=True` says `fn` draws from torch's random number generators (a dropout inside a kernel): the call is
        never rerun in the backward, merged with an equal call or dropped as unused, so it draws exactly once, as
        eager's call does.

        `scratch`, a function of the operator's arguments, gives the bytes `fn` allocates and frees again within one
        call (a kernel's workspace): planning that moves values across the call counts them there, so it does not
        raise the peak.

        `flops`, a function of the operator's arguments, gives the floating-point operations of one call (a fused
        attention kernel's matmuls). Without it the backward never reruns the call for its outputs: they are saved.
        With it, an activation memory budget below 1 may have the backward rerun it, weighed as a matmul of the same
        flops per byte of output is (fulmen.transforms.remat).

        With `replaces=`, calls to that function (a torch function, a function of the user's program or a method
        such as `NewGELU.forward`) are acquired as this symbol while this executor is in the executor list; the
        call keeps the torch ops of the original as its parts, so it descends to them when nothing claims it.

        `name` is this executor's own: another executor may have an operator of the same name (traces then print the
        one registered later after its executor's name, `myexec_attention`). Registering `name` again under this
        executor's name (a notebook cell run again) replaces the old operator, with a warning; the operators of
        fulmen's own executors are never replaced.
        """
        if like is not None and meta is not None:
            raise ValueError(f"register_operator({name!r}): give like= or meta=, not both")
        if not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"register_operator: {name!r} is not a valid Python identifier (traces print it)")
        previous = REGISTRATIONS.operator(self.name, name)
        if previous is not None and self.name in OWN_EXECUTORS:
            raise ValueError(f"an operator named {name!r} is already registered by executor "
                             f"{previous.executor.name!r}")
        if not callable(fn):
            raise TypeError(f"register_operator({name!r}): fn must be callable, got {fn!r}")
        if recomputable and random:
            raise ValueError(f"register_operator({name!r}): a random operator cannot be recomputable (a rerun would "
                             "draw other numbers)")
        if replaces is not None:
            if not callable(replaces):
                raise TypeError(f"register_operator({name!r}): replaces= must be a function, got {replaces!r}")
            if lookup(replaces) is None and type(replaces) is not types.FunctionType:
                raise TypeError(f"register_operator({name!r}): replaces= must be a torch function or a Python "
                                f"function or method (found by its code when called), got {replaces!r}")
            self._check_unreplaced(replaces, replacing=previous)
        if previous is not None:  # checked: the old registration goes only when the new one is made
            # the same name from an executor of the same name: a notebook cell run again, which replaces its operator
            warnings.warn(f"register_operator({name!r}): registered again by executor {self.name!r}; the new "
                          "registration replaces the old one (callables jitted before trace again on their next "
                          "call)", stacklevel=2)
            previous.executor._forget_operator(previous)
        printed = REGISTRATIONS.printed_name(self.name, name)
        shapes = like or meta
        # Without like=/meta=, `fn` itself runs on meta tensors (fine for functions of torch ops).
        tags = Tag.KERNEL | (Tag.RECOMPUTABLE if recomputable else Tag.NONE) | (Tag.RANDOM if random else Tag.NONE)
        sym = Symbol(name=name, printed=printed, impl=fn, meta=_template_meta(name, shapes) if shapes else None,
                     tags=tags, executor=self, scratch=scratch, flops=flops)
        REGISTRATIONS.add(sym)
        self.operators[name] = sym
        if replaces is not None:
            self.replacements[replaces] = sym
        self._registered()
        return sym

    def register_lookaside(self, original: Callable[..., Any], replacement: Callable[..., Any]) -> None:
        """While this executor is active, acquisition traces `replacement` wherever the program calls `original`, a
        method of a module class of the user's program (e.g. `LLaMAMLP.forward`), with the same arguments: a
        forward wherever `nn.Module.__call__` runs it, any method where the program looks it up on the jitted
        module and its submodules (nothing of the class is patched; see fulmen/acquisition/replacements.py).

        For programs whose code has no call boundary around the computation an operator should replace: the
        replacement restates `original` through a function that has one (and that `register_operator(replaces=)`
        turns into the operator). The user's code is not changed; outside this executor's acquisitions `original`
        runs as written."""
        if not callable(original) or not callable(replacement):
            raise TypeError(f"register_lookaside expects two functions, got {original!r} and {replacement!r}")
        if lookup(original) is not None:
            raise ValueError(f"register_lookaside: {original!r} is a torch function; replace it with "
                             "register_operator(replaces=) or give its symbol an implementation instead")
        self._check_unreplaced(original)
        qualname = getattr(original, "__qualname__", "").split(".")
        if type(original) is not types.FunctionType or len(qualname) < 2 or qualname[-2] == "<locals>":
            raise TypeError(f"register_lookaside: {original!r} is not a method of a module class; a function is "
                            "replaced with register_operator(replaces=)")
        self.lookasides[original] = replacement
        self._registered()

    def _forget_operator(self, sym: Symbol) -> None:
        REGISTRATIONS.remove(sym)
        if self.operators.get(sym.name) is sym:
            del self.operators[sym.name]
        self.replacements = {original: op for original, op in self.replacements.items() if op is not sym}
        self._registered()

    def _check_unreplaced(self, original: Callable[..., Any], replacing: Symbol | None = None) -> None:
        if original in self.replacements and self.replacements[original] is not replacing:
            raise ValueError(f"executor {self.name!r} already replaces {original!r} by "
                             f"{self.replacements[original].name}")
        if original in self.lookasides:
            raise ValueError(f"executor {self.name!r} already traces {self.lookasides[original]!r} in place of "
                             f"{original!r}")

    def register_implementation(
        self,
        sym: Symbol | Callable[..., Any],
        *,
        checker: Callable[..., bool] | None = None,
        execution_transform: Callable[..., Any] | None = None,
        grad_transform: Callable[..., Any] | None = None,
    ) -> None:
        """Lets this executor run `sym` (a symbol, e.g. `fulmen.torch.softmax`, or a torch callable) when `checker`
        accepts the call's arguments: by `execution_transform` (a program of other symbols with the same signature)
        or, without one, by the symbol's own callable; `grad_transform` is then its grad rule.

        `grad_transform` takes the symbol's arguments, computes its result, and hands back the grad of each floating
        input whose `.requires_grad` is True with `fulmen.put_grad(x, grad)` (reading the outputs' grads with
        `fulmen.get_grad(out)`). A rule that puts no grad for such an input is refused
        (fulmen.core.errors.ExecutorContractError, at the user's line): fulmen would take that grad as zero. Where
        the grad really is zero, put it explicitly: `put_grad(x, torch.zeros_like(x))`.

        `checker` runs while a trace is built, on the trace's proxies (their shape, dtype, device and requires_grad;
        no values), and answers True or False. Its answer is part of the trace, reused by every call the trace's
        guards admit, so it must answer from its arguments alone: state of its own (a flag it reads) is not guarded.
        After changing such state, register the implementation again: any registration on an executor makes the
        callables jitted with it trace again on their next call."""
        if not isinstance(sym, Symbol):
            binding = lookup(sym)
            if binding is None:
                raise ValueError(f"register_implementation: {sym!r} is neither a symbol nor a torch callable "
                                 "fulmen knows")
            sym = binding.symbol
        self.implementations[sym] = Implementation(checker, execution_transform, grad_transform)
        self._registered()

    def claims(self, bsym: BoundSymbol) -> Implementation | None:
        impl = self.implementations.get(bsym.sym)
        if impl is not None and impl.execution_transform is not None:
            return impl if impl.accepts(bsym, self) else None
        # Its own kernels run directly. A replacing operator (it has the original's ops as parts) descends to
        # them instead: its `fn` is the user's function, which may take objects a trace cannot pass.
        if bsym.sym.executor is self and not bsym.subsymbols:
            return DIRECT if impl is None or impl.accepts(bsym, self) else None
        return None

    def grad_rule(self, bsym: BoundSymbol) -> Callable[..., Any] | None:
        impl = self.implementations.get(bsym.sym)
        if impl is None or impl.grad_transform is None or not impl.accepts(bsym, self):
            return None
        return impl.grad_transform


class FusionExecutor(Executor):
    """An executor that compiles regions of consecutive fusible calls (see fulmen.executors.passes).

    `recomputes_inputs`: cheap values a region would hand to a later region are recomputed by that region instead
    (fulmen.executors.region_remat); the executor must fuse any cheap call it fused once again elsewhere.
    """

    recomputes_inputs = False

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        raise NotImplementedError

    def worth_fusing(self, bsyms: list[BoundSymbol]) -> bool:
        return len(bsyms) > 1

    def is_view(self, bsym: BoundSymbol) -> bool:
        """Whether `bsym` only views its input (no kernel in eager): one of a value that exists anyway stays out of
        the regions, since a region would write out a copy of it (see fulmen.executors.passes.fuse_regions)."""
        return False

    def fuse(self, bsyms: list[BoundSymbol], inputs: list[TensorProxy], outputs: list[TensorProxy],
             index: int) -> BoundSymbol:
        """One call computing `outputs` from `inputs` by running `bsyms`; `index` numbers a trace's regions."""
        raise NotImplementedError
