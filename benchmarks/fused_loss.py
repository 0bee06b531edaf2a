"""Never materialising the logits: a LitGPT training step with a large vocabulary, side by side in one process.

    python benchmarks/fused_loss.py [--model_name Llama-3.2-1B] [--micro_batch_size 4] [--seq_len 2048]
        [--compilers eager,torch.compile,eager+liger,fulmen,fulmen+liger] [--cap_gb 40] [--out ...]

Rows (the same `forward_and_loss` as benchmarks/step.py: the model's logits and torch's cross-entropy):
- eager, torch.compile: the logits (B*T x 128,256 for Llama 3) exist, with their gradient.
- eager+liger: the model's trunk eagerly, then Liger-Kernel's LigerFusedLinearCrossEntropyFunction on its lm_head
  weight (what a user gets by rewriting the model for Liger).
- fulmen: fulmen's default executors; its fused linear + cross-entropy (fulmen.transforms.fused_loss) is on by
  default. fulmen-unfused: the same with JitOptions(fuse_linear_cross_entropy=False).
- fulmen+liger: the "liger" executor ahead of the defaults (Liger's kernels for the fused loss, RMSNorm, RoPE,
  SwiGLU).
- fulmen-budget-0.5, -0.3, -0: fulmen with JitOptions(activation_memory_budget=...): the backward recomputes matmuls
  so the forward saves that share of its default bytes (less memory for more compute).
- fulmen-offload-0.2, -0.4, -0.6: fulmen with JitOptions(offload=OffloadOptions(fraction=...)): that share of the
  saved bytes waits in pinned host memory, copied on a side stream (less memory for host-link bandwidth).

Per row: ms/iter (median of --iters timed steps after --warmup), peak allocated memory over the row's run, tokens/s,
the first step's seconds, the loss. Then, under a memory cap of --cap_gb (torch.cuda.set_per_process_memory_fraction),
the largest micro-batch found to fit and its tokens/s: from the peaks at --micro_batch_size and twice it, the largest
batch the cap should hold is predicted and tried (a smaller one after an out-of-memory, at most --cap_probes runs).
Weights are bf16 ("bf16-true"), the optimizer torch.optim.AdamW(fused=True), as in benchmarks/step.py.

CPU smoke test:

    python benchmarks/fused_loss.py --device cpu --dtype fp32 --model_name pythia-14m --n_layer 1 --seq_len 32 \\
        --micro_batch_size 2 --iters 2 --warmup 1 --cap_gb 0 --compilers eager,fulmen --out /tmp/fused_loss.json
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BENCHMARKS = Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:  # step.py sits beside this file
    sys.path.insert(0, str(BENCHMARKS))
import step  # noqa: E402 - benchmarks/step.py: model, batch, timing and report helpers shared by the benchmarks

import fulmen  # noqa: E402

BUDGET_ROWS = {"fulmen-budget-0.5": 0.5, "fulmen-budget-0.3": 0.3, "fulmen-budget-0": 0.0}
OFFLOAD_ROWS = {"fulmen-offload-0.2": 0.2, "fulmen-offload-0.4": 0.4, "fulmen-offload-0.6": 0.6}
COMPILERS = ("eager", "torch.compile", "eager+liger", "fulmen", "fulmen-unfused", "fulmen+liger", *BUDGET_ROWS,
             *OFFLOAD_ROWS)
DEFAULT = "eager,torch.compile,eager+liger,fulmen,fulmen+liger"


def _liger_loss(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The trunk of the LitGPT model, then Liger's fused linear + cross-entropy on its lm_head weight."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    weight = model.lm_head.weight
    model.lm_head = torch.nn.Identity()  # GPT.forward then returns the final norm's output

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = model(x)
        return LigerFusedLinearCrossEntropyFunction.apply(h.reshape(-1, h.shape[-1]), weight, y.reshape(-1))[0]

    return loss


def make_loss_fn(name: str, model: torch.nn.Module, executors: list[str] | None) -> tuple[Callable, Any]:
    """`loss_fn(x, y)` for one row, and what compiled it (fulmen's jitted function for the fulmen rows)."""
    if name == "eager":
        return (lambda x, y: step.forward_and_loss(model, x, y)), None
    if name == "eager+liger":
        return _liger_loss(model), None
    if name == "torch.compile":
        compiled = torch.compile(step.forward_and_loss)
    else:
        names = executors or [executor.name for executor in fulmen.get_default_executors()]
        if name == "fulmen+liger":
            names = ["liger", *names]
        offload = fulmen.OffloadOptions(fraction=OFFLOAD_ROWS[name]) if name in OFFLOAD_ROWS else None
        options = fulmen.JitOptions(fuse_linear_cross_entropy=name != "fulmen-unfused",
                                    activation_memory_budget=BUDGET_ROWS.get(name, 1.0), offload=offload)
        compiled = fulmen.jit(step.forward_and_loss, executors=names, options=options)
    return (lambda x, y: compiled(model, x, y)), compiled


def measure(loss_fn: Callable, params: list[torch.Tensor], model: Any, args: argparse.Namespace, batch: int,
            device: torch.device, warmup: int, iters: int) -> dict:
    """One run at micro-batch `batch`: a fresh optimizer, 1 + warmup + iters steps; its peak and median step."""
    run = argparse.Namespace(**{**vars(args), "micro_batch_size": batch, "warmup": warmup, "iters": iters})
    x, y = step.make_batch(run, model.config, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed = step.time_steps(loss_fn, params, x, y, run, lambda: step.sync(device))
    median_s = statistics.median(timed["iter_ms"]) / 1e3
    return {"micro_batch_size": batch, "ms_per_iter": median_s * 1e3, "tokens_per_s": batch * args.seq_len / median_s,
            "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
            "first_step_s": timed["first_step_s"], "first_loss": timed["first_loss"],
            "final_loss": timed["final_loss"]}


def _attempt(loss_fn, params, model, args, batch, device) -> dict:
    """`measure` under the cap: the result, or {"micro_batch_size", "status": "oom"}."""
    for p in params:
        p.grad = None
    try:
        result = measure(loss_fn, params, model, args, batch, device, warmup=1, iters=args.cap_iters)
        result["status"] = "ok"
    except Exception as error:  # noqa: BLE001 - an out-of-memory is the answer; anything else is recorded too
        result = {"micro_batch_size": batch, "status": "oom" if step.is_oom(error) else "error",
                  "error": f"{type(error).__name__}: {str(error)[:300]}"}
    for p in params:
        p.grad = None
    gc.collect()
    torch.cuda.empty_cache()
    ok = result["status"] == "ok"
    measured = f", peak {result['peak_gb']:.1f} GB, {result['tokens_per_s']:.0f} tokens/s" if ok else ""
    print(f"  cap {args.cap_gb} GB, micro-batch {batch}: {result['status']}{measured}", flush=True)
    return result


def largest_batch(loss_fn, params, model, args, device, base: int) -> dict:
    """The largest micro-batch found to fit under --cap_gb, from a linear fit of peak memory in the batch size."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * 1e9 / total), device)
    probes: list[dict] = []
    low: dict | None = None  # the largest batch that fit
    high: int | None = None  # the smallest that did not

    def attempt(batch: int) -> bool:
        nonlocal low, high
        probes.append(_attempt(loss_fn, params, model, args, batch, device))
        if probes[-1]["status"] == "ok":
            low = probes[-1] if low is None or batch > low["micro_batch_size"] else low
            return True
        high = batch if high is None else min(high, batch)
        return False

    try:
        if attempt(base) and attempt(2 * base):  # peak = fixed + per_sample * batch: what the cap should hold
            first, second = probes[0], probes[1]
            per_sample = max((second["peak_gb"] - first["peak_gb"]) / base, 1e-3)
            guess = 2 * base + int((0.95 * args.cap_gb - second["peak_gb"]) / per_sample)
        else:
            guess = (low["micro_batch_size"] + high) // 2 if low is not None else base // 2
        while len(probes) < args.cap_probes and guess >= 1:
            if high is not None:
                guess = min(guess, high - 1)
            if low is not None and guess <= low["micro_batch_size"]:
                break
            if attempt(guess):
                guess = (guess + high) // 2 if high is not None else guess + max(1, guess // 4)
            else:
                guess = (low["micro_batch_size"] + guess) // 2 if low is not None else guess // 2
        best = low or {}
        return {"cap_gb": args.cap_gb, "micro_batch_size": best.get("micro_batch_size"),
                "tokens_per_s": best.get("tokens_per_s"), "peak_gb": best.get("peak_gb"), "first_oom": high,
                "probes": probes}
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def run_row(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = step.build_model(args, device, dtype)
    params = list(model.parameters())  # before eager+liger takes the lm_head out of the module
    loss_fn, compiled = make_loss_fn(name, model, args.executors)
    result = {"status": "ok", **measure(loss_fn, params, model, args, args.micro_batch_size, device, args.warmup,
                                        args.iters)}
    if device.type == "cuda":
        result["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9  # the row's whole run
    if isinstance(compiled, fulmen.JittedFunction):  # what the fused-loss pass did, as its trace says
        result["traces"] = [t.provenance for t in fulmen.last_traces(compiled)]
    if device.type == "cuda" and args.cap_gb > 0:
        result["under_cap"] = largest_batch(loss_fn, params, model, args, device, args.micro_batch_size)
    return result


def benchmark(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    try:
        return run_row(name, args, device, dtype)
    except Exception as error:  # noqa: BLE001 - recorded, the next row still runs
        return {"status": "oom" if step.is_oom(error) else "error", "error": f"{type(error).__name__}: {error}"}
    finally:
        step.cleanup(name, device)


def print_table(results: dict[str, dict]) -> None:
    def row(name: str, r: dict) -> str:
        cap = r.get("under_cap", {})
        return (f"{r['ms_per_iter']:9.1f}{step.fmt(r['peak_gb'], '.2f'):>9}{r['tokens_per_s']:10.0f}"
                f"{r['first_step_s']:11.1f}{r['final_loss']:9.4f}{step.fmt(cap.get('cap_gb'), '.0f'):>8}"
                f"{step.fmt(cap.get('micro_batch_size'), 'd'):>10}{step.fmt(cap.get('tokens_per_s'), '.0f'):>10}")

    step.print_rows(f"{'row':16}{'ms/iter':>9}{'peak GB':>9}{'tokens/s':>10}{'1st step s':>11}{'loss':>9}"
                    f"{'cap GB':>8}{'max batch':>10}{'tokens/s':>10}", results, 16, row)


def main(argv: list[str] | None = None) -> dict:
    parser = step.make_parser(__doc__, COMPILERS, "benchmarks/fused_loss.json")
    parser.set_defaults(model_name="Llama-3.2-1B", compilers=DEFAULT)
    parser.add_argument("--cap_gb", type=float, default=40.0, help="memory cap of the largest-batch search (0: none)")
    parser.add_argument("--cap_iters", type=int, default=3, help="timed steps per batch size under the cap")
    parser.add_argument("--cap_probes", type=int, default=3, help="runs of the largest-batch search per row")
    args = step.parse_common(parser, argv, COMPILERS)
    device, dtype = torch.device(args.device), step.DTYPES[args.dtype]
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    results: dict[str, dict] = {}
    start = time.perf_counter()
    for name in args.compilers:
        print(f"{name}: running", flush=True)
        row_start = time.perf_counter()
        results[name] = r = benchmark(name, args, device, dtype)
        r["row_s"] = time.perf_counter() - row_start
        print(f"{name}: {r['status']} in {r['row_s']:.0f} s" + (f" ({r['error'][:300]})" if "error" in r else ""),
              flush=True)
    print_table(results)
    ratios = {}
    compiled = results.get("torch.compile", {})
    if compiled.get("status") == "ok" and compiled.get("peak_gb"):
        for name, r in results.items():
            if r["status"] == "ok":
                ratios[name] = {"ms_per_iter": r["ms_per_iter"] / compiled["ms_per_iter"],
                                "peak_gb": r["peak_gb"] / compiled["peak_gb"]}
        print("vs torch.compile: " + ", ".join(f"{n} {v['ms_per_iter']:.2f}x time, {v['peak_gb']:.2f}x peak"
                                              for n, v in ratios.items()))
    report = {
        "benchmark": "LitGPT training step with its loss: the full logits against fused linear + cross-entropy",
        "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "fulmen_git": step.git_revision(), "litgpt": step.version("litgpt"), "liger": step.version("liger-kernel"),
        "args": vars(args), "tokens_per_step": args.micro_batch_size * args.seq_len, "results": results,
        "ratios_vs_torch_compile": ratios, "wall_s": time.perf_counter() - start,
    }
    step.write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
