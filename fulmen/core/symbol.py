"""Symbols and bound symbols: the multi-level IR.

A `Symbol` is an operation: its name, how a trace prints a call to it, the callable that executes it on real
tensors and, for composites, a decomposition into other symbols. A `BoundSymbol` is one call of a symbol in a
trace; a composite's call keeps the calls its decomposition made as `subsymbols`, so one trace can be read (and
executed) at the torch level or at the prim level.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

from fulmen.core import pytree
from fulmen.core.proxies import TensorProxy
from fulmen.core.source import SourceLocation, user_location


class Tag(enum.Flag):
    NONE = 0
    VIEW = enum.auto()  # the output may alias the first input (functionalization tracks it)
    IMPURE = enum.auto()  # has side effects (never removed, never merged)
    RANDOM = enum.auto()  # draws from an RNG (never merged by CSE)
    NO_GRAD = enum.auto()  # the output never requires grad (detach)
    RECOMPUTABLE = enum.auto()  # cheap next to its outputs' bytes: the backward may rerun it instead of saving them
    REGION = enum.auto()  # a recorded region of the user's program (an autograd.Function call): runs as its parts
    # Its decomposition rounds where eager's kernel on the call's device rounds, and a compiler's own lowering of the
    # op may not (Inductor computes aten.tanh_backward in float32 and rounds once; eager's CUDA kernel rounds each
    # step in bfloat16): fusion regions compile the decomposition.
    EAGER_ROUNDING = enum.auto()
    # Runs a kernel an executor registered (fulmen.extend's register_operator): declared functional, its outputs new
    # tensors of the declared layout; the first run of each call checks that (fulmen.core.verify.check_first_runs).
    KERNEL = enum.auto()


# How the printed callee's root name is imported, so a printed trace executes as it stands.
IMPORTS: dict[str, str] = {
    "torch": "import torch",
    "prims": "from fulmen.ops import prims",
    "impls": "from fulmen.ops.kernels import impls",
    "fused_loss": "from fulmen.ops import fused_loss",
    "float8": "from fulmen.ops import float8",
    "optim": "from fulmen.ops import optim",  # the whole step's optimizer updates
    "operator": "import operator",
    "dist": "from fulmen.distributed import prims as dist",  # the collectives (fulmen.distributed.prims)
}


@dataclass(eq=False, slots=True)
class Symbol:
    name: str
    printed: str  # the callee as a trace prints it, e.g. "torch.nn.functional.linear" or "prims.add"
    impl: Callable[..., Any]  # runs the symbol on real tensors; `printed` resolves to it
    is_prim: bool = False
    decomposition: Callable[..., Any] | None = None
    # Computes output metadata; None means "run `impl` on meta tensors" (torch's own meta kernels).
    meta: Callable[..., Any] | None = None
    tags: Tag = Tag.NONE
    # The operator executor that registered this symbol (fulmen.extend); None for fulmen's own symbols.
    executor: Any = None
    # Bytes the implementation allocates and frees again within one call (a kernel's workspace), a function of the
    # call's arguments; None: none beyond its outputs. Memory planning counts them at the call.
    scratch: Callable[..., int] | None = None
    # The floating-point operations one call does, a function of the call's arguments; None: none that the
    # rematerialisation's cost model knows (it then never reruns the call in the backward). An executor's fused
    # kernel declares them so that a memory budget can weigh rerunning it against saving its outputs.
    flops: Callable[..., int] | None = None
    # Per output (in pytree order), whether it can require grad, as eager's autograd marks them (native_layer_norm's
    # mean and rstd cannot); None: every floating output can.
    differentiable_outputs: tuple[bool, ...] | None = None

    def __call__(self, *args, **kwargs):
        builder = current_builder()
        if builder is None:
            return self.impl(*args, **kwargs)
        if self.executor is not None and not builder.rules_running:
            # the program calls an executor's operator itself: no torch call precedes it to say where
            builder.source = user_location() or builder.source
            return builder.bind_operator(self, args, kwargs)
        return builder.bind(self, args, kwargs)

    def __repr__(self) -> str:
        return f"<Symbol {self.printed}>"


@dataclass(slots=True)
class BoundSymbol:
    sym: Symbol
    args: tuple
    kwargs: dict[str, Any]
    output: Any
    subsymbols: list[BoundSymbol] = field(default_factory=list)
    source: SourceLocation | None = None
    # Which torch.utils.checkpoint.checkpoint call the op ran in (0: none): its values are recomputed, not saved.
    checkpoint_region: int = 0
    # The executor that runs this call (set by the transform for execution).
    executor: Any = None
    # The proxies among args/kwargs and among the output, found on first use: passes ask for them again and again
    # (region planning, thousands of times per trace), and a call's args and output never change after it is made
    # (changes make a new call through `from_bsym`, which starts with no cache).
    _arg_proxies: tuple[TensorProxy, ...] | None = field(default=None, init=False, repr=False, compare=False)
    _output_proxies: tuple[TensorProxy, ...] | None = field(default=None, init=False, repr=False, compare=False)

    def from_bsym(self, **changes) -> BoundSymbol:
        return replace(self, **changes)

    def with_args_mapped(self, fn: Callable[[TensorProxy], Any]) -> BoundSymbol:
        """This call (and its subsymbols) reading `fn(p)` wherever it read the proxy `p`."""
        return replace(
            self,
            args=map_proxies(self.args, fn),
            kwargs=map_proxies(self.kwargs, fn),
            subsymbols=[sub.with_args_mapped(fn) for sub in self.subsymbols],
        )

    def _args(self) -> tuple[TensorProxy, ...]:
        if self._arg_proxies is None:
            self._arg_proxies = tuple(iter_proxies((self.args, self.kwargs)))
        return self._arg_proxies

    def _outputs(self) -> tuple[TensorProxy, ...]:
        if self._output_proxies is None:
            self._output_proxies = tuple(iter_proxies(self.output))
        return self._output_proxies

    def proxy_args(self) -> list[TensorProxy]:
        return list(self._args())

    def proxy_outputs(self) -> list[TensorProxy]:
        return list(self._outputs())

    def draws_random(self) -> bool:
        """Whether the call, or any part of its decomposition, draws random numbers."""
        return bool(self.sym.tags & Tag.RANDOM) or any(sub.draws_random() for sub in self.subsymbols)

    def arg_names(self) -> set[str]:
        return {p.pname for p in self._args()}

    def output_names(self) -> list[str]:
        return [p.pname for p in self._outputs()]


def _is_proxy(obj: Any) -> bool:
    return type(obj) is TensorProxy


def iter_proxies(obj: Any) -> Iterator[TensorProxy]:
    """Proxies inside nested containers (fulmen.core.pytree's rule), in order."""
    return pytree.leaves(obj, _is_proxy)


def map_proxies(obj: Any, fn: Callable[[TensorProxy], Any]) -> Any:
    """`obj` with every proxy replaced by `fn(proxy)`, keeping the container types."""
    return pytree.tree_map(fn, obj, _is_proxy)


class Builder:
    """Receives bound symbols while a trace is being built (see fulmen.core.trace.TraceBuilder)."""

    source: SourceLocation | None = None  # the user's line the calls bound now come from
    rules_running = 0  # > 0 while a grad rule or an execution transform runs: its calls keep their call's line

    def bind(self, sym: Symbol, args: tuple, kwargs: dict[str, Any]) -> Any:  # pragma: no cover - interface
        raise NotImplementedError

    def bind_operator(self, sym: Symbol, args: tuple, kwargs: dict[str, Any]) -> Any:
        """A call the program makes of an executor's operator itself, where a rule's call would be `bind`'s."""
        return self.bind(sym, args, kwargs)


# The builders receiving symbol calls, innermost last: per thread and per task (a ContextVar holding a tuple).
_BUILDERS: ContextVar[tuple[Builder, ...]] = ContextVar("fulmen_trace_builders", default=())


def current_builder() -> Builder | None:
    builders = _BUILDERS.get()
    return builders[-1] if builders else None


def push_builder(builder: Builder) -> None:
    _BUILDERS.set((*_BUILDERS.get(), builder))


def pop_builder(builder: Builder) -> None:
    builders = _BUILDERS.get()
    assert builders and builders[-1] is builder, "unbalanced trace builders"
    _BUILDERS.set(builders[:-1])
