"""The public transform API: user code that rewrites fulmen.jit's traces at documented stages.

    class CountOps(fulmen.Transform):
        def transform_acquired(self, trace):
            ...
            return trace.from_trace("CountOps", bound_symbols=...)

    jitted = fulmen.jit(fn, transforms=[CountOps()])

`fulmen.jit` calls each transform's hooks in the order the transforms are listed, after fulmen's own passes of the
same stage, which are Transforms too (`fulmen.pipeline(jitted).describe()` lists them all in the order they run; see
fulmen.jit.pipeline). A hook returns a new trace, or the trace it was given to leave it unchanged. What a hook returns
is checked before anything runs: same inputs, the same number of outputs with the same shape, dtype and device, and
every value defined before it is read. Its provenance line (`# Constructed by ...`) names the transform.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import ClassVar

from fulmen.core.errors import FulmenError
from fulmen.core.proxies import TensorProxy
from fulmen.core.trace import Trace


class TransformError(FulmenError):
    """A transform returned a trace fulmen cannot run in place of the one it was given."""


class Stage(enum.Enum):
    """The stages of fulmen.jit's pipeline, in order."""

    ACQUIRED = "acquired"  # the whole program as acquired, after dead-code elimination and CSE, before autodiff
    GRAD = "grad"  # the forward and backward traces autodiff split the program into
    DISTRIBUTED = "distributed"  # DDP / FSDP collectives inserted (built in, no hook)
    EXECUTION = "execution"  # calls claimed by executors, fusion regions formed (fulmen's own hook only)
    FINAL = "final"  # the traces that run, before codegen
    CODEGEN = "codegen"  # `del` after last use, CUDA graphs, Python source (fulmen's own hooks only)


class TraceKind(enum.Enum):
    """Which trace a FINAL-stage hook sees."""

    COMPUTATION = "computation"  # a program without a backward (nothing required grad)
    FORWARD = "forward"  # returns the program's outputs, then the tensors saved for the backward
    BACKWARD = "backward"  # takes (saved, cotangents), returns the inputs' grads


@dataclass(frozen=True, slots=True)
class GradTraces:
    """The forward and backward traces of a differentiated program, as GRAD-stage hooks see them.

    The forward returns the program's outputs followed by the `n_saved` tensors saved for the backward; the
    backward takes those saved tensors (in the same order), then the outputs' cotangents, and returns the grads of
    the program's inputs. A hook may change what is saved (its device, say) as long as the forward's saved outputs
    and the backward's saved inputs keep matching.
    """

    forward: Trace
    backward: Trace
    n_saved: int

    @property
    def saved_by_forward(self) -> tuple[TensorProxy, ...]:
        return tuple(self.forward.output[len(self.forward.output) - self.n_saved :])

    @property
    def saved_in_backward(self) -> tuple[TensorProxy, ...]:
        return tuple(self.backward.inputs[: self.n_saved])


class Transform:
    """A trace transform for `fulmen.jit(fn, transforms=[...])`. Override the hooks of the stages you need.

    Every hook returns a trace: a new one (`trace.from_trace(provenance, bound_symbols=..., ...)`) or the one it
    was given, unchanged. Symbols are recorded by calling them inside `with TraceBuilder(trace.namespace)`, or
    bound symbols may be copied and reordered (`bsym.from_bsym(...)`).
    """

    @property
    def name(self) -> str:
        """What the provenance of the traces this transform returns names it by."""
        return type(self).__name__

    def transform_acquired(self, trace: Trace) -> Trace:
        """Stage ACQUIRED: the whole program (torch-level symbols, each with its prims as subsymbols), before
        autodiff. What it returns is differentiated, distributed and claimed by executors like the program."""
        return trace

    def transform_forward(self, traces: GradTraces) -> Trace:
        """Stage GRAD: a new forward trace, given the forward and the backward for all outputs' cotangents."""
        return traces.forward

    def transform_backward(self, traces: GradTraces) -> Trace:
        """Stage GRAD: a new backward trace, given the forward this transform returned (`traces.forward`).

        Called for every backward fulmen builds (one per pattern of outputs that receive a cotangent), each time
        with the same forward."""
        return traces.backward

    def transform_final(self, trace: Trace, kind: TraceKind) -> Trace:
        """Stage FINAL: the trace that will run, after executors claimed its calls; codegen only adds `del`s."""
        return trace

    # Stages EXECUTION and CODEGEN belong to fulmen's own passes (the executors' claim; `del` after last use, CUDA
    # graphs): a pass there must keep what the executors claimed and every `del` valid, which the checks of a hook
    # cannot see. fulmen.jit refuses a transform it is given that overrides them; rewrite the trace in
    # transform_final instead.
    def transform_execution(self, trace: Trace, kind: TraceKind) -> Trace:
        """Stage EXECUTION (fulmen's own): the trace with its calls claimed by executors."""
        return trace

    def transform_codegen(self, trace: Trace, kind: TraceKind, returned: int) -> Trace:
        """Stage CODEGEN (fulmen's own): the trace codegen prints. `returned`: how many of its outputs the caller
        receives (a forward's saved tensors follow them)."""
        return trace

    def __repr__(self) -> str:
        return f"<Transform {self.name}>"


class TracePass(Transform):
    """A built-in pass that is one function of a trace (`run`), applied to the acquired program; `title` is its name,
    which its traces' provenance lines begin with."""

    title: ClassVar[str]

    @property
    def name(self) -> str:
        return self.title

    def run(self, trace: Trace) -> Trace:
        raise NotImplementedError

    def transform_acquired(self, trace: Trace) -> Trace:
        return self.run(trace)


class CleanupPass(TracePass):
    """A TracePass that also cleans each backward autodiff builds (stage GRAD)."""

    def transform_backward(self, traces: GradTraces) -> Trace:
        return self.run(traces.backward)


# --- what the program's inputs are called ------------------------------------------------------------------------
# While fulmen.jit runs the ACQUIRED stage: the qualified names of the parameters and buffers each trace input stands
# for, by the input's proxy name, worked out on first use (fulmen.jit.jitted).
_INPUT_NAMES: ContextVar[Callable[[], Mapping[str, tuple[str, ...]]] | None] = ContextVar("fulmen_input_names",
                                                                                         default=None)


@contextlib.contextmanager
def named_inputs(resolve: Callable[[], Mapping[str, tuple[str, ...]]]) -> Iterator[None]:
    """Makes `input_names` answer from `resolve()`, called at most once and only when asked."""
    found: list[Mapping[str, tuple[str, ...]]] = []

    def once() -> Mapping[str, tuple[str, ...]]:
        if not found:
            found.append(resolve())
        return found[0]

    token = _INPUT_NAMES.set(once)
    try:
        yield
    finally:
        _INPUT_NAMES.reset(token)


def input_names(proxy: TensorProxy) -> tuple[str, ...]:
    """The qualified names of the module parameter or buffer that the trace input `proxy` stands for
    (`("transformer.h.0.attn.qkv.weight",)`; a tied weight has one per place), inside an ACQUIRED-stage hook; () for
    any other value, and outside fulmen.jit's pipeline."""
    resolve = _INPUT_NAMES.get()
    return resolve().get(proxy.pname, ()) if resolve is not None else ()


def overrides(transform: Transform, hook: str) -> bool:
    """Whether `transform` has hook `hook` (`"transform_acquired"`, ...) of its own, which the pipeline then runs."""
    method = getattr(transform, hook)
    return getattr(method, "__func__", method) is not getattr(Transform, hook)
