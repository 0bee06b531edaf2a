"""`fulmen.jit`: jitted functions and modules, their cache and the pipeline from acquisition to execution."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fulmen.acquisition.acquire import Interpreter, current_interpreter
from fulmen.acquisition.aliasing import AliasPlan, StorageGroups, plan_aliases, storage_offsets
from fulmen.acquisition.autograd_facts import refuse_leaf_without_grads, refuse_returned_nodes
from fulmen.acquisition.autograd_functions import function_apply_recorded
from fulmen.acquisition.is_compiling import seen_as_compiling
from fulmen.acquisition.replacements import call_table
from fulmen.core import pytree
from fulmen.core.errors import CacheLimitError, CacheLimitWarning, DataDependentError, TraceError
from fulmen.core.proxies import TensorProxy, stand_for, unproxyable
from fulmen.core.source import SourceLocation
from fulmen.core.trace import Trace, TraceBuilder
from fulmen.executors import base as executor_base
from fulmen.executors.base import Executor
from fulmen.jit.buffer_registrations import RealModules, Registration
from fulmen.jit.dynamic_shapes import DynamicDims, SymbolicInputs, frozen, has_sizes, settled, settled_writes, thawed
from fulmen.jit.grad_slots import GradWrite, StepInterpreter
from fulmen.jit.module_inputs import ModuleInput, ShadowTree, build_shadow, qualified_names
from fulmen.jit.optimizer_steps import OptimizerSteps
from fulmen.jit.pipeline import Pipeline
from fulmen.jit.program_outputs import program_outputs
from fulmen.jit.trace_cache import Cache, CacheEntry, ReturnedInput
from fulmen.jit.undo import HookSnapshot, reachable_modules
from fulmen.observation.global_setters import Setters
from fulmen.observation.global_state import GlobalState, StateLeftChanged
from fulmen.observation.guards import (
    ModuleKeys,
    argument_key,
    compile_check,
    global_state_key,
    module_key,
    symbolic_argument_key,
)
from fulmen.observation.observer import Observer
from fulmen.ops import prims
from fulmen.options import CacheLimitAction, JitOptions
from fulmen.runtime.distinct_outputs import identity_pattern, kept_distinct, repeats_as_first
from fulmen.runtime.output_grads import Retained, rewatch
from fulmen.runtime.trace_function import UpdatedInput, apply
from fulmen.runtime.view_outputs import ViewOutput, retaken, take_views
from fulmen.transforms.autocast import autocast_enabled, without_autocast
from fulmen.transforms.distribution import distributed_input, distributed_program, logical_meta
from fulmen.transforms.transform import named_inputs
from fulmen.transforms.update_order import updates_early


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    eager_calls: int = 0  # misses past JitOptions.cache_limit, run uncompiled


def _arg_hints(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> list[str]:
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
        pairs = list(bound.arguments.items())
    except (TypeError, ValueError):
        pairs = [(f"arg{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    # prefix_0, prefix_key, prefix_field: the keys from the argument to each tensor, the order `flatten` takes them in
    return [name + "".join(f"_{key}" for key in path)
            for name, value in pairs for path, _ in pytree.leaves_with_paths(value, _is_tensor)]


def _places(result: Any, returned: int, rebinds: list[tuple[nn.Module, str, str]]) -> tuple[str, ...]:
    """Where each output of the trace is for the program: in what it returns (`output['hidden_states'][1]`), then
    the module attributes it assigned."""
    places = [f"output{where}" for where, _ in pytree.tensor_places(result)]
    if len(places) != returned:  # flatten took other tensors (those of an object the program was given)
        places = [f"output #{i}" for i in range(returned)]
    return (*places, *(r.describe() if isinstance(r, GradWrite) else f"attribute {r[2]} of a "
                       f"{type(r[0]).__qualname__} module" for r in rebinds))


def _named_arguments(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> tuple[list[str], list[Any]]:
    """The program's parameter names and the values they receive (`**kwargs` is a dict the call makes anew: its
    values are the program's, the dict is not)."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return [f"arg{i}" for i in range(len(args))] + list(kwargs), [*args, *kwargs.values()]
    names, values = [], []
    for name, value in bound.arguments.items():
        if bound.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            names += [f"{name}[{key!r}]" for key in value]
            values += list(value.values())
        else:
            names.append(name)
            values.append(value)
    return names, values


def _is_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor)


def _needs_grad(trace: Trace) -> bool:
    """Whether the trace runs through autograd: some input requires grad and some output was computed from it with
    grad enabled (also inside `with torch.enable_grad():` in a call made under no_grad)."""
    if not any(p.requires_grad for p in trace.inputs):
        return False
    if torch.is_grad_enabled():
        return any(isinstance(out, TensorProxy) and out.requires_grad for out in trace.output)
    inputs = {p.pname for p in trace.inputs}
    return any(isinstance(out, TensorProxy) and out.requires_grad and out.pname not in inputs for out in trace.output)


def _with_grad_mode(fn: Callable[..., Any], enabled: bool) -> Callable[..., Any]:
    """`fn` run with grad mode `enabled`: the mode the trace's outputs were computed in, where the caller's differs
    (under inference mode, which records no history whatever grad mode says, as the caller's)."""

    def run(*inputs: torch.Tensor) -> Any:
        if torch.is_inference_mode_enabled():
            return fn(*inputs)
        before = torch.is_grad_enabled()
        torch._C._set_grad_enabled(enabled)
        try:
            return fn(*inputs)
        finally:
            torch._C._set_grad_enabled(before)

    return run


def _refuse_stored_proxies(args: tuple, kwargs: dict[str, Any]) -> None:
    """Objects the program was given must not keep traced tensors (eager would have stored real ones there)."""
    given = [(f"argument {i}", arg) for i, arg in enumerate(args)] + [(f"argument {k}", v) for k, v in kwargs.items()]
    for name, value in given:
        where = pytree.find(value, lambda obj: type(obj) is TensorProxy)
        if where is None:
            continue
        raise TraceError(
            f"the program stored a traced tensor into an object it was given ({name}: {where}); fulmen cannot "
            "update Python objects across calls. Create the object inside the program and return it, or leave it "
            "out (e.g. use_cache=False for a Hugging Face KV cache).", None)


@dataclass
class Acquisition:
    """One run of the user's program under the interpreter, and what it produced."""

    builder: TraceBuilder
    interpreter: Interpreter
    observer: Observer
    tree: ShadowTree | None
    inputs: list[TensorProxy]  # the trace's inputs, in the order a call passes them
    values: list[TensorProxy]
    out_spec: Any
    out_objects: dict[int, Any]
    returns_input: tuple[ReturnedInput | None, ...]
    rebinds: list[tuple[nn.Module, str, str]]
    retained: Retained | None  # what each call keeps the grad of (the program's retain_grad calls)
    dirty: tuple[int, ...]  # inputs that get an autograd history (their values follow the rebinds' in `values`)
    compiling: bool  # traced as a tracer is seen (torch.compiler.is_compiling()), see fulmen.acquisition.is_compiling
    registrations: tuple[Registration, ...] = ()  # the buffers the program registered (buffer_registrations.py)
    places: tuple[str, ...] = ()  # where each returned tensor sits in the output (`output['logits']`), for messages
    views: tuple[ViewOutput, ...] = ()  # returned views of computed tensors, taken again by the call

    def written(self) -> dict[int, SourceLocation | None]:
        """The inputs the program updates in place (their final values are copied back), by position, with the line
        of the update."""
        position = {p.pname: i for i, p in enumerate(self.inputs)}
        where = self.interpreter.functional.written_at
        return {position[bsym.args[1].pname]: where(bsym.args[1]) for bsym in self.builder.bound_symbols
                if bsym.sym is prims.copy_ and bsym.args[1].pname in position}


def _with_storage(plan: AliasPlan, fn: Callable[..., tuple], *inputs: torch.Tensor) -> tuple:
    return fn(*inputs, *plan.bases(inputs))


def _carry_attributes(tensor: torch.Tensor, proxy: TensorProxy, name: str) -> None:
    clashing = sorted(set(tensor.__dict__) & (set(proxy.__dict__) | set(dir(type(proxy)))))
    if clashing:
        raise TraceError(f"fulmen cannot trace a tensor argument ({name}) with Python attributes {clashing}: the "
                         "trace's stand-in for it uses those names itself; rename them", None)
    proxy.__dict__.update(tensor.__dict__)


def _refuse_unproxyable(tensors: list[torch.Tensor], names: list[str]) -> None:
    for tensor, name in zip(tensors, names):
        if (why := unproxyable(tensor)) is not None:
            raise TraceError(f"fulmen cannot trace the tensor argument {name}: {why}", None)


def _module_proxy(builder: TraceBuilder, interpreter: Interpreter, tensor: torch.Tensor, name: str) -> TensorProxy:
    proxy = builder.make_proxy(logical_meta(tensor), tensor.device, tensor.requires_grad, name=name)
    stand_for(proxy, tensor)
    interpreter.autograd.add_input(proxy, proxy, tensor)
    return proxy


def _facts_read(acquisition: Acquisition) -> tuple[tuple[int, str, bool], ...] | None:
    """The inputs whose `is_leaf` (or `grad_fn`) or `is_inference` the program read, by position, with what it
    read."""
    read = acquisition.interpreter.autograd.read
    if not read:
        return None
    position = {id(p): i for i, p in enumerate(acquisition.inputs)}
    return tuple(sorted((position[id(proxy)], fact, value) for proxy, fact, value in read.values()))


class JittedFunction:
    """A callable that runs `fn` through its cached, compiled traces."""

    def __init__(self, fn: Callable[..., Any], options: JitOptions, module: nn.Module | None = None,
                 executors: tuple[Executor, ...] = ()) -> None:
        self._fn = fn
        # inspect.signature(jitted) is fn's: libraries choose the arguments they pass by it (transformers' generate
        # computes position_ids from the attention mask only for a forward that names them)
        self.__wrapped__ = fn
        self._module = module
        self._options = options
        self.executors = executors
        self._cache = Cache(options.cache_limit)
        self._dims = DynamicDims(options.dynamic)
        self._module_inputs: list[ModuleInput] = []
        self._module_keys = ModuleKeys()  # module_key of the module tensors, again only when they changed
        self.stats = CacheStats()
        self.last_entry: CacheEntry | None = None
        self.pipeline = Pipeline(options, executors, Interpreter)
        self.last_miss_reasons: list[str] = []  # why the last call that missed could not use each cached trace
        self._warned = False
        self._registrations_seen = -1  # executor_base.REGISTRATIONS.count when _registrations_key was counted
        self._registrations_key: tuple[int, ...] = ()

    def __deepcopy__(self, memo: dict[int, Any]) -> JittedFunction:
        """`fn` (and its module) copied, jitted anew with the same options and executors: the traces name the
        original's tensors, and executors are registered by identity."""
        module = copy.deepcopy(self._module, memo)
        return JittedFunction(copy.deepcopy(self._fn, memo), self._options, module, self.executors)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if current_interpreter() is not None:  # called by a program another fulmen.jit acquires: part of its trace
            return (self._fn if self._module is None else self._module)(*args, **kwargs)
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            tensors, spec = list(args), len(args)
        else:
            tensors = []
            spec = pytree.flatten((args, kwargs), tensors)
        module_tensors = [source.fetch() for source in self._module_inputs]
        registrations = (self._registrations_key if executor_base.REGISTRATIONS.count == self._registrations_seen
                         else self._recount_registrations())
        state = global_state_key()
        try:
            key = (spec, argument_key(tensors), self._module_keys(module_tensors), state, registrations)
        except AttributeError:  # a module tensor was removed or replaced by a non-tensor: trace anew
            key = None
        except RuntimeError:  # a tensor without strides (nested): refused, named
            _refuse_unproxyable(tensors, self._names(args, kwargs, len(tensors)))
            raise
        entry = self._cache.lookup(key, tensors, module_tensors)
        if entry is None and self._dims.active and key is not None:  # a trace with symbolic sizes (dynamic_shapes.py)
            for positions in self._dims.keys(tensors):
                entry = self._cache.lookup(self._symbolic_key(key, tensors, positions), tensors, module_tensors)
                if entry is not None:
                    break
        if entry is None and len(self._cache.layouts) > 1:
            entry, module_tensors = self._other_layouts(spec, tensors, (state, registrations), module_tensors)
        if entry is None:
            self.stats.misses += 1
            names = self._names(args, kwargs, len(tensors))
            self.last_miss_reasons = self._cache.miss_reasons(
                key, tensors, module_tensors, names, self._module_inputs,
                lambda positions: self._symbolic_key(key, tensors, positions))
            if self._cache.entries:
                self.last_miss_reasons += self._dims.notes(names)
            if self._cache.full:
                return self._past_limit(args, kwargs)
            self._dims.observe(tensors)
            before = GlobalState.current()
            try:
                entry, module_tensors = self._compile(args, kwargs, tensors, (spec, state, registrations), names,
                                                      before)
            except BaseException:
                before.restore()  # the grad mode or autocast a refused program set is not left behind
                raise
            self._cache.add(entry)
            if entry.symbolic:
                self._dims.traced[entry.symbolic] = None
        else:
            self.stats.hits += 1
        self.last_entry = entry
        constants = entry.current_constants()
        outputs = entry.fn(*tensors, *module_tensors, *constants)
        return self._finish(entry, outputs, tensors, module_tensors, constants)

    def declare_dynamic(self, dims: dict[int, frozenset[int]]) -> None:
        """Dimensions (argument tensor position -> dims) symbolic from the first trace (those Dynamo made symbolic
        in a graph fulmen.dynamo runs)."""
        self._dims.declare(dims)

    @staticmethod
    def _symbolic_key(key: tuple | None, tensors: list[torch.Tensor], positions: tuple[int, ...]) -> tuple | None:
        """The cache key of a trace whose arguments at `positions` carry symbolic sizes (its shape guards check
        them)."""
        if key is None or not positions:
            return key
        return (key[0], symbolic_argument_key(tensors, positions), *key[2:])

    def _recount_registrations(self) -> tuple[int, ...]:
        """Its executors' registration counts, a part of the cache key: after a registration (an implementation, a
        replacement) a fresh fulmen.jit would trace otherwise, so a trace built before is not reused."""
        self._registrations_seen = executor_base.REGISTRATIONS.count
        self._registrations_key = tuple(executor.registrations for executor in self.executors)
        return self._registrations_key

    def _other_layouts(self, spec: Any, tensors: list, tail: tuple, module_tensors: list) -> tuple:
        """A cached trace made when the module had other parameters or buffers (a ModuleList grew, then shrank)."""
        for layout in self._cache.layouts:
            if list(layout) == self._module_inputs:
                continue
            other = [source.fetch() for source in layout]
            try:
                key = (spec, argument_key(tensors), module_key(other), *tail)
            except AttributeError:
                continue
            entry = self._cache.lookup(key, tensors, other)
            if entry is not None:
                self._module_inputs = list(layout)
                return entry, other
        return None, module_tensors

    def _names(self, args: tuple, kwargs: dict[str, Any], n: int) -> list[str]:
        hints = _arg_hints(self._module.forward if self._module is not None else self._fn, args, kwargs)
        return hints if len(hints) == n else [f"arg{i}" for i in range(n)]

    def _past_limit(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        name = getattr(self._module if self._module is not None else self._fn, "__qualname__",
                       type(self._module).__qualname__)
        reason = self.last_miss_reasons[-1].split(": ", 1)[-1]
        message = (f"fulmen.jit({name}) holds JitOptions.cache_limit={self._cache.limit} traces and this call needs "
                   f"another: {reason}")
        latest = self._cache.entries[-1]
        distributed = any(distributed_input(t) is not None for t in (*(s.fetch() for s in latest.module_inputs),
                                                          *(t for t in latest.constants if t is not None)))
        if self._options.cache_limit_action is CacheLimitAction.ERROR or distributed:
            why = " (a program with ddp / fsdp parameters cannot run eagerly)" if distributed else ""
            raise CacheLimitError(f"{message}{why}. Keep it constant, or raise the limit "
                                  "(fulmen.last_cache_miss_reasons lists why each trace did not apply)")
        if not self._warned:
            self._warned = True
            warnings.warn(f"{message}. Calls that miss the cache run eagerly from now on "
                          "(fulmen.last_cache_miss_reasons lists why each trace did not apply)", CacheLimitWarning,
                          stacklevel=3)
        self.stats.eager_calls += 1
        return (self._fn if self._module is None else self._module)(*args, **kwargs)

    @staticmethod
    def _finish(entry: CacheEntry, outputs: tuple, tensors: list[torch.Tensor], module_tensors: list[torch.Tensor],
                constants: tuple) -> Any:
        for write in entry.writes:  # the Python state the program stored (fulmen.observation.state_writes)
            write.apply()
        if entry.distinct is not None:  # what the trace merged, eager gives as distinct tensors (distinct_outputs.py)
            distinct = kept_distinct(outputs, entry.distinct)
            if distinct is not outputs and entry.program is not None and entry.program.feeding:
                rewatch(entry.program.feeding, outputs, distinct)
            outputs = distinct
        produced = outputs
        if len(outputs) > entry.n_outputs:  # then the rebinds' values, then the values of updated inputs
            for rebind, value in zip(entry.rebinds, outputs[entry.n_outputs :]):
                if isinstance(rebind, GradWrite):
                    rebind.apply(value)
                    continue
                module, container, name = rebind
                getattr(module, container)[name] = value
            outputs = outputs[: entry.n_outputs]
        returns_input, views = entry.returns_input, entry.views
        if entry.view_sizes:  # views taken by symbolic sizes: this call's (dynamic_shapes.thawed)
            returns_input, views = thawed((returns_input, views), entry.shapes.values(tensors))
        takes_inputs = any(r is not None for r in returns_input)
        if takes_inputs or entry.retained is not None:
            inputs = [*tensors, *module_tensors, *constants]
        if takes_inputs:
            returned = [r.take(inputs, out) if r is not None else out for r, out in zip(returns_input, outputs)]
            if entry.program is not None and entry.program.feeding:
                rewatch(entry.program.feeding, outputs, returned)
            outputs = returned
        if views is not None:  # views of computed tensors, taken outside the autograd node (view_outputs.py)
            returned = take_views(views, outputs, produced)
            if entry.program is not None and entry.program.feeding:
                rewatch(entry.program.feeding, outputs, returned)
            outputs = returned
        if entry.distinct is not None and any(first != i for i, first in enumerate(entry.distinct)):
            outputs = repeats_as_first(list(outputs), entry.distinct)
        if entry.retained is not None:
            entry.retained.apply(outputs, produced, inputs)
        if entry.out_spec == pytree.TENSOR:
            return outputs[0]
        return pytree.unflatten(entry.out_spec, outputs, entry.out_objects)

    # --- acquisition ---------------------------------------------------------------------------------------------
    def _acquire(self, args: tuple, kwargs: dict[str, Any], tensors: list[torch.Tensor], names: list[str],
                 aliases: AliasPlan | None, real_inputs: list[torch.Tensor], compiling: bool,
                 symbolic: SymbolicInputs | None = None) -> Acquisition:
        for executor in self.executors:
            executor.acquiring()
        builder = TraceBuilder(decompose=self._options.decompose)
        # with loss.backward() and .grad inside the program (grad_slots.py)
        interpreter = StepInterpreter(builder, self.executors, self._options)
        observer = Observer((self._fn,))
        _refuse_unproxyable(tensors, names)
        proxies = [builder.make_proxy(symbolic.meta(t, i) if symbolic is not None else logical_meta(t), t.device,
                                      t.requires_grad, name=hint) for i, (t, hint) in enumerate(zip(tensors, names))]
        visible, storage = self._shared_storage(builder, interpreter, proxies, aliases, real_inputs, names)
        for tensor, seen, proxy in zip(tensors, visible, proxies):
            interpreter.autograd.add_input(seen, proxy, tensor)
        for tensor, proxy, name in zip(tensors, visible, names):
            if tensor.__dict__:  # Python attributes the program may read (the cache key holds them)
                _carry_attributes(tensor, proxy, name)
            stand_for(proxy, tensor)
        originals: dict[int, Any] = {}
        spec = pytree.flatten((args, kwargs), [], originals)
        proxy_args, proxy_kwargs = pytree.unflatten(spec, visible, originals)
        observer.arguments(*_named_arguments(self._module.forward if self._module is not None else self._fn,
                                             proxy_args, proxy_kwargs))
        target: Callable[..., Any] = self._fn
        tree: ShadowTree | None = None
        real = RealModules(reachable_modules(self._fn, self._module, args, kwargs))
        calls = call_table(self.executors, interpreter)
        setters = Setters(interpreter)  # torch's global setters the program calls, recorded where it calls them
        steps = OptimizerSteps(interpreter, interpreter.grad_slots.extra_guards)  # torch.optim steps in the program
        watches = {**calls.watches, **setters.watches, **steps.watches}
        if self._module is not None:
            # A sharded parameter enters with its full shape (its distribution gathers it before use).
            tree = build_shadow(self._module, functools.partial(_module_proxy, builder, interpreter), observer,
                                calls.lookasides)
            target = tree.root
        try:
            with (builder, interpreter, interpreter.replacing(calls.torch), observer.watching(watches),
                  real.watching(), function_apply_recorded(interpreter),
                  seen_as_compiling() if compiling else contextlib.nullcontext()):
                interpreter.quiet = observer.quiet
                interpreter.arrays.held_by_caller = observer.held_by_global
                observer.changing_generators = setters.keep_generators
                result = target(*proxy_args, **proxy_kwargs)
                if symbolic is not None:  # sizes it returns are the traced call's ints (dynamic_shapes.settled)
                    result = settled(result)
        except DataDependentError:
            observer.undo()  # acquired again as a tracer is seen (_compile), or refused: stored once, as eager
            raise
        except Exception:
            if symbolic is not None:  # acquired again with static shapes (_compile): stored once, as eager
                observer.undo()
            raise
        finally:
            setters.put_back()  # a seed the program set for real while acquired (the trace sets it again)
        setters.check()
        _refuse_stored_proxies(args, kwargs)
        refuse_returned_nodes(result)
        module_proxies = tree.proxies if tree else []
        with builder:
            values, out_spec, out_objects, returns_input, rebinds, dirty, retained, views = program_outputs(
                result, visible + module_proxies, tree, interpreter,
                proxies + module_proxies + interpreter.captured_inputs() + storage, pytree.identified(spec),
                real.found)
        interpreter.arrays.refuse_returned(values, interpreter.functional.root)
        inputs = proxies + module_proxies + [p for _, p in interpreter.constants] + storage
        interpreter.autograd.refuse_returned_leaves(result, values[: len(returns_input) + len(rebinds)])
        position = {id(p): i for i, p in enumerate(inputs)}
        values += [value for _, value in dirty]
        registrations = (*(tree.registrations() if tree is not None else ()), *(r.registration() for r in real.found))
        places = _places(result, len(returns_input), rebinds)
        hidden: dict[int, str] = {}  # one label per base the trace returns beside the program's outputs
        for v in views:
            if v.base >= len(places):
                hidden.setdefault(v.base, f"{places[v.output]}._base")
        places += tuple(hidden[base] for base in sorted(hidden))
        return Acquisition(builder, interpreter, observer, tree, inputs, values, out_spec, out_objects, returns_input,
                           rebinds, retained, tuple(position[id(obj)] for obj, _ in dirty), compiling, registrations,
                           places, views)

    @staticmethod
    def _shared_storage(builder: TraceBuilder, interpreter: Interpreter, proxies: list[TensorProxy],
                        aliases: AliasPlan | None, real_inputs: list[torch.Tensor], names: list[str]):
        """The proxies the program receives, and one extra trace input per shared storage (see aliasing.py)."""
        if aliases is None:
            return proxies, []
        visible = list(proxies)
        storage = []
        for group in aliases.groups:
            first = real_inputs[group.members[0]]
            meta = torch.empty((group.extent,), dtype=first.dtype, device="meta")
            hint = names[group.members[0]] if group.members[0] < len(names) else "captured"
            base = builder.make_proxy(meta, first.device, name=f"{hint}_storage")
            storage.append(base)
            with builder, interpreter:
                views = [torch.as_strided(base, real_inputs[m].shape, real_inputs[m].stride(),
                                          real_inputs[m].storage_offset()) for m in group.members]
            for member, view in zip(group.members, views):
                if member < len(proxies):
                    visible[member] = view
                else:  # a tensor the program captured: it reads the view
                    interpreter.seed_constant(real_inputs[member], view)
        return visible, storage

    # --- compilation ---------------------------------------------------------------------------------------------
    def _compile(self, args: tuple, kwargs: dict[str, Any], tensors: list[torch.Tensor], key_parts: tuple,
                 names: list[str], before: GlobalState) -> tuple[CacheEntry, list]:
        positions = self._dims.to_trace(tensors)
        if not positions:
            return self._compile_traced(args, kwargs, tensors, key_parts, names, before, None)
        symbolic = SymbolicInputs({p: self._dims.dims[p] for p in positions})
        try:
            with symbolic.dispatch():
                traced = self._compile_traced(args, kwargs, tensors, key_parts, names, before, symbolic)
            for position, dim, why in symbolic.specialised():
                self._dims.pin(position, dim, why)
            return traced
        except Exception as error:
            # What the trace with symbols could not do: a trace of static shapes (the program's own error raises
            # again there), and static shapes for this callable from now on
            before.restore()
            traced = self._compile_traced(args, kwargs, tensors, key_parts, names, before, None)
            self._dims.give_up(symbolic.failure(error))
            return traced

    def _compile_traced(self, args: tuple, kwargs: dict[str, Any], tensors: list[torch.Tensor], key_parts: tuple,
                        names: list[str], before: GlobalState, symbolic: SymbolicInputs | None
                        ) -> tuple[CacheEntry, list]:
        # What a run that is acquired again did to Python state is undone first (undo.py): eager runs it once.
        hooks = HookSnapshot(reachable_modules(self._fn, self._module, args, kwargs))
        try:
            acquisition = self._acquire(args, kwargs, tensors, names, None, [], False, symbolic)
        except DataDependentError:
            # Eager's path reads a tensor value; libraries keep such reads out of the path they take under a tracer
            # (Hugging Face's `if padding_mask.all()`), which computes the same values.
            hooks.restore()
            before.restore()
            acquisition = self._acquire(args, kwargs, tensors, names, None, [], True, symbolic)
        except Exception:
            if symbolic is not None:
                hooks.restore()
            raise
        try:
            return self._compile_acquired(acquisition, args, kwargs, tensors, key_parts, names, before, hooks,
                                          symbolic)
        except Exception:
            if symbolic is not None:  # acquired again with static shapes: the program's writes are undone
                acquisition.observer.undo()
                hooks.restore()
            raise

    def _compile_acquired(self, acquisition: Acquisition, args: tuple, kwargs: dict[str, Any],
                          tensors: list[torch.Tensor], key_parts: tuple, names: list[str], before: GlobalState,
                          hooks: HookSnapshot, symbolic: SymbolicInputs | None) -> tuple[CacheEntry, list]:
        compiling = acquisition.compiling
        tree, interpreter = acquisition.tree, acquisition.interpreter
        module_inputs = tree.inputs if tree is not None else []
        self._module_inputs = module_inputs
        module_tensors = [source.fetch() for source in self._module_inputs]
        constants = [t for t, _ in interpreter.constants]
        real_inputs = [*tensors, *module_tensors, *constants]
        written = acquisition.written()
        aliases = None
        if written:
            all_names = [*names, *(m.qualified for m in module_inputs), *(p.pname for _, p in interpreter.constants)]
            aliases = plan_aliases(real_inputs, written, all_names, range(len(tensors), len(tensors) +
                                                                               len(module_tensors)))
            if aliases is not None and symbolic is not None:
                raise NotImplementedError("the program updates in place inputs that share memory")
            if aliases is not None:  # acquire again, with the shared storage as one input
                acquisition.observer.undo()
                hooks.restore()
                before.restore()
                acquisition = self._acquire(args, kwargs, tensors, names, aliases, real_inputs, compiling)
                tree, interpreter = acquisition.tree, acquisition.interpreter
                constants = [t for t, _ in interpreter.constants]
                real_inputs = [*tensors, *module_tensors, *constants]
        # what the trace sets again itself (setters.py), from the state the call began with, as on every later call
        before.restore_replayed()
        if acquisition.dirty and aliases is not None:
            updated = acquisition.inputs[acquisition.dirty[0]]
            raise TraceError("the program updates in place an input that shares memory with another input, with a "
                             "value that requires grad; fulmen cannot give shared memory that autograd history: pass "
                             "copies (x.clone())", interpreter.functional.written_at(updated))
        values, out_spec, out_objects = acquisition.values, acquisition.out_spec, acquisition.out_objects
        returns_input, rebinds = acquisition.returns_input, acquisition.rebinds
        builder = acquisition.builder
        acquired = Trace("computation", acquisition.inputs, builder.bound_symbols, tuple(values),
                         "Acquisition (fulmen.jit)", builder.namespace)
        # a pass may choose by parameter name (float8's skip): the names of the module tensors the trace takes
        with named_inputs(lambda: qualified_names(acquisition.tree, acquisition.interpreter.constants,
                                                  reachable_modules(self._fn, self._module, args, kwargs))):
            traces = self.pipeline.acquire(acquired)
        if interpreter.grad_slots.backward_ran:  # a whole step: each update right after its grad (update_order.py)
            reordered = updates_early(traces[-1], self._options.optimizer_bucket_cap_mb)
            if reordered is not traces[-1]:
                traces.append(reordered)
        bases = aliases.bases(real_inputs) if aliases is not None else []
        distributed = distributed_program(acquired, [*real_inputs, *bases])
        if distributed is not None:  # a call passes a sharded module tensor: its view is the trace's to take
            returns_input = tuple(r if r is None or r.position < len(tensors) else None for r in returns_input)
        # this program's passes: CUDA graphs capture into a pool of its own, where it can have them
        pipeline = self.pipeline.for_program(traces[-1], distributed is not None,
                                             getattr(self._fn, "__qualname__", "the program"))
        program = None
        if _needs_grad(traces[-1]) and not interpreter.grad_slots.backward_ran:
            first_dirty = len(values) - len(acquisition.dirty)
            where = interpreter.functional.written_at
            dirty = tuple(UpdatedInput(first_dirty + k, i, where(acquisition.inputs[i]),
                                       interpreter.functional.written_through_view(acquisition.inputs[i]))
                          for k, i in enumerate(acquisition.dirty))
            # grad rules record as the program's own calls did; inference mode (a call under torch.inference_mode()
            # that enables grad) would have them record no history, leaving the backward without grads
            with torch.inference_mode(False), torch.enable_grad():
                program, forward_traces = pipeline.differentiate(traces[-1], distributed, dirty, acquisition.places,
                                                                 retaken(acquisition.views))
            traces.extend(forward_traces)
            fn = functools.partial(apply, program)
            if not torch.is_grad_enabled():  # the program enables grad inside (torch.enable_grad())
                fn = _with_grad_mode(fn, True)
        else:
            if torch.is_grad_enabled() and any(type(out) is TensorProxy and out.requires_grad
                                               for out in traces[-1].output):
                refuse_leaf_without_grads(traces[-1])
            traces.extend(pipeline.computation(traces[-1], distributed))
            fn = traces[-1].python_callable()
            if torch.is_grad_enabled() and any(p.requires_grad for p in traces[-1].inputs):
                fn = _with_grad_mode(fn, False)  # no output has a history: torch must not record one
        if autocast_enabled():
            fn = without_autocast(fn)
        if aliases is not None:
            fn = functools.partial(_with_storage, aliases, fn)
        guards = (*acquisition.observer.guards(), *interpreter.grad_slots.guards())
        left = GlobalState.current()  # the program's own changes, still applied (the passes undo theirs)
        shapes = symbolic.guards(acquisition.inputs) if symbolic is not None else None
        positions = tuple(symbolic.dims) if symbolic is not None else ()
        fetched = interpreter.grad_slots.fetched()  # captured tensors each call reads anew (grad_slots.py)
        if fetched:
            skipped = {position for position, _ in fetched}  # not kept alive by the entry
            constants = [None if i in skipped else t for i, t in enumerate(constants)]
        entry = CacheEntry(
            fn=fn,
            traces=tuple(traces),
            out_spec=out_spec,
            out_objects=out_objects,
            n_outputs=len(returns_input),
            returns_input=frozen(returns_input) if symbolic is not None else returns_input,
            rebinds=tuple(rebinds),
            constants=tuple(constants),
            backward_traces=tuple(program.backward_traces) if program is not None else (),
            program=program,
            key=self._symbolic_key((key_parts[0], argument_key(tensors), module_key(module_tensors), *key_parts[1:]),
                                   tensors, positions),
            shapes=shapes,
            symbolic=positions,
            guards=guards,
            check=compile_check(guards),
            storage=StorageGroups(real_inputs, [len(real_inputs) - len(constants) + i for i, _ in fetched])
            if written else None,
            offsets=storage_offsets(real_inputs) if interpreter.reads_storage_offset or aliases is not None else None,
            module_inputs=tuple(module_inputs),
            facts=_facts_read(acquisition),
            aliases=aliases,
            writes=(*(settled_writes(acquisition.observer.writes) if symbolic is not None else
                      acquisition.observer.writes), *acquisition.registrations,
                    *((StateLeftChanged(left),) if left != before else ()), *interpreter.grad_slots.cleared()),
            # the bases of views the call takes again are objects of their own too
            distinct=identity_pattern(values[: len(values) - len(acquisition.dirty)]),
            retained=acquisition.retained,
            views=(frozen(acquisition.views) if symbolic is not None else acquisition.views) or None,
            fetched=fetched,
        )
        if symbolic is not None and has_sizes((entry.returns_input, entry.views)):
            entry = dataclasses.replace(entry, view_sizes=True)
        return entry, module_tensors
