"""The one `torch.autograd.Function` that runs a forward trace and, on `backward()`, its backward trace.

Saved tensors live on the autograd node in a plain list that the backward trace unpacks and clears, so each is freed
as soon as the backward has used it (tensors saved with `ctx.save_for_backward` stay alive until the node finishes);
a backward that retains the graph (`retain_graph=True`) gives the trace a copy of that list, so a later backward
finds them all. Their version counters are checked as eager's would be; an input the forward itself updates in place
(a write-back) was saved before the update, so a backward that reads it raises eager's error. An input the forward
updates in place with a value that has a history other than its own (`buf[1:] = w * 2`; `y.mul_(w)` on a `y` that
requires grad) is returned as that value's output and marked dirty: autograd gives it the history eager's in-place
update gives it, and the grad the backward computes for the input goes to its old history (an input that requires
grad must not be a leaf: eager refuses that update too, and so does fulmen, naming the update's line). An input that
is a view of another tensor, or that the program last updated through a view of it (`x[1:] = w`), gets that history
from a Function of its own that returns the view alone (`_UpdatedView`), the only kind autograd rebases a view for:
the base's grad_fn becomes CopySlices and the view's a view of it, as in eager, so later uses of either differentiate
back into the program (a view eager refuses to update so, of a leaf or made under no_grad or by unbind, is refused
before anything is written). The forward reads such a view's old value through a view of its base made for the
call, so hooks on the view's old node do not fire, as in eager; a retained grad (`retain_grad()`) of an input updated
so is refused, as eager's counts the program's own uses of the new value, which are inside this node. The input's
version counter ends bumped once per update, as eager's. A backward
that reads such an input's old value reads a copy the forward takes before the update, as eager's in-place ops save
their `original_self`; an earlier autograd graph that saved the input still fails on its version counter. Within the
program, a read of the old value before the update also gets the copy (eager would refuse the backward if that read
saved the input). When saved-tensor hooks are active (`torch.autograd.graph.saved_tensors_hooks`, `save_on_cpu`),
the tensors go through `save_for_backward` so the hooks see them; an input the forward saves, then updates in place,
is packed before the forward runs, when eager's op would pack it, and as in eager no version of what the hooks
packed is checked. Inputs that get no grad enter detached (`apply`). Under inference mode, which records no history
whatever grad mode says, only the forward runs.

With CUDA graphs (`JitOptions.cuda_graphs`), a forward replays its graphs only when the previous replayed forward's
backward has run (`GraphedProgram.start_forward`); otherwise it runs the same program without graphs, and its
backward does too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd import forward_ad

from fulmen.acquisition.autograd_facts import refuse_leaf_without_grads
from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.source import SourceLocation, user_location
from fulmen.core.symbolic import symbolic_dispatch, symbolic_trace
from fulmen.core.trace import Trace
from fulmen.ops import prims
from fulmen.runtime.output_grads import check_watched, feeding_outputs, watch
from fulmen.runtime.view_outputs import internal_views, unviewed
from fulmen.transforms.autocast import without_autocast
from fulmen.transforms.cudagraphs import GraphedProgram
from fulmen.transforms.distribution import DistributionTransform, GradSync
from fulmen.transforms.forward_backward import GradPlan


@dataclass(frozen=True, slots=True)
class UpdatedInput:
    """An input the forward updates in place with the value it returns at `output`, which has a history other than the
    input's own: the input is returned there instead and marked dirty, so autograd gives it the history eager's in-place
    update gives it."""

    output: int
    input: int
    where: SourceLocation | None  # the update's line
    through_view: bool = False  # the last update was of a view of the input: eager's grad_fn is CopySlices


Finalize = Callable[[Trace, GradSync], list[Trace]]  # the passes from a backward trace to the one that runs


@dataclass
class GradProgram:
    plan: GradPlan
    forward_fn: Callable[..., tuple]
    finalize: Finalize
    backward_traces: list[Trace]  # for all cotangents present (fulmen.last_backward_traces)
    autocast: bool = False  # acquired under autocast: the backward runs with autocast off, like the forward
    distributed: DistributionTransform | None = None  # collectives of ddp / fsdp parameters
    dirty: tuple[UpdatedInput, ...] = ()
    places: tuple[str, ...] = ()  # where each output sits in what the program returns, for messages
    # outputs the caller gets as views taken again from other outputs (fulmen.runtime.view_outputs): they get no grad
    retaken: tuple[int, ...] = ()
    _backward_fns: dict[tuple[tuple[bool, ...], GradSync], Callable[..., tuple]] = field(default_factory=dict)
    graphs: GraphedProgram | None = None  # CUDA graphs: forward_fn and graphed_backward_fn replay them
    plain_forward_fn: Callable[..., tuple] | None = None  # the forward without graphs
    graphed_backward_fn: Callable[..., tuple] | None = None

    def __post_init__(self) -> None:
        self.expected = expected_cotangents(self.plan.differentiable, self.retaken)  # what backward_traces get
        self._backward_fns[self.expected, GradSync.SYNC] = self._callable(self.backward_traces[-1])
        self.n_outputs = self.plan.n_outputs
        self.non_differentiable = tuple(i for i, d in enumerate(self.plan.differentiable) if not d)
        self.saved_names = tuple(p.pname for p in self.plan.saved)
        # the saved values that may be an output or a view of one (the same value, or any view): _unlinked checks
        # only these, as a check per saved value costs most of a microsecond
        outputs = {p.pname for p in self.plan.forward.output[: self.plan.n_outputs] if type(p) is TensorProxy}
        # outputs the caller gets from the node that are views of a tensor only the forward makes (view_outputs.py)
        self.internal_views = internal_views(self.plan.forward, self.plan.n_outputs,
                                             {*self.retaken, *(d.output for d in self.dirty)})
        self.may_alias_outputs = tuple(k for k, p in enumerate(self.plan.forward.output[self.plan.n_outputs :])
                                       if type(p) is TensorProxy and (p.pname in outputs or p.meta._is_view()))
        # (saved position, input position) of the inputs the forward saves, then updates in place
        position = {p.pname: i for i, p in enumerate(self.plan.source.inputs)}
        updated = {b.args[1].pname for b in self.plan.forward.bound_symbols
                   if b.sym is prims.copy_ and b.kwargs.get("bumps", 1)}
        saved_inputs = [(k, position[p.pname]) for k, p in enumerate(self.plan.saved) if p.pname in updated]
        # those with a new history: the backward reads a copy of their old value (eager's original_self), not stale
        dirty = {d.input for d in self.dirty}
        self.originals = tuple((k, i) for k, i in saved_inputs if i in dirty)
        self.stale = tuple((k, i) for k, i in saved_inputs if i not in dirty)
        self._stale_reads: dict[tuple[bool, ...], tuple[bool, ...]] = {}
        # inputs the backward gives no grad: detached, so that autograd does not walk into their histories
        grads = self.plan.assemble(self.plan.differentiable)[2]
        self.no_grad_inputs = tuple(i for i, grad in enumerate(grads) if grad is None and i not in dirty)
        if len(self.no_grad_inputs) == len(grads) and any(self.plan.differentiable):
            refuse_leaf_without_grads(self.plan.source)  # autograd.Function's outputs would not require grad
        updated_outputs = {d.output for d in self.dirty}
        self.feeding = tuple(
            f for f in feeding_outputs(self.plan.source, self.plan.differentiable, self.places)
            if f.output not in updated_outputs
        )

    def use_graphs(self, graphs: GraphedProgram, plain_forward: Trace, plain_backward: Trace) -> None:
        """The forward and backward traces (the last of `backward_traces`) replay CUDA graphs; `plain_forward` and
        `plain_backward` are the same programs without them."""
        self.graphs = graphs
        self.plain_forward_fn = plain_forward.python_callable()
        self.graphed_backward_fn = self._backward_fns[self.expected, GradSync.SYNC]
        self._backward_fns[self.expected, GradSync.SYNC] = self._callable(plain_backward)

    def _callable(self, trace: Trace) -> Callable[..., tuple]:
        fn = trace.python_callable()
        return without_autocast(fn) if self.autocast else fn

    def backward_fn(self, present: tuple[bool, ...], mode: GradSync = GradSync.SYNC) -> Callable[..., tuple]:
        fn = self._backward_fns.get((present, mode))
        if fn is None:
            with symbolic_dispatch(symbolic_trace(self.plan.forward)):  # built later than the forward: its sizes too
                fn = self._callable(self.finalize(self.plan.backward(present), mode)[-1])
            self._backward_fns[present, mode] = fn
        return fn

    def stale_reads(self, present: tuple[bool, ...]) -> tuple[bool, ...]:
        """For each of `stale`, whether the backward for the cotangents `present` reads it."""
        reads = self._stale_reads.get(present)
        if reads is None:
            with symbolic_dispatch(symbolic_trace(self.plan.forward)):
                trace = self.plan.backward(present)
            names = {name for b in trace.bound_symbols for name in b.arg_names()}
            names.update(p.pname for p in trace.output if p is not None)
            reads = self._stale_reads[present] = tuple(self.saved_names[k] in names for k, _ in self.stale)
        return reads

    def run_backward(self, present: tuple[bool, ...], sync: bool, saved: list, cotangents: list,
                     graphed: bool = False) -> tuple:
        """The input grads; gradients of distributed parameters are reduced across ranks when `sync`, else
        held back (by the distribution) for the next synced backward to add before reducing. `graphed`: the
        forward replayed CUDA graphs (its saved values are their outputs)."""
        if graphed and present == self.expected:
            return self.graphed_backward_fn(saved, cotangents)
        if self.distributed is None:
            return self.backward_fn(present)(saved, cotangents)
        if not sync:
            return self.distributed.hold_back(self.backward_fn(present, GradSync.LOCAL)(saved, cotangents))
        pending = self.distributed.take_pending()
        if pending is None:
            return self.distributed.deliver(self.backward_fn(present)(saved, cotangents))
        return self.distributed.deliver(self.backward_fn(present, GradSync.PENDING)(saved, cotangents, pending))


def expected_cotangents(differentiable: tuple[bool, ...], retaken: tuple[int, ...]) -> tuple[bool, ...]:
    """Which outputs a backward usually gets a cotangent for: the differentiable ones the caller holds."""
    return tuple(d and i not in retaken for i, d in enumerate(differentiable))


def apply(program: GradProgram, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Runs `program` through `FulmenFunction`. An input that requires grad but gets none from the backward (state
    the program holds but does not differentiate through) enters detached: autograd would otherwise run its old
    history's nodes with no grad, which fails once that history was freed by an earlier backward."""
    transform = torch._C._functorch.peek_interpreter_stack()
    if transform is not None:  # FulmenFunction keeps state on ctx, which functorch's transforms do not support
        raise RuntimeError(
            f"a fulmen-jitted function that computes grads cannot run inside a torch.func transform (here "
            f"{transform.key().name.lower()}): differentiate with fulmen's own transforms instead, "
            "fulmen.grad / fulmen.vjp / fulmen.jvp / fulmen.vmap applied to the function itself, or call the function "
            "without fulmen.jit inside torch.func")
    if torch.is_inference_mode_enabled():
        return _run_without_history(program, inputs)
    _refuse_tangents(program, inputs)
    given = inputs
    if program.no_grad_inputs or program.dirty:
        inputs = list(inputs)
        for i in program.no_grad_inputs:
            if inputs[i].requires_grad:
                inputs[i] = inputs[i].detach()
        for updated in program.dirty:
            tensor = inputs[updated.input]
            _refuse_update(tensor, program.plan.source.inputs[updated.input].pname, updated.where)
            if tensor._is_view() and tensor.requires_grad and tensor.dtype == tensor._base.dtype:
                # the forward reads the view's old value through a view of its base made now: eager's update of the
                # view sends its old value's grad to the base's old node, never through the view's own (nor its hooks)
                inputs[updated.input] = tensor._base.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
    outputs = FulmenFunction.apply(program, *inputs)
    if not program.dirty:
        return outputs
    outputs = list(outputs)
    for updated in _rebased(program, given):
        tensor = given[updated.input]
        # a view of the input itself: its base (the input) gets the CopySlices node eager's update through a view gives
        view = tensor if tensor._is_view() else tensor[...]
        outputs[updated.output] = _UpdatedView.apply(view, outputs[updated.output])
    # marking a tensor dirty bumps its version counter once more than the updates the forward made (eager's count)
    dirty = [given[updated.input] for updated in program.dirty]
    torch._C._autograd._unsafe_set_version_counter(dirty, [t._version - 1 for t in dirty])
    return tuple(outputs)


def give_history(alias: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`alias`, a `.detach()` alias of an input (or a view of one) the program updated in place with `value`, which
    has a history, with that history, as eager's update gives it (its memory is the input's: the forward wrote it)."""
    version = alias._version
    with torch.enable_grad():  # the program may have enabled grad itself
        alias = _UpdatedView.apply(alias, value)
    torch._C._autograd._unsafe_set_version_counter((alias,), (version,))  # the update was counted by the forward
    return alias


def _rebased(program: GradProgram, inputs: Sequence[torch.Tensor]) -> list[UpdatedInput]:
    """The updated inputs that get their history through a view (`_UpdatedView`), not from `FulmenFunction`."""
    return [updated for updated in program.dirty if updated.through_view or inputs[updated.input]._is_view()]


class _UpdatedView(torch.autograd.Function):
    """Gives `view`, which the forward updated in place with `value`, `value`'s history, as eager's update gives it.

    A Function that updates a view in place may return that view alone (autograd then makes its base's grad_fn a
    CopySlices over the Function), so the view's update is this Function of its own, after `FulmenFunction`: the
    grad of the view's new value goes to `value`, whose grad (from `FulmenFunction`) covers the view's old value, so
    the view's old value itself gets none from here."""

    @staticmethod
    def forward(ctx, view: torch.Tensor, value: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.mark_dirty(view)
        return view

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return torch.zeros_like(grad), grad


def _tangents_refused(names: list[str]) -> TraceError:
    return TraceError(
        f"fulmen cannot carry forward-mode tangents (torch.autograd.forward_ad) through a jitted call that also "
        f"computes grads; here {', '.join(names)} carries one. Differentiate the function in forward mode with "
        "fulmen.jvp, or make the call where no input requires grad (torch.no_grad())", user_location())


def _refuse_tangents(program: GradProgram, inputs: Sequence[torch.Tensor]) -> None:
    """Refuses inputs that carry forward-mode tangents before the forward runs. FulmenFunction.jvp refuses them too,
    but only after the forward ran, with the program's updates of its inputs made (and its random numbers drawn):
    fulmen.dynamo's fallback then ran the graph again, updating a buffer twice."""
    if forward_ad._current_level < 0:  # no dual level is open: no tangents
        return
    names = [p.pname for p, tensor in zip(program.plan.source.inputs, inputs)
             if forward_ad.unpack_dual(tensor).tangent is not None]
    if names:
        raise _tangents_refused(names)


def _run_without_history(program: GradProgram, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The outputs of a call under inference mode, which records no history whatever grad mode says (an entry traced
    with grad enabled, called under `torch.inference_mode()` with `torch.enable_grad()` inside, or one whose program
    enables grad itself): the forward alone, its saved values dropped (they may be inference tensors, which autograd
    refuses to save, and no backward will read them)."""
    forward_fn = program.forward_fn if program.graphs is None else program.plain_forward_fn  # no graph token taken
    outputs = list(forward_fn(*inputs)[: program.n_outputs])
    for updated in program.dirty:  # as eager's in-place update returns the tensor it updated
        outputs[updated.output] = inputs[updated.input]
    return tuple(outputs)


def _hooks_active() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _versions(program: GradProgram, saved: Sequence[torch.Tensor]) -> list[int]:
    """The version counters of the values saved for backward, to refuse a backward after they changed in place."""
    for name, tensor in zip(program.saved_names, saved):
        if tensor.is_inference():  # it tracks no version, and eager refuses to save it
            raise RuntimeError(f"Inference tensors cannot be saved for backward: the backward of the jitted function "
                               f"needs {name}, a tensor created under torch.inference_mode() (or a view of one). "
                               "Make a clone of it to get a normal tensor, or use torch.no_grad() instead of "
                               "torch.inference_mode()")
    return [t._version for t in saved]


class FulmenFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, program: GradProgram, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.hooked = _hooks_active()
        forward_fn = program.forward_fn
        ctx.graph_token = None
        if program.graphs is not None:
            # saved-tensor hooks would move the saved values out of the graphs' memory: no graphs under them
            ctx.graph_token = None if ctx.hooked else program.graphs.start_forward()
            if ctx.graph_token is None:
                forward_fn = program.plain_forward_fn
        # eager packs an input when the op reading it runs, before the program updates it in place: so does fulmen
        ctx.early = _pack_stale(program, inputs) if ctx.hooked and program.stale else None
        if program.dirty or program.stale or program.originals:
            outputs, saved = _run_updating_inputs(ctx, program, forward_fn, inputs)
        else:
            results = forward_fn(*inputs)
            outputs, saved = results[: program.n_outputs], results[program.n_outputs :]
        if program.internal_views:
            outputs = unviewed(outputs, program.internal_views)
        ctx.program = program
        ctx.sync = program.distributed is None or program.distributed.sync  # no_sync() is decided when the forward runs
        saved = _unlinked(saved, outputs, program.may_alias_outputs)
        if ctx.hooked:  # a pack hook that keeps the tensor it is given (save_on_cpu on CPU) would close the cycle too
            early = {k for k, _ in program.stale} if ctx.early is not None else set()
            ctx.save_for_backward(*(t for k, t in enumerate(saved) if k not in early))
        else:
            ctx.saved = saved
            ctx.versions = _versions(program, saved)
        ctx.set_materialize_grads(False)
        if program.non_differentiable:
            ctx.mark_non_differentiable(*(outputs[i] for i in program.non_differentiable))
        ctx.watched = watch(program.feeding, outputs)
        return tuple(outputs)

    @staticmethod
    def jvp(ctx, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """Called only under torch.autograd.forward_ad with a tangent on an input: the backward trace cannot give
        one (eager's ops would carry it), so the call is refused, naming the inputs and the user's line."""
        program: GradProgram = ctx.program
        names = [p.pname for p, tangent in zip(program.plan.source.inputs, tangents[1:]) if tangent is not None]
        raise _tangents_refused(names)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fulmen does not support double backward or backward(create_graph=True) through a jitted function"
            )
        program: GradProgram = ctx.program
        # backward(retain_graph=True): the saved values must outlive this backward, which frees them as it goes
        retained = torch._C._autograd._get_current_graph_task_keep_graph()
        if ctx.hooked:
            saved = _unpack_hooked(ctx, program)
        else:
            saved = ctx.saved
            if saved is None:
                raise RuntimeError("Trying to backward through a fulmen-jitted function a second time: its saved "
                                   "tensors were freed by the first backward. Specify retain_graph=True in the first "
                                   "backward (or autograd.grad) call to backward through it again")
            if retained:
                saved = list(saved)  # the backward trace clears the list it is given, not ctx's
            else:
                ctx.saved = None
            for name, tensor, version in zip(program.saved_names, saved, ctx.versions):
                if tensor._version != version:
                    raise RuntimeError(
                        f"one of the variables needed for gradient computation has been modified by an inplace "
                        f"operation: {name} (saved by a fulmen-jitted function) is at version {tensor._version}; "
                        f"expected version {version} instead.{_input_hint(program, name)}"
                    )
        present = tuple(d and g is not None for d, g in zip(program.plan.differentiable, grads))
        if program.feeding:
            check_watched(program.feeding, ctx.watched, present)
        if program.stale and not ctx.hooked:  # eager checks no version of what saved-tensor hooks packed
            _check_stale(program, present, ctx.stale)
        cotangents = [g for g, p in zip(grads, present) if p]
        # a graphed forward's saved values live in the graphs' memory, valid while its token is unfinished (no forward
        # replays the graphs meanwhile): a backward that retains them runs without graphs and leaves the token open
        token = None if retained else ctx.graph_token
        input_grads = program.run_backward(present, ctx.sync, saved, cotangents, graphed=token is not None)
        if token is not None:
            GraphedProgram.finish_backward(token)
        return (None, *input_grads)


def _unlinked(saved: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
              candidates: tuple[int, ...]) -> list[torch.Tensor]:
    """`saved`, with a detached alias (the same memory and version counter, no autograd history) in place of each of
    `candidates` that is an output of the node or a view of one. Autograd makes this node those outputs' grad_fn, and
    the node holds `saved`: an output kept there is a reference cycle that only the cyclic collector frees, and a view
    of one holds its base's history in C++, a cycle no collector sees, so a forward whose backward never ran kept its
    outputs alive for good (eager's saved outputs keep no grad_fn either)."""
    saved = list(saved)
    if not candidates:
        return saved
    returned = {id(out) for out in outputs}
    for k in candidates:
        t = saved[k]
        if id(t) in returned or t._is_view() and id(t._base) in returned:
            saved[k] = t.detach()
    return saved


def _pack_stale(program: GradProgram, inputs: tuple[torch.Tensor, ...]) -> tuple[Callable, list]:
    """The unpack hook and what the active pack hook gives for each input the forward saves, then updates in place
    (`stale`), packed before the forward runs, when eager's op reading it would pack it: `save_on_cpu` keeps the old
    value, a hook that keeps the tensor itself sees the update, as in eager."""
    pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return unpack, [pack(inputs[i]) for _, i in program.stale]


def _unpack_hooked(ctx, program: GradProgram) -> list[torch.Tensor]:
    """The saved values of a forward run under saved-tensor hooks, in the backward trace's order."""
    saved = list(ctx.saved_tensors)
    if ctx.early is not None:
        if not ctx.early:
            raise RuntimeError("Trying to backward through a fulmen-jitted function a second time: its saved tensors "
                               "were freed by the first backward. Specify retain_graph=True in the first backward (or "
                               "autograd.grad) call to backward through it again")
        unpack, packed = ctx.early
        for (k, _), value in zip(program.stale, packed):  # stale is in saved order: each insert lands at its place
            saved.insert(k, unpack(value))
        if not torch._C._autograd._get_current_graph_task_keep_graph():
            ctx.early = ()  # freed, as autograd frees what save_for_backward holds
    return saved


def _input_hint(program: GradProgram, name: str) -> str:
    """Why an update that eager's backward would not notice can fail fulmen's: it may save an input where eager
    saves a value computed from it (`(x * a).exp()`: eager saves the exp, fulmen x and a, recomputing the exp)."""
    if all(p.pname != name for p in program.plan.source.inputs):
        return ""
    return (f" {name} is an input of the jitted function, which its backward saves where eager's may save a value "
            "computed from it instead: update a clone of it, update it after the backward, or run the call and the "
            "update under torch.autograd.graph.allow_mutation_on_saved_tensors()")


def _run_updating_inputs(ctx, program: GradProgram, forward_fn: Callable[..., tuple],
                         inputs: tuple[torch.Tensor, ...]) -> tuple[list, tuple]:
    """The forward of a program that updates inputs it saves (`stale`, `originals`) or gives a history (`dirty`)."""
    before = [inputs[i]._version for _, i in program.stale]
    originals = [inputs[i].clone() for _, i in program.originals]
    results = forward_fn(*inputs)
    ctx.stale = [(version, inputs[i]._version) for version, (_, i) in zip(before, program.stale)]
    outputs, saved = list(results[: program.n_outputs]), list(results[program.n_outputs :])
    for (k, _), original in zip(program.originals, originals):
        saved[k] = original
    rebased = _rebased(program, inputs)
    marked = [updated for updated in program.dirty if updated not in rebased]
    for updated in marked:
        outputs[updated.output] = inputs[updated.input]
    if marked:
        ctx.mark_dirty(*(inputs[updated.input] for updated in marked))
    return outputs, saved


def _refuse_update(tensor: torch.Tensor, name: str, where: SourceLocation | None) -> None:
    """An update with a history of an input eager refuses to update so (FulmenFunction and `_UpdatedView` would
    fail too, after the forward wrote it): refused before the forward runs, as eager refuses before writing; and one
    of an input whose grad is retained, which fulmen cannot give."""
    if tensor.requires_grad and tensor.is_leaf:
        raise TraceError(
            f"fulmen cannot differentiate an in-place update of {name}, a leaf tensor that requires grad (eager "
            "refuses it too: a leaf Variable that requires grad is used in an in-place operation); update a "
            "clone, or update it under torch.no_grad() or through .detach()", where)
    if tensor.retains_grad or tensor._is_view() and tensor._base.retains_grad:
        raise TraceError(
            f"fulmen cannot retain the grad of {name} (or of the tensor it is a view of), which the program updates "
            "in place with a value that has an autograd history: eager's retained grad of the updated tensor also "
            "counts the program's own uses of it, which run inside the jitted function; call retain_grad() after "
            "the call", where)
    if tensor._is_view():
        _refuse_view_update(tensor, name, where)


def _refuse_view_update(tensor: torch.Tensor, name: str, where: SourceLocation | None) -> None:
    meta = torch._C._autograd._get_creation_meta(tensor)
    if tensor._base.requires_grad and tensor._base.is_leaf:
        why = ("a view of a leaf tensor that requires grad (eager: a view of a leaf Variable that requires grad is "
               "being used in an in-place operation)")
    elif meta != torch._C._autograd.CreationMeta.DEFAULT:
        how = {"NO_GRAD_MODE": "made under torch.no_grad()", "INFERENCE_MODE": "made under torch.inference_mode()",
               "MULTI_OUTPUT_NODE": "one of several views one op returns (unbind, split, chunk)"}.get(meta.name,
                                                                                              meta.name)
        why = f"a view {how}, which eager refuses to update in place with a value that requires grad"
    else:
        return
    raise TraceError(f"fulmen cannot differentiate an in-place update of {name}, {why}; update a clone, or update it "
                     "under torch.no_grad()", where)


def _check_stale(program: GradProgram, present: tuple[bool, ...], versions: list[tuple[int, int]]) -> None:
    """Eager saves the input itself, so an update after saving it fails its version check in the backward."""
    for (k, _), (before, after), read in zip(program.stale, versions, program.stale_reads(present)):
        if read:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"{program.saved_names[k]} (saved by a fulmen-jitted function, then updated in place by it) is at "
                f"version {after}; expected version {before} instead.")
