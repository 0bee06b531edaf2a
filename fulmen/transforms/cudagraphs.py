"""CUDA graphs ("reduce-overhead"): the capturable runs of the final forward and backward traces captured once and
replayed, so a step costs a few graph launches instead of one launch per kernel.

`JitOptions(cuda_graphs=True)` turns it on: the `CUDAGraphs` transform at stage CODEGEN, between two `del` after last
use passes (it drops the first one's `del`s, which would split the runs). It groups each maximal run of capturable
calls of a final trace into one `CUDAGraphN(...)` call (its parts print under it at depth 1). A call is capturable
when every tensor it reads or writes is on a CUDA device and it has no side effect (in-place writes to the program's
inputs and collectives run between the graphs, eagerly). A program with no CUDA tensor, a distributed (DDP / FSDP)
program, or a machine without CUDA gets no graphs, with a warning that says why.

How a graph region runs (`CUDAGraphRegion`):
- its first call runs the region's code as it is (a warm-up: Inductor compiles, libraries create their handles);
- its second call captures it. Each argument that is the same object as on the first call (parameters, a batch the
  caller reuses) or that is the output of another graph of the program (saved tensors in the backward) is read
  where it lies; any other argument gets a static copy, refreshed on every replay;
- later calls replay. An argument read in place that moved (a parameter reassigned) invalidates every graph of the
  program: they are warmed up and captured again (after three such invalidations the program stops using graphs).
Each layout of a region's arguments (shapes and strides) has its own warm-up, capture and graph: a trace with symbolic
sizes runs one graph per shape, at most `MAX_SHAPES` per region and while all graphs of the program keep at most
`MAX_KEPT_SHARE` of the device's memory in their outputs, the least recently used dropped first. A new shape costs
one eager warm-up call, one capture (a run and its recording) and the pool memory its graph keeps: its outputs (the
forward's saved values and results, the backward's gradients at that shape), besides what the other shapes' graphs
keep; what the graphs use only inside a replay is shared by all of them.

Memory: all graphs of one program (its forward and backward) capture into one memory pool, and the allocator's
cached blocks are released before the first capture, so the pool takes the place of the memory the warm-up step
used instead of adding to it. A graph's outputs keep their memory between replays: the values a forward saves for
its backward and the gradients a backward returns are written to the same places at every replay. Hence:
- outputs the caller receives (the forward's results, the backward's gradients) are cloned out of the pool;
- a forward replays only after the backward of the previous replayed forward ran (or its graph was dropped):
  otherwise it runs without graphs, and so does its backward (see `GraphedProgram`).
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Symbol, Tag, iter_proxies
from fulmen.core.trace import Trace
from fulmen.ops import prims
from fulmen.transforms.common import DEL, delete_last_used
from fulmen.transforms.regions import form_regions
from fulmen.transforms.transform import TraceKind, Transform

# Arguments read in place that moved: the program's graphs are captured again at most this many times.
MAX_INVALIDATIONS = 3
# Graphs one region keeps, one per layout of its arguments (a trace with symbolic sizes runs many shapes): the most
# recently used ones; torch.compile's "reduce-overhead" keeps one graph per shape too, without a bound.
MAX_SHAPES = 8
# ... and while their outputs keep at most this share of the device's memory together (each program's pool apart):
# a shape's graph keeps its outputs, the forward's saved values at that length, so eight lengths of a large step
# could otherwise hold eight sets of activations. The newest graph of a region is kept whatever its size.
MAX_KEPT_SHARE = 0.25
CAPTURE_DEVICE = "cuda"  # the device type whose work graphs capture


class GraphPool:
    """The memory pool and capture stream shared by the graphs of one program, and their validity."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.handle: tuple[int, int] | None = None
        self.stream: torch.cuda.Stream | None = None
        self.generation = 0  # bumped when the graphs must be captured again
        self.static_ptrs: set[int] = set()  # addresses of the graphs' outputs (stable by construction)
        self.invalidations = 0
        self.disabled: str | None = None  # why the program no longer uses graphs
        self.kept_bytes = 0  # what the graphs' outputs hold, all regions of the program together
        self.budget: int | None = None  # at most this, dropping each region's least recently used graphs first

    def prepare_capture(self) -> None:
        if self.budget is None:
            self.budget = int(MAX_KEPT_SHARE * torch.cuda.get_device_properties(torch.cuda.current_device())
                              .total_memory)
        if self.handle is None:
            # The warm-up step's activations sit in the allocator's cache; released, the pool reuses that memory.
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            self.handle = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream()

    def invalidate(self, reason: str) -> None:
        self.generation += 1
        self.handle = None
        self.static_ptrs.clear()
        self.kept_bytes = 0
        self.invalidations += 1
        if self.invalidations > MAX_INVALIDATIONS:
            self.disable(f"{reason}, {self.invalidations} times")

    def disable(self, reason: str) -> None:
        if self.disabled is None:
            self.disabled = reason
            warnings.warn(f"fulmen CUDA graphs: {self.name} runs without graphs from now on: {reason}", stacklevel=2)


class _ShapeGraph:
    """One region's graph for one layout of its arguments: the warm-up call's arguments, then the capture."""

    def __init__(self) -> None:
        self.graph: torch.cuda.CUDAGraph | None = None
        self.previous: list[weakref.ref] | None = None  # the arguments of the warm-up call
        self.static_inputs: list[torch.Tensor] = []
        self.addresses: list[int | None] = []  # per argument read where it lies, its address; None: copied in
        self.outputs: Any = None
        self.nbytes = 0  # what its outputs hold in the pool


def _output_bytes(outputs: Any) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tree_leaves(outputs)
                if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def layout_key(args: tuple) -> tuple:
    """What a graph holds fixed of its arguments: each one's shape and strides (a trace with symbolic sizes calls its
    regions with other shapes; a static trace, always with the same)."""
    return tuple([(tuple(arg.shape), arg.stride()) for arg in args])


class CUDAGraphRegion:
    """The callable of one `CUDAGraphN` call: warm-up, capture, then replays (see the module docstring), for each
    layout of its arguments apart (`layout_key`): a trace with symbolic sizes keeps one graph per shape it runs, the
    `MAX_SHAPES` most recently used; a new shape costs one warm-up call, one capture and the pool memory its graph
    keeps (its outputs); dropping the least recently used one releases its graph and outputs."""

    def __init__(self, fn: Callable[..., Any], pool: GraphPool, name: str) -> None:
        self.fn = fn
        self.pool = pool
        self.name = name
        self._reset()

    def _reset(self) -> None:
        self.generation = self.pool.generation
        self.shapes: OrderedDict[tuple, _ShapeGraph] = OrderedDict()
        self.captures = 0  # graphs captured since the last reset (one per shape, again after eviction)

    def __call__(self, *args: torch.Tensor) -> Any:
        if self.pool.disabled is not None:
            return self.fn(*args)
        if self.generation != self.pool.generation:
            self._reset()
        key = layout_key(args)
        state = self.shapes.get(key)
        if state is None:
            state = self.shapes[key] = _ShapeGraph()
            while len(self.shapes) > MAX_SHAPES:
                self._drop(next(iter(self.shapes)))
        else:
            self.shapes.move_to_end(key)
        if state.graph is None:
            if state.previous is None:
                state.previous = [weakref.ref(arg) for arg in args]
                return self.fn(*args)
            return self._capture(key, state, args)
        for static, address, arg in zip(state.static_inputs, state.addresses, args):
            if address is None:
                static.copy_(arg)
            elif arg.data_ptr() != address:  # the same tensor object may hold new memory (`param.data = ...`)
                self.pool.invalidate(f"an argument of {self.name} read in place moved")
                return self.fn(*args)
        state.graph.replay()
        return state.outputs

    def _drop(self, key: tuple) -> None:
        state = self.shapes.pop(key)
        self.pool.kept_bytes -= state.nbytes
        self.pool.static_ptrs.difference_update(
            out.data_ptr() for out in tree_leaves(state.outputs) if isinstance(out, torch.Tensor))

    def _within_budget(self, newest: tuple) -> None:
        """Drops this region's least recently used graphs while the pool's graphs keep more than its budget."""
        pool = self.pool
        while pool.budget is not None and pool.kept_bytes > pool.budget:
            oldest = next((k for k, state in self.shapes.items() if k != newest and state.graph is not None), None)
            if oldest is None:
                return
            self._drop(oldest)

    def _capture(self, key: tuple, state: _ShapeGraph, args: tuple[torch.Tensor, ...]) -> Any:
        pool = self.pool
        pool.prepare_capture()
        state.static_inputs, state.addresses = [], []
        for arg, previous in zip(args, state.previous):
            if previous() is arg or arg.data_ptr() in pool.static_ptrs:
                state.static_inputs.append(arg)
                state.addresses.append(arg.data_ptr())
            else:
                state.static_inputs.append(_static_copy(arg))
                state.addresses.append(None)
        stream = pool.stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # libraries create their handles for the capture stream outside the capture
            self.fn(*state.static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool.handle, stream=stream):
                outputs = self.fn(*state.static_inputs)
        except RuntimeError as error:  # an op that cannot be captured (a host synchronisation, a CPU copy)
            pool.disable(f"capturing {self.name} failed: {error}")
            return self.fn(*args)
        state.graph, state.outputs, state.nbytes = graph, outputs, _output_bytes(outputs)
        self.captures += 1
        pool.kept_bytes += state.nbytes
        pool.static_ptrs.update(out.data_ptr() for out in tree_leaves(outputs) if isinstance(out, torch.Tensor))
        self._within_budget(key)
        graph.replay()
        return outputs


def _static_copy(arg: torch.Tensor) -> torch.Tensor:
    """A tensor of `arg`'s layout (dense when `arg` overlaps itself, e.g. an expanded tensor) holding its values."""
    if torch._debug_has_internal_overlap(arg) == 0:  # no overlap: its own strides
        static = torch.empty_strided(arg.shape, arg.stride(), dtype=arg.dtype, device=arg.device)
    else:
        static = torch.empty(arg.shape, dtype=arg.dtype, device=arg.device)
    return static.copy_(arg)


@dataclass
class _Pending:
    done: bool = False


@dataclass
class GraphedProgram:
    """Pairs the replays of a forward's graphs with its backward's: the values a replayed forward saves live in the
    graphs' outputs until its backward has run, so the next forward replays only then."""

    pool: GraphPool
    _last: weakref.ref | None = field(default=None, repr=False)

    def start_forward(self) -> _Pending | None:
        """A token to keep with the forward's saved values when the forward may replay its graphs, else None (run
        this forward and its backward without graphs)."""
        if self.pool.disabled is not None:
            return None
        last = self._last() if self._last is not None else None
        if last is not None and not last.done:
            return None
        token = _Pending()
        self._last = weakref.ref(token)
        return token

    @staticmethod
    def finish_backward(token: _Pending) -> None:
        token.done = True


def decline_reason(trace: Trace, distributed: bool) -> str | None:
    """Why a program gets no CUDA graphs at all, or None."""
    if distributed:
        return "the program has distributed (DDP / FSDP) collectives, which are not captured"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    devices = {p.device.type for p in (*trace.inputs, *iter_proxies(trace.output))}
    if CAPTURE_DEVICE not in devices:
        return f"the program runs on {', '.join(sorted(devices)) or 'no device'}, not on a CUDA device"
    return None


def capturable(bsym: BoundSymbol) -> bool:
    if bsym.sym.tags & Tag.IMPURE:
        return False
    proxies = bsym.proxy_args() + bsym.proxy_outputs()
    return bool(proxies) and all(p.device.type == CAPTURE_DEVICE for p in proxies)


def capture_regions(trace: Trace, pool: GraphPool, cloned_outputs: int) -> Trace:
    """`trace` with its capturable runs as `CUDAGraphN` calls; its first `cloned_outputs` outputs, where a graph
    computes them, are cloned out of the graphs' memory."""
    regions: list[BoundSymbol] = []

    def build(run: list[BoundSymbol], inputs: list[TensorProxy], outputs: list[TensorProxy]) -> BoundSymbol:
        name = f"CUDAGraph{len(regions)}"
        # each intermediate freed after its last use inside the capture too: the pool holds the working set only
        body = delete_last_used(Trace(name, inputs, run, tuple(outputs), f"CUDA graph region of {trace.name}",
                                      trace.namespace))
        sym = Symbol(name=name, printed=name, impl=CUDAGraphRegion(body.python_callable(), pool, name), meta=None,
                     executor=CUDAGRAPHS)
        region = BoundSymbol(sym, tuple(inputs), {}, tuple(outputs), list(run), run[0].source, executor=CUDAGRAPHS)
        regions.append(region)
        return region

    grouped = form_regions(trace, capturable, build)
    captured = {p.pname for region in regions for p in region.proxy_outputs()}
    bsyms = list(grouped.bound_symbols)
    output = list(trace.output)
    for i, out in enumerate(output[:cloned_outputs]):
        if type(out) is TensorProxy and out.pname in captured:
            copy = TensorProxy(trace.namespace.fresh(), out.meta, out.device, out.requires_grad)
            bsyms.append(BoundSymbol(prims.clone, (out,), {}, copy, [], None))
            output[i] = copy
    return trace.from_trace(f"CUDA graphs ({len(regions)} regions)", bound_symbols=bsyms, output=tuple(output))


class _CUDAGraphsExecutor:
    """Names the owner of `CUDAGraphN` symbols in printed traces (`# CUDAGraph0: from executor 'cudagraphs'`)."""

    name = "cudagraphs"


CUDAGRAPHS = _CUDAGraphsExecutor()


def graph_pool_for(trace: Trace, distributed: bool, name: str) -> GraphPool | None:
    """A pool for the graphs of the program `trace` acquired, or None (with a warning) when it cannot have any."""
    reason = decline_reason(trace, distributed)
    if reason is not None:
        # graph_pool_for < Pipeline.for_program < JittedFunction._compile_acquired < _compile_traced < _compile <
        # JittedFunction.__call__ < the user's call
        warnings.warn(f"fulmen.jit(options=JitOptions(cuda_graphs=True)): {name} runs without CUDA graphs: {reason}",
                      stacklevel=7)
        return None
    return GraphPool(name)


class CUDAGraphs(Transform):
    """Stage CODEGEN: the capturable runs of a trace that runs as `CUDAGraphN` calls capturing into `pool` (see the
    module docstring); `DeleteLastUsed` runs again after it. fulmen.jit's pipeline lists one without a pool and gives
    each program one of its own (`Pipeline.for_program`), or leaves the pass out where the program cannot have graphs;
    without a pool it leaves traces as they are."""

    def __init__(self, pool: GraphPool | None = None) -> None:
        self.pool = pool

    @property
    def name(self) -> str:
        return "CUDA graphs"

    def transform_codegen(self, trace: Trace, kind: TraceKind, returned: int) -> Trace:
        if self.pool is None:
            return trace
        # the `del`s of the pass before would split the runs: the regions form between the calls, freed after again
        calls = [bsym for bsym in trace.bound_symbols if bsym.sym is not DEL]
        return capture_regions(trace.from_trace(trace.provenance, bound_symbols=calls), self.pool, returned)
