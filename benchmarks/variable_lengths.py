"""A training loop whose batches change length every step: one trace for every length (issue 48), side by side.

    python benchmarks/variable_lengths.py [--model_name tiny-llama-1.1b] [--micro_batch_size 4]
        [--lengths 384:2048:12] [--repeats 2]
        [--compilers eager,torch.compile,fulmen,fulmen-static,fulmen-serial-compile]
        [--out benchmarks/variable_lengths.json]

Every compiler trains a fresh model (the same seed, weights in the benchmark dtype, fused AdamW on CUDA) on the same
schedule: each of the lengths `--repeats` times, in one shuffled order (`--seed`), a batch of random tokens of that
length each step. Rows: `eager`; `torch.compile` (its automatic dynamic shapes: a dimension that changed is
recompiled symbolic); `fulmen` (`fulmen.jit`'s default, `JitOptions(dynamic=None)`: symbolic sizes once a length
changed); `fulmen-static` (`JitOptions(dynamic=False)`: one trace per length up to `cache_limit`, then eager, with
fulmen's warning: fulmen before symbolic sizes); `fulmen-serial-compile` (the default, its torchcompile regions
compiled one after another at their first calls: `TorchCompileExecutor(compile_workers=0)`, where `fulmen` compiles
them ahead in workers, fulmen.core.compile_ahead). Compiled is `forward_and_loss(model, x, y)` (benchmarks/step.py).
Every row compiles cold: in `torch._inductor.utils.fresh_cache()` (a new directory for Inductor's and Triton's
caches, Inductor's in-memory caches cleared), and fulmen's rows a torchcompile executor of their own (setting
TORCHINDUCTOR_CACHE_DIR alone leaves every later row the first one's Triton builds: Inductor fixes
TRITON_CACHE_DIR in the process's environment at its first kernel). Before the first row, one small Inductor
compile on the device pays what a process pays once (Inductor's imports, its Triton compile workers' start), so
that no row carries it.

Measured per compiler, every step synchronised on either side: the whole run's wall time (compilation included),
tokens/s over the whole run, each step's time by length (the first time a length is seen, then the later ones), the
median ms/step of the steps whose length was seen before ("warm"), then the schedule once more free-running (one
synchronize at the end: ms/step of a training loop), the peak allocated memory, the number of traces (fulmen's cache
misses; torch.compile's compiled frames) and of eager fallbacks, the seconds in Inductor's compiles (`inductor_s`,
`INDUCTOR_TIMERS`), and every step's loss (the compilers train on the same batches, so the losses agree to
rounding).

CPU smoke test:

    python benchmarks/variable_lengths.py --device cpu --dtype fp32 --model_name pythia-14m --n_layer 1 \\
        --micro_batch_size 2 --lengths 16:64:4 --compilers eager,fulmen,fulmen-static --out /tmp/vl.json
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch._inductor.utils import fresh_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step  # noqa: E402 - the shared measurement code (benchmarks/step.py)

import fulmen  # noqa: E402
from fulmen.executors.registry import get_default_executors  # noqa: E402
from fulmen.executors.torch_compile import TorchCompileExecutor  # noqa: E402

COMPILERS = ("eager", "torch.compile", "fulmen", "fulmen-static", "fulmen-serial-compile")


def lengths(spec: str) -> list[int]:
    """`low:high:count` -> `count` lengths from `low` to `high`, evenly spaced, each a multiple of 8."""
    low, high, count = (int(part) for part in spec.split(":"))
    if count < 2 or not 0 < low < high:
        raise argparse.ArgumentTypeError(f"--lengths {spec!r}: want low:high:count with 0 < low < high, count >= 2")
    return [8 * round((low + (high - low) * i / (count - 1)) / 8) for i in range(count)]


def schedule(args: argparse.Namespace) -> list[int]:
    """Each length `args.repeats` times, shuffled with `args.seed`: the same order for every compiler."""
    order = [length for length in args.lengths for _ in range(args.repeats)]
    random.Random(args.seed).shuffle(order)
    return order


def compiled_loss(name: str, executors: list[str] | None) -> Callable:
    if name == "eager":
        return step.forward_and_loss
    if name == "torch.compile":
        return torch.compile(step.forward_and_loss)
    options = fulmen.JitOptions(dynamic=False) if name == "fulmen-static" else fulmen.JitOptions()
    workers = 0 if name == "fulmen-serial-compile" else None
    chosen = [TorchCompileExecutor(name=f"torchcompile-{name}", compile_workers=workers)
              if getattr(e, "name", e) == "torchcompile" else e for e in (executors or get_default_executors())]
    return fulmen.jit(step.forward_and_loss, executors=chosen, options=options)


def traces(name: str, loss: Callable) -> int | None:
    if name.startswith("fulmen"):
        return fulmen.cache_misses(loss)
    if name == "torch.compile":
        return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return None


# Inductor's own timers (torch._dynamo.utils.compilation_time_metrics), seconds in this process: its compiles (for
# fulmen, of the torchcompile regions; for torch.compile, with AOTAutograd), their code generation, and the wait for
# the Triton / C++ builds its compile workers make. What a fulmen row's first steps take beyond them is fulmen's own
# tracing, autodiff and code generation. A region a compile_ahead worker compiled is a cache hit here.
INDUCTOR_TIMERS = {"compiles": "create_aot_dispatcher_function", "codegen": "GraphLowering.compile_to_module",
                   "waiting_for_builds": "async_compile.wait"}


def inductor_times() -> dict[str, float]:
    metrics = torch._dynamo.utils.compilation_time_metrics
    return {key: sum(metrics.get(timer, ())) for key, timer in INDUCTOR_TIMERS.items()}


def run(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if name == "torch.compile":
        torch._dynamo.utils.counters.clear()
    model = step.build_model(args, device, dtype)
    params = list(model.parameters())
    optimizer = step.make_optimizer(params)
    loss_fn = compiled_loss(name, args.executors)
    generator = torch.Generator().manual_seed(args.seed)
    order = schedule(args)
    batches = []
    for length in order:
        tokens = torch.randint(0, model.config.vocab_size, (args.micro_batch_size, length + 1), generator=generator)
        tokens = tokens.to(device)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    compile_times = inductor_times()
    seen: set[int] = set()
    per_length: dict[int, dict[str, list[float]]] = {}
    warm_ms, losses = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step.sync(device)
        run_start = time.perf_counter()
        for length, (x, y) in zip(order, batches):
            start = time.perf_counter()
            loss = train_step(x, y)
            step.sync(device)
            ms = (time.perf_counter() - start) * 1e3
            kind = "later" if length in seen else "first"
            per_length.setdefault(length, {"first": [], "later": []})[kind].append(ms)
            if kind == "later":
                warm_ms.append(ms)
            seen.add(length)
            losses.append(loss.item())
        whole_run_s = time.perf_counter() - run_start
        step.sync(device)
        start = time.perf_counter()
        for x, y in batches:
            train_step(x, y)
        step.sync(device)
        free_ms = (time.perf_counter() - start) * 1e3 / len(batches)
    fallbacks = sum("eager" in str(w.message).lower() and "fulmen" in str(w.message).lower() for w in caught)
    tokens = args.micro_batch_size * sum(order)
    return {
        "status": "ok",
        "whole_run_s": whole_run_s,
        "tokens_per_s_run": tokens / whole_run_s,
        "warm_ms_per_step": statistics.median(warm_ms) if warm_ms else None,
        "free_running_ms_per_step": free_ms,
        "per_length_ms": {str(length): per_length[length] for length in sorted(per_length)},
        "traces": traces(name, loss_fn),
        "inductor_s": {key: seconds - compile_times[key] for key, seconds in inductor_times().items()},
        "eager_fallback_warnings": fallbacks,
        "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        "losses": losses,
    }


def print_table(results: dict[str, dict]) -> None:
    print(f"{'compiler':<16}{'whole run s':>12}{'inductor s':>11}{'warm ms/step':>14}{'free ms/step':>14}"
          f"{'tokens/s':>11}{'traces':>8}{'peak GB':>9}")
    for name, r in results.items():
        if r["status"] != "ok":
            print(f"{name:<16} {r['status']}: {r['error'][:100]}")
            continue
        print(f"{name:<16}{r['whole_run_s']:>12.1f}{r['inductor_s']['compiles']:>11.1f}"
              f"{step.fmt(r['warm_ms_per_step'], '.1f'):>14}"
              f"{r['free_running_ms_per_step']:>14.1f}{r['tokens_per_s_run']:>11,.0f}{str(r['traces']):>8}"
              f"{step.fmt(r['peak_gb'], '.1f'):>9}")


def ratios(results: dict[str, dict]) -> dict[str, dict]:
    """fulmen's whole run and warm ms/step over torch.compile's and over fulmen-static's, where both ran."""
    out = {}
    for base in ("torch.compile", "fulmen-static"):
        b = results.get(base, {})
        if b.get("status") != "ok":
            continue
        for name, r in results.items():
            if name == base or r.get("status") != "ok":
                continue
            out.setdefault(name, {})[f"whole_run_vs_{base}"] = r["whole_run_s"] / b["whole_run_s"]
            if r["warm_ms_per_step"] and b["warm_ms_per_step"]:
                out[name][f"warm_ms_vs_{base}"] = r["warm_ms_per_step"] / b["warm_ms_per_step"]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name", default="tiny-llama-1.1b")
    parser.add_argument("--n_layer", type=int, default=None)
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--lengths", type=lengths, default=lengths("384:2048:12"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compilers", default=",".join(COMPILERS))
    parser.add_argument("--executors", default=None)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bf16", choices=sorted(step.DTYPES))
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", default="benchmarks/variable_lengths.json")
    args = parser.parse_args(argv)
    args.compilers = [c.strip() for c in args.compilers.split(",") if c.strip()]
    if unknown := sorted(set(args.compilers) - set(COMPILERS)):
        parser.error(f"unknown compilers {unknown}; choose from {list(COMPILERS)}")
    args.executors = args.executors.split(",") if args.executors else None
    args.seq_len = max(args.lengths)  # the model's max_seq_length (step.build_model)
    device, dtype = torch.device(args.device), step.DTYPES[args.dtype]
    report = {
        "benchmark": "variable_lengths",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "fulmen_revision": step.git_revision(), "model_name": args.model_name,
        "n_layer": args.n_layer, "micro_batch_size": args.micro_batch_size, "dtype": args.dtype,
        "lengths": args.lengths, "schedule": schedule(args), "results": {},
    }
    step.warm_up_inductor(device)
    for name in args.compilers:
        try:
            with fresh_cache():
                report["results"][name] = run(name, args, device, dtype)
        except Exception as error:  # noqa: BLE001 - recorded, the next compiler still runs
            report["results"][name] = {"status": "error", "error": f"{type(error).__name__}: {error}"}
        finally:
            step.cleanup(name, device)
        report["ratios"] = ratios(report["results"])
        step.write_report(report, args.out)  # after each compiler: a kill keeps the rows already measured
    print_table(report["results"])
    return report


if __name__ == "__main__":
    main()
