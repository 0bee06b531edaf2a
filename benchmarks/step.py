"""A LitGPT training step (forward, cross-entropy, backward, AdamW step) under several compilers, side by side.

    python benchmarks/step.py [--model_name tiny-llama-1.1b] [--micro_batch_size 4] [--seq_len 2048]
        [--compilers eager,torch.compile,fulmen,fulmen+unsloth,thunder] [--executors NAME,...]
        [--out benchmarks/step.json]

`fulmen+unsloth` is fulmen with the "unsloth" executor (fulmen.unsloth's Triton kernels for cross-entropy, SwiGLU
and RoPE) ahead of the same executors as the `fulmen` row (`--executors`, or fulmen's defaults). `fulmen+cudagraphs`
is fulmen with `JitOptions(cuda_graphs=True)`, `torch.compile+cudagraphs` torch.compile's "reduce-overhead" mode
(neither is in the default list). `fulmen+matmul-regions` lets the matmuls join the torchcompile executor's regions
(`TorchCompileExecutor(fuse_matmuls=True)`), `fulmen+matmul-autotune` also autotunes them (Inductor's
`max_autotune_gemm`: its Triton matmul templates, with neighbouring elementwise work fused in, where they beat
cuBLAS), and `torch.compile+max-autotune` is torch.compile's "max-autotune-no-cudagraphs" mode for comparison.
`fulmen-whole-step` jits the whole step, the optimizer's step and zero_grad included (one program: each parameter's
update right after its gradient, in buckets, fulmen.transforms.update_order), and `fulmen-whole-step+cudagraphs`
captures it in CUDA graphs (the in-place updates run between them). `fulmen+inductor-roundings` compiles the
regions without Inductor's `emulate_precision_casts` (on in the `fulmen` row): a fused chain of half-precision ops
keeps float32 between its ops instead of rounding after each, as eager does. `fulmen-symbolic` and
`torch.compile-dynamic` compile for symbolic sizes from the first call (`JitOptions(dynamic=True)`,
`torch.compile(dynamic=True)`): what one trace for every length costs at a fixed length.

`--preset seed-002` is the seed-002 notebook's regime: llm.c's GPT-2 124M as examples/llmc/model.py writes it
(`--model_name llmc-gpt2`, its own loss in the forward), B=4, T=64, fp32 with TF32 off, `torch.optim.Adam`:

    python benchmarks/step.py --preset seed-002 --compilers eager,torch.compile,fulmen,fulmen+cudagraphs,\
        torch.compile+cudagraphs,fulmen-whole-step,fulmen-whole-step+cudagraphs

Every compiler runs in turn in this one process on one device, each on a fresh model built from the same seed and
trained on the same random batch, so the losses they report should agree. The weights are in the benchmark dtype
("bf16-true": no autocast, no fp32 master weights), like the single-device row of Lightning Thunder's TinyLlama
table (eager vs Inductor vs Thunder).

What is compiled: the function `forward_and_loss(model, x, y)`, so the cross-entropy is in the trace, as in
Thunder's pretraining script (`torch.compile` and `thunder.jit` get the same function, for parity). When a compiler
raises on that function it is retried on the module alone with the loss computed eagerly; `mode` in the JSON says
which one ran ("function" or "module") and `function_mode_error` why the first failed. The optimizer step is eager
for every compiler: `torch.optim.AdamW(fused=True)` on CUDA, `foreach=True` on CPU (`--optimizer adam`:
`torch.optim.Adam` with its defaults, as the seed-002 notebook).

Measured per compiler: the wall time of the first step (compilation included, cold: each row in new Inductor and
Triton caches, after one small warm-up compile), then `--warmup` untimed steps, then
`--iters` steps each timed with a device synchronize on either side (median reported; with `--rounds N` every
compiler runs N times, the order reversed every other round, and the median is over all its timed steps); the
peak allocated CUDA
memory over the compiler's whole run (model, optimizer state and steps); tokens/s = micro_batch_size * seq_len /
median; the loss of the last step; on CUDA, the GPU time per step of each kernel family (matmul, attention,
triton, adam, other) from torch.profiler over `--profile_steps` further steps, and the largest kernels.
MFU = FLOPs per step / (median seconds * the GPU's dense bf16 peak), with the
FLOPs per step from LitGPT's `estimate_flops(model, training=True) * micro_batch_size` (what LitGPT's pretraining
logs): 3 * (2 * n_params * seq_len + 4 * n_layer * n_embd * seq_len**2) per sequence, all parameters counted, the
embedding included (the same formula for llmc-gpt2). MFU is null on CPU, for a dtype other than bf16 and for a GPU
not in `fulmen.pretrain.flops.PEAK_BF16_DENSE_FLOPS`.

A failing compiler (an exception or an OOM) is recorded with its error and the next one runs.
CPU smoke test:

    python benchmarks/step.py --device cpu --dtype fp32 --model_name pythia-14m --n_layer 1 --seq_len 32 \\
        --micro_batch_size 2 --iters 2 --warmup 1 --compilers eager,fulmen --out /tmp/step.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from litgpt import GPT, Config
from litgpt.utils import estimate_flops
from torch._inductor.utils import fresh_cache
from torch.autograd import DeviceType

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # fulmen may be pip-installed; examples/ is imported from the checkout
    sys.path.insert(0, str(REPO))
import fulmen  # noqa: E402
from examples.llmc import model as llmc_model  # noqa: E402
from fulmen.executors.torch_compile import TorchCompileExecutor  # noqa: E402
from fulmen.pretrain.flops import peak_flops  # noqa: E402 - the same table pretraining reports MFU with

DEFAULT_COMPILERS = ("eager", "torch.compile", "fulmen", "fulmen+unsloth", "thunder")
# the whole step (forward, loss, backward, optimizer step and zero_grad) jitted as one program (issue 50)
WHOLE_STEP = {"fulmen-whole-step": False, "fulmen-whole-step+cudagraphs": True}
COMPILERS = (*DEFAULT_COMPILERS, "fulmen+cudagraphs", "torch.compile+cudagraphs", *WHOLE_STEP, "fulmen-unfused-loss",
             "fulmen-repeated-heads", "fulmen+matmul-regions", "fulmen+matmul-autotune", "torch.compile+max-autotune",
             "fulmen+inductor-roundings", "fulmen-symbolic", "torch.compile-dynamic")
# torchcompile executor variants: Inductor options for its regions, and whether matmuls join them. With the matmuls
# in: cuBLAS still (default options), or Inductor's autotuned Triton matmul templates with the neighbouring
# elementwise work fused in where they win (max_autotune_gemm).
REGION_VARIANTS = {"fulmen+matmul-regions": ({}, True), "fulmen+matmul-autotune": ({"max_autotune_gemm": True}, True),
                   "fulmen+inductor-roundings": ({"emulate_precision_casts": False}, False)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LLMC_GPT2 = "llmc-gpt2"  # the seed-002 notebook's GPT-2 (examples/llmc/model.py), not a LitGPT config
PRESETS = {"seed-002": {"model_name": LLMC_GPT2, "micro_batch_size": 4, "seq_len": 64, "dtype": "fp32",
                        "optimizer": "adam", "tf32": False}}


def forward_and_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def forward_and_own_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """llm.c's GPT-2 computes its loss in its forward, as the seed-002 notebook trains it."""
    return model(x, y)[1]


def loss_function(model: torch.nn.Module) -> Callable:
    return forward_and_own_loss if isinstance(model, llmc_model.GPT) else forward_and_loss


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A randomly initialised GPT created on `device` in `dtype` (the default dtype while the weights are made):
    LitGPT's, or llm.c's GPT-2 for `--model_name llmc-gpt2`."""
    overrides = {"n_layer": args.n_layer} if args.n_layer is not None else {}
    torch.manual_seed(args.seed)
    if args.model_name == LLMC_GPT2:
        with torch.device(device), default_dtype(dtype):
            return llmc_model.GPT(llmc_model.GPTConfig(**overrides)).to(dtype)
    config = Config.from_name(args.model_name, **overrides)
    with torch.device(device), default_dtype(dtype):
        model = GPT(config)
        model.max_seq_length = args.seq_len
    return model.to(dtype)  # the RoPE cache LitGPT builds in fp32 too, as bf16-true precision converts it


def training_flops(model: torch.nn.Module, args: argparse.Namespace) -> float:
    """FLOPs of a training step: LitGPT's `estimate_flops`, or its formula for llm.c's GPT-2 (all parameters,
    3 * (2 * n_params * T + 4 * n_layer * n_embd * T**2) per sequence)."""
    if isinstance(model, llmc_model.GPT):
        config, n_params = model.config, sum(p.numel() for p in model.parameters())
        per_sequence = 3 * (2 * n_params * args.seq_len + 4 * config.n_layer * config.n_embd * args.seq_len ** 2)
        return per_sequence * args.micro_batch_size
    return estimate_flops(model, training=True) * args.micro_batch_size


def make_batch(args: argparse.Namespace, config: Config, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, config.vocab_size, (args.micro_batch_size, args.seq_len + 1), generator=generator)
    tokens = tokens.to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def compile_fn(name: str, executors: list[str] | None) -> Callable[[Any], Callable]:
    if name == "torch.compile":
        return torch.compile
    if name == "torch.compile+cudagraphs":
        return lambda fn: torch.compile(fn, mode="reduce-overhead")
    if name == "torch.compile+max-autotune":
        return lambda fn: torch.compile(fn, mode="max-autotune-no-cudagraphs")
    if name in REGION_VARIANTS:  # the same executors, torchcompile's regions compiled another way
        options, fuse_matmuls = REGION_VARIANTS[name]
        fusing = TorchCompileExecutor(f"torchcompile[{name}]", options, fuse_matmuls=fuse_matmuls)
        names = executors or [executor.name for executor in fulmen.get_default_executors()]
        return lambda fn: fulmen.jit(fn, executors=[fusing if e == "torchcompile" else e for e in names])
    if name == "fulmen":
        return lambda fn: fulmen.jit(fn, executors=executors)
    if name == "fulmen+cudagraphs":
        return lambda fn: fulmen.jit(fn, executors=executors, options=fulmen.JitOptions(cuda_graphs=True))
    if name == "fulmen-symbolic":  # the trace symbolic in every size from the first call (issue 48)
        return lambda fn: fulmen.jit(fn, executors=executors, options=fulmen.JitOptions(dynamic=True))
    if name == "torch.compile-dynamic":
        return lambda fn: torch.compile(fn, dynamic=True)
    if name == "fulmen-unfused-loss":  # what the fused linear + cross-entropy pass changes
        return lambda fn: fulmen.jit(fn, executors=executors,
                                     options=fulmen.JitOptions(fuse_linear_cross_entropy=False))
    if name == "fulmen-repeated-heads":  # what grouped-query attention (fulmen.transforms.grouped_attention) changes
        return lambda fn: fulmen.jit(fn, executors=executors,
                                     options=fulmen.JitOptions(grouped_query_attention=False))
    if name == "fulmen+unsloth":  # fulmen.unsloth's Triton kernels first, then the same executors
        names = executors or [executor.name for executor in fulmen.get_default_executors()]
        return lambda fn: fulmen.jit(fn, executors=["unsloth", *names])
    if name == "thunder":
        import thunder

        return thunder.jit
    raise ValueError(f"unknown compiler {name!r}")


def make_loss_fn(name: str, mode: str, model: torch.nn.Module, executors: list[str] | None) -> Callable:
    """`loss_fn(x, y)` for one compiler: the compiled `forward_and_loss` ("function") or compiled module ("module")."""
    loss = loss_function(model)
    if name == "eager":
        return lambda x, y: loss(model, x, y)
    compile_ = compile_fn(name, executors)
    if mode == "function":
        compiled = compile_(loss)
    else:
        compiled_model = compile_(model)
        compiled = lambda _, x, y: loss(compiled_model, x, y)  # noqa: E731
    if name == "torch.compile+cudagraphs":  # each step is a new generation of torch's cudagraph trees
        def step_begin(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(model, x, y)

        return step_begin
    return lambda x, y: compiled(model, x, y)


def make_whole_step(name: str, model: torch.nn.Module, executors: list[str] | None) -> Callable:
    """`step(optimizer, x, y)` for a whole-step row: the forward, loss, backward, optimizer step and zero_grad in one
    jitted program (fulmen.jit of a training step), with CUDA graphs for the `+cudagraphs` row."""
    loss = loss_function(model)

    def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                   y: torch.Tensor) -> torch.Tensor:
        value = loss(model, x, y)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return value

    jitted = fulmen.jit(train_step, executors=executors,
                        options=fulmen.JitOptions(cuda_graphs=WHOLE_STEP[name]))
    return lambda optimizer, x, y: jitted(model, optimizer, x, y)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Kernel families of a step's GPU time, by kernel name: the first family with a matching fragment wins.
KERNEL_FAMILIES = (
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("matmul", ("triton_tem_",)),  # Inductor's Triton matmul templates, with any epilogue fused into them
    ("triton", ("triton",)),
    ("adam", ("adam", "multi_tensor_apply")),  # fused AdamW, and the foreach kernels of torch.optim.Adam
    ("matmul", ("gemm", "cutlass", "cublas", "nvjet", "xmma", "wgmma", "matmul", "splitk")),
    ("communication", ("nccl",)),
)


def kernel_family(name: str) -> str:
    lowered = name.lower()
    for family, fragments in KERNEL_FAMILIES:
        if any(fragment in lowered for fragment in fragments):
            return family
    return "other"


def profile_steps(step: Callable[[], Any], steps: int, fence: Callable[[], None]) -> dict:
    """GPU time per step of each kernel family and of the largest kernels, from torch.profiler over `steps` steps."""
    fence()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            step()
        fence()
    families = {family: 0.0 for family, _ in KERNEL_FAMILIES} | {"other": 0.0}
    kernels: dict[str, list[float]] = {}  # name -> [ms per step, launches per step]
    launches = 0
    for event in profiler.events():
        if event.device_type != DeviceType.CUDA:
            continue
        ms = event.time_range.elapsed_us() / 1e3 / steps  # a kernel (or copy) on the device
        families[kernel_family(event.name)] += ms
        totals = kernels.setdefault(event.name, [0.0, 0.0])
        totals[0] += ms
        totals[1] += 1 / steps
        launches += 1
    top = sorted(kernels.items(), key=lambda item: -item[1][0])[:40]
    return {"gpu_ms_per_step_by_family": families, "gpu_ms_per_step": sum(families.values()),
            "kernels_per_step": launches / steps,
            "top_kernels": [{"name": name, "ms_per_step": ms, "launches_per_step": count}
                            for name, (ms, count) in top],
            **gpu_idle(profiler, steps), "top_ops": top_ops(step, fence)}


def gpu_idle(profiler: torch.profiler.profile, steps: int) -> dict:
    """How much of the profiled steps' span the GPU ran no kernel: the host's work it waited for (launches, guards,
    Python between kernels), per step."""
    spans = sorted((event.time_range.start, event.time_range.end) for event in profiler.events()
                   if event.device_type == DeviceType.CUDA)
    if not spans:
        return {}
    busy, (start, end) = 0, spans[0]
    first = start
    for begin, finish in spans[1:]:
        if begin > end:
            busy, start = busy + end - start, begin
        end = max(end, finish)
    busy += end - start
    return {"gpu_span_ms_per_step": (end - first) / 1e3 / steps,
            "gpu_idle_ms_per_step": (end - first - busy) / 1e3 / steps}


def top_ops(step: Callable[[], Any], fence: Callable[[], None], count: int = 30) -> list[dict]:
    """One more step profiled with its host calls: the torch ops (with their input shapes) whose kernels take the
    most GPU time, so a kernel family's time can be traced to the calls that launch it."""
    fence()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                record_shapes=True) as profiler:
        step()
        fence()
    averages = profiler.key_averages(group_by_input_shape=True)
    rows = sorted(averages, key=lambda a: -a.self_device_time_total)[:count]
    return [{"op": a.key, "shapes": str(a.input_shapes)[:160], "calls": a.count,
             "self_device_ms": a.self_device_time_total / 1e3} for a in rows]


def make_optimizer(params: list[torch.Tensor], name: str = "adamw") -> torch.optim.Optimizer:
    """AdamW, fused on CUDA and foreach on CPU; or the seed-002 notebook's `torch.optim.Adam` with its defaults."""
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4)
    if params[0].device.type == "cuda":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def time_steps(loss_fn: Callable, params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor,
               args: argparse.Namespace, fence: Callable[[], None],
               backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
               whole_step: Callable | None = None) -> dict:
    """`make_optimizer(params, args.optimizer)`: one first step, `args.warmup` untimed steps, then `args.iters` steps
    each timed between two `fence()` calls (synchronised every step: the host's work before the first kernel counts),
    then `args.iters` steps free-running between one pair of fences, then (on CUDA) `args.profile_steps` profiled
    steps. `backward`:
    `fabric.backward` for Fabric's rows. `whole_step(optimizer, x, y)`, for the whole-step rows, runs all of a step
    (then the parameters the first step updated are those with optimizer state)."""
    optimizer = make_optimizer(params, getattr(args, "optimizer", "adamw"))

    def step(count_grads: bool = False) -> tuple[torch.Tensor, int]:
        if whole_step is not None:
            loss = whole_step(optimizer, x, y)
            return loss.detach(), len(optimizer.state) if count_grads else 0
        loss = loss_fn(x, y)
        backward(loss)
        with_grad = sum(p.grad is not None for p in params) if count_grads else 0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach(), with_grad

    fence()
    start = time.perf_counter()
    first_loss, with_grad = step(count_grads=True)
    fence()
    first_step_s = time.perf_counter() - start
    first_loss = first_loss.item()  # now: a compiler replaying CUDA graphs overwrites it with the next step
    for _ in range(args.warmup):
        step()
    iter_ms = []
    loss = None
    for _ in range(args.iters):
        fence()
        start = time.perf_counter()
        loss, _ = step()
        fence()
        iter_ms.append((time.perf_counter() - start) * 1e3)
    # the same steps free-running: the host queues step after step, one fence at the end, as a training loop does
    fence()
    start = time.perf_counter()
    for _ in range(args.iters):
        loss, _ = step()
    fence()
    free_ms = (time.perf_counter() - start) * 1e3 / max(args.iters, 1)
    timed = {"iter_ms": iter_ms, "free_running_ms_per_iter": free_ms, "first_step_s": first_step_s,
             "first_loss": first_loss, "final_loss": loss.item(), "params_with_grad": [with_grad, len(params)]}
    if params[0].device.type == "cuda" and getattr(args, "profile_steps", 0):
        timed["profile"] = profile_steps(step, args.profile_steps, fence)
    return timed


def run_compiler(name: str, mode: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """Builds a fresh model and optimizer, runs 1 + warmup + iters steps and returns the measurements."""
    # what an earlier compiler left allocated (should be ~0) is counted in this one's peak
    allocated_before_gb = torch.cuda.memory_allocated(device) / 1e9 if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(args, device, dtype)
    flops_per_step = training_flops(model, args)
    n_params = sum(p.numel() for p in model.parameters())
    params = list(model.parameters())
    x, y = make_batch(args, model.config, device)
    if name in WHOLE_STEP:
        loss_fn, whole_step = None, make_whole_step(name, model, args.executors)
    else:
        loss_fn, whole_step = make_loss_fn(name, mode, model, args.executors), None
    timed = time_steps(loss_fn, params, x, y, args, lambda: sync(device), whole_step=whole_step)
    iter_ms = timed["iter_ms"]
    median_s = statistics.median(iter_ms) / 1e3
    peak = peak_flops(device, dtype)
    result = {
        "status": "ok",
        "mode": mode,
        "ms_per_iter": median_s * 1e3,
        "ms_per_iter_min": min(iter_ms),
        "ms_per_iter_mean": statistics.fmean(iter_ms),
        "free_running_ms_per_iter": timed["free_running_ms_per_iter"],
        "iter_ms": iter_ms,
        "first_step_s": timed["first_step_s"],
        "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        # CUDA graphs' pools hold memory the allocator counts as reserved, not allocated, between replays
        "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9 if device.type == "cuda" else None,
        "allocated_before_gb": allocated_before_gb,
        "tokens_per_s": args.micro_batch_size * args.seq_len / median_s,
        "mfu": flops_per_step / (median_s * peak) if peak else None,
        "flops_per_step": flops_per_step,
        "n_params": n_params,
        "first_loss": timed["first_loss"],
        "final_loss": timed["final_loss"],
        "params_with_grad": timed["params_with_grad"],
        **timed.get("profile", {}),
    }
    with_grad = timed["params_with_grad"][0]
    if with_grad != len(params):
        result["warning"] = f"only {with_grad} of {len(params)} parameters received a gradient"
    return result


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def cleanup(name: str, device: torch.device) -> None:
    if name.startswith("torch.compile"):
        torch._dynamo.reset()  # its caches hold on to the graphs compiled for this model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def benchmark(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """One compiler's result: "ok" with the measurements, or "error" with the error of every mode tried."""
    errors: dict[str, str] = {}
    for mode in ("function",) if name == "eager" else ("function", "module"):
        oom = False
        try:
            with fresh_cache():  # cold: no Triton build or Inductor kernel of an earlier row reused
                result = run_compiler(name, mode, args, device, dtype)
        except Exception as error:  # noqa: BLE001 - recorded, the next compiler still runs
            errors[mode] = f"{type(error).__name__}: {error}"
            oom = is_oom(error)
            result = None
        finally:
            cleanup(name, device)
        if result is not None:
            if errors:
                result["function_mode_error"] = errors["function"]
            return result
        if oom:  # the module alone would not fit either
            return {"status": "oom", "error": errors[mode], "errors": errors}
    return {"status": "error", "error": errors["function"], "errors": errors}


def warm_up_inductor(device: torch.device) -> None:
    """One small Inductor compile and call, in a cache of its own: what a process pays once (Inductor's imports, its
    Triton compile workers' start), so that no row's first step carries it."""
    with fresh_cache():
        torch.compile(lambda x: (x.sin() * 2).sum(-1))(torch.randn(8, 8, device=device))
    torch._dynamo.reset()


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_rows(header: str, results: dict[str, dict], width: int, row: Callable[[str, dict], str]) -> None:
    """A table: `header`, then a line per result, its name in `width` columns, then `row(name, result)` or why it
    did not run."""
    print(header)
    for name, r in results.items():
        cells = row(name, r) if r["status"] == "ok" else f"{r['status']}: {r.get('error') or r.get('reason')}"
        print(f"{name:{width}}{cells}")


def print_table(results: dict[str, dict], ratios: dict[str, dict]) -> None:
    header = (f"{'compiler':25}{'ms/iter':>10}{'x eager':>9}{'free ms':>9}{'x eager':>9}{'peak GB':>9}"
              f"{'1st step s':>12}{'tokens/s':>11}")
    print_rows(header + f"{'MFU':>7}{'final loss':>12}  mode", results, 25, lambda name, r: (
        f"{r['ms_per_iter']:10.2f}{fmt(ratios.get(name, {}).get('ms_per_iter'), '.3f'):>9}"
        f"{fmt(r.get('free_running_ms_per_iter'), '.2f'):>9}"
        f"{fmt(ratios.get(name, {}).get('free_running_ms_per_iter'), '.3f'):>9}{fmt(r['peak_gb'], '.2f'):>9}"
        f"{r['first_step_s']:12.2f}{r['tokens_per_s']:11.0f}{fmt(r['mfu'], '.1%'):>7}{r['final_loss']:12.5f}"
        f"  {r['mode']}" + (f"  WARNING: {r['warning']}" if "warning" in r else "")))
    profiled = {name: r for name, r in results.items() if "gpu_ms_per_step_by_family" in r}
    if profiled:
        families = list(next(iter(profiled.values()))["gpu_ms_per_step_by_family"])
        print(f"\n{'GPU ms per step':25}{'reserved GB':>12}{'kernels':>9}{'total':>8}"
              + "".join(f"{family:>14}" for family in families))
        for name, r in profiled.items():
            by_family = r["gpu_ms_per_step_by_family"]
            print(f"{name:25}{fmt(r['peak_reserved_gb'], '.2f'):>12}{r['kernels_per_step']:9.0f}"
                  f"{r['gpu_ms_per_step']:8.2f}" + "".join(f"{by_family[family]:14.2f}" for family in families))


def ratios_to(results: dict[str, dict], baseline: str) -> dict[str, dict]:
    """Each row's ms/iter and peak memory over the `baseline` row's (empty when the baseline did not run)."""
    base = results.get(baseline, {})
    if base.get("status") != "ok":
        return {}
    ratios = {}
    for name, r in results.items():
        if r["status"] == "ok":
            ratios[name] = {
                "ms_per_iter": r["ms_per_iter"] / base["ms_per_iter"],
                "free_running_ms_per_iter": (r["free_running_ms_per_iter"] / base["free_running_ms_per_iter"]
                                             if "free_running_ms_per_iter" in r and "free_running_ms_per_iter" in base
                                             else None),
                "peak_gb": r["peak_gb"] / base["peak_gb"] if r["peak_gb"] and base["peak_gb"] else None,
            }
    return ratios


def git_revision() -> str | None:
    try:
        git = lambda *argv: subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True)
        rev, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", "fulmen")
    except OSError:
        return None
    if rev.returncode != 0:
        return None
    return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def write_report(report: dict, path: str | Path) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")  # a kill mid-write leaves the last whole report in place
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(out)
    print(f"wrote {out}")


def make_parser(description: str | None, choices: tuple[str, ...], out: str,
                defaults: tuple[str, ...] | None = None) -> argparse.ArgumentParser:
    """The arguments this script and fsdp_step.py share; `choices`: the compilers (rows) to pick from, `defaults`
    the rows run when none are named (all choices when None)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name", default="tiny-llama-1.1b", help=f"a LitGPT config name, or {LLMC_GPT2}")
    parser.add_argument("--micro_batch_size", type=int, default=4, help="sequences per process")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    parser.add_argument("--iters", type=int, default=10, help="timed steps (the median is reported)")
    parser.add_argument("--compilers", default=",".join(defaults or choices),
                        help=f"comma list from {','.join(choices)}")
    parser.add_argument("--executors", default=None, help="comma list passed as fulmen.jit(..., executors=[...])")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--n_layer", type=int, default=None, help="override the config's n_layer (smoke tests)")
    parser.add_argument("--seed", type=int, default=42, help="the weights' seed (the same in every process)")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "adam"))
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=False,
                        help="TF32 matmuls for fp32 (off by default, as in the seed-002 regime)")
    parser.add_argument("--profile_steps", type=int, default=3, help="steps profiled on CUDA (0: none)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="a named regime; its settings are the defaults the other flags override")
    parser.add_argument("--out", default=out)
    return parser


def parse_common(parser: argparse.ArgumentParser, argv: list[str] | None,
                 choices: tuple[str, ...]) -> argparse.Namespace:
    """Parses and checks the shared arguments (comma lists become lists; a preset's settings become defaults)."""
    preset = parser.parse_known_args(argv)[0].preset
    if preset is not None:
        parser.set_defaults(**PRESETS[preset])
    args = parser.parse_args(argv)
    args.compilers = [c.strip() for c in args.compilers.split(",") if c.strip()]
    unknown = sorted(set(args.compilers) - set(choices))
    if unknown:
        parser.error(f"unknown compilers {unknown}; choose from {list(choices)}")
    if args.executors is not None:
        args.executors = [e.strip() for e in args.executors.split(",") if e.strip()]
    if args.iters < 1:
        parser.error("--iters must be at least 1")
    return args


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser(__doc__, COMPILERS, "benchmarks/step.json", DEFAULT_COMPILERS)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every compiler this many times, in the given order then reversed, alternately")
    args = parse_common(parser, argv, COMPILERS)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def merge_rounds(runs: list[dict]) -> dict:
    """One compiler's result over its rounds: the median over every timed step of every round, the highest peak,
    the mean GPU time per kernel family; the first step and the largest kernels of the first round (later rounds
    find compilers' caches warm); each round's own figures under `rounds`."""
    failed = [r for r in runs if r["status"] != "ok"]
    if failed or len(runs) == 1:
        return failed[0] if failed else runs[0]
    first = runs[0]
    iter_ms = [ms for r in runs for ms in r["iter_ms"]]
    median = statistics.median(iter_ms)
    merged = {**first, "iter_ms": iter_ms, "ms_per_iter": median, "ms_per_iter_min": min(iter_ms),
              "ms_per_iter_mean": statistics.fmean(iter_ms),
              "tokens_per_s": first["tokens_per_s"] * first["ms_per_iter"] / median,
              "mfu": first["mfu"] * first["ms_per_iter"] / median if first["mfu"] is not None else None,
              "peak_gb": max(r["peak_gb"] for r in runs) if first["peak_gb"] is not None else None,
              "rounds": [{key: r.get(key) for key in ("position", "ms_per_iter", "peak_gb", "first_step_s",
                                                      "gpu_ms_per_step", "gpu_ms_per_step_by_family")} for r in runs]}
    if "gpu_ms_per_step_by_family" in first:
        merged["gpu_ms_per_step_by_family"] = {
            family: statistics.fmean(r["gpu_ms_per_step_by_family"][family] for r in runs)
            for family in first["gpu_ms_per_step_by_family"]}
        merged["gpu_ms_per_step"] = statistics.fmean(r["gpu_ms_per_step"] for r in runs)
    return merged


def set_tf32(enabled: bool) -> None:
    # matmuls only: these models have no convolution (cuDNN's TF32 flag is left as it is)
    torch.backends.cuda.matmul.allow_tf32 = enabled


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    set_tf32(args.tf32)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    thunder_version, thunder_error = None, None
    if "thunder" in args.compilers:
        try:
            import thunder  # optional

            thunder_version = getattr(thunder, "__version__", None) or version("lightning-thunder")
        except Exception as error:  # noqa: BLE001 - Thunder is optional and often fails to import
            thunder_error = f"import thunder failed: {type(error).__name__}: {error}"

    def report() -> dict:  # written after every row, so a run cut short keeps the rows it finished
        results = {name: merge_rounds(rs) for name, rs in runs.items() if rs}
        return {
            "benchmark": f"training step of {args.model_name}: forward, cross-entropy, backward, {args.optimizer} step",
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "fulmen": version("fulmen"),
            "fulmen_git": git_revision(),
            "thunder": thunder_version,
            "litgpt": version("litgpt"),
            "args": vars(args),
            "tokens_per_step": args.micro_batch_size * args.seq_len,
            "peak_flops": peak_flops(device, dtype),
            "results": results,
            "ratios_vs_eager": ratios_to(results, "eager"),
            "ratios_vs_torch_compile": ratios_to(results, "torch.compile"),
        }

    # Later rows run on a warmer GPU (on an H200, a row's matmuls take about 1% longer per position), so with
    # `--rounds` each row also runs at the other end of the order.
    runs: dict[str, list[dict]] = {name: [] for name in args.compilers}
    warm_up_inductor(device)
    for round_ in range(args.rounds):
        order = args.compilers if round_ % 2 == 0 else args.compilers[::-1]
        for position, name in enumerate(order):
            if name == "thunder" and thunder_error is not None:
                runs[name].append({"status": "skipped", "reason": thunder_error})
                print(f"{name}: skipped ({thunder_error})", flush=True)
            else:
                print(f"{name}: running", flush=True)
                r = benchmark(name, args, device, dtype) | {"position": position}
                runs[name].append(r)
                print(f"{name}: {r['status']}" + (f" ({r['error']})" if "error" in r else ""), flush=True)
            write_report(report(), args.out)
    final = report()
    print_table(final["results"], final["ratios_vs_eager"])
    return final


if __name__ == "__main__":
    main()
