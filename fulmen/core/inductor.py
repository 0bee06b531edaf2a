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
from torch.fx.experimental.proxy_tensor import make_fx

_ARGUMENT = re.compile(r"L\['t(\d+)'\]")  # an argument as torch's produce_guards names it


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
    used while the guards its ShapeEnv produced hold (Inductor's own among them)."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any] | None = None,
                 key: Callable[[tuple[torch.Tensor, ...]], tuple] = strides,
                 dynamic: tuple[frozenset[int], ...] | None = None) -> None:
        self._fn = fn
        self._options = options or None
        self._key = key
        self._dynamic = dynamic
        self.variants: dict[tuple, Variant] = {}
        self.guarded: list[tuple[Callable[[tuple], bool], Variant]] = []  # the symbolic variants, with their guards

    def __call__(self, *args: torch.Tensor) -> Any:
        if self._dynamic is not None:
            for admits, variant in self.guarded:
                if admits(args):
                    return variant(*args)
            return self._compile_symbolic(args)(*args)
        variant = self.variants.get(self._key(args))
        if variant is None:
            variant = self._compile(args)
        return variant(*args)

    def _compile(self, args: tuple[torch.Tensor, ...]) -> Variant:
        # Callers run where nothing records autograd (inside the autograd bridge, or without grad), so `fn` is
        # traced and compiled as inference on detached arguments.
        with torch.no_grad():
            inputs = [arg.detach() for arg in args]
            variant = self._inductor(make_fx(self._fn, tracing_mode="fake")(*inputs), inputs)
        self.variants[self._key(args)] = variant
        return variant

    def _compile_symbolic(self, args: tuple[torch.Tensor, ...]) -> Variant:
        from torch._dynamo.source import LocalSource
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import (
            SYMPY_INTERP,
            DimDynamic,
            ShapeEnv,
            StatelessSymbolicContext,
        )

        mode = FakeTensorMode(shape_env=ShapeEnv())
        fakes = []
        for arg, dims in zip(args, self._dynamic):
            context = StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DUCK if d in dims else DimDynamic.STATIC for d in range(arg.dim())])
            fakes.append(mode.from_tensor(arg.detach(), symbolic_context=context))
        with torch.no_grad():
            graph = make_fx(self._fn, tracing_mode="fake")(*fakes)
            placeholders = [node.meta["val"] for node in graph.graph.nodes if node.op == "placeholder"]
            variant = self._inductor(graph, placeholders)
        guards = mode.shape_env.produce_guards(placeholders, [LocalSource(f"t{i}") for i in range(len(args))],
                                               ignore_static=False)
        body = " and ".join("(" + _ARGUMENT.sub(r"a[\1]", guard) + ")" for guard in guards) or "True"
        self.guarded.append((eval(f"lambda a: {body}", dict(SYMPY_INTERP)), variant))  # noqa: S307 (torch's guards)
        return variant

    def _inductor(self, graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Variant:
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        captured: list[tuple[torch.fx.GraphModule, Any]] = []

        def inner_compile(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
            compiled = compile_fx_inner(gm, example_inputs, **kwargs)
            captured.append((gm, compiled))
            return compiled

        # AOTAutograd's cache is off so that a cache hit does not skip the inner compile whose result is called
        # directly (Inductor's own cache still applies).
        with torch._functorch.config.patch(enable_autograd_cache=False):
            facts = _Facts.of(graph)  # before Inductor rewrites the graph's output in place
            wrapped = compile_fx(graph, inputs, inner_compile=inner_compile, config_patches=self._options)
        return _variant(facts, len(inputs), wrapped, captured)


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
