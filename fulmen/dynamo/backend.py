"""A torch.compile backend that runs the graphs Dynamo captures through fulmen (Thunder calls its own "ThunderFX").

    compiled = torch.compile(model, backend=fulmen.dynamo.backend(executors=["sdpa", "torch"]))

Dynamo splits the program where it cannot build a graph (data-dependent branches, `.item()`, `nonzero`) and runs
those parts as Python; each graph it captures (an FX graph, parameters among its inputs, no AOT autograd) comes
here. On its first call the whole graph goes through `fulmen.jit` (its autodiff and executors); if fulmen refuses
it, the graph is acquired node by node to find the nodes it refuses (fulmen.dynamo.splitter), which are split out
and run by Inductor (or eagerly) while fulmen runs the rest. A piece whose compilation fulmen refuses later (a new
shape, a grad it cannot build) falls back the same way. `report()` lists Dynamo's graph breaks and fulmen's pieces
with their reasons; `fulmen.last_traces(backend)` gives the trace each fulmen piece ran last.
"""

from __future__ import annotations

import copy
import enum
import operator
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from fulmen.core.errors import FulmenError
from fulmen.core.trace import Trace
from fulmen.dynamo.func_regions import escaping_value_reason
from fulmen.dynamo.hops import as_torch_calls, with_context_calls
from fulmen.dynamo.sizes import SizeInputs
from fulmen.dynamo.splitter import (
    CALLS,
    first_line,
    input_reads_first,
    refused_nodes,
    refused_under_autocast,
    split,
    static_refusals,
)
from fulmen.executors.base import Executor
from fulmen.executors.registry import resolve
from fulmen.jit.jitted_module import JittedModule
from fulmen.jit.jitted_module import core as jitted_core
from fulmen.options import JitOptions


class Fallback(enum.Enum):
    """What runs the pieces fulmen refuses."""

    INDUCTOR = "inductor"
    EAGER = "eager"


@dataclass
class Piece:
    """One piece of a captured graph and what runs it."""

    name: str
    nodes: int
    runner: nn.Module
    reasons: list[str] = field(default_factory=list)  # why fulmen does not run it; empty when it does

    @property
    def by_fulmen(self) -> bool:
        return isinstance(self.runner, FulmenPiece) and self.runner.fallback is None

    @property
    def runs_by(self) -> str:
        """"fulmen", or the fallback that runs the piece now ("inductor", "eager")."""
        runner = self.runner.fallback if isinstance(self.runner, FulmenPiece) else self.runner
        return "fulmen" if runner is None else runner.fallback.value


@dataclass
class GraphRecord:
    """A graph Dynamo handed over, the graph breaks Dynamo reported before it, and its pieces once it ran."""

    index: int
    graph: torch.fx.GraphModule
    breaks: list[str]
    pieces: list[Piece] = field(default_factory=list)


def _calls(module: torch.fx.GraphModule) -> int:
    return sum(node.op in CALLS for node in module.graph.nodes)


class FallbackPiece(nn.Module):
    """Runs a piece eagerly or compiles it with Inductor on its first call."""

    def __init__(self, module: torch.fx.GraphModule, fallback: Fallback) -> None:
        super().__init__()
        self.module = module
        self.fallback = fallback
        self._compiled: Callable[..., Any] | None = None
        self.record: Piece | None = None

    def forward(self, *args: Any) -> Any:
        if self.fallback is Fallback.EAGER:
            return self.module(*args)
        if self._compiled is None:
            # heavy: only when a piece needs it
            from torch._dynamo.exc import TensorifyScalarRestartAnalysis
            from torch._inductor import compile as inductor_compile
            from torch._inductor.exc import InductorError

            flat, spec = _flat_outputs(self.module)
            try:
                # fallback_random: random ops draw from torch's generator as eager does (Inductor's own draws differ)
                compiled = inductor_compile(flat, _example_inputs(flat, args), options={"fallback_random": True})
            except (InductorError, TensorifyScalarRestartAnalysis) as error:
                # Inductor compiles the piece on the graph's first call, outside Dynamo's analysis, from Dynamo's
                # example values; what it cannot compile so runs eagerly (a float attribute read under dynamic=True,
                # `.item()` of the tensor Dynamo made of it: Inductor asked Dynamo to restart its analysis with the
                # float specialized, or failed on the item's unbacked binding)
                self.fallback = Fallback.EAGER
                if self.record is not None:
                    why = first_line(error) if isinstance(error, InductorError) else "it would specialize a float"
                    self.record.reasons.append(f"Inductor cannot compile the piece here ({why}): it runs eagerly")
                return self.module(*args)
            self._compiled = lambda *inputs: pytree.tree_unflatten(list(compiled(*inputs)), spec)
        return self._compiled(*args)


def _example_inputs(module: torch.fx.GraphModule, args: tuple) -> list[Any]:
    """The values Dynamo recorded for `module`'s inputs (fake tensors, SymInts of dynamic sizes), else `args`: the
    graph's own metadata holds Dynamo's symbolic shapes, which Inductor cannot reconcile with concrete inputs."""
    placeholders = [node for node in module.graph.nodes if node.op == "placeholder"]
    return [node.meta.get("example_value", arg) for node, arg in zip(placeholders, args)]


def _flat_outputs(module: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, pytree.TreeSpec]:
    """`module` returning a flat tuple of its outputs (what Inductor compiles), and how to rebuild them: outputs
    that are tuples (a higher-order op's result) are taken apart with getitem."""
    graph = copy.deepcopy(module.graph)
    output = graph.output_node()

    def expand(value: Any) -> Any:
        example = value.meta.get("example_value") if isinstance(value, torch.fx.Node) else None
        if not isinstance(example, (tuple, list)):
            return value
        with graph.inserting_before(output):
            parts = [graph.call_function(operator.getitem, (value, i)) for i in range(len(example))]
        for part, item in zip(parts, example):
            part.meta["example_value"] = item
        return type(example)(expand(part) for part in parts)

    leaves, spec = pytree.tree_flatten(pytree.tree_map(expand, output.args[0]))
    output.args = (tuple(leaves),)
    return torch.fx.GraphModule(module, graph), spec


class FulmenPiece(nn.Module):
    """Runs a piece through fulmen; if fulmen refuses to compile it for some inputs, the fallback runs it from then on
    and the reason joins the piece's record."""

    def __init__(self, module: torch.fx.GraphModule, executors: tuple[Executor, ...], options: JitOptions,
                 fallback: Fallback) -> None:
        super().__init__()
        self.module = module
        runnable = with_context_calls(module)
        # Dynamo's graphs generate their code on their first call; until then forward is `_lazy_forward(*args)`, and
        # fulmen named the graph's inputs args_0, args_1, ... in traces and errors instead of Dynamo's names for them
        _LazyGraphModule.force_recompile(runnable)
        self.sizes = SizeInputs.of(module)  # Dynamo's symbolic sizes (sizes.py): read from the tensors, not taken
        if self.sizes is not None:
            runnable = self.sizes.from_tensors(runnable)
        self.jitted = JittedModule(runnable, options, executors)
        if self.sizes is not None:
            jitted_core(self.jitted).declare_dynamic(self.sizes.dims)
        self._fallback_kind = fallback
        self.fallback: FallbackPiece | None = None
        self.record: Piece | None = None

    def run(self, *args: Any) -> Any:
        """The piece through fulmen (what raises its refusal)."""
        return self.jitted(*(self.sizes.arguments(args) if self.sizes is not None else args))

    def forward(self, *args: Any) -> Any:
        if self.fallback is None:
            try:
                return self.run(*args)
            except FulmenError as error:
                self.fallback = FallbackPiece(self.module, self._fallback_kind)
                self.fallback.record = self.record
                if self.record is not None:
                    self.record.reasons.append(first_line(error))
        return self.fallback(*args)


class _SplitProgram:
    """What Dynamo calls for one graph: compiled on the first call, from the inputs it sees. The whole graph goes to
    fulmen; only if fulmen refuses it are the refused nodes found and split out."""

    def __init__(self, backend: FulmenBackend, record: GraphRecord) -> None:
        self.backend = backend
        self.record = record
        self.run: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.run is not None:
            return self.run(*args)
        graph, backend = self.record.graph, self.backend
        refusal = ""
        if not static_refusals(graph):
            whole = FulmenPiece(graph, backend.executors, backend.options, backend.fallback)
            try:
                out = whole.run(*args)
            except FulmenError as error:
                refusal = first_line(error)
            else:
                self.run = self._keep("graph", graph, whole, []).runner
                return out
        refused = refused_nodes(graph, args, backend.options.decompose, backend.executors)
        # acquired, then refused by a later pass (autodiff, executors), refused inside an autocast region, or a value
        # of a torch.func transform's level used after it: the graph falls back whole
        whole_reason = (refusal if not refused else
                        escaping_value_reason(graph) or refused_under_autocast(graph, refused))
        if whole_reason is not None:
            self.run = self._keep("graph", graph, FallbackPiece(graph, backend.fallback), [whole_reason]).runner
        else:
            result, reasons = split(graph, refused)
            for name, why in reasons.items():
                module = getattr(result, name)
                runner = (FallbackPiece(module, backend.fallback) if why else
                          FulmenPiece(module, backend.executors, backend.options, backend.fallback))
                setattr(result, name, self._keep(name, module, runner, why).runner)
            self.run = result
        return self.run(*args)

    def _keep(self, name: str, module: torch.fx.GraphModule, runner: FulmenPiece | FallbackPiece,
              reasons: list[str]) -> Piece:
        piece = Piece(name, _calls(module), runner, list(reasons))
        runner.record = piece
        self.record.pieces.append(piece)
        return piece


class FulmenBackend:
    """A torch.compile backend; one object per compiled program keeps its report and traces."""

    def __init__(self, executors: Sequence[Executor | str] | None = None, options: JitOptions | None = None,
                 fallback: Fallback | str = Fallback.INDUCTOR) -> None:
        self.executors = resolve(executors)
        self.options = options or JitOptions()
        if not isinstance(self.options, JitOptions):
            raise TypeError(f"options must be a JitOptions, got {type(self.options).__name__}")
        try:
            self.fallback = Fallback(fallback)
        except ValueError:
            raise ValueError(f"fallback must be one of {[f.value for f in Fallback]}, got {fallback!r}") from None
        self.graphs: list[GraphRecord] = []
        self._breaks_seen = Counter(_graph_breaks())

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        breaks = Counter(_graph_breaks())
        new = sorted(reason.split("\n", 1)[0] for reason, count in breaks.items()
                     if count > self._breaks_seen.get(reason, 0))
        self._breaks_seen = breaks
        record = GraphRecord(len(self.graphs), input_reads_first(as_torch_calls(graph)), new)
        self.graphs.append(record)
        return _SplitProgram(self, record)

    @property
    def pieces(self) -> list[Piece]:
        return [piece for record in self.graphs for piece in record.pieces]

    def last_traces(self) -> list[Trace]:
        """The trace each fulmen piece ran last (its final, executed trace), in the order Dynamo captured them."""
        return [entry.traces[-1] for entry in self._entries()]

    def last_backward_traces(self) -> list[Trace]:
        """The backward trace each fulmen piece built last (pieces without a backward are left out)."""
        return [entry.backward_traces[-1] for entry in self._entries() if entry.backward_traces]

    def _entries(self) -> list[Any]:
        runners = [piece.runner for piece in self.pieces if piece.by_fulmen]
        return [runner.jitted._jit.last_entry for runner in runners if runner.jitted._jit.last_entry is not None]

    def report(self) -> str:
        lines = [f"fulmen.dynamo: {len(self.graphs)} graph(s) from Dynamo, fallback {self.fallback.value}"]
        for record in self.graphs:
            lines.extend(f"  Dynamo graph break: {reason}" for reason in record.breaks)
            lines.append(f"graph {record.index}: {_calls(record.graph)} ops, {len(record.pieces)} piece(s)")
            for piece in record.pieces:
                lines.append(f"  {piece.name:<10} {piece.runs_by:<8} {piece.nodes:>5} ops")
                lines.extend(f"      {reason}" for reason in piece.reasons)
        return "\n".join(lines)

    __str__ = report


def _graph_breaks() -> Counter:
    from torch._dynamo.utils import counters  # Dynamo is loaded once torch.compile calls a backend

    return counters["graph_break"]


def backend(executors: Sequence[Executor | str] | None = None, options: JitOptions | None = None,
            fallback: Fallback | str = Fallback.INDUCTOR) -> FulmenBackend:
    """A torch.compile backend running each captured graph through fulmen with `executors` (default:
    `fulmen.get_default_executors()`) and `options`; what fulmen refuses runs by `fallback` ("inductor" or "eager")."""
    return FulmenBackend(executors, options, fallback)
