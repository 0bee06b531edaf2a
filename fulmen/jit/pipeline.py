"""fulmen.jit's pipeline as data: one ordered list of `Transform`s, each at its stage, from the acquired trace to the
code that runs. `print(fulmen.pipeline(jitted))` shows it; for the default options:

    acquired     Dead Code Elimination                  DeadCodeElimination
    acquired     Common Subexpression Elimination       CommonSubexpressionElimination
    acquired     Dead Code Elimination                  DeadCodeElimination
    acquired     Fused linear + cross-entropy           FuseLinearCrossEntropy
    acquired     Grouped-query attention                GroupQueryAttention
    grad         autodiff                               (stage machinery: a forward, a backward per cotangents)
    grad         Dead Code Elimination                  DeadCodeElimination, on the backward
    grad         Common Subexpression Elimination       CommonSubexpressionElimination, on the backward
    grad         Dead Code Elimination                  DeadCodeElimination, on the backward
    distributed  DDP / FSDP collectives                 (stage machinery: programs with distributed parameters)
    execution    Transform for execution (sdpa, torch)  ClaimExecution
    codegen      Delete Last Used                       DeleteLastUsed

The options choose fulmen's own passes: JitOptions.cse (the acquired program's CSE and second DCE; the backward's
always run), fuse_linear_cross_entropy, grouped_query_attention, float8 (`Float8 matmuls`, after those two),
cuda_graphs (`CUDAGraphs` between two `Delete Last Used`, fulmen.transforms.cudagraphs). Within a stage, fulmen's
own passes run first, then the transforms the user gave (`fulmen.jit(fn, transforms=[...])`), in their order, at each
stage whose hooks they override (stages ACQUIRED, GRAD, FINAL), then CPU offloading (JitOptions.offload, a GRAD
transform). What the user's transforms and offloading return is checked and stamped with their name; fulmen's own
passes are trusted and stamp their own.

Autodiff and the DDP / FSDP collectives stay stage machinery, not Transforms: autodiff turns one trace into a
saved-for-backward plan, a forward and a backward per pattern of cotangents (no trace -> trace hook can return that),
and the collectives depend on the tensors each call passes and, in the backward, on its GradSync mode.

`fulmen.last_traces` (the forward, or the whole program when nothing is differentiated) and
`fulmen.last_backward_traces` list one trace per pass that changed something, in this order, each stamped with its
pass (`# Constructed by ...`, which begins with the Transform's name).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fulmen.core.proxies import TensorProxy
from fulmen.core.trace import Trace, TraceBuilder
from fulmen.core.verify import trace_problems
from fulmen.executors.base import Executor
from fulmen.executors.passes import transform_for_execution
from fulmen.options import JitOptions
from fulmen.runtime.trace_function import GradProgram, UpdatedInput, expected_cotangents
from fulmen.transforms.autocast import autocast_enabled
from fulmen.transforms.common import CommonSubexpressionElimination, DeadCodeElimination, DeleteLastUsed
from fulmen.transforms.cudagraphs import CUDAGraphs, GraphedProgram, GraphPool, graph_pool_for
from fulmen.transforms.distribution import DistributionTransform, GradSync
from fulmen.transforms.float8 import Float8Matmuls
from fulmen.transforms.forward_backward import plan_grad
from fulmen.transforms.fused_loss import FuseLinearCrossEntropy
from fulmen.transforms.grouped_attention import GroupQueryAttention
from fulmen.transforms.offload import OffloadTransform
from fulmen.transforms.transform import GradTraces, Stage, TraceKind, TracePass, Transform, TransformError, overrides

# The hooks a transform runs through at each stage (DISTRIBUTED has none).
HOOKS: dict[Stage, tuple[str, ...]] = {
    Stage.ACQUIRED: ("transform_acquired",),
    Stage.GRAD: ("transform_forward", "transform_backward"),
    Stage.EXECUTION: ("transform_execution",),
    Stage.FINAL: ("transform_final",),
    Stage.CODEGEN: ("transform_codegen",),
}
FULMENS_STAGES = (Stage.EXECUTION, Stage.CODEGEN)  # no transform the user gives runs there
_MACHINERY = {Stage.GRAD: ("autodiff", "(stage machinery: a forward, a backward per cotangents)"),
              Stage.DISTRIBUTED: ("DDP / FSDP collectives", "(stage machinery: programs with distributed parameters)")}


@dataclass(frozen=True, slots=True)
class Step:
    """One pass: `transform` run at `stage` through `hooks`, the hooks of that stage it overrides."""

    stage: Stage
    transform: Transform
    hooks: tuple[str, ...]
    user: bool = False  # one of the transforms fulmen.jit was given
    checked: bool = False  # what it returns is checked and stamped with its name (the user's and offloading)

    @classmethod
    def of(cls, stage: Stage, transform: Transform, user: bool = False, checked: bool = False) -> Step:
        return cls(stage, transform, tuple(h for h in HOOKS[stage] if overrides(transform, h)), user, checked)

    def describe(self) -> str:
        detail = type(self.transform).__name__ + (" (yours)" if self.user else "")
        if self.stage is Stage.GRAD:
            detail += ", on the " + " and the ".join(h.removeprefix("transform_") for h in self.hooks)
        return _row(self.stage, self.transform.name, detail)


def _row(stage: Stage, name: str, detail: str) -> str:
    return f"{stage.value:<12} {name:<38} {detail}"


class ClaimExecution(Transform):
    """Stage EXECUTION: the executors, in their priority order, claim the calls; fusion regions form
    (fulmen.executors.passes)."""

    def __init__(self, executors: tuple[Executor, ...], interpreter_factory: Callable[[TraceBuilder], Any],
                 common: bool = False) -> None:
        self.executors = executors
        self.interpreter_factory = interpreter_factory
        self.common = common  # JitOptions.cse: what claiming made twice is computed once

    @property
    def name(self) -> str:
        return f"Transform for execution ({', '.join(e.name for e in self.executors)})"

    def transform_execution(self, trace: Trace, kind: TraceKind) -> Trace:
        return transform_for_execution(trace, self.executors, self.interpreter_factory, self.common)


def differentiated_rewrites(options: JitOptions, prune: bool = True) -> list[TracePass]:
    """The passes `options` ask for that change what a backward computes (the fused head and loss, grouped-query
    attention), in their order: stage ACQUIRED runs them before autodiff, and a whole step's `loss.backward()` on
    what it differentiates (fulmen.jit.grad_slots) with `prune=False`."""
    rewrites: list[TracePass] = []
    if options.fuse_linear_cross_entropy:
        rewrites.append(FuseLinearCrossEntropy(options.cross_entropy_chunk_rows, prune))
    if options.grouped_query_attention:
        rewrites.append(GroupQueryAttention(prune=prune))
    return rewrites


def default_steps(options: JitOptions, claim: Transform) -> tuple[Step, ...]:
    """The passes `options` ask for, with the transforms they give at their stages (see the module docstring)."""
    dead, common = DeadCodeElimination(), CommonSubexpressionElimination()
    acquired: list[Transform] = [dead, common, dead] if options.cse else [dead]
    acquired += differentiated_rewrites(options)
    if options.float8 is not None:  # after the fused loss, which takes the head it fuses
        f8 = options.float8
        acquired.append(Float8Matmuls(f8.recipe, f8.skip, f8.lm_head, f8.all_gather))
    codegen: list[Transform] = [DeleteLastUsed()]
    if options.cuda_graphs:  # the graphed trace's values freed again (inside a graph too: cudagraphs.py)
        codegen += [CUDAGraphs(), DeleteLastUsed()]
    given = [(t, True) for t in options.transforms]
    if options.offload is not None:
        given.append((OffloadTransform(options.offload), False))

    def theirs(stage: Stage) -> list[Step]:
        steps = [Step.of(stage, t, user, checked=True) for t, user in given]
        return [step for step in steps if step.hooks]

    return (*(Step.of(Stage.ACQUIRED, t) for t in acquired), *theirs(Stage.ACQUIRED),
            *(Step.of(Stage.GRAD, t) for t in (dead, common, dead)), *theirs(Stage.GRAD),
            Step.of(Stage.EXECUTION, claim), *theirs(Stage.FINAL),
            *(Step.of(Stage.CODEGEN, t) for t in codegen))


def _refuse_fulmens_stages(transforms: Sequence[Transform]) -> None:
    for transform in transforms:
        for stage in FULMENS_STAGES:
            for hook in HOOKS[stage]:
                if overrides(transform, hook):
                    raise TransformError(
                        f"transform {transform.name} overrides {hook}: stage {stage.value} is fulmen's own (the "
                        "executors' claim; `del` after last use and CUDA graphs), whose traces the checks of a hook "
                        "cannot vouch for. Rewrite the trace that runs in transform_final instead")


class Pipeline:
    """The passes `fulmen.jit` runs for one jitted callable (its options, executors and transforms): `steps`, in
    the order they run."""

    def __init__(self, options: JitOptions, executors: tuple[Executor, ...],
                 interpreter_factory: Callable[[TraceBuilder], Any]) -> None:
        self.executors = executors
        self.interpreter_factory = interpreter_factory
        self.memory_budget = options.activation_memory_budget
        _refuse_fulmens_stages(options.transforms)
        self._set_steps(default_steps(options, ClaimExecution(executors, interpreter_factory, options.cse)))

    def _set_steps(self, steps: tuple[Step, ...]) -> None:
        self.steps = steps
        self._stages = {stage: tuple(s for s in steps if s.stage is stage) for stage in Stage}
        self._finishing = tuple(s for s in steps if s.stage in (Stage.EXECUTION, Stage.FINAL, Stage.CODEGEN))
        self._plain: Pipeline | None = None

    def _with_steps(self, steps: tuple[Step, ...]) -> Pipeline:
        other = copy.copy(self)
        other._set_steps(steps)
        return other

    def at(self, stage: Stage) -> tuple[Step, ...]:
        """The passes of `stage`, in order."""
        return self._stages[stage]

    def describe(self) -> str:
        """Every pass in the order it runs, a line each: its stage, its name (what its traces' provenance begins
        with), its class ("yours" for a transform fulmen.jit was given)."""
        lines = []
        for stage in Stage:
            if stage in _MACHINERY:
                lines.append(_row(stage, *_MACHINERY[stage]))
            lines += [step.describe() for step in self.at(stage)]
        return "\n".join(lines)

    __str__ = describe

    # --- CUDA graphs: a pool per program ---------------------------------------------------------------------
    def for_program(self, trace: Trace, distributed: bool, name: str) -> Pipeline:
        """The passes of the program `trace` acquired: a CUDAGraphs pass captures into a pool of the program's own,
        or is left out (with a warning saying why) where the program cannot have graphs."""
        if self.graphs is not None or not any(isinstance(s.transform, CUDAGraphs) for s in self.steps):
            return self
        pool = graph_pool_for(trace, distributed, name)
        if pool is None:
            return self.without_graphs()
        return self._with_steps(tuple(replace(s, transform=CUDAGraphs(pool)) if isinstance(s.transform, CUDAGraphs)
                                      else s for s in self.steps))

    @property
    def graphs(self) -> GraphPool | None:
        """The pool this program's CUDA graphs capture into (None: no graphs)."""
        return next((s.transform.pool for s in self.steps if isinstance(s.transform, CUDAGraphs)), None)

    def without_graphs(self) -> Pipeline:
        """The passes without CUDA graphs: the CUDAGraphs pass and the `del` pass after it left out."""
        if self._plain is None:
            at = next((i for i, s in enumerate(self.steps) if isinstance(s.transform, CUDAGraphs)), None)
            self._plain = self if at is None else self._with_steps(self.steps[:at] + self.steps[at + 2:])
        return self._plain

    # --- the stages ------------------------------------------------------------------------------------------
    def acquire(self, trace: Trace) -> list[Trace]:
        """Stage ACQUIRED: the traces from the acquired one to what autodiff (or execution) starts from."""
        traces = [trace]
        for step in self.at(Stage.ACQUIRED):
            _append(traces, self._run(step, traces[-1], step.transform.transform_acquired(traces[-1]),
                                      _check_same_interface))
        return traces

    def computation(self, trace: Trace, distributed: DistributionTransform | None) -> list[Trace]:
        """The stages after ACQUIRED for a program nothing is differentiated in."""
        traces = [distributed.forward(trace, len(trace.output))] if distributed is not None else []
        trace = traces[-1] if traces else trace
        return traces + self.finish(trace, TraceKind.COMPUTATION, len(trace.output))

    def differentiate(self, trace: Trace, distributed: DistributionTransform | None,
                      dirty: tuple[UpdatedInput, ...] = (), places: tuple[str, ...] = (),
                      retaken: tuple[int, ...] = ()) -> tuple[GradProgram, list[Trace]]:
        """Stage GRAD and what follows for the forward; the backward's passes run in the returned program. With
        CUDA graphs, the last two traces of the forward and of the backward capture them and the two before them
        are the same program without graphs. `dirty`: the inputs the program updates in place with a value that
        has an autograd history, which they get. `places`: where the outputs sit in what the program returns (for
        messages). `retaken`: the outputs the caller gets as views taken again from other outputs, which never get
        a grad (fulmen.runtime.view_outputs)."""
        plan = plan_grad(trace, self.interpreter_factory, self.executors, self.memory_budget)
        n_saved = len(plan.saved)
        forward = plan.forward
        present = expected_cotangents(plan.differentiable, retaken)
        backward = plan.backward(present)
        traces, forwards = [forward], []
        for step in self.at(Stage.GRAD):
            if "transform_forward" in step.hooks:
                forward = self._run(step, forward, step.transform.transform_forward(GradTraces(forward, backward,
                                                                                               n_saved)),
                                    lambda b, a, what: _check_forward(b, a, plan.n_outputs, n_saved, what))
                _append(traces, forward)
            forwards.append(forward)
            backward = self._backward(step, GradTraces(forward, backward, n_saved))
        if distributed is not None:
            traces.append(distributed.forward(traces[-1], plan.n_outputs))
        traces += self.finish(traces[-1], TraceKind.FORWARD, plan.n_outputs)
        finalize = BackwardPasses(self, tuple(forwards), n_saved, distributed)
        program = GradProgram(plan, traces[-1].python_callable(), finalize,
                              finalize(plan.backward(present), GradSync.SYNC, graphed=True), autocast_enabled(),
                              distributed, dirty, places, retaken)
        if self.graphs is not None:
            # the forward and backward without graphs (before CUDAGraphs and its `del` pass), for a forward whose
            # previous backward has not run yet
            program.use_graphs(GraphedProgram(self.graphs), traces[-3], program.backward_traces[-3])
        return program, traces

    def finish(self, trace: Trace, kind: TraceKind, returned: int) -> list[Trace]:
        """Stages EXECUTION, FINAL and CODEGEN. `returned`: how many of the outputs the caller receives (CUDA graphs
        clone them out of their pool)."""
        traces = [trace]
        for step in self._finishing:
            before, transform = traces[-1], step.transform
            if step.stage is Stage.EXECUTION:
                after = transform.transform_execution(before, kind)
            elif step.stage is Stage.FINAL:
                after = transform.transform_final(before, kind)
            else:
                after = transform.transform_codegen(before, kind, returned)
            _append(traces, self._run(step, before, after, _check_same_interface))
        return traces[1:]

    def _backward(self, step: Step, traces: GradTraces) -> Trace:
        backward = traces.backward
        if "transform_backward" in step.hooks:
            backward = self._run(step, backward, step.transform.transform_backward(traces),
                                 lambda b, a, what: _check_backward(b, a, traces, what))
        if step.checked:
            # also when the backward hook left the backward as it was: the forward's may have changed what is saved
            _same_values(traces.saved_by_forward, backward.inputs[: traces.n_saved],
                         f"{step.transform.name} (stage grad)",
                         "saved tensors (the forward's saved outputs against the backward's inputs)")
        return backward

    def _run(self, step: Step, before: Trace, after: Any, check: Callable[[Trace, Trace, str], None]) -> Trace:
        """What `step`'s hook returned for `before`: as it is for fulmen's own passes, else checked and stamped."""
        return self._hook(step.transform, step.stage, before, after, check) if step.checked else after

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
    they pair with is fixed: `forwards[i]` is the forward after GRAD pass i."""

    pipeline: Pipeline
    forwards: tuple[Trace, ...]
    n_saved: int
    distributed: DistributionTransform | None

    def __call__(self, backward: Trace, mode: GradSync, graphed: bool = False) -> list[Trace]:
        """`graphed`: the backward replays CUDA graphs (the one for all cotangents, synced), when the program has
        them."""
        pipeline = self.pipeline if graphed else self.pipeline.without_graphs()
        traces = [backward]
        for step, forward in zip(pipeline.at(Stage.GRAD), self.forwards):
            _append(traces, pipeline._backward(step, GradTraces(forward, traces[-1], self.n_saved)))
        if self.distributed is not None:
            traces.append(self.distributed.backward(traces[-1], mode))
        # the gradients all go to the caller: all cloned out of the graphs' pool
        return traces + pipeline.finish(traces[-1], TraceKind.BACKWARD, len(traces[-1].output))


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
