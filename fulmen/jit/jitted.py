"""`fulmen.jit`: jitted functions and modules, their cache and the pipeline from acquisition to execution."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fulmen.core import pytree
from fulmen.core.errors import DataDependentError, TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.trace import Trace, TraceBuilder
from fulmen.distributed.specs import logical_meta
from fulmen.distributed.transform import DistributedProgram
from fulmen.executors.base import Executor
from fulmen.jit.acquire import Interpreter
from fulmen.jit.bridge import FulmenFunction, GradProgram
from fulmen.jit.compiling import seen_as_compiling
from fulmen.jit.function_apply import function_apply_recorded
from fulmen.jit.guards import global_state_key, tensor_key
from fulmen.jit.lookasides import function_lookasides
from fulmen.jit.overrides import AttributeGuard, ModuleInput, ShadowTree, build_shadow
from fulmen.jit.pipeline import Pipeline
from fulmen.jit.replacements import replacements
from fulmen.ops import prims
from fulmen.options import JitOptions
from fulmen.transforms.autocast import autocast_enabled, without_autocast
from fulmen.transforms.cudagraphs import GraphedProgram, graph_pool_for


@dataclass(frozen=True, slots=True)
class CacheEntry:
    fn: Callable[..., tuple]
    traces: tuple[Trace, ...]
    out_spec: Any
    out_objects: dict[int, Any]  # unhashable non-tensor outputs, by id
    n_outputs: int
    returns_input: tuple[int | None, ...]  # output i is input tensor returns_input[i] itself (eager identity)
    rebinds: tuple[tuple[nn.Module, str, str], ...]  # trailing outputs reassigned to module attributes
    attribute_guards: tuple[AttributeGuard, ...]
    constants: tuple[torch.Tensor, ...]
    backward_traces: tuple[Trace, ...] = ()
    program: GradProgram | None = None

    def guards_hold(self) -> bool:
        return all(guard.holds() for guard in self.attribute_guards)


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0


def _leaf_names(obj: Any, prefix: str, out: list[str]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(prefix)
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            _leaf_names(item, f"{prefix}_{i}", out)
    elif isinstance(obj, dict):
        for key, item in obj.items():
            _leaf_names(item, f"{prefix}_{key}", out)
    elif hasattr(obj, "__dataclass_fields__") and not isinstance(obj, type):
        for key in obj.__dataclass_fields__:
            _leaf_names(getattr(obj, key), f"{prefix}_{key}", out)


def _arg_hints(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> list[str]:
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
        pairs = list(bound.arguments.items())
    except (TypeError, ValueError):
        pairs = [(f"arg{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    names: list[str] = []
    for name, value in pairs:
        _leaf_names(value, name, names)
    return names


def _needs_grad(trace: Trace) -> bool:
    return torch.is_grad_enabled() and any(p.requires_grad for p in trace.inputs) and any(
        isinstance(out, TensorProxy) and out.requires_grad for out in trace.output)


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


@dataclass(frozen=True, slots=True)
class _Acquired:
    """One run of the program on proxies: what recorded it, its inputs and what it returned."""

    builder: TraceBuilder
    interpreter: Interpreter
    proxies: list[TensorProxy]
    tree: ShadowTree | None
    result: Any


class JittedFunction:
    """A callable that runs `fn` through its cached, compiled traces."""

    def __init__(self, fn: Callable[..., Any], options: JitOptions, module: nn.Module | None = None,
                 executors: tuple[Executor, ...] = ()) -> None:
        self._fn = fn
        self._module = module
        self._options = options
        self.executors = executors
        self._cache: dict[Any, list[CacheEntry]] = {}
        self._module_inputs: list[ModuleInput] = []
        self.stats = CacheStats()
        self.last_entry: CacheEntry | None = None
        self.pipeline = Pipeline(options, executors, Interpreter)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            tensors, spec = list(args), len(args)
        else:
            tensors = []
            spec = pytree.flatten((args, kwargs), tensors)
        module_tensors = [source.fetch() for source in self._module_inputs]
        try:
            key = (spec, tensor_key(tensors), tensor_key(module_tensors), global_state_key())
        except AttributeError:  # a module tensor was removed or replaced by a non-tensor: trace anew
            key = None
        entry = None
        for candidate in self._cache.get(key, ()):
            if candidate.guards_hold():
                entry = candidate
                break
        if entry is None:
            self.stats.misses += 1
            entry, module_tensors = self._compile(args, kwargs, tensors)
            if key is not None and self._module_inputs and len(module_tensors) == len(self._module_inputs):
                key = (spec, tensor_key(tensors), tensor_key(module_tensors), global_state_key())
            self._cache.setdefault(key, []).append(entry)
        else:
            self.stats.hits += 1
        self.last_entry = entry
        outputs = entry.fn(*tensors, *module_tensors, *entry.constants)
        return self._finish(entry, outputs, tensors)

    @staticmethod
    def _finish(entry: CacheEntry, outputs: tuple, tensors: list[torch.Tensor]) -> Any:
        if entry.rebinds:
            for (module, container, name), value in zip(entry.rebinds, outputs[entry.n_outputs :]):
                getattr(module, container)[name] = value
            outputs = outputs[: entry.n_outputs]
        if any(i is not None for i in entry.returns_input):
            outputs = [tensors[i] if i is not None else out for i, out in zip(entry.returns_input, outputs)]
        if entry.out_spec == pytree.TENSOR:
            return outputs[0]
        return pytree.unflatten(entry.out_spec, outputs, entry.out_objects)

    # --- compilation ---------------------------------------------------------------------------------------------
    def _acquire(self, args: tuple, kwargs: dict[str, Any], tensors: list[torch.Tensor],
                 compiling: bool) -> _Acquired:
        builder = TraceBuilder(decompose=self._options.decompose)
        interpreter = Interpreter(builder)
        hints = _arg_hints(self._module.forward if self._module is not None else self._fn, args, kwargs)
        if len(hints) != len(tensors):
            hints = [f"arg{i}" for i in range(len(tensors))]
        proxies = [builder.make_proxy(logical_meta(t), t.device, t.requires_grad, name=hint)
                   for t, hint in zip(tensors, hints)]
        originals: dict[int, Any] = {}
        pytree.identity_objects((args, kwargs), originals)
        spec = pytree.flatten((args, kwargs), [])
        proxy_args, proxy_kwargs = pytree.unflatten(spec, proxies, originals)
        target: Callable[..., Any] = self._fn
        tree: ShadowTree | None = None
        if self._module is not None:
            # A sharded parameter enters with its full shape (fulmen.distributed gathers it before use).
            tree = build_shadow(
                self._module, lambda t, name: builder.make_proxy(logical_meta(t), t.device, t.requires_grad, name=name)
            )
            target = tree.root
            self._module_inputs = tree.inputs
        with (builder, interpreter, function_lookasides(builder), replacements(self.executors, interpreter),
              function_apply_recorded(interpreter), seen_as_compiling() if compiling else contextlib.nullcontext()):
            result = target(*proxy_args, **proxy_kwargs)
        return _Acquired(builder, interpreter, proxies, tree, result)

    def _compile(self, args: tuple, kwargs: dict[str, Any], tensors: list[torch.Tensor]) -> tuple[CacheEntry, list]:
        try:
            run = self._acquire(args, kwargs, tensors, compiling=False)
        except DataDependentError:
            # Eager's path reads a tensor value; libraries keep such reads out of the path they take under a tracer
            # (Hugging Face's `if padding_mask.all()`), which computes the same values.
            run = self._acquire(args, kwargs, tensors, compiling=True)
        builder, interpreter, proxies, tree = run.builder, run.interpreter, run.proxies, run.tree
        _refuse_stored_proxies(args, kwargs)
        with builder:
            entry_parts = self._outputs(run.result, proxies, tree, interpreter)
        trace_inputs = proxies + (tree.proxies if tree else []) + [p for _, p in interpreter.constants]
        values, out_spec, out_objects, returns_input, rebinds = entry_parts
        acquired = Trace("computation", trace_inputs, builder.bound_symbols, tuple(values), "Acquisition (fulmen.jit)",
                         builder.namespace)
        traces = self.pipeline.acquire(acquired)
        module_tensors = [source.fetch() for source in self._module_inputs]
        dist = DistributedProgram.of(acquired, [*tensors, *module_tensors, *(t for t, _ in interpreter.constants)])
        graphs = None
        if self._options.cuda_graphs:
            graphs = graph_pool_for(traces[-1], dist is not None, getattr(self._fn, "__qualname__", "the program"))
        program = None
        if _needs_grad(traces[-1]):
            program, forward_traces = self.pipeline.differentiate(traces[-1], dist, graphs)
            traces.extend(forward_traces)
            if graphs is not None:
                # the forward and backward without graphs, for a forward whose previous backward has not run yet
                program.use_graphs(GraphedProgram(graphs), traces[-3], program.backward_traces[-3])
            fn = functools.partial(FulmenFunction.apply, program)
        else:
            traces.extend(self.pipeline.computation(traces[-1], dist, graphs))
            fn = traces[-1].python_callable()
        if autocast_enabled():
            fn = without_autocast(fn)
        entry = CacheEntry(
            fn=fn,
            traces=tuple(traces),
            out_spec=out_spec,
            out_objects=out_objects,
            n_outputs=len(values) - len(rebinds),
            returns_input=returns_input,
            rebinds=tuple(rebinds),
            attribute_guards=tree.guards() if tree else (),
            constants=tuple(t for t, _ in interpreter.constants),
            backward_traces=tuple(program.backward_traces) if program is not None else (),
            program=program,
        )
        return entry, module_tensors

    @staticmethod
    def _outputs(result: Any, proxies: list[TensorProxy], tree: ShadowTree | None, interpreter: Interpreter):
        functional = interpreter.functional
        leaves: list[torch.Tensor] = []
        out_objects: dict[int, Any] = {}
        try:
            out_spec = pytree.flatten(result, leaves, out_objects)
        except TypeError as error:
            raise TraceError(str(error), None) from None
        pytree.identity_objects(result, out_objects)
        input_index = {id(p): i for i, p in enumerate(proxies)}
        values, returns_input = [], []
        for leaf in leaves:
            if type(leaf) is TensorProxy:
                values.append(functional.resolve(leaf))
            else:
                values.append(interpreter._constant(leaf))
            returns_input.append(input_index.get(id(leaf)))
        rebinds = []
        if tree is not None:
            for module, container, name, given, now in tree.rebinds():
                value = functional.resolve(now)
                if (value.shape, value.dtype, value.device) == (given.shape, given.dtype, given.device):
                    prims.copy_(value, given)
                else:
                    values.append(value)
                    rebinds.append((module, container, name))
        functional.write_back(proxies + (tree.proxies if tree else []))
        return values, out_spec, out_objects, tuple(returns_input), rebinds


class JittedModule(nn.Module):
    """An `nn.Module` that runs the wrapped module's forward through fulmen.

    Parameters, buffers, state dicts, train/eval and device moves are the wrapped module's own (no prefix), so
    optimizers, Fabric and checkpoints see the original module.
    """

    def __init__(self, model: nn.Module, options: JitOptions, executors: tuple[Executor, ...] = ()) -> None:
        super().__init__()
        self._model = model
        self._jit = JittedFunction(model.forward, options, module=model, executors=executors)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._jit(*args, **kwargs)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._model.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._model.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False):
        return self._model.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_model"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        model = self.__dict__.get("_modules", {}).get("_model")
        if model is not None and not name.startswith("_") and hasattr(model, name) and name not in self.__dict__:
            setattr(model, name, value)  # e.g. `jitted.max_seq_length = 64` configures the wrapped model
        else:
            super().__setattr__(name, value)


def core(fn: JittedFunction | JittedModule) -> JittedFunction:
    """The `JittedFunction` behind the result of `fulmen.jit`."""
    inner = getattr(fn, "_forward_module", None)  # Lightning Fabric's wrapper of a module it set up
    if isinstance(inner, JittedModule):
        fn = inner
    if isinstance(fn, JittedModule):
        return fn._jit
    if isinstance(fn, JittedFunction):
        return fn
    raise TypeError(f"expected the result of fulmen.jit, got {type(fn).__name__}")
