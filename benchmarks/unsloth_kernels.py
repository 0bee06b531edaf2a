"""fulmen.unsloth's kernels against eager and torch.compile, one operation at a time, forward + backward.

    python benchmarks/unsloth_kernels.py [--batch 4] [--seq_len 2048] [--out benchmarks/unsloth_kernels.json]

Shapes are TinyLlama-1.1B's at the given batch and sequence length, bf16: cross-entropy over (B*T, 32000) logits,
SwiGLU on two (B, T, 5632) tensors, RoPE on the queries (B, 32, T, 64) as LitGPT passes them (a transposed view).
Each operation runs as a function of its inputs: eager, `torch.compile` of it, and `fulmen.jit(..., executors=
["unsloth"])` (the kernels alone); the "unsloth kernels" row calls the forward and backward kernels directly,
without fulmen or autograd, so the difference to the "unsloth" row is the host's cost per call. Reported per row:
the median of `--iters` timed forward + backward passes (CUDA events, after `--warmup` untimed ones), the bytes the
kernels must at least move (inputs read and outputs written, forward and backward) over that time as GB/s, and the
peak memory the pass allocated above its inputs.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
try:
    import fulmen
except ImportError:  # run from a checkout that is not pip-installed
    sys.path.insert(0, str(REPO))
    import fulmen
import litgpt.model  # noqa: E402
from step import write_report  # noqa: E402 - step.py sits beside this script

from fulmen.unsloth.executor import swiglu  # noqa: E402


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)


def swiglu_op(e: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return swiglu(e, g)  # a call of it, which the unsloth executor replaces


def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return litgpt.model.apply_rope(qkv.transpose(1, 2), cos, sin)


def direct_kernels(name: str) -> Callable:
    """The kernels called directly, without fulmen or autograd: what the kernels themselves cost."""
    kernels = importlib.import_module(f"fulmen.unsloth.{name}")

    def cross_entropy_pass(logits: torch.Tensor, targets: torch.Tensor) -> None:
        losses, lse = kernels.forward(logits, targets, -100)
        kernels.backward(torch.ones((), device=logits.device), logits, targets, lse, -100)

    def swiglu_pass(e: torch.Tensor, g: torch.Tensor) -> None:
        kernels.backward(kernels.forward(e, g), e, g)

    def rope_pass(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        kernels.backward(kernels.forward(qkv.transpose(1, 2), cos, sin), cos, sin)

    return {"cross_entropy": cross_entropy_pass, "swiglu": swiglu_pass, "rope": rope_pass}[name]


def cases(batch: int, seq_len: int) -> dict[str, tuple[Callable, list[torch.Tensor], int]]:
    """name -> (function, inputs (leaves: those differentiated require grad), the bytes forward + backward must
    move)."""
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    rows, vocab, hidden, heads, head_size = batch * seq_len, 32000, 5632, 32, 64
    logits = torch.randn(rows, vocab, device=cuda, dtype=bf16, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), device=cuda)
    e, g = (torch.randn(batch, seq_len, hidden, device=cuda, dtype=bf16, requires_grad=True) for _ in range(2))
    qkv = torch.randn(batch, seq_len, heads, head_size, device=cuda, dtype=bf16, requires_grad=True)
    cos, sin = (t.unsqueeze(0).to(bf16) for t in litgpt.model.build_rope_cache(seq_len, head_size, device=cuda))
    size = 2  # bytes of a bf16 element
    return {
        # forward reads the logits; backward reads them again and writes their gradient
        "cross_entropy": (cross_entropy, [logits, targets], 3 * logits.numel() * size),
        # forward reads e, g and writes h; backward reads dh, e, g and writes de, dg
        "swiglu": (swiglu_op, [e, g], 8 * e.numel() * size),
        # forward reads x, writes out; backward reads the gradient, writes dx (cos/sin are small)
        "rope": (rope, [qkv, cos, sin], 4 * qkv.numel() * size),
    }


def measure(fn: Callable, inputs: list[torch.Tensor], warmup: int, iters: int) -> dict:
    cotangent = None

    def step() -> None:
        nonlocal cotangent
        out = fn(*inputs)
        if out is None:  # the direct kernels ran forward and backward themselves
            return
        if cotangent is None:
            cotangent = torch.randn_like(out)
        out.backward(cotangent)
        for x in inputs:
            x.grad = None

    step()  # compiles
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"ms": statistics.median(times), "ms_all": times,
            "peak_gb_above_inputs": (torch.cuda.max_memory_allocated() - base) / 1e9}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/unsloth_kernels.json")
    args = parser.parse_args(argv)
    results: dict[str, dict] = {}
    for name, (fn, inputs, moved) in cases(args.batch, args.seq_len).items():
        rows = {"eager": fn, "torch.compile": torch.compile(fn), "unsloth": fulmen.jit(fn, executors=["unsloth"]),
                "unsloth kernels": direct_kernels(name)}
        results[name] = {}
        for row, runner in rows.items():
            r = measure(runner, inputs, args.warmup, args.iters)
            r["gb_per_s"] = moved / (r["ms"] / 1e3) / 1e9
            results[name][row] = r
            print(f"{name:14}{row:15}{r['ms']:9.3f} ms{r['gb_per_s']:9.0f} GB/s{r['peak_gb_above_inputs']:8.2f} GB",
                  flush=True)
        torch._dynamo.reset()
    report = {"benchmark": "unsloth kernels vs eager and torch.compile, forward + backward, bf16",
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args), "results": results}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
