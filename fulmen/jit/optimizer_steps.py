"""`optimizer.step()` of torch.optim inside a jitted program (issue 50: the whole training step in one trace).

torch's own step code runs while the program is acquired (its hooks, `_use_grad_for_differentiable`'s grad mode, its
`_init_group` reading each `p.grad`, which is the trace's grad: grad_slots.py). Three points are fulmen's:

- the optimizer is one fulmen knows exactly (SGD, Adam, AdamW, not a subclass): any other is refused naming it and the
  line, since its step reads tensor values (`state['step'].item()`) that a trace would have to take as constants;
- its lazy state (Adam's step count and moments) is made before the traced `_init_group` runs, by torch's own
  `_init_group` run eagerly on the parameters that have a grad in the trace (as torch.compile does): the values are
  eager's (zeros, a step of 0), and the trace reads the state as it stands on every later call, so the second call
  hits the cache;
- the kernel (`_single_tensor_adam`, `_multi_tensor_adam`, `_fused_adam`, `_single_tensor_sgd`, ...) that torch's
  functional `adam()` / `sgd()` chose is recorded as one `optim.*_update` call per parameter (fulmen.ops.optim),
  whose implementation is that same kernel: eager's arithmetic, the bias corrections in Python doubles from the step
  tensor read when the call runs. Its results are written back into the parameter and the state tensors.

A float learning rate is an input of the trace, read from its param group by each call (lr_input): a scheduler
stepping between calls reuses the trace. The other hyperparameters (betas, momentum, weight decay, ...) are constants of
the trace, guarded (a schedule of momentum, OneCycleLR's, traces once per value); so are the param groups themselves
and each parameter's state tensors (add_param_group, load_state_dict trace again).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch

from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.source import frame_location
from fulmen.observation.frame_tap import QuietWatch
from fulmen.observation.guards import Guard
from fulmen.observation.value_checks import Emitter
from fulmen.ops import optim

_adam = importlib.import_module("torch.optim.adam")
_sgd = importlib.import_module("torch.optim.sgd")
_optimizer = importlib.import_module("torch.optim.optimizer")

KNOWN = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
_STEP_WRAPPER = next(c for c in torch.optim.Optimizer.profile_hook_step.__code__.co_consts
                     if isinstance(c, types.CodeType) and c.co_name == "wrapper")


def _code(fn: Any) -> types.CodeType | None:
    """The code of torch's function under its wrappers (torch._dynamo wraps optimizer methods and kernels once it is
    imported: TorchPatcher)."""
    return getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None


# kernel code -> its name in fulmen.ops.optim (torch's `_{name}_adam`)
_ADAM_KERNELS = {_code(getattr(_adam, f"_{kernel}_adam")): kernel for kernel in optim.KERNELS}
_SGD_KERNELS = {_code(getattr(_sgd, f"_{kernel}_sgd")): kernel for kernel in optim.KERNELS}


_NO_RECORD = object()  # what record_function's __enter__ keeps (and hands its __exit__) while acquired


class _Refusal:
    """Stands for the optimizer in torch's step wrapper so that the call raises `error` at the user's line (a trace
    function cannot raise into the frame it watches)."""

    def __init__(self, error: Exception) -> None:
        object.__setattr__(self, "_error", error)

    def __getattribute__(self, name: str) -> Any:
        raise object.__getattribute__(self, "_error")


class StepWatch(QuietWatch):
    """torch.optim's step wrapper (`Optimizer.profile_hook_step`): refuses an optimizer fulmen does not know."""

    def enter(self, frame: types.FrameType) -> Any:
        args = frame.f_locals.get("args") or ()
        optimizer = args[0] if args else None
        if type(optimizer) in KNOWN:
            return None
        name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        known = ", ".join(f"torch.optim.{k.__name__}" for k in KNOWN)
        error = TraceError(f"fulmen cannot trace the step of the optimizer {name}: it traces the updates of {known} "
                           "exactly (their steps read tensor values, such as state['step'], that a trace cannot "
                           "hold as constants). Call optimizer.step() outside the jitted function, or use one of "
                           "those", frame_location(frame.f_back))
        frame.f_locals["args"] = (_Refusal(error), *args[1:])
        return None


class InitGroupWatch(QuietWatch):
    """`_init_group` of a known optimizer: makes the lazy state of the parameters that have a grad in the trace, by
    torch's own `_init_group` run eagerly, and guards the group's hyperparameters."""

    def __init__(self, steps: OptimizerSteps) -> None:
        self.steps = steps

    def enter(self, frame: types.FrameType) -> Any:
        local = frame.f_locals
        optimizer, group = local.get("self"), local.get("group")
        if type(optimizer) not in KNOWN or not isinstance(group, dict):
            return None
        self.steps.guard_group(optimizer, group)
        if isinstance(optimizer, torch.optim.Adam):
            self.steps.initialize(optimizer, group)
        return None


class KernelWatch(QuietWatch):
    """torch's functional `adam()` / `sgd()`: the kernel it chose (its local `func`) becomes fulmen's recording."""

    def __init__(self, kernels: dict[types.CodeType | None, str], record: Callable[..., Any]) -> None:
        self.kernels = kernels
        self.record = record

    def enter(self, frame: types.FrameType) -> Any:
        return frame

    def line(self, token: Any, frame: types.FrameType) -> None:
        local = frame.f_locals
        func = local.get("func")
        if func is None or getattr(func, "__name__", None) == "recorded":
            return
        kernel = self.kernels.get(_code(func))
        if kernel is not None:
            def recorded(*args: Any, **kwargs: Any) -> None:
                return self.record(kernel, *args, **kwargs)

            local["func"] = recorded


def _numbers(optimizer: str, where: Any, **hyperparameters: Any) -> None:
    """Refuses a hyperparameter the step's kernel gets as anything but a Python number (a tensor's value would be a
    constant of the trace)."""
    for name, value in hyperparameters.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TraceError(f"fulmen traces {optimizer}'s step with Python numbers for its hyperparameters; {name} "
                             f"is a {type(value).__name__}", where)


def _lr_of(group: dict) -> torch.Tensor:
    return torch.scalar_tensor(group["lr"], dtype=torch.float64)


class OptimizerSteps:
    """What one acquisition does with the torch.optim steps the program makes."""

    def __init__(self, interpreter: Any, guards: list[Guard]) -> None:
        self.interpreter = interpreter
        self.guards = guards
        self._guarded: set[int] = set()
        self._kept: list[Any] = []
        self.current: tuple[torch.optim.Optimizer, dict] | None = None  # the step and group whose kernel runs next
        self._lr: dict[int, torch.Tensor] = {}  # id(group) -> the tensor holding its lr while traced (lr_input)
        # torch.autograd.profiler.record_function around the step and zero_grad: no profiler range in the trace
        interpreter.special[torch.ops.profiler._record_function_enter_new] = lambda *args, **kwargs: _NO_RECORD
        interpreter.special[torch.ops.profiler._record_function_exit._RecordFunction] = lambda *args, **kwargs: None
        self.watches: dict[types.CodeType, Any] = {
            _STEP_WRAPPER: StepWatch(),
            _code(torch.optim.Adam._init_group): InitGroupWatch(self),
            _code(torch.optim.SGD._init_group): InitGroupWatch(self),
            _code(_adam.adam): KernelWatch(_ADAM_KERNELS, self.record_adam),
            _code(_sgd.sgd): KernelWatch(_SGD_KERNELS, self.record_sgd),
        }

    # --- state and guards -------------------------------------------------------------------------------------------
    def _has_grad(self, p: torch.Tensor) -> bool:
        slot = self.interpreter.grad_slots.slots.get(id(p))
        if slot is not None:
            return slot.value is not None
        with torch._C.DisableTorchFunction():
            return p.grad is not None

    def initialize(self, optimizer: torch.optim.Optimizer, group: dict) -> None:
        """Adam's lazy state of the parameters with a grad and no state yet, made as eager's first step makes it."""
        fresh = [p for p in group["params"] if self._has_grad(p) and not optimizer.state.get(p)]
        if not fresh:
            return
        with self.interpreter.quiet, torch._C.DisableTorchFunction(), torch.no_grad():
            held = [p.grad for p in fresh]
            try:
                for p in fresh:
                    p.grad = torch.zeros_like(p)  # what `_init_group` reads of a grad: that there is one
                type(optimizer)._init_group(optimizer, {**group, "params": fresh}, [], [], [], [], [], [])
            finally:
                for p, grad in zip(fresh, held):
                    p.grad = grad

    def guard_group(self, optimizer: torch.optim.Optimizer, group: dict) -> None:
        """The group, found from the optimizer, and its hyperparameters as traced (a scheduler's new lr traces again;
        load_state_dict's new groups too)."""
        self.current = (optimizer, group)
        if id(group) in self._guarded:
            return
        self._guarded.add(id(group))
        self._kept.append(group)
        emit = Emitter()
        name = emit.bind(group)
        index = next(i for i, g in enumerate(optimizer.param_groups) if g is group)
        # the groups and their parameters as traced: add_param_group, or a parameter added to a group, trace again
        groups, params = emit.bind(optimizer.param_groups), emit.bind(group["params"])
        checks = [f"{emit.bind(optimizer)}.param_groups is {groups}", f"len({groups}) == {len(optimizer.param_groups)}",
                  f"{groups}[{index}] is {name}", f"{name}['params'] is {params}",
                  f"len({params}) == {len(group['params'])}",
                  f"all(a is b for a, b in zip({params}, {emit.bind(tuple(group['params']))}))"]
        for key, value in group.items():
            if key == "params":
                continue
            if not isinstance(value, (bool, int, float, str, tuple, type(None))):
                raise TraceError(f"fulmen cannot trace an optimizer step whose param group holds {key}={value!r} "
                                 "(a tensor or other object): pass a Python number", self.interpreter.builder.source)
            check = f"type({name}[{key!r}]) is {emit.bind(type(value))}"
            if key != "lr" or type(value) is not float:  # a float lr is an input of the trace (lr_input)
                check += f" and {name}[{key!r}] == {emit.bind(value)}"
            checks.append(check)
        traced = ", ".join(f"{k}={v!r}" for k, v in group.items() if k in ("lr", "momentum", "betas",
                                                                            "weight_decay"))
        self.guards.append(Guard("an optimizer param group or its hyperparameters", " and ".join(checks),
                                 emit.bindings, traced))

    def _guard_state(self, param: torch.Tensor, read: dict[str, torch.Tensor | None]) -> None:
        """The optimizer state of `param` holds the tensors the trace read, or none where it read none (SGD's first
        momentum buffer): load_state_dict's new tensors, or a buffer made since, trace again."""
        if self.current is None:
            raise TraceError("internal error: fulmen did not see the optimizer step's _init_group",
                             self.interpreter.builder.source)
        optimizer, _ = self.current
        state = optimizer.state[param]
        self._kept.append(state)
        emit = Emitter()
        name = emit.bind(state)
        checks = [f"{emit.bind(optimizer)}.state.get({emit.bind(param)}) is {name}"]
        checks += [f"{name}.get({key!r}) is {emit.bind(value) if value is not None else None}"
                   for key, value in read.items()]
        traced = ", ".join(f"{k}: {'a tensor' if v is not None else 'none'}" for k, v in read.items())
        self.guards.append(Guard("the optimizer state of a parameter", " and ".join(checks), emit.bindings, traced))

    def lr_input(self, lr: Any) -> Any:
        """The learning rate of the group whose kernel runs, as the trace reads it: a float is an input each call
        reads from the group (a 0-dim float64 tensor holds a Python float exactly; the update reads it back with
        .item()), so a scheduler changing it every step reuses the trace; another number stays a guarded constant."""
        if type(lr) is not float or self.current is None:
            return lr
        _, group = self.current
        holder = self._lr.get(id(group))
        if holder is None:
            with torch._C.DisableTorchFunction():
                holder = self._lr[id(group)] = _lr_of(group)
            self.interpreter.grad_slots.fetches.append((holder, functools.partial(_lr_of, group)))
        return self._value(holder)

    # --- the kernels ------------------------------------------------------------------------------------------------
    def _value(self, x: Any) -> Any:
        return None if x is None else self.interpreter._values(x)

    def _write(self, obj: torch.Tensor, value: TensorProxy, what: str) -> None:
        interpreter = self.interpreter
        with torch.no_grad():
            interpreter._assign(interpreter._proxy(obj), value, what)
        # a parameter or state tensor the guards pin by identity: the update writes each call's tensor, also one of
        # memory torch does not own (a checkpoint loaded with mmap)
        interpreter.arrays.hold(obj)

    def record_adam(self, kernel: str, params: list, grads: list, exp_avgs: list, exp_avg_sqs: list,
                    max_exp_avg_sqs: list, state_steps: list, grad_scale: Any = None, found_inf: Any = None, *,
                    amsgrad: bool, has_complex: bool, beta1: Any, beta2: Any, lr: Any, weight_decay: Any, eps: Any,
                    maximize: bool, capturable: bool, differentiable: bool,
                    decoupled_weight_decay: bool = False) -> None:
        where = self.interpreter.builder.source
        if grad_scale is not None or found_inf is not None or capturable or differentiable or has_complex:
            raise TraceError("fulmen traces Adam's step without grad_scale/found_inf, capturable, differentiable or "
                             "complex parameters", where)
        _numbers("Adam", where, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps)
        with self.interpreter.quiet:
            for i, param in enumerate(params):
                maximum = max_exp_avg_sqs[i] if amsgrad else None
                out = optim.ADAM_UPDATE(
                    self._value(param), self._value(grads[i]), self._value(exp_avgs[i]), self._value(exp_avg_sqs[i]),
                    self._value(maximum), self._value(state_steps[i]), lr=self.lr_input(lr), beta1=beta1, beta2=beta2,
                    weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize,
                    decoupled_weight_decay=decoupled_weight_decay, kernel=kernel)
                updated = [param, exp_avgs[i], exp_avg_sqs[i], *([maximum] if amsgrad else []), state_steps[i]]
                self._guard_state(param, {"step": state_steps[i], "exp_avg": exp_avgs[i],
                                          "exp_avg_sq": exp_avg_sqs[i],
                                          **({"max_exp_avg_sq": maximum} if amsgrad else {})})
                for obj, value in zip(updated, out, strict=True):
                    self._write(obj, value, "Adam's update")

    def record_sgd(self, kernel: str, params: list, grads: list, momentum_buffer_list: list,
                   grad_scale: Any = None, found_inf: Any = None, *, weight_decay: Any, momentum: Any, lr: Any,
                   dampening: Any, nesterov: bool, maximize: bool, has_sparse_grad: bool) -> None:
        where = self.interpreter.builder.source
        if grad_scale is not None or found_inf is not None or has_sparse_grad:
            raise TraceError("fulmen traces SGD's step without grad_scale/found_inf or sparse grads", where)
        _numbers("SGD", where, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
        with self.interpreter.quiet:
            for i, param in enumerate(params):
                buffer = momentum_buffer_list[i] if momentum != 0 else None
                out = optim.SGD_UPDATE(self._value(param), self._value(grads[i]), self._value(buffer),
                                       lr=self.lr_input(lr),
                                       momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                       nesterov=nesterov, maximize=maximize, kernel=kernel)
                self._write(param, out[0], "SGD's update")
                if momentum == 0:
                    continue
                self._guard_state(param, {"momentum_buffer": buffer})
                if buffer is None:
                    # eager's first step makes the buffer (a copy of the grad): a tensor of the optimizer's state from
                    # now on, made here once and written by this trace's calls; its guard tells later calls apart
                    with torch._C.DisableTorchFunction():
                        made = torch.empty_like(out[1].meta, device=out[1].device)
                    momentum_buffer_list[i] = made  # SGD.step stores it into the state, as eager's
                    self._write(made, out[1], "SGD's momentum buffer")
                else:
                    self._write(buffer, out[1], "SGD's update")
