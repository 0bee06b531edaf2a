"""A LitGPT training step data-parallel over several processes: torch's FSDP2 vs fulmen.distributed (vs Thunder).

    python benchmarks/fsdp_step.py [--devices 2] [--model_name tiny-llama-1.1b] [--micro_batch_size 4]
        [--seq_len 2048] [--compilers fsdp2,fsdp2+torch.compile,fulmen-fsdp,...] [--out benchmarks/fsdp_step.json]

The script launches its own ranks with `torch.multiprocessing.spawn`: `--devices` processes, one per GPU (rank r on
cuda:r, NCCL) or all on the CPU with `--device cpu` (gloo). Every rank trains on its own random batch of
`--micro_batch_size` sequences of `--seq_len` tokens (token ids from a generator seeded with 1234 + rank, the same
batch every step). The rows run in turn in the same processes:

    fsdp2                 torch's FSDP2: `fully_shard` on every block of `model.transformer.h`, then on the root; eager
    fsdp2+torch.compile   the same, with `torch.compile(forward_and_loss)`
    fulmen-fsdp           `fulmen.distributed.fsdp(model, device=device, sharding_strategy="ZERO3",
                          bucketing_strategy="BLOCK")` then `fulmen.jit(forward_and_loss)`
    fulmen-fsdp-zero2     the same with sharding_strategy="ZERO2"
    fulmen-ddp            `fulmen.distributed.ddp(model)` then `fulmen.jit(forward_and_loss)`
    thunder-fsdp          `thunder.distributed.fsdp(thunder.jit(model), ZERO3, BLOCK)`: Thunder's FSDP transforms a
                          jitted module, so the loss is eager here ("mode": "module"); "unavailable" when thunder
                          does not import
    fabric-fsdp           Lightning Fabric's own FSDPStrategy (torch FSDP1, FULL_SHARD, each LitGPT Block wrapped),
                          precision "bf16-true", the model made under `fabric.init_module(empty_init=True)`; eager.
                          Its rows warn that some parameters got no gradient: with FSDP1's `use_orig_params`, a
                          rank's view of a parameter it holds no piece of is empty and keeps `.grad` None
    fabric-ThunderFSDPStrategy  the same Fabric program with `fulmen.strategies.ThunderFSDPStrategy(ZERO3, BLOCK,
                          jit=False)` and `fulmen.jit(forward_and_loss)`, as a pretraining script writes it
    fabric-ThunderDDPStrategy   the same with `ThunderDDPStrategy(jit=False)` (the model made on the device)

What is compiled and how the optimizer steps follow step.py (whose helpers this script imports): the compiled
function is `forward_and_loss(model, x, y)` (but for Thunder, above), the weights are bf16-true, the optimizer is
AdamW (fused on CUDA, foreach on CPU), created after the model is sharded, so for the FSDP rows it holds each rank's
shards only.

Model creation: the FSDP rows build the model on the meta device and let the sharding materialise it, so no rank
ever holds the whole model: FSDP2 with `to_empty` and then `reset_parameters` (see `init_fsdp2` for why it runs on
full tensors), fulmen and Thunder with their own `device=` materialisation. The DDP row builds the model on the
device. All seed `--seed` first, so every rank and every row starts from the same weights, and the losses the rows
report should agree.

Measured per row (rank 0 gathers the ranks' figures): the wall time of the first step (compilation included), then
`--warmup` untimed steps, then `--iters` steps, each between a device synchronize plus barrier on either side; the
median over those steps of the slowest rank's time; the peak allocated CUDA memory over the row (model, optimizer
state and steps), the largest of the ranks; tokens/s = devices * micro_batch_size * seq_len / median; MFU = the FLOPs
one GPU runs per step (LitGPT's `estimate_flops` of the whole model times micro_batch_size, as step.py) / (median
seconds * the GPU's dense bf16 peak); the loss of the last step, averaged over ranks. Ratios are against the fsdp2
row. A failing row (an exception or an OOM on any rank) is recorded with its error and the next one runs; a rank
that dies or hangs (the process group times out after `--timeout_s`) ends the run, and the rows not finished by
then are recorded as errors.

CPU smoke test:

    python benchmarks/fsdp_step.py --device cpu --dtype fp32 --model_name pythia-14m --n_layer 1 --seq_len 32 \\
        --micro_batch_size 2 --iters 2 --warmup 1 --compilers fsdp2,fulmen-fsdp,fulmen-ddp --devices 2 \\
        --out /tmp/fsdp_step.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from litgpt.utils import estimate_flops
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

BENCHMARKS = Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:  # step.py sits beside this file; the spawned ranks import this one by name
    sys.path.insert(0, str(BENCHMARKS))
import step  # noqa: E402

fulmen = step.fulmen
ROWS = ("fsdp2", "fsdp2+torch.compile", "fulmen-fsdp", "fulmen-fsdp-zero2", "fulmen-ddp", "thunder-fsdp",
        "fabric-fsdp", "fabric-ThunderFSDPStrategy", "fabric-ThunderDDPStrategy")
FABRIC_ROWS = ROWS[-3:]
COMPILER = {  # which of step.py's compilers each row jits `forward_and_loss` with
    "fsdp2": "eager",
    "fsdp2+torch.compile": "torch.compile",
    "fulmen-fsdp": "fulmen",
    "fulmen-fsdp-zero2": "fulmen",
    "fulmen-ddp": "fulmen",
    "thunder-fsdp": "thunder",
    "fabric-fsdp": "eager",
    "fabric-ThunderFSDPStrategy": "fulmen",
    "fabric-ThunderDDPStrategy": "fulmen",
}
BASELINE = "fsdp2"
BATCH_SEED = 1234  # rank r trains on the batch drawn from seed BATCH_SEED + r


def cast_buffers(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Floating-point buffers to `dtype` (LitGPT's `reset_parameters` rebuilds the RoPE cache in fp32)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(dtype)


@torch.no_grad()
def init_fsdp2(model: torch.nn.Module, device: torch.device) -> None:
    """Initialises an FSDP2 model after `to_empty`: every module's `reset_parameters` runs on full tensors and each
    rank keeps its shard of the result.

    Module by module, in `modules()` order, as `fulmen.distributed.fsdp` materialises, so both draw the same
    numbers as a model built on one device. Calling `reset_parameters` on the sharded DTensors themselves (the
    recipe of torch's docs) draws other numbers: on CPU each rank fills its shard from its own generator.
    """
    for module in model.modules():
        own = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
        if not own or not hasattr(module, "reset_parameters"):
            continue
        sharded = {name: p for name, p in module._parameters.items() if p is not None}
        full = {name: torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device))
                for name, p in sharded.items()}
        module._parameters.update(full)
        try:
            module.reset_parameters()
        finally:
            module._parameters.update(sharded)
        for name, param in sharded.items():
            if isinstance(param, DTensor):
                shard = distribute_tensor(full[name].detach(), param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(shard.to_local())
            else:
                param.copy_(full[name])


def build_distributed_model(name: str, args: argparse.Namespace, device: torch.device,
                            dtype: torch.dtype) -> torch.nn.Module:
    """The row's model: sharded (materialised from the meta device) or replicated, in `dtype`."""
    if name == "fulmen-ddp":
        return fulmen.distributed.ddp(step.build_model(args, device, dtype))
    model = step.build_model(args, torch.device("meta"), dtype)
    torch.manual_seed(args.seed)  # the materialisation draws the weights
    with step.default_dtype(dtype):
        if name in ("fsdp2", "fsdp2+torch.compile"):
            for block in model.transformer.h:
                fully_shard(block)
            fully_shard(model)
            model.to_empty(device=device)
            init_fsdp2(model, device)
        elif name in ("fulmen-fsdp", "fulmen-fsdp-zero2"):
            strategy = "ZERO2" if name == "fulmen-fsdp-zero2" else "ZERO3"
            model = fulmen.distributed.fsdp(model, device=device, sharding_strategy=strategy,
                                            bucketing_strategy="BLOCK")
        else:
            raise ValueError(f"unknown row {name!r}")
    cast_buffers(model, dtype)
    return model


def thunder_fsdp_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Thunder's FSDP is a transform of a jitted module (`thunder.distributed.fsdp` takes a `ThunderModule`), so
    this row compiles the module, not `forward_and_loss`; the transform materialises the meta model."""
    import thunder
    from thunder.distributed import FSDPBucketingStrategy, FSDPType
    from thunder.distributed import fsdp as thunder_fsdp

    model = step.build_model(args, torch.device("meta"), dtype)
    torch.manual_seed(args.seed)
    with step.default_dtype(dtype):
        return thunder_fsdp(thunder.jit(model), device=device, sharding_strategy=FSDPType.ZERO3,
                            bucketing_strategy=FSDPBucketingStrategy.BLOCK)


def fence(device: torch.device) -> None:
    """Every rank has finished its queued work."""
    step.sync(device)
    dist.barrier()
    step.sync(device)


def fabric_model(name: str, args: argparse.Namespace, device: torch.device,
                 dtype: torch.dtype) -> tuple[torch.nn.Module, Callable[[torch.Tensor], None]]:
    """The model set up by `L.Fabric` with the row's strategy, on the ranks this script started (torchrun's
    environment, so Fabric joins the existing process group instead of launching processes)."""
    import lightning as L
    from lightning.fabric.strategies import FSDPStrategy
    from litgpt.model import Block

    from fulmen.strategies import ThunderDDPStrategy, ThunderFSDPStrategy

    strategies = {
        "fabric-fsdp": lambda: FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD"),
        "fabric-ThunderFSDPStrategy": lambda: ThunderFSDPStrategy(sharding_strategy="ZERO3",
                                                                  bucketing_strategy="BLOCK", jit=False),
        "fabric-ThunderDDPStrategy": lambda: ThunderDDPStrategy(jit=False),
    }
    precision = {torch.bfloat16: "bf16-true", torch.float32: "32-true"}[dtype]
    fabric = L.Fabric(accelerator=device.type, devices=args.devices, strategy=strategies[name](),
                      precision=precision)
    fabric.launch()
    torch.manual_seed(args.seed)
    with fabric.init_module(empty_init=name != "fabric-ThunderDDPStrategy"):
        model = step.build_model(args, fabric.device if name == "fabric-ThunderDDPStrategy" else
                                 torch.device("meta"), dtype)
    torch.manual_seed(args.seed)  # the materialisation draws the weights
    model = fabric.setup_module(model)
    cast_buffers(model, dtype)
    return model, fabric.backward


def measure(name: str, args: argparse.Namespace, rank: int, device: torch.device, dtype: torch.dtype) -> dict:
    """This rank's figures for one row: a fresh model and optimizer, then 1 + warmup + iters steps."""
    config = step.build_model(args, torch.device("meta"), dtype).config
    backward = torch.Tensor.backward
    if name in FABRIC_ROWS:
        (model, backward), mode = fabric_model(name, args, device, dtype), "function"
        loss_fn = step.make_loss_fn(COMPILER[name], "function", model, args.executors)
    elif name == "thunder-fsdp":
        model, mode = thunder_fsdp_model(args, device, dtype), "module"
        loss_fn = step.make_loss_fn("eager", "function", model, None)  # the loss on the jitted module's logits
    else:
        model, mode = build_distributed_model(name, args, device, dtype), "function"
        loss_fn = step.make_loss_fn(COMPILER[name], "function", model, args.executors)
    batch_args = argparse.Namespace(**{**vars(args), "seed": BATCH_SEED + rank})
    x, y = step.make_batch(batch_args, config, device)
    timed = step.time_steps(loss_fn, list(model.parameters()), x, y, args, lambda: fence(device), backward)
    return {
        "status": "ok",
        "mode": mode,
        **timed,
        "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
    }


def merge(gathered: list[dict], args: argparse.Namespace, flops_per_step: int, peak: float | None) -> dict:
    """One row's result from every rank's figures."""
    failed = {rank: r for rank, r in enumerate(gathered) if r["status"] != "ok"}
    if failed:
        rank, first = next(iter(failed.items()))
        return {"status": first["status"], "error": f"rank {rank}: {first['error']}",
                "errors": {str(rank): r["error"] for rank, r in failed.items()}}
    iter_ms = [max(per_rank) for per_rank in zip(*(r["iter_ms"] for r in gathered))]  # the slowest rank's
    median_s = statistics.median(iter_ms) / 1e3
    peaks = [r["peak_gb"] for r in gathered]
    losses = [r["final_loss"] for r in gathered]
    result = {
        "status": "ok",
        "mode": gathered[0]["mode"],
        "ms_per_iter": median_s * 1e3,
        "ms_per_iter_min": min(iter_ms),
        "ms_per_iter_mean": statistics.fmean(iter_ms),
        "iter_ms": iter_ms,
        "first_step_s": max(r["first_step_s"] for r in gathered),
        "peak_gb": max(peaks) if peaks[0] is not None else None,
        "peak_gb_per_rank": peaks if peaks[0] is not None else None,
        "allocated_before_gb": max(r["allocated_before_gb"] for r in gathered) if peaks[0] is not None else None,
        "tokens_per_s": len(gathered) * args.micro_batch_size * args.seq_len / median_s,
        "mfu": flops_per_step / (median_s * peak) if peak else None,
        "first_loss": statistics.fmean(r["first_loss"] for r in gathered),
        "final_loss": statistics.fmean(losses),
        "final_loss_per_rank": losses,
        "params_with_grad": gathered[0]["params_with_grad"],  # of this rank's parameters (shards for FSDP)
    }
    incomplete = [rank for rank, r in enumerate(gathered) if r["params_with_grad"][0] != r["params_with_grad"][1]]
    if incomplete:
        result["warning"] = f"some parameters received no gradient on ranks {incomplete}"
    return result


def run_row(name: str, args: argparse.Namespace, rank: int, device: torch.device, dtype: torch.dtype,
            flops_per_step: int) -> dict:
    """Runs one row on every rank; all ranks return the merged result."""
    step.cleanup(COMPILER[name], device)  # resets the peak memory stats too
    allocated_before_gb = torch.cuda.memory_allocated(device) / 1e9 if device.type == "cuda" else None
    try:
        local = measure(name, args, rank, device, dtype)
    except Exception as error:  # noqa: BLE001 - recorded, the next row still runs
        local = {"status": "oom" if step.is_oom(error) else "error", "error": f"{type(error).__name__}: {error}"}
    local["allocated_before_gb"] = allocated_before_gb
    step.cleanup(COMPILER[name], device)  # measure's model, optimizer and compiled function are gone by now
    gathered: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    dist.barrier()
    return merge(gathered, args, flops_per_step, step.peak_flops(device, dtype))


def _worker(rank: int, args: argparse.Namespace, rows: list[str], port: int, results_path: str) -> None:
    """One rank: runs every row; rank 0 writes the results after each."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    # torchrun's variables: the Fabric rows find a TorchElasticEnvironment and join this process group
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.devices), GROUP_RANK="0",
                      LOCAL_WORLD_SIZE=str(args.devices), TORCHELASTIC_RUN_ID="fsdp_step")
    if args.device == "cpu":
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if device.type == "cpu" else "nccl", rank=rank, world_size=args.devices,
                            timeout=datetime.timedelta(seconds=args.timeout_s),
                            device_id=device if device.type == "cuda" else None)
    try:
        dtype = step.DTYPES[args.dtype]
        flops_per_step = estimate_flops(step.build_model(args, torch.device("meta"), dtype), training=True)
        flops_per_step *= args.micro_batch_size
        results: dict[str, dict] = {}
        for name in rows:
            if rank == 0:
                print(f"{name}: running", flush=True)
            results[name] = run_row(name, args, rank, device, dtype, flops_per_step)
            if rank == 0:
                r = results[name]
                print(f"{name}: {r['status']}" + (f" ({r['error']})" if "error" in r else ""), flush=True)
                Path(results_path).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def print_table(results: dict[str, dict], ratios: dict[str, dict]) -> None:
    print(f"| row | ms/iter | x {BASELINE} | peak GB/GPU | 1st step s | tokens/s | MFU | final loss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        if r["status"] != "ok":
            why = str(r.get("error") or r.get("reason")).splitlines()[0][:200].replace("|", "\\|")
            print(f"| {name} | {r['status']}: {why} |||||||")
            continue
        ratio = ratios.get(name, {}).get("ms_per_iter")
        warning = f" (WARNING: {r['warning']})" if "warning" in r else ""
        fmt = step.fmt
        print(f"| {name}{warning} | {r['ms_per_iter']:.2f} | {fmt(ratio, '.3f')} | {fmt(r['peak_gb'], '.2f')} "
              f"| {r['first_step_s']:.2f} | {r['tokens_per_s']:.0f} | {fmt(r['mfu'], '.1%')} | {r['final_loss']:.5f} |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = step.make_parser(__doc__, ROWS, "benchmarks/fsdp_step.json")
    parser.add_argument("--devices", type=int, default=2, help="processes (ranks), one per GPU")
    parser.add_argument("--timeout_s", type=int, default=900, help="the process group's collective timeout")
    args = step.parse_common(parser, argv, ROWS)
    if args.devices < 1:
        parser.error("--devices must be at least 1")
    if args.device == "cuda" and torch.cuda.device_count() < args.devices:
        parser.error(f"--devices {args.devices} but {torch.cuda.device_count()} CUDA devices are visible")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    dtype = step.DTYPES[args.dtype]
    results: dict[str, dict] = {}
    thunder_version = None
    if "thunder-fsdp" in args.compilers:
        try:
            import thunder  # optional

            thunder_version = getattr(thunder, "__version__", None) or step.version("lightning-thunder")
        except Exception as error:  # noqa: BLE001 - Thunder is optional and often fails to import
            results["thunder-fsdp"] = {"status": "unavailable", "reason": f"import thunder failed: "
                                       f"{type(error).__name__}: {error}"}
    rows = [name for name in args.compilers if name not in results]

    crash = None
    with tempfile.TemporaryDirectory() as tmp:
        results_path = Path(tmp) / "results.json"
        if rows:
            try:
                mp.spawn(_worker, args=(args, rows, free_port(), str(results_path)), nprocs=args.devices)
            except Exception as error:  # noqa: BLE001 - a rank died: the rows it finished are kept
                crash = f"{type(error).__name__}: {error}"
                print(f"a rank failed: {crash}", flush=True)
        done = json.loads(results_path.read_text()) if results_path.exists() else {}
    for name in rows:
        results[name] = done.get(name) or {"status": "error", "error": crash or "no result"}
    results = {name: results[name] for name in args.compilers}

    ratios: dict[str, dict] = {}
    base = results.get(BASELINE, {})
    if base.get("status") == "ok":
        for name, r in results.items():
            if r["status"] == "ok":
                ratios[name] = {
                    "ms_per_iter": r["ms_per_iter"] / base["ms_per_iter"],
                    "peak_gb": r["peak_gb"] / base["peak_gb"] if r["peak_gb"] and base["peak_gb"] else None,
                }
    print_table(results, ratios)
    cuda = args.device == "cuda"
    report = {
        "benchmark": "LitGPT training step, data parallel: forward, cross-entropy, backward, AdamW step",
        "device": args.device,
        "devices": args.devices,
        "backend": "nccl" if cuda else "gloo",
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "fulmen": step.version("fulmen"),
        "fulmen_git": step.git_revision(),
        "thunder": thunder_version,
        "litgpt": step.version("litgpt"),
        "args": vars(args),
        "tokens_per_step": args.devices * args.micro_batch_size * args.seq_len,
        "peak_flops": step.peak_flops(torch.device("cuda", 0), dtype) if cuda else None,
        "results": results,
        f"ratios_vs_{BASELINE}": ratios,
    }
    if crash is not None:
        report["crash"] = crash
    step.write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
