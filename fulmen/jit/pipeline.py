"""fulmen.jit's pipeline as data: the passes of each stage, in order, from the acquired trace to the code that runs.

    acquired     dce, cse, dce (cse and the second dce when JitOptions.cse); linear + cross-entropy fused (when
                 JitOptions.fuse_linear_cross_entropy); attention over repeated key/value heads grouped (when
                 JitOptions.grouped_query_attention); then each transform's transform_acquired
    grad         autodiff splits the program into a forward and a backward (backward: dce, cse, dce); then each
                 transform's transform_forward and transform_backward
    distributed  DDP / FSDP collectives (programs with distributed parameters)
    execution    executors claim the calls, fusion regions form
    final        each transform's transform_final
    codegen      `del` after last use; with JitOptions.cuda_graphs, the capturable runs grouped into CUDA graphs
                 (and `del` after last use again)

The transforms are the user's (`fulmen.jit(fn, transforms=[...])`) followed by the built-in ones the options ask
for (`JitOptions.offload`): one mechanism for both. `fulmen.last_traces` (the forward, or the whole program when
nothing is differentiated) and `fulmen.last_backward_traces` list one trace per pass that changed something, in
this order, each stamped with its pass (`# Constructed by ...`). `Pipeline.describe()` prints the list.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fulmen.core.proxies import TensorProxy
from fulmen.core.trace import Trace, TraceBuilder
from fulmen.core.verify import trace_problems
from fulmen.executors.base import Executor
from fulmen.executors.passes import transform_for_execution
from fulmen.options import JitOptions
from fulmen.runtime.trace_function import GradProgram, UpdatedInput, expected_cotangents
from fulmen.transforms.autocast import autocast_enabled
from fulmen.transforms.common import cse, dce, delete_last_used
from fulmen.transforms.cudagraphs import GraphPool, capture_regions
from fulmen.transforms.distribution import DistributionTransform, GradSync
from fulmen.transforms.forward_backward import plan_grad
from fulmen.transforms.fused_loss import fuse_linear_cross_entropy
from fulmen.transforms.grouped_attention import group_query_attention
from fulmen.transforms.offload import OffloadTransform
from fulmen.transforms.transform import GradTraces, Stage, TraceKind, Transform, TransformError

Pass = Callable[[Trace], Trace]


@dataclass(frozen=True, slots=True)
class Step:
    """One pass of a stage."""

    stage: Stage
    name: str
    run: Pass


class Pipeline:
    """The passes `fulmen.jit` runs for one jitted callable (its options, executors and transforms)."""

    def __init__(self, options: JitOptions, executors: tuple[Executor, ...],
                 interpreter_factory: Callable[[TraceBuilder], Any]) -> None:
        self.executors = executors
        self.interpreter_factory = interpreter_factory
        self.memory_budget = options.activation_memory_budget
        builtin = (OffloadTransform(options.offload),) if options.offload is not None else ()
        self.transforms: tuple[Transform, ...] = (*options.transforms, *builtin)
        cleanup = (("dead code", dce), ("cse", cse), ("dead code", dce))
        acquired = list(cleanup[: 3 if options.cse else 1])
        if options.fuse_linear_cross_entropy:
            acquired.append(("fuse linear + cross-entropy",
                             functools.partial(fuse_linear_cross_entropy, chunk_rows=options.cross_entropy_chunk_rows)))
        if options.grouped_query_attention:
            acquired.append(("grouped-query attention", group_query_attention))
        self.acquired = tuple(Step(Stage.ACQUIRED, name, run) for name, run in acquired)
        self.backward_cleanup = tuple(Step(Stage.GRAD, name, run) for name, run in cleanup)
        self.execution = (Step(Stage.EXECUTION, "claim and fuse", self._claim),)
        self.codegen = (Step(Stage.CODEGEN, "del after last use", delete_last_used),)

    def _claim(self, trace: Trace) -> Trace:
        return transform_for_execution(trace, self.executors, self.interpreter_factory)

    def describe(self) -> str:
        """The stages and their passes, in the order they run."""
        hooks = ", ".join(t.name for t in self.transforms) or "none"
        lines = [f"acquired: {', '.join(s.name for s in self.acquired)}; transforms: {hooks}",
                 f"grad: autodiff; backward {', '.join(s.name for s in self.backward_cleanup)}; transforms: {hooks}",
                 "distributed: DDP / FSDP collectives when parameters are distributed",
                 f"execution: {', '.join(s.name for s in self.execution)} "
                 f"({', '.join(e.name for e in self.executors)})",
                 f"final: transforms: {hooks}",
                 f"codegen: {', '.join(s.name for s in self.codegen)}"]
        return "\n".join(lines)

    # --- the stages ------------------------------------------------------------------------------------------
    def acquire(self, trace: Trace) -> list[Trace]:
        """Stage ACQUIRED: the traces from the acquired one to what autodiff (or execution) starts from."""
        traces = [trace]
        for step in self.acquired:
            _append(traces, step.run(traces[-1]))
        for transform in self.transforms:
            _append(traces, self._hook(transform, Stage.ACQUIRED, traces[-1], transform.transform_acquired(traces[-1]),
                                       _check_same_interface))
        return traces

    def computation(self, trace: Trace, distributed: DistributionTransform | None,
                    graphs: GraphPool | None = None) -> list[Trace]:
        """The stages after ACQUIRED for a program nothing is differentiated in."""
        traces = [distributed.forward(trace, len(trace.output))] if distributed is not None else []
        trace = traces[-1] if traces else trace
        return traces + self.finish(trace, TraceKind.COMPUTATION, graphs, len(trace.output))

    def differentiate(self, trace: Trace, distributed: DistributionTransform | None, graphs: GraphPool | None = None,
                      dirty: tuple[UpdatedInput, ...] = (), places: tuple[str, ...] = (),
                      retaken: tuple[int, ...] = ()) -> tuple[GradProgram, list[Trace]]:
        """Stage GRAD and what follows for the forward; the backward's passes run in the returned program. With
        `graphs`, the last two traces of the forward and of the backward capture CUDA graphs and the two before
        them are the same program without graphs. `dirty`: the inputs the program updates in place with a value
        that has an autograd history, which they get. `places`: where the outputs sit in what the program returns
        (for messages). `retaken`: the outputs the caller gets as views taken again from other outputs, which never
        get a grad (fulmen.runtime.view_outputs)."""
        plan = plan_grad(trace, self.interpreter_factory, self.executors, self.memory_budget)
        n_saved = len(plan.saved)
        forward = plan.forward
        present = expected_cotangents(plan.differentiable, retaken)
        backward = self._clean(plan.backward(present))[-1]
        traces, forwards = [forward], []
        for transform in self.transforms:
            before = GradTraces(forward, backward, n_saved)
            forward = self._hook(transform, Stage.GRAD, forward, transform.transform_forward(before),
                                 lambda b, a, what: _check_forward(b, a, plan.n_outputs, n_saved, what))
            _append(traces, forward)
            forwards.append(forward)
            backward = self._transform_backward(transform, GradTraces(forward, backward, n_saved))
        if distributed is not None:
            traces.append(distributed.forward(traces[-1], plan.n_outputs))
        traces += self.finish(traces[-1], TraceKind.FORWARD, graphs, plan.n_outputs)
        finalize = BackwardPasses(self, tuple(forwards), n_saved, distributed)
        program = GradProgram(plan, traces[-1].python_callable(), finalize,
                              finalize(plan.backward(present), GradSync.SYNC, graphs), autocast_enabled(),
                              distributed, dirty, places, retaken)
        return program, traces

    def finish(self, trace: Trace, kind: TraceKind, graphs: GraphPool | None = None,
               cloned_outputs: int = 0) -> list[Trace]:
        """Stages EXECUTION, FINAL and CODEGEN. `graphs`: capture CUDA graphs into that pool, cloning the first
        `cloned_outputs` outputs (what the caller receives) out of it."""
        traces = [trace]
        for step in self.execution:
            traces.append(step.run(traces[-1]))
        for transform in self.transforms:
            _append(traces, self._hook(transform, Stage.FINAL, traces[-1],
                                       transform.transform_final(traces[-1], kind), _check_same_interface))
        final = traces[-1]
        for step in self.codegen:
            traces.append(step.run(traces[-1]))
        if graphs is not None:
            graphed = capture_regions(final, graphs, cloned_outputs)
            traces += [graphed, delete_last_used(graphed)]
        return traces[1:]

    def _clean(self, trace: Trace) -> list[Trace]:
        traces = [trace]
        for step in self.backward_cleanup:
            traces.append(step.run(traces[-1]))
        return traces

    def _transform_backward(self, transform: Transform, traces: GradTraces) -> Trace:
        backward = self._hook(transform, Stage.GRAD, traces.backward, transform.transform_backward(traces),
                              lambda b, a, what: _check_backward(b, a, traces, what))
        # also when the backward hook left the backward as it was: the forward's may have changed what is saved
        _same_values(traces.saved_by_forward, backward.inputs[: traces.n_saved], f"{transform.name} (stage grad)",
                     "saved tensors (the forward's saved outputs against the backward's inputs)")
        return backward

    @staticmethod
    def _hook(transform: Transform, stage: Stage, before: Trace, after: Any,
              check: Callable[[Trace, Trace, str], None]) -> Trace:
        """`after`, what `transform` returned for `before`, checked and stamped with the transform's name."""
        what = f"{transform.name} (stage {stage.value})"
        if after is before:
            return before
        if not isinstance(after, Trace):
            raise TransformError(f"transform {what} returned {type(after).__name__}, not a Trace")
        problems = trace_problems(after)
        if problems:
            raise TransformError(f"transform {what} returned an invalid trace: " + "; ".join(problems[:5]))
        check(before, after, what)
        provenance = after.provenance
        if provenance == before.provenance:
            provenance = what
        elif transform.name not in provenance:
            provenance = f"{transform.name}: {provenance}"
        return after if provenance == after.provenance else after.from_trace(provenance)


@dataclass(frozen=True)
class BackwardPasses:
    """The passes every backward trace of one program goes through (the bridge's `finalize`), once the forward
    they pair with is fixed: `forwards[i]` is what transform i returned for the forward."""

    pipeline: Pipeline
    forwards: tuple[Trace, ...]
    n_saved: int
    distributed: DistributionTransform | None

    def __call__(self, backward: Trace, mode: GradSync, graphs: GraphPool | None = None) -> list[Trace]:
        traces = self.pipeline._clean(backward)
        for transform, forward in zip(self.pipeline.transforms, self.forwards):
            _append(traces, self.pipeline._transform_backward(transform, GradTraces(forward, traces[-1],
                                                                                    self.n_saved)))
        if self.distributed is not None:
            traces.append(self.distributed.backward(traces[-1], mode))
        # the gradients all go to the caller: all cloned out of the graphs' pool
        return traces + self.pipeline.finish(traces[-1], TraceKind.BACKWARD, graphs, len(traces[-1].output))


def _append(traces: list[Trace], trace: Trace) -> None:
    if trace is not traces[-1]:
        traces.append(trace)


# --- what a transform may change --------------------------------------------------------------------------------
def _describe(value: Any) -> str:
    return value.type_string() if type(value) is TensorProxy else repr(value)


def _same_values(before: Sequence, after: Sequence, what: str, role: str) -> None:
    if len(before) != len(after):
        raise TransformError(f"transform {what} changed the number of {role} from {len(before)} to {len(after)}")
    for position, (old, new) in enumerate(zip(before, after)):
        if (type(old) is TensorProxy) != (type(new) is TensorProxy) or type(old) is TensorProxy and (
                tuple(old.shape), old.dtype, old.device) != (tuple(new.shape), new.dtype, new.device):
            raise TransformError(f"transform {what} changed {role} {position} from {_describe(old)} to "
                                 f"{_describe(new)}")


def _same_inputs(before: Trace, after: Trace, what: str, start: int = 0) -> None:
    old = [p.pname for p in before.inputs[start:]]
    new = [p.pname for p in after.inputs[start:]]
    if old != new or before.input_groups != after.input_groups:
        raise TransformError(f"transform {what} changed the trace's inputs from {old} to {new}; the caller passes "
                             "the same tensors whatever a transform does")


def _check_same_interface(before: Trace, after: Trace, what: str) -> None:
    _same_inputs(before, after, what)
    _same_values(before.output, after.output, what, "outputs")


def _check_forward(before: Trace, after: Trace, n_outputs: int, n_saved: int, what: str) -> None:
    _same_inputs(before, after, what)
    _same_values(before.output[:n_outputs], after.output[:n_outputs], what, "program outputs")
    if len(after.output) != n_outputs + n_saved:
        raise TransformError(f"transform {what} returned a forward with {len(after.output) - n_outputs} saved "
                             f"tensors; the backward takes {n_saved}")


def _check_backward(before: Trace, after: Trace, traces: GradTraces, what: str) -> None:
    _same_inputs(before, after, what, start=traces.n_saved)
    _same_values(before.output, after.output, what, "grads")
