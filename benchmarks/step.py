"""A LitGPT training step (forward, cross-entropy, backward, AdamW step) under several compilers, side by side.

    python benchmarks/step.py [--model_name tiny-llama-1.1b] [--micro_batch_size 4] [--seq_len 2048]
        [--compilers eager,torch.compile,fulmen,fulmen+unsloth,thunder] [--executors NAME,...]
        [--out benchmarks/step.json]

`fulmen+unsloth` is fulmen with the "unsloth" executor (fulmen.unsloth's Triton kernels for cross-entropy, SwiGLU
and RoPE) ahead of the same executors as the `fulmen` row (`--executors`, or fulmen's defaults).

Every compiler runs in turn in this one process on one device, each on a fresh model built from the same seed and
trained on the same random batch, so the losses they report should agree. The weights are in the benchmark dtype
("bf16-true": no autocast, no fp32 master weights), like the single-device row of Lightning Thunder's TinyLlama
table (eager vs Inductor vs Thunder).

What is compiled: the function `forward_and_loss(model, x, y)`, so the cross-entropy is in the trace, as in
Thunder's pretraining script (`torch.compile` and `thunder.jit` get the same function, for parity). When a compiler
raises on that function it is retried on the module alone with the loss computed eagerly; `mode` in the JSON says
which one ran ("function" or "module") and `function_mode_error` why the first failed. The optimizer step is eager
for every compiler: `torch.optim.AdamW(fused=True)` on CUDA, `foreach=True` on CPU.

Measured per compiler: the wall time of the first step (compilation included), then `--warmup` untimed steps, then
`--iters` steps each timed with a device synchronize on either side (median reported); the peak allocated CUDA
memory over the compiler's whole run (model, optimizer state and steps); tokens/s = micro_batch_size * seq_len /
median; the loss of the last step. MFU = FLOPs per step / (median seconds * the GPU's dense bf16 peak), with the
FLOPs per step from LitGPT's `estimate_flops(model, training=True) * micro_batch_size` (what LitGPT's pretraining
logs): 3 * (2 * n_params * seq_len + 4 * n_layer * n_embd * seq_len**2) per sequence, all parameters counted, the
embedding included. MFU is null on CPU, for a dtype other than bf16 and for a GPU not in
`fulmen.pretrain.flops.PEAK_BF16_DENSE_FLOPS`.

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

REPO = Path(__file__).resolve().parents[1]
try:
    import fulmen
except ImportError:  # run from a checkout that is not pip-installed
    sys.path.insert(0, str(REPO))
    import fulmen
from fulmen.pretrain.flops import peak_flops  # noqa: E402 - the same table pretraining reports MFU with

COMPILERS = ("eager", "torch.compile", "fulmen", "fulmen+unsloth", "thunder")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def forward_and_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> GPT:
    """A randomly initialised GPT created on `device` in `dtype` (the default dtype while the weights are made)."""
    overrides = {"n_layer": args.n_layer} if args.n_layer is not None else {}
    config = Config.from_name(args.model_name, **overrides)
    torch.manual_seed(args.seed)
    with torch.device(device), default_dtype(dtype):
        model = GPT(config)
        model.max_seq_length = args.seq_len
    return model.to(dtype)  # the RoPE cache LitGPT builds in fp32 too, as bf16-true precision converts it


def make_batch(args: argparse.Namespace, config: Config, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, config.vocab_size, (args.micro_batch_size, args.seq_len + 1), generator=generator)
    tokens = tokens.to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def compile_fn(name: str, executors: list[str] | None) -> Callable[[Any], Callable]:
    if name == "torch.compile":
        return torch.compile
    if name == "fulmen":
        return lambda fn: fulmen.jit(fn, executors=executors)
    if name == "fulmen+unsloth":  # fulmen.unsloth's Triton kernels first, then the same executors
        names = executors or [executor.name for executor in fulmen.get_default_executors()]
        return lambda fn: fulmen.jit(fn, executors=["unsloth", *names])
    if name == "thunder":
        import thunder

        return thunder.jit
    raise ValueError(f"unknown compiler {name!r}")


def make_loss_fn(name: str, mode: str, model: GPT, executors: list[str] | None) -> Callable:
    """`loss_fn(x, y)` for one compiler: the compiled `forward_and_loss` ("function") or compiled module ("module")."""
    if name == "eager":
        return lambda x, y: forward_and_loss(model, x, y)
    compile_ = compile_fn(name, executors)
    if mode == "function":
        compiled = compile_(forward_and_loss)
        return lambda x, y: compiled(model, x, y)
    compiled_model = compile_(model)
    return lambda x, y: forward_and_loss(compiled_model, x, y)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(loss_fn: Callable, params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor,
               args: argparse.Namespace, fence: Callable[[], None],
               backward: Callable[[torch.Tensor], None] = torch.Tensor.backward) -> dict:
    """AdamW (fused on CUDA, foreach on CPU) over `params`: one first step, `args.warmup` untimed steps, then
    `args.iters` steps each timed between two `fence()` calls. `backward`: `fabric.backward` for Fabric's rows."""
    if params[0].device.type == "cuda":
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    def step(count_grads: bool = False) -> tuple[torch.Tensor, int]:
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
    for _ in range(args.warmup):
        step()
    iter_ms = []
    loss = first_loss
    for _ in range(args.iters):
        fence()
        start = time.perf_counter()
        loss, _ = step()
        fence()
        iter_ms.append((time.perf_counter() - start) * 1e3)
    return {"iter_ms": iter_ms, "first_step_s": first_step_s, "first_loss": first_loss.item(),
            "final_loss": loss.item(), "params_with_grad": [with_grad, len(params)]}


def run_compiler(name: str, mode: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """Builds a fresh model and optimizer, runs 1 + warmup + iters steps and returns the measurements."""
    # what an earlier compiler left allocated (should be ~0) is counted in this one's peak
    allocated_before_gb = torch.cuda.memory_allocated(device) / 1e9 if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(args, device, dtype)
    flops_per_step = estimate_flops(model, training=True) * args.micro_batch_size
    n_params = sum(p.numel() for p in model.parameters())
    params = list(model.parameters())
    x, y = make_batch(args, model.config, device)
    loss_fn = make_loss_fn(name, mode, model, args.executors)
    timed = time_steps(loss_fn, params, x, y, args, lambda: sync(device))
    iter_ms = timed["iter_ms"]
    median_s = statistics.median(iter_ms) / 1e3
    peak = peak_flops(device, dtype)
    result = {
        "status": "ok",
        "mode": mode,
        "ms_per_iter": median_s * 1e3,
        "ms_per_iter_min": min(iter_ms),
        "ms_per_iter_mean": statistics.fmean(iter_ms),
        "iter_ms": iter_ms,
        "first_step_s": timed["first_step_s"],
        "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        "allocated_before_gb": allocated_before_gb,
        "tokens_per_s": args.micro_batch_size * args.seq_len / median_s,
        "mfu": flops_per_step / (median_s * peak) if peak else None,
        "flops_per_step": flops_per_step,
        "n_params": n_params,
        "first_loss": timed["first_loss"],
        "final_loss": timed["final_loss"],
        "params_with_grad": timed["params_with_grad"],
    }
    with_grad = timed["params_with_grad"][0]
    if with_grad != len(params):
        result["warning"] = f"only {with_grad} of {len(params)} parameters received a gradient"
    return result


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def cleanup(name: str, device: torch.device) -> None:
    if name == "torch.compile":
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


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(results: dict[str, dict], ratios: dict[str, dict]) -> None:
    header = f"{'compiler':15}{'ms/iter':>10}{'x eager':>9}{'peak GB':>9}{'1st step s':>12}{'tokens/s':>11}"
    print(header + f"{'MFU':>7}{'final loss':>12}  mode")
    for name, r in results.items():
        if r["status"] != "ok":
            print(f"{name:15}{r['status']}: {r.get('error') or r.get('reason')}")
            continue
        ratio = ratios.get(name, {}).get("ms_per_iter")
        print(
            f"{name:15}{r['ms_per_iter']:10.2f}{fmt(ratio, '.3f'):>9}{fmt(r['peak_gb'], '.2f'):>9}"
            f"{r['first_step_s']:12.2f}{r['tokens_per_s']:11.0f}{fmt(r['mfu'], '.1%'):>7}{r['final_loss']:12.5f}"
            f"  {r['mode']}" + (f"  WARNING: {r['warning']}" if "warning" in r else "")
        )


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
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


def make_parser(description: str | None, choices: tuple[str, ...], out: str) -> argparse.ArgumentParser:
    """The arguments this script and fsdp_step.py share; `choices`: the compilers (rows) to pick from."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name", default="tiny-llama-1.1b", help="a LitGPT config name")
    parser.add_argument("--micro_batch_size", type=int, default=4, help="sequences per process")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    parser.add_argument("--iters", type=int, default=10, help="timed steps (the median is reported)")
    parser.add_argument("--compilers", default=",".join(choices), help=f"comma list from {','.join(choices)}")
    parser.add_argument("--executors", default=None, help="comma list passed as fulmen.jit(..., executors=[...])")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--n_layer", type=int, default=None, help="override the config's n_layer (smoke tests)")
    parser.add_argument("--seed", type=int, default=42, help="the weights' seed (the same in every process)")
    parser.add_argument("--out", default=out)
    return parser


def parse_common(parser: argparse.ArgumentParser, argv: list[str] | None,
                 choices: tuple[str, ...]) -> argparse.Namespace:
    """Parses and checks the shared arguments (comma lists become lists)."""
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
    return parse_common(make_parser(__doc__, COMPILERS, "benchmarks/step.json"), argv, COMPILERS)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
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

    results: dict[str, dict] = {}
    for name in args.compilers:
        if name == "thunder" and thunder_error is not None:
            results[name] = {"status": "skipped", "reason": thunder_error}
            print(f"{name}: skipped ({thunder_error})", flush=True)
            continue
        print(f"{name}: running", flush=True)
        results[name] = benchmark(name, args, device, dtype)
        r = results[name]
        print(f"{name}: {r['status']}" + (f" ({r['error']})" if "error" in r else ""), flush=True)

    ratios: dict[str, dict] = {}
    eager = results.get("eager", {})
    if eager.get("status") == "ok":
        for name, r in results.items():
            if r["status"] == "ok":
                ratios[name] = {
                    "ms_per_iter": r["ms_per_iter"] / eager["ms_per_iter"],
                    "peak_gb": r["peak_gb"] / eager["peak_gb"] if r["peak_gb"] and eager["peak_gb"] else None,
                }
    print_table(results, ratios)
    report = {
        "benchmark": "LitGPT training step: forward, cross-entropy, backward, AdamW step",
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
        "ratios_vs_eager": ratios,
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
