"""Inductor compiles of fusion regions run ahead of their first call, in parallel worker processes (issue 48).

A trace's regions are known when the executors claim it, but `InductorFunction` compiles each one on its first
call, one after another: Inductor lowers a graph in Python, on one core (on an H200 machine, 15 regions of a
TinyLlama step took 14 s of a 2-trace run's 51). `CompileAhead.submit` hands a region's source to a pool of worker
processes (torch's own `SubprocPool`, which Inductor uses for its Triton compiles) as soon as it is claimed; each
worker compiles it into Inductor's FX graph cache. The region's first call compiles it in this process as before,
a cache hit where its worker has finished: the cache is torch's own, keyed by the graph, its inputs' metadata,
Inductor's config and torch's numerics settings, so what runs is what this process would have compiled. The first
call never waits: a region its worker has not finished, or failed, or compiled under another key compiles here as
without workers; so does every region when a job cannot be sent (its options do not pickle, no process starts).

Both sides build the graph the same way (`cacheable`): the region's function traced on fake inputs of a
`FakeTensorMode` with a ShapeEnv (without one, Inductor bypasses its FX graph cache), so the keys agree.

Static regions only. A region of a symbolic trace compiles in this process at its first call, never from the cache
(fulmen.core.inductor): a cache entry keeps the guards its compile added on the sizes only for graphs that take the
sizes as SymInt arguments, and a region's graph takes tensors alone.
"""

from __future__ import annotations

import atexit
import os
import pickle
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx


@dataclass(frozen=True, slots=True)
class InputSpec:
    """What a region's compiled code assumes of one input: its layout, with the sizes of the `dynamic` dims (a
    symbolic trace's) as hints of sizes it takes any value of. With dynamic dims the storage offset is symbolic too
    unless it is 0 or 1 (torch's rule): the chunks of a fused loss are slices at offsets that vary with the rows, and
    one compiled for offset 0 guards on it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    dynamic: frozenset[int] = frozenset()
    offset: int = 0

    @classmethod
    def of(cls, tensor: torch.Tensor, dynamic: frozenset[int] = frozenset()) -> InputSpec:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device, dynamic,
                   tensor.storage_offset())

    def empty(self) -> torch.Tensor:
        """An uninitialised tensor laid out as this spec says (under a fake mode: no memory)."""
        tensor = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        if self.offset:
            extent = tensor.untyped_storage().nbytes() // tensor.element_size()
            storage = torch.empty(self.offset + extent, dtype=self.dtype, device=self.device).untyped_storage()
            tensor.set_(storage, self.offset, self.shape, self.stride)
        return tensor


def cacheable(fn: Callable[..., Any], specs: tuple[InputSpec, ...]
              ) -> tuple[torch.fx.GraphModule, list[torch.Tensor], Any]:
    """`fn` (a region's function) traced to an aten graph on fake inputs laid out as `specs`, which Inductor's FX
    graph cache keys (the same in a worker and here): the graph, its inputs and their ShapeEnv. A dynamic dim is a
    symbol (equal hints share one, as torch.compile's duck sizing), the others static."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    with FakeTensorMode():
        bases = [s.empty() for s in specs]
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [mode.from_tensor(base, symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DUCK if d in s.dynamic else DimDynamic.STATIC for d in range(len(s.shape))]))
        for base, s in zip(bases, specs)]
    with torch.no_grad():
        graph = make_fx(fn, tracing_mode="fake")(*fakes)
    return graph, [node.meta["val"] for node in graph.graph.nodes if node.op == "placeholder"], mode.shape_env


def compile_inductor(graph: torch.fx.GraphModule, inputs: list[torch.Tensor], options: dict[str, Any] | None,
                     inner_compile: Any = None) -> Any:
    """Inductor's compile of an aten graph, as every region is compiled (here and in a worker)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    # AOTAutograd's cache is off so that a cache hit does not skip the inner compile whose result
    # InductorFunction calls directly (Inductor's own FX graph cache still applies)
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(graph, inputs, inner_compile=inner_compile or compile_fx_inner, config_patches=options)


@dataclass(frozen=True, slots=True)
class _Job:
    source: str  # the region's Python (a printed trace defining `name`)
    name: str
    specs: tuple[InputSpec, ...]
    options: dict[str, Any] | None
    inductor_config: bytes  # torch._inductor.config.save_config_portable(), pickled
    settings: dict[str, Any]  # `_settings()`


def _settings() -> dict[str, Any]:
    """This process's torch settings that Inductor's FX graph cache key reads (codecache.FxGraphHashDetails)."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)  # (reading allow_tf32 too would mix torch's two APIs)
    return {"fp32_precision": precision, "tf32": matmul.allow_tf32 if precision is None else None,
            "fp16_reduction": matmul.allow_fp16_reduced_precision_reduction,
            "bf16_reduction": matmul.allow_bf16_reduced_precision_reduction,
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()),
            "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
            "threads": torch.get_num_threads(), "default_dtype": torch.get_default_dtype()}


def _apply(settings: dict[str, Any]) -> None:
    matmul = torch.backends.cuda.matmul
    if settings["fp32_precision"] is not None:
        matmul.fp32_precision = settings["fp32_precision"]
    else:  # a torch without fp32_precision
        matmul.allow_tf32 = settings["tf32"]
    matmul.allow_fp16_reduced_precision_reduction = settings["fp16_reduction"]
    matmul.allow_bf16_reduced_precision_reduction = settings["bf16_reduction"]
    deterministic, warn_only = settings["deterministic"]
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = settings["fill_uninitialized_memory"]
    torch.set_num_threads(settings["threads"])
    torch.set_default_dtype(settings["default_dtype"])


def _fill_cache(payload: bytes) -> None:
    """In a worker: compile the job's region into Inductor's FX graph cache."""
    job: _Job = pickle.loads(payload)  # noqa: S301 (written by this process's parent)
    _apply(job.settings)
    namespace: dict[str, Any] = {}
    exec(compile(job.source, f"<fulmen region {job.name}>", "exec"), namespace)  # noqa: S102 (the parent's trace)
    graph, fakes, _ = cacheable(namespace[job.name], job.specs)
    with torch._inductor.config.patch(pickle.loads(job.inductor_config)):  # noqa: S301
        compile_inductor(graph, fakes, job.options)


def default_workers() -> int:
    """Half the cores this process may run on, at most 8, where there are at least 8 (a worker is a process with
    torch imported, about 1 GB; on fewer cores the compiles would take the cores the program runs on)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(8, cores // 2) if cores >= 8 else 0


class CompileAhead:
    """A pool of `workers` compile processes, started at the first job (0: none; `submit` returns None)."""

    def __init__(self, workers: int) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"compile_workers: a number of processes, 0 or more (0: compile at first calls), got "
                             f"{workers!r}")
        self.workers = workers
        self.jobs: list[Future] = []  # every job submitted (a test waits for them; the program does not)
        self._pool: Any = None

    def start(self) -> None:
        """Start the workers (the first `submit` does too), so they are ready when the first job comes."""
        if self.workers > 0 and self._pool is None:
            from torch._inductor.compile_worker.subproc_pool import SubprocKind, SubprocPool

            try:  # quiesced when idle: the workers exit, the pool starts them again for the next job
                self._pool = SubprocPool(self.workers, kind=SubprocKind.FORK, quiesce=True)
                self._pool.wakeup()
            except Exception:  # noqa: BLE001 - no worker can start here: every region compiles at its first call
                self._pool, self.workers = None, 0
                return
            atexit.register(self.shutdown)

    def submit(self, source: str, name: str, specs: tuple[InputSpec, ...], options: dict[str, Any] | None
               ) -> Future | None:
        """Compile the function `name` that `source` defines, for inputs laid out as `specs`, in a worker."""
        if self.workers <= 0:
            return None
        try:
            config = pickle.dumps(torch._inductor.config.save_config_portable())
            payload = pickle.dumps(_Job(source, name, specs, options, config, _settings()))
        except Exception:  # noqa: BLE001 - options or config that do not pickle: the region compiles at its first call
            return None
        self.start()
        if self._pool is None:
            return None
        self.jobs.append(self._pool.submit(_fill_cache, payload))
        return self.jobs[-1]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
