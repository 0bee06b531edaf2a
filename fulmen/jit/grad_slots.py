"""`loss.backward()` inside a jitted program, and the `.grad` of the tensors it reaches (issue 50).

A whole training step (`loss.backward(); optimizer.step(); optimizer.zero_grad()`) is one trace. At the backward
call acquisition differentiates what it recorded so far with fulmen's own grad transform (the rules of
fulmen.transforms.autodiff, as `fulmen.jit` does for a backward outside), writes the backward's calls into the
trace right there, and keeps each leaf's gradient in a *slot*: the program's `p.grad` reads the slot (a trace
value), `p.grad = None` empties it, `p.grad.zero_()` updates it, and a second backward adds into it as eager's
AccumulateGrad does. After the call the trace's final slot values become the tensors' `.grad` (GradWrite), so a
caller sees what eager leaves: the grad, or None after `zero_grad(set_to_none=True)`.

Leaves are the real tensors the program captured (the parameters of a model passed as an argument, or a global's):
each one the trace touched has a guard on its `.grad` as the trace began: None, or a tensor laid out as then, which
each call reads anew (a trace input: CacheEntry.fetched), so micro-batches accumulating into the grads of the step
before reuse one trace; a grad that is a view is guarded by identity. The backward consumes the graph, as eager's
(retain_graph is refused): the values computed before it no longer require grad, so nothing else of the trace runs
through torch.autograd.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily

from fulmen.acquisition.acquire import Interpreter, _captured
from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.trace import Trace, TraceBuilder
from fulmen.jit.pipeline import differentiated_rewrites
from fulmen.observation.guards import Guard
from fulmen.observation.value_checks import Emitter
from fulmen.ops import prims
from fulmen.options import JitOptions
from fulmen.transforms.autodiff import BackwardAssembler, GradTransform
from fulmen.transforms.distribution import distributed_input

T = torch.Tensor


@dataclass(eq=False)
class GradWrite:
    """After each call: `tensor.grad = value` (the trace's final value of its slot, or None)."""

    tensor: torch.Tensor
    name: str  # the trace input standing for it, for messages

    def apply(self, value: torch.Tensor | None = None) -> None:
        self.tensor.grad = value

    def describe(self) -> str:
        return f"the .grad of {self.name}"


@dataclass(eq=False)
class Slot:
    tensor: torch.Tensor  # the real tensor (a captured leaf)
    proxy: TensorProxy  # the trace input standing for it
    initial: torch.Tensor | None  # its real .grad when the trace began
    value: Any  # what `.grad` reads now: None, or a tensor the program holds (a trace value, or `initial` itself)


@contextlib.contextmanager
def _off_acquisition(interpreter: Interpreter) -> Iterator[None]:
    """The grad rules run off the acquisition's mode (they record into a builder of their own, as fulmen.grad's do)
    and off the program's modes above it."""
    stack = _get_current_function_mode_stack()
    with contextlib.ExitStack() as popped:
        if interpreter in stack:
            for _ in range(len(stack) - stack.index(interpreter)):
                popped.enter_context(_pop_mode_temporarily())
        yield


def _grad_of(tensor: torch.Tensor) -> torch.Tensor | None:
    return tensor.grad


def _fetchable(grad: torch.Tensor | None) -> bool:
    """A grad each call may read anew (not a view: its base would be another input the trace does not see)."""
    return grad is not None and grad._base is None and type(grad) is torch.Tensor


def _layout(grad: torch.Tensor | None) -> tuple | None:
    """What a trace reading a grad assumes of it: its metadata (the cache key's, for an input), not its identity."""
    if not _fetchable(grad):
        return None
    return (grad.shape, grad.stride(), grad.storage_offset(), grad.dtype, grad.device, grad.requires_grad)


class StepInterpreter(Interpreter):
    """fulmen.jit's acquisition: the interpreter, with backward calls and `.grad` inside the program (GradSlots)."""

    def __init__(self, builder: TraceBuilder, executors: tuple[Any, ...], options: JitOptions) -> None:
        super().__init__(builder)
        self.grad_slots = GradSlots(self, executors, options)

    def captured_inputs(self) -> list[TensorProxy]:
        """As the interpreter's, but an update of a captured leaf that requires grad is refused only where autograd
        sees it, as eager refuses it: under torch.no_grad() (an optimizer's step) eager allows it."""
        for tensor, proxy in self.constants:
            if self.functional.written_seen_by_autograd(proxy) and tensor.requires_grad and tensor.is_leaf:
                raise TraceError(_captured(tensor), self.functional.written_at(proxy))
        self.arrays.refuse_changes(self.functional.was_written, self.functional.written_at)
        return [proxy for _, proxy in self.constants]


class GradSlots:
    """The `.grad` of the program's leaves while it is acquired, and its backward calls."""

    def __init__(self, interpreter: Interpreter, executors: tuple[Any, ...], options: JitOptions) -> None:
        self.interpreter = interpreter
        # differentiated with the jit's executors' grad rules, as a jitted forward's backward is: fused attention
        # saves its statistics and runs its own backward, where the operator-level rule recomputes the attention
        self.executors = executors
        self.options = options
        self.slots: dict[int, Slot] = {}  # id(real tensor) -> its slot
        self.backward_ran = False
        self.extra_guards: list[Guard] = []  # those of the optimizer steps (optimizer_steps.py)
        # captured tensors each call reads anew: (the tensor traced with, how a call fetches its own)
        self.fetches: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]] = []
        interpreter.special.update({
            T.grad.__get__: self.read,
            T.grad.__set__: self.assign,
            T.backward: self.tensor_backward,
            torch.autograd.backward: self.autograd_backward,
        })

    # --- .grad ------------------------------------------------------------------------------------------------------
    def _slot(self, x: torch.Tensor) -> Slot | None:
        if type(x) is TensorProxy:
            return None
        slot = self.slots.get(id(x))
        if slot is None:
            proxy = self.interpreter._constant(x)
            with torch._C.DisableTorchFunction():
                initial = x.grad
            slot = self.slots[id(x)] = Slot(x, proxy, initial, initial)
            if _fetchable(initial):  # the grad a call begins with is its own (a new tensor after each step)
                self.fetches.append((initial, functools.partial(_grad_of, x)))
        return slot

    def read(self, x: torch.Tensor) -> Any:
        slot = self._slot(x)
        if slot is None:
            raise TraceError("fulmen cannot read the .grad of a tensor argument or module input inside the program "
                             "(it follows the grads of tensors the program captures, such as the parameters of a "
                             "model passed as an argument); read it outside the jitted function",
                             self.interpreter.builder.source)
        return slot.value

    def assign(self, x: torch.Tensor, value: Any) -> None:
        slot = self._slot(x)
        if slot is None:
            raise TraceError("fulmen cannot assign the .grad of a tensor argument or module input inside the program",
                             self.interpreter.builder.source)
        if value is not None:
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"assigned grad expected to be a Tensor or None but got grad of type "
                                f"{type(value).__name__}")
            with torch._C.DisableTorchFunction():
                if value.dtype != x.dtype or value.device != x.device or value.shape != x.shape:
                    raise RuntimeError("assigned grad has data of a different size, dtype or device than the "
                                       "tensor it is assigned to")
        slot.value = value

    # --- backward ---------------------------------------------------------------------------------------------------
    def tensor_backward(self, tensor: torch.Tensor, gradient: Any = None, retain_graph: Any = None,
                        create_graph: bool = False, inputs: Any = None) -> None:
        self.backward([tensor], [gradient], retain_graph, create_graph, inputs)

    def autograd_backward(self, tensors: Any, grad_tensors: Any = None, retain_graph: Any = None,
                          create_graph: bool = False, grad_variables: Any = None, inputs: Any = None) -> None:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        grads = grad_tensors if grad_tensors is not None else grad_variables
        grads = [None] * len(tensors) if grads is None else [grads] if isinstance(grads, torch.Tensor) else list(grads)
        self.backward(tensors, grads, retain_graph, create_graph, inputs)

    def backward(self, tensors: list[Any], gradients: list[Any], retain_graph: Any, create_graph: bool,
                 inputs: Any) -> None:
        interpreter = self.interpreter
        builder = interpreter.builder
        where = builder.source
        if create_graph or retain_graph or inputs is not None:
            what = "create_graph=True" if create_graph else "retain_graph=True" if retain_graph else "inputs="
            raise TraceError(f"fulmen cannot trace a backward with {what} inside the jitted program; call it "
                             "without, or outside the jitted function", where)
        if self.options.float8 is not None:  # its transform converts a forward's matmuls before autodiff
            raise TraceError("fulmen cannot trace loss.backward() inside the program with JitOptions.float8: float8 "
                             "matmuls have their grad rules in the backward of a jitted forward; call backward "
                             "outside the jitted function", where)
        if len(builder.scopes) != 1 or builder.checkpoint_region:
            raise TraceError("fulmen traces a backward inside the program only at its top level (not inside a "
                             "replaced function, an autograd.Function or a checkpointed region)", where)
        if interpreter.retained:
            raise TraceError("fulmen cannot trace loss.backward() inside the program after retain_grad() on a tensor "
                             "it computes: call backward outside the jitted function", where)
        roots, seeds = [], []
        for i, (tensor, gradient) in enumerate(zip(tensors, gradients, strict=True)):
            value = interpreter._values(tensor)
            if type(value) is not TensorProxy or not value.requires_grad:
                raise RuntimeError(f"element {i} of tensors does not require grad and does not have a grad_fn")
            if gradient is None:
                if value.numel() != 1:
                    raise RuntimeError("grad can be implicitly created only for scalar outputs")
                seed = prims.full(tuple(value.shape), 1, dtype=value.dtype, device=value.device)
            else:
                seed = interpreter._values(gradient)
            roots.append(value)
            seeds.append(seed)
        scope = builder.scopes[0]
        produced: set[str] = set()
        free: dict[str, TensorProxy] = {}
        for bsym in scope:
            free.update((p.pname, p) for p in bsym.proxy_args() if p.pname not in produced)
            produced.update(bsym.output_names())
        trace = self._rewritten(Trace("step", list(free.values()), list(scope), tuple(roots), "", builder.namespace))
        with _off_acquisition(interpreter), torch.enable_grad():
            joint = GradTransform(trace, Interpreter, self.executors).joint()
        scope[:] = joint.forward
        assembler = BackwardAssembler(builder)
        for root, seed in zip(roots, seeds):
            assembler.accumulate(root, seed)
        builder.source = where
        with torch.no_grad():
            assembler.run(joint.chunks)
        constants = {id(p): t for t, p in interpreter.constants}
        for proxy in trace.inputs:
            grad = assembler.cot.get(proxy.pname)
            if grad is None or not proxy.requires_grad:
                continue
            tensor = constants.get(id(proxy))
            if tensor is None:
                raise TraceError(f"fulmen cannot trace loss.backward() reaching {proxy.pname}, a tensor argument or "
                                 "module input that requires grad: inside the program it follows the grads of the "
                                 "tensors the program captures (the parameters of a model passed as an argument); "
                                 "pass the model, or call backward outside the jitted function", where)
            with torch._C.DisableTorchFunction():
                hooked = bool(tensor._backward_hooks or getattr(tensor, "_post_accumulate_grad_hooks", None))
            if hooked:
                raise TraceError(f"fulmen cannot trace loss.backward() inside the program for {proxy.pname}, which has "
                                 "a hook (register_hook / register_post_accumulate_grad_hook) that eager's backward "
                                 "calls: call backward outside the jitted function", where)
            if distributed_input(tensor) is not None:
                raise TraceError(f"fulmen cannot trace loss.backward() inside the program for {proxy.pname}, a ddp / "
                                 "fsdp parameter: the reductions of its grads belong to the backward of a jitted "
                                 "forward; call backward outside the jitted function", where)
            self._accumulate(tensor, grad)
        # the graph is consumed, as eager's without retain_graph: nothing computed so far carries a history
        with torch._C.DisableTorchFunction():
            for bsym in scope:
                for out in bsym.proxy_outputs():
                    if out.requires_grad:
                        out.requires_grad_(False)
        self.backward_ran = True

    def _rewritten(self, trace: Trace) -> Trace:
        """The jit's rewrites of the acquired program that change what its backward computes (the fused head and
        loss, grouped-query attention; fulmen.jit.pipeline runs them on a forward before autodiff), run here on
        what is differentiated: on the whole trace they would come after this backward is written. They leave the
        calls they replace for the whole trace's dead-code elimination, as the program may still read them."""
        for rewrite in differentiated_rewrites(self.options, prune=False):
            trace = rewrite.run(trace)
        return trace

    def _accumulate(self, tensor: torch.Tensor, grad: TensorProxy) -> None:
        """Eager's AccumulateGrad: the first grad becomes `.grad` (laid out as the tensor, its layout contract), a
        later one is added into it in place."""
        slot = self._slot(tensor)
        with torch._C.DisableTorchFunction():
            contiguous = tensor.is_contiguous()
            laid_out = grad.stride() == tensor.stride()
        if slot.value is None:
            if not laid_out:
                if not contiguous:
                    raise TraceError(f"fulmen cannot lay out the grad of {slot.proxy.pname} (strides "
                                     f"{tensor.stride()}) as eager's AccumulateGrad does",
                                     self.interpreter.builder.source)
                grad = prims.clone(grad, memory_format=torch.contiguous_format)
            elif grad.meta._is_view():  # a view of a larger value (a transposed matmul): .grad is a tensor of its own
                grad = prims.clone(grad, memory_format=torch.preserve_format)
            slot.value = grad
            return
        with self.interpreter, torch.no_grad():
            slot.value.add_(grad)

    # --- after the program ran --------------------------------------------------------------------------------------
    def outputs(self) -> list[tuple[GradWrite, TensorProxy]]:
        """The grads the trace computes, to set after each call: (where, the trace value)."""
        writes = []
        for slot in self.slots.values():
            if slot.value is slot.initial or slot.value is None:
                continue  # unchanged, updated in place (a captured tensor: written back), or cleared (`cleared`)
            if type(slot.value) is not TensorProxy:
                raise TraceError(f"fulmen cannot assign a tensor from outside the program to the .grad of "
                                 f"{slot.proxy.pname}", None)
            writes.append((GradWrite(slot.tensor, slot.proxy.pname), slot.value))
        return writes

    def cleared(self) -> list[GradWrite]:
        """The grads to set to None after each call (the program set a grad it began with to None)."""
        return [GradWrite(s.tensor, s.proxy.pname) for s in self.slots.values()
                if s.value is None and s.initial is not None]

    def fetched(self) -> tuple[tuple[int, Callable[[], torch.Tensor]], ...]:
        """(position among the interpreter's constants, fetch) of the captured tensors each call reads anew."""
        position = {id(p): i for i, (_, p) in enumerate(self.interpreter.constants)}
        found = []
        for tensor, fetch in self.fetches:
            proxy = self.interpreter._constant_ids.get(id(tensor))
            if proxy is not None and id(proxy) in position:
                found.append((position[id(proxy)], fetch))
        return tuple(found)

    def guards(self) -> list[Guard]:
        """Each touched tensor's `.grad` as the trace began: None, or that tensor."""
        found = []
        for slot in self.slots.values():
            emit = Emitter()
            tensor = emit.bind(slot.tensor)
            if slot.initial is None:
                source = f"{tensor}.grad is None"
                traced = "None"
            elif _fetchable(slot.initial):
                source = f"{emit.bind(_layout)}({tensor}.grad) == {emit.bind(_layout(slot.initial))}"
                traced = "a tensor laid out as " + repr(_layout(slot.initial))
            else:
                source = f"{tensor}.grad is {emit.bind(slot.initial)}"
                traced = "a tensor"
            found.append(Guard(f"the .grad of {slot.proxy.pname}", source, emit.bindings, traced))
        return found + self.extra_guards
