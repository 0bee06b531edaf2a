"""CPU offloading of saved activations (`fulmen.jit(..., offload=OffloadOptions(fraction=f))`) on a LitGPT step.

    python benchmarks/offload.py [--fractions 0.5,1.0] [--model_name tiny-llama-1.1b] [--micro_batch_size 4]
        [--seq_len 2048] [--cap_gb 24] [--max_batch 24] [--out benchmarks/offload_h200.json]

Part 1, at `--micro_batch_size`: eager, fulmen, and fulmen with offloading at each fraction, each on a fresh model
built from the same seed, trained with fused AdamW on the same batch (benchmarks/step.py's setup): the median
ms/iter, the peak allocated device memory over the row's run, the bytes the forward saves and offloads per step,
and every step's loss next to eager's and fulmen's. Offloading runs the same kernels on the same values, so its
losses match fulmen's up to torch.compile regions that split differently around the copies; fulmen matches eager
within bf16 noise.

Part 2, under a device memory cap (`torch.cuda.set_per_process_memory_fraction`, `--cap_gb`): the largest
micro-batch for which two training steps run, without offloading and with the largest fraction. The search starts
from the batch size part 1's peaks predict (a line through the fixed cost and the per-sequence cost) and steps up or
down until it finds the boundary, so it compiles a few shapes only.

The losses, the ms/iter and the memory are printed as a table and written to `--out` as JSON.
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step  # noqa: E402 - benchmarks/step.py: the model, batch and report helpers shared by the benchmarks

import fulmen  # noqa: E402
from fulmen.transforms.offload import OFFLOAD  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name", default="tiny-llama-1.1b")
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--fractions", default="0.5,1.0", help="comma list of OffloadOptions.fraction values")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--cap_gb", type=float, default=24.0, help="device memory cap of part 2 (GB, 1e9 bytes)")
    parser.add_argument("--max_batch", type=int, default=24, help="the largest micro-batch part 2 tries")
    parser.add_argument("--n_layer", type=int, default=None, help="override the config's n_layer (smoke tests)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bf16", choices=sorted(step.DTYPES))
    parser.add_argument("--executors", default=None)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", default="benchmarks/offload_h200.json")
    args = parser.parse_args(argv)
    args.fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    args.executors = [e.strip() for e in args.executors.split(",")] if args.executors else None
    return args


def make_loss_fn(row: str, model: torch.nn.Module, args: argparse.Namespace):
    if row == "eager":
        return lambda x, y: step.forward_and_loss(model, x, y), None
    fraction = None if row == "fulmen" else float(row.split("=")[1])
    offload = fulmen.OffloadOptions(fraction=fraction) if fraction is not None else None
    jitted = fulmen.jit(step.forward_and_loss, executors=args.executors, offload=offload)
    return (lambda x, y: jitted(model, x, y)), jitted


def saved_bytes(jitted: Any) -> tuple[int, int]:
    """(bytes the forward saves for the backward, bytes of those it offloads) per step, read off its final trace."""
    forward = fulmen.last_traces(jitted)[-1]
    offloaded = sum(b.args[0].numel() * b.args[0].element_size() for b in forward.bound_symbols if b.sym is OFFLOAD)
    saved = [p for p in forward.output[1:] if isinstance(p, fulmen.TensorProxy)]  # output 0 is the loss
    return sum(p.numel() * p.element_size() for p in saved), offloaded


def run_row(row: str, args: argparse.Namespace, batch_size: int, steps: int) -> dict:
    """`steps` training steps of a fresh model; the losses, the per-step times and the peak memory."""
    device, dtype = torch.device(args.device), step.DTYPES[args.dtype]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    args = argparse.Namespace(**{**vars(args), "micro_batch_size": batch_size})
    model = step.build_model(args, device, dtype)
    x, y = step.make_batch(args, model.config, device)
    loss_fn, jitted = make_loss_fn(row, model, args)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if device.type == "cuda" else {}))
    losses, times = [], []
    for _ in range(steps):
        step.sync(device)
        start = time.perf_counter()
        loss = loss_fn(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step.sync(device)
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.item())
    result = {"losses": losses, "step_ms": times,
              "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
              "reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9 if device.type == "cuda" else None}
    if jitted is not None:
        saved, offloaded = saved_bytes(jitted)
        result.update(saved_gb=saved / 1e9, offloaded_gb=offloaded / 1e9)
    del model, optimizer, loss_fn, jitted, x, y
    return result


def part1(args: argparse.Namespace) -> dict[str, dict]:
    rows = ["eager", "fulmen", *(f"fulmen+offload={f:g}" for f in args.fractions)]
    results = {}
    for row in rows:
        try:
            result = run_row(row, args, args.micro_batch_size, 1 + args.warmup + args.iters)
            timed = result["step_ms"][1 + args.warmup:]
            result.update(status="ok", ms_per_iter=statistics.median(timed), first_step_s=result["step_ms"][0] / 1e3)
        except Exception as error:  # noqa: BLE001 - recorded, the next row still runs
            result = {"status": "oom" if step.is_oom(error) else "error", "error": f"{type(error).__name__}: {error}"}
        finally:
            step.cleanup(row, torch.device(args.device))
        results[row] = result
        print(row, {k: v for k, v in result.items() if k not in ("losses", "step_ms")}, flush=True)
    eager = results["eager"].get("losses")
    plain = results["fulmen"].get("losses")
    for row, result in results.items():
        if result["status"] == "ok" and eager:
            result["max_abs_loss_diff_vs_eager"] = max(abs(a - b) for a, b in zip(result["losses"], eager))
        if row.startswith("fulmen+offload") and result["status"] == "ok" and plain:
            result["max_abs_loss_diff_vs_fulmen"] = max(abs(a - b) for a, b in zip(result["losses"], plain))
    return results


def fits(row: str, args: argparse.Namespace, batch_size: int) -> bool:
    try:
        run_row(row, args, batch_size, 2)
        return True
    except Exception as error:
        if not step.is_oom(error):
            raise
        return False
    finally:
        step.cleanup(row, torch.device(args.device))


def largest_batch(row: str, args: argparse.Namespace, guess: int) -> dict:
    """The largest micro-batch <= --max_batch for which `row` fits under the cap, searched from `guess`."""
    tried: dict[int, bool] = {}

    def probe(batch: int) -> bool:
        if batch not in tried:
            tried[batch] = fits(row, args, batch)
            print(f"  {row} micro-batch {batch}: {'fits' if tried[batch] else 'out of memory'}", flush=True)
        return tried[batch]

    batch = max(1, min(guess, args.max_batch))
    if probe(batch):
        while batch < args.max_batch and probe(batch + 1):
            batch += 1
    else:
        while batch > 1 and not probe(batch - 1):
            batch -= 1
        batch -= 1
    return {"largest_micro_batch": batch, "at_max_batch": batch >= args.max_batch, "tried": tried}


def predict(result: dict, base_gb: float, batch: int, cap_gb: float) -> int:
    """The batch size at which `result`'s peak, a fixed `base_gb` plus a cost per sequence, reaches the cap."""
    if result.get("status") != "ok" or result["peak_gb"] is None:
        return batch
    per_sequence = max((result["peak_gb"] - base_gb) / batch, 1e-3)
    return max(1, math.floor((cap_gb * 0.97 - base_gb) / per_sequence))


def part2(args: argparse.Namespace, results: dict[str, dict]) -> dict:
    device = torch.device(args.device)
    if device.type != "cuda":
        return {"skipped": "the memory cap needs a CUDA device"}
    device = torch.device("cuda", torch.cuda.current_device())  # the cap takes an index
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * 1e9 / total), device)
    # parameters, grads and AdamW's two states in the model's dtype: what does not grow with the batch
    model = step.build_model(args, torch.device("meta"), step.DTYPES[args.dtype])
    base_gb = 4 * sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    found = {}
    try:
        for row in ("fulmen", f"fulmen+offload={max(args.fractions):g}"):
            guess = predict(results.get(row, {}), base_gb, args.micro_batch_size, args.cap_gb)
            found[row] = largest_batch(row, args, guess)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    return {"cap_gb": args.cap_gb, "fixed_gb_estimate": base_gb, **found}


def print_table(results: dict[str, dict], capped: dict) -> None:
    def cells(name: str, r: dict) -> str:
        memory = f"{step.fmt(r['peak_gb'], '.2f'):>9}{step.fmt(r.get('saved_gb'), '.2f'):>10}"
        diffs = f"{r.get('max_abs_loss_diff_vs_eager', 0.0):18.2e}"
        diffs += f"{step.fmt(r.get('max_abs_loss_diff_vs_fulmen'), '.2e'):>19}"
        return f"{r['ms_per_iter']:9.1f}{memory}{step.fmt(r.get('offloaded_gb'), '.2f'):>10}{diffs}"

    step.print_rows(f"\n{'row':22}{'ms/iter':>9}{'peak GB':>9}{'saved GB':>10}{'offl. GB':>10}{'max |loss-eager|':>18}"
                    f"{'max |loss-fulmen|':>19}", results, 22, cells)
    print("eager losses:", [round(v, 5) for v in results["eager"].get("losses", [])])
    for row, r in capped.items():
        if isinstance(r, dict) and "largest_micro_batch" in r:
            bound = " (the most tried: --max_batch)" if r["at_max_batch"] else ""
            print(f"largest micro-batch under {capped['cap_gb']} GB: {row}: {r['largest_micro_batch']}{bound}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    results = part1(args)
    capped = part2(args, results)
    print_table(results, capped)
    report = {"model_name": args.model_name, "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len,
              "dtype": args.dtype, "fractions": args.fractions, "results": results, "memory_cap": capped,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
              "torch": torch.__version__, "fulmen_revision": step.git_revision()}
    step.write_report(report, args.out)
    gc.collect()
    return report


if __name__ == "__main__":
    main()
