"""A function compiled by Inductor without Dynamo: traced once per argument layout, then called directly.

`torch.compile` re-runs Dynamo's guards on every call (about 25 us of host time each, hundreds of calls in a
transformer step). fulmen's callers already know what a guard would check, so each compiled variant is keyed by
what can still vary between calls: `InductorFunction(fn, options, key=...)` traces `fn` to an aten graph (`make_fx`
on fake copies of the arguments) and hands it to Inductor on the first call with a new key.

* `strides` (the default): a fusion region of a trace, whose shapes, dtypes and devices the trace fixes; Inductor's
  code still indexes with the strides it was compiled for.
* `layouts`: shapes, strides, dtypes and devices, for a helper called with several shapes (chunks of rows).

Calls skip AOTAutograd's runtime wrappers too, where those would do nothing: `torch._inductor.compile` wraps
Inductor's code in wrappers that apply input mutations, rebuild aliased outputs as views, deduplicate arguments and
set grad modes (1.5 of a region call's 14 us on an H200 machine's host, `benchmarks/overhead.py`; more where
outputs alias inputs, whose views the wrappers rebuild). A variant
whose graph mutates nothing, and whose Inductor graph takes and returns exactly the graph's tensors, calls
Inductor's compiled graph itself (`Variant.direct`); any other keeps the wrapped callable.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from fulmen.core.compile_ahead import CompileAhead, InputSpec, cacheable, compile_inductor

_ARGUMENT = re.compile(r"L\['t(\d+)'\]")  # an argument as torch's produce_guards names it
ADMITTED_LAYOUTS = 4096  # layouts remembered per symbolic function (then forgotten at once: asked again)


def strides(args: tuple[torch.Tensor, ...]) -> tuple:
    return tuple([arg.stride() for arg in args])


def layouts(args: tuple[torch.Tensor, ...]) -> tuple:
    return tuple([(arg.shape, arg.stride(), arg.dtype, arg.device) for arg in args])


@dataclass(frozen=True, slots=True)
class Variant:
    """One compiled variant: `direct` is set when Inductor's own compiled graph can be called without
    AOTAutograd's wrappers (`why_wrapped` says why not otherwise); it returns the graph's outputs flat, which
    `out_spec` nests again (a flat tuple, the usual case, needs no unflattening)."""

    wrapped: Callable[..., Any]
    direct: Callable[[list[torch.Tensor]], Any] | None
    out_spec: pytree.TreeSpec | None
    why_wrapped: str | None

    def __call__(self, *args: torch.Tensor) -> Any:
        if self.direct is None:
            return self.wrapped(*args)
        if torch.is_grad_enabled():
            # Inductor's code writes through `out=` arguments, which autograd refuses for inputs that require grad;
            # the wrapped call turns grad mode off too (the graph was compiled as inference).
            with torch.no_grad():
                outputs = self.direct(list(args))
        else:
            outputs = self.direct(list(args))
        if self.out_spec is None:
            return tuple(outputs)
        return pytree.tree_unflatten(list(outputs), self.out_spec)


class InductorFunction:
    """`fn(*tensors)` compiled by Inductor, one variant per `key(args)`; with `dynamic` (per argument, the dims that
    vary between calls: a fusion region of a trace with symbolic sizes), variants compiled for symbolic sizes, each
    used while the guards its ShapeEnv produced hold (Inductor's own among them). `ahead` starts a static variant's
    compile in a worker before its first call (fulmen.core.compile_ahead)."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any] | None = None,
                 key: Callable[[tuple[torch.Tensor, ...]], tuple] = strides,
                 dynamic: tuple[frozenset[int], ...] | None = None) -> None:
        self._fn = fn
        self._options = options or None
        self._key = key
        self._dynamic = dynamic
        self.variants: dict[tuple, Variant] = {}
        self.guarded: list[tuple[Callable[[tuple], bool], Variant]] = []  # the symbolic variants, with their guards
        self._ahead: list[_Traced] = []  # variants a worker compiles, not called yet
        self._admitted: dict[tuple, Variant] = {}  # a symbolic variant by the layouts its guards admitted

    def __call__(self, *args: torch.Tensor) -> Any:
        if self._dynamic is not None:
            # the guards read the arguments' layouts alone: which variant admits one is asked once (a dict lookup,
            # ~2 us for five arguments against ~5 us for their guards)
            layout = tuple([(arg.shape, arg.stride(), arg.storage_offset()) for arg in args])
            variant = self._admitted.get(layout)
            if variant is None:
                variant = next((v for admits, v in self.guarded if admits(args)), None) or self._compile_symbolic(args)
                if len(self._admitted) >= ADMITTED_LAYOUTS:
                    self._admitted.clear()
                self._admitted[layout] = variant
            return variant(*args)
        variant = self.variants.get(self._key(args))
        if variant is None:
            variant = self._compile(args)
        return variant(*args)

    def ahead(self, source: str, name: str, specs: tuple[InputSpec, ...], pool: CompileAhead) -> None:
        """Start compiling the variant for inputs laid out as `specs` in `pool`'s workers, which build this function
        as the Python `source` defines `name`. A static region's (keyed by strides) only: symbolic variants never
        come from Inductor's cache (`_guarded`)."""
        if self._key is not strides or self._dynamic is not None or not pool.workers:
            return
        if tuple(s.stride for s in specs) in self.variants or any(a.specs == specs for a in self._ahead):
            return
        pool.submit(source, name, specs, self._options)
        self._ahead.append(_Traced(specs, *cacheable(self._fn, specs)))

    def _traced(self, args: tuple[torch.Tensor, ...]) -> _Traced:
        # Callers run where nothing records autograd (inside the autograd bridge, or without grad), so `fn` is
        # traced and compiled as inference, on fake inputs Inductor's FX graph cache keys (compile_ahead.cacheable)
        dims = self._dynamic or (frozenset(),) * len(args)
        specs = tuple(InputSpec.of(arg, d) for arg, d in zip(args, dims))
        return _Traced(specs, *cacheable(self._fn, specs))

    # Compiling never waits for a worker: a region whose compile it has not finished (or that failed there) compiles
    # here as without workers, so a first call takes no longer than this process's own compile.
    def _compile(self, args: tuple[torch.Tensor, ...]) -> Variant:
        key = self._key(args)
        traced = next((a for a in self._ahead if tuple(s.stride for s in a.specs) == key), None)
        if traced is not None:
            self._ahead.remove(traced)
        traced = traced or self._traced(args)
        variant = self.variants[key] = self._inductor(traced.graph, traced.inputs, self._options)
        return variant

    def _compile_symbolic(self, args: tuple[torch.Tensor, ...]) -> Variant:
        variant = self._guarded(self._traced(args))
        if not self.guarded[-1][0](args):  # else every call with these arguments would compile again
            raise RuntimeError(f"fulmen: a region compiled for symbolic sizes does not admit the arguments it was "
                               f"compiled for ({layouts(args)}): a fulmen bug, please report it")
        return variant

    def _guarded(self, traced: _Traced) -> Variant:
        from torch._dynamo.source import LocalSource
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        # Compiled afresh, never from Inductor's FX graph cache: a cache entry keeps the guards its compile added (on
        # the sizes it specialised for, e.g. `4*s0 <= 4096` for a reduction) only over graphs taking sizes as SymInt
        # arguments, which these (tensors alone) do not, so a hit would leave them out of the guards below and run
        # code compiled for some sizes at any size. Without Inductor's size asserts: the guards check every size
        # and stride already (~0.5 us an argument a call)
        options = {"size_asserts": False, **(self._options or {}), "fx_graph_cache": False}
        variant = self._inductor(traced.graph, traced.inputs, options)
        sources = [LocalSource(f"t{i}") for i in range(len(traced.inputs))]
        guards = traced.shape_env.produce_guards(traced.inputs, sources, ignore_static=False)
        body = " and ".join("(" + _ARGUMENT.sub(r"a[\1]", guard) + ")" for guard in guards) or "True"
        self.guarded.append((eval(f"lambda a: {body}", dict(SYMPY_INTERP)), variant))  # noqa: S307 (torch's guards)
        return variant

    def _inductor(self, graph: torch.fx.GraphModule, inputs: list[torch.Tensor],
                  options: dict[str, Any] | None) -> Variant:
        from torch._inductor.compile_fx import compile_fx_inner

        captured: list[tuple[torch.fx.GraphModule, Any]] = []

        def inner_compile(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
            compiled = compile_fx_inner(gm, example_inputs, **kwargs)
            captured.append((gm, compiled))
            return compiled

        facts = _Facts.of(graph)  # before Inductor rewrites the graph's output in place
        wrapped = compile_inductor(graph, inputs, options, inner_compile)
        return _variant(facts, len(inputs), wrapped, captured)


@dataclass(frozen=True, slots=True)
class _Traced:
    """A variant's graph, traced on the fake inputs Inductor's FX graph cache keys, as this process compiles it."""

    specs: tuple[InputSpec, ...]
    graph: torch.fx.GraphModule
    inputs: list[torch.Tensor]
    shape_env: Any


@dataclass(frozen=True, slots=True)
class _Facts:
    """What decides whether a traced graph can skip AOTAutograd's wrappers."""

    outputs: list[Any]
    out_spec: pytree.TreeSpec
    mutating: torch._ops.OpOverload | None

    @classmethod
    def of(cls, graph: torch.fx.GraphModule) -> _Facts:
        outputs, out_spec = pytree.tree_flatten(graph.graph.output_node().args[0])
        mutating = next((node.target for node in graph.graph.nodes if isinstance(node.target, torch._ops.OpOverload)
                         and node.target._schema.is_mutable), None)
        return cls(outputs, out_spec, mutating)


def _variant(facts: _Facts, arity: int, wrapped: Callable[..., Any],
             captured: list[tuple[torch.fx.GraphModule, Any]]) -> Variant:
    """Whether AOTAutograd's wrappers around Inductor's graph are the identity for the traced graph's calls."""
    outputs, out_spec = facts.outputs, facts.out_spec

    def keep(why: str) -> Variant:
        return Variant(wrapped, None, None, why)

    if facts.mutating is not None:
        return keep(f"the graph mutates tensors ({facts.mutating})")
    if not all(isinstance(output, torch.fx.Node) for output in outputs):
        return keep("the graph returns values that are not tensors")
    if len(captured) != 1:
        return keep(f"Inductor compiled {len(captured)} graphs for it")
    inner, compiled = captured[0]
    placeholders = sum(1 for node in inner.graph.nodes if node.op == "placeholder")
    returned = len(pytree.tree_leaves(inner.graph.output_node().args[0]))
    if placeholders != arity or returned != len(outputs):
        return keep(f"Inductor's graph takes {placeholders} and returns {returned} tensors, "
                    f"not {arity} and {len(outputs)}")
    flat_tuple = out_spec == pytree.tree_flatten(tuple(outputs))[1]
    return Variant(wrapped, compiled, None if flat_tuple else out_spec, None)
