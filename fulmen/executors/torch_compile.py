"""The `torchcompile` executor: fusion regions of the final traces compiled with torch.compile (Inductor).

A region is a run of consecutive calls built only from elementwise, shape, conversion and reduction prims (so
norms, activations, RoPE, softmax, the cross-entropy parts, and their grads); matmuls, attention, random draws,
collectives, in-place writes and custom kernels end a region, since Inductor does not beat cuBLAS or fused
attention kernels and regions must not move communication. `fuse_matmuls=True` lets matmuls join regions too, so
Inductor sees their neighbours: with its default options it still calls cuBLAS for them, and with
`compile_options={"max_autotune_gemm": True}` it may choose its Triton matmul templates with the neighbouring
elementwise work fused in as a prologue or epilogue (at the cost of autotuning each matmul shape on the first step).
Each region becomes one callable printed as `TorchCompileN(...)`, and its parts print under it at depth 1.

Regions round as eager does: Inductor's `emulate_precision_casts` is on unless `compile_options` turn it off.
Without it Inductor keeps float32 between the fused ops of a half-precision chain, so `erf`'s bfloat16 grad, a
division's or RoPE's arithmetic differ from eager's in up to two thirds of their elements; with it each op's result
is rounded to its dtype as eager's kernel writes it. It cost nothing measurable on the TinyLlama step (112.9 vs
113.0 ms on an H200). Calls tagged `Tag.EAGER_ROUNDING` (eager's backward kernels, `pow` by a number) compile as
fulmen's decompositions, which round where eager's kernel on the region's device rounds: Inductor's own lowering of,
say, `aten.tanh_backward` computes in float32 and rounds once, as eager's CPU kernel does, while eager's CUDA kernel
rounds after each operation in bfloat16. What Inductor computes with other math than eager's kernels (its own tanh
and exp, sums in another order, float32 products contracted into fused multiply-adds where nvcc contracted others)
still differs by a unit here and there; the torch executor alone gives eager's bits.

Regions are printed with canonical names and compiled once per distinct source: the repeated blocks of a
transformer give identical regions (same ops, same shapes), which share one compiled function.

A region is compiled on its first call, without Dynamo (`fulmen.core.inductor.InductorFunction`): the trace
already fixes the shapes, dtypes and devices of a region's arguments, so only their strides key the compiled
variants, and calls go straight to Inductor's code instead of re-running torch.compile's guards. With
`compile_workers` (None: half the cores, at most 8, where there are 8 or more; 0: none), worker processes compile
each region of a static trace into Inductor's FX graph cache as soon as it is claimed, so a first call finds it
compiled (fulmen.core.compile_ahead).

It also claims the chunked linear + cross-entropy symbols (fulmen.ops.fused_loss): they run with `compiled=True`,
each chunk's elementwise work (log-sum-exp, softmax and its gradient) as one compiled function between the matmuls.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from fulmen.core.compile_ahead import CompileAhead, InputSpec, default_workers
from fulmen.core.inductor import InductorFunction
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Symbol, Tag, map_proxies
from fulmen.core.symbolic import symbolic_trace
from fulmen.core.trace import Namespace, Trace
from fulmen.executors.base import FusionExecutor, Implementation
from fulmen.executors.registry import register_executor
from fulmen.ops import fused_loss, prims
from fulmen.ops.registry import SYMBOLS
from fulmen.transforms.remat import CHEAP_PRIMS, leaf_calls

_SHAPE_PRIMS = frozenset(prims.PRIMS[name] for name in (
    "alias", "reshape", "permute", "expand", "squeeze", "unsqueeze", "slice", "select"))
FUSIBLE_PRIMS = CHEAP_PRIMS | frozenset(prims.PRIMS[name] for name in (
    "sum", "amax", "amin", "prod", "var", "cumsum", "argmax", "argmin", "take", "take_along_axis", "slice_scatter",
    "select_scatter"))
_RESHAPE = prims.PRIMS["reshape"]
_MATMUL = prims.PRIMS["matmul"]
# Leaves without a prim decomposition that Inductor still fuses well.
FUSIBLE_LEAVES = frozenset(SYMBOLS[name] for name in ("torch.logsumexp", "torch.arange", "impls.setitem"))


def _computes(leaf: BoundSymbol) -> bool:
    """Whether a leaf is a kernel of its own in eager: every prim but views, and a reshape whose input's layout
    allows no view (it copies)."""
    if leaf.sym is _RESHAPE:
        return not leaf.output.meta._is_view()
    return leaf.sym not in _SHAPE_PRIMS


class TorchCompileExecutor(FusionExecutor):
    """Fusion regions compiled by Inductor; `compile_options` are Inductor config options for every region
    (`torch._inductor.list_options()`), e.g. `{"max_autotune": True}` (`emulate_precision_casts` is on unless they
    say otherwise); `recompute_inputs`: see `FusionExecutor.recomputes_inputs`; `fuse_matmuls`: matmuls join
    regions (see the module's docs)."""

    def __init__(self, name: str = "torchcompile", compile_options: dict[str, Any] | None = None,
                 recompute_inputs: bool = True, fuse_matmuls: bool = False, compile_workers: int | None = None
                 ) -> None:
        super().__init__(name)
        self.recomputes_inputs = recompute_inputs
        self.fusible_leaves = FUSIBLE_PRIMS | FUSIBLE_LEAVES | ({_MATMUL} if fuse_matmuls else set())
        options = dict(compile_options or {})
        unknown = sorted(set(options) - set(torch._inductor.list_options()))
        if unknown:
            raise ValueError(f"TorchCompileExecutor: {unknown} are not Inductor config options "
                             "(torch._inductor.list_options())")
        self.compile_options = {"emulate_precision_casts": True, **options}
        self._compiled: dict[str, InductorFunction] = {}
        self.ahead = CompileAhead(default_workers() if compile_workers is None else compile_workers)

    def acquiring(self) -> None:
        self.ahead.start()  # its workers import torch while the program is traced

    def claims(self, bsym: BoundSymbol) -> Implementation | None:
        if bsym.sym not in _COMPILED_CHUNKS or bsym.kwargs.get("compiled"):
            return None
        on_device = all(p.device.type in ("cuda", "cpu") for p in bsym.proxy_args())
        return _COMPILED_CHUNKS[bsym.sym] if on_device else None

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        if bsym.sym.executor is not None or bsym.sym.tags & (Tag.RANDOM | Tag.IMPURE):
            return False
        if self.declines(bsym) is not None:
            return False
        if any(p.device.type not in ("cuda", "cpu") for p in bsym.proxy_args() + bsym.proxy_outputs()):
            return False
        return all(leaf.sym in self.fusible_leaves for leaf in leaf_calls(bsym))

    def declines(self, bsym: BoundSymbol) -> str | None:
        """Why no region takes `bsym` though its ops may be fusible, or None."""
        complex_value = next((p for leaf in leaf_calls(bsym) for p in (*leaf.proxy_args(), *leaf.proxy_outputs())
                              if p.dtype.is_complex), None)
        if complex_value is not None:
            return (f"{bsym.sym.printed} computes with the complex tensor {complex_value.pname} "
                    f"({complex_value.type_string()}): Inductor generates no code for complex operators (it falls back "
                    "to eager's kernels one by one, with a warning, slower than eager), so the torch executor runs "
                    "it")
        return None

    def worth_fusing(self, bsyms: list[BoundSymbol]) -> bool:
        # Worth a compiled call when it saves a kernel launch: two or more calls that compute (views are free). A
        # lone call (a gelu between two matmuls) runs as eager's own kernel, which rounds as eager does and costs
        # the same launch.
        computing = sum(1 for bsym in bsyms if any(_computes(leaf) for leaf in leaf_calls(bsym)))
        return computing > 1

    def is_view(self, bsym: BoundSymbol) -> bool:
        return not any(_computes(leaf) for leaf in leaf_calls(bsym))

    def fuse(self, bsyms: list[BoundSymbol], inputs: list[TensorProxy], outputs: list[TensorProxy],
             index: int) -> BoundSymbol:
        source, region = _canonical_region(bsyms, inputs, outputs)
        symbolic = symbolic_trace(region)
        # a region of symbolic sizes (fulmen.core.symbolic) runs at every size its trace admits: compiled for
        # symbolic sizes in the dims that are symbolic in the trace, where a static trace's regions differ by
        # strides only
        dynamic = tuple(frozenset(d for d, size in enumerate(p.shape) if isinstance(size, torch.SymInt))
                        for p in region.inputs) if symbolic else None
        compiled = self._compiled.get(source)
        if compiled is None:
            compiled = InductorFunction(region.python_callable(), self.compile_options, dynamic=dynamic)
            self._compiled[source] = compiled
        if self.ahead.workers and not symbolic:  # its compile starts in a worker now (core.compile_ahead)
            specs = tuple(InputSpec(tuple(p.shape), tuple(p.meta.stride()), p.dtype, p.device,
                                    offset=p.meta.storage_offset()) for p in region.inputs)
            compiled.ahead(source, region.name, specs, self.ahead)
        name = f"TorchCompile{index}"
        sym = Symbol(name=name, printed=name, impl=compiled, meta=None, executor=self)
        return BoundSymbol(sym, tuple(inputs), {}, tuple(outputs), list(bsyms), bsyms[0].source, executor=self)


def _with_compiled_chunks(sym: Symbol) -> Implementation:
    return Implementation(execution_transform=lambda *args, **kwargs: sym(*args, **{**kwargs, "compiled": True}))


_COMPILED_CHUNKS = {sym: _with_compiled_chunks(sym) for sym in fused_loss.CHUNKED}


def _region_calls(bsyms: list[BoundSymbol]) -> Iterator[BoundSymbol]:
    """The calls a region compiles: each call as the trace has it, except those whose decompositions round as eager's
    kernel on the region's device rounds (`Tag.EAGER_ROUNDING`)."""
    for bsym in bsyms:
        if bsym.sym.tags & Tag.EAGER_ROUNDING and bsym.subsymbols:
            yield from bsym.subsymbols
        else:
            yield bsym


def _canonical_region(bsyms: list[BoundSymbol], inputs: list[TensorProxy],
                      outputs: list[TensorProxy]) -> tuple[str, Trace]:
    """The region as a trace of its own with names by position, and its printed source (the cache key)."""
    namespace = Namespace()
    renamed: dict[str, TensorProxy] = {}

    def rename(proxy: TensorProxy) -> TensorProxy:
        new = renamed.get(proxy.pname)
        if new is None:
            new = TensorProxy(namespace.fresh(), proxy.meta, proxy.device, False)
            renamed[proxy.pname] = new
        return new

    region_inputs = [rename(p) for p in inputs]
    body = []
    for bsym in _region_calls(bsyms):
        body.append(bsym.from_bsym(args=map_proxies(bsym.args, rename), kwargs=map_proxies(bsym.kwargs, rename),
                                   output=map_proxies(bsym.output, rename), subsymbols=[], source=None))
    region_outputs = tuple(rename(p) for p in outputs)
    trace = Trace("region", region_inputs, body, region_outputs, "fusion region (torchcompile)", namespace)
    return trace.python(include_sources=False), trace


torchcompile = register_executor(TorchCompileExecutor())
