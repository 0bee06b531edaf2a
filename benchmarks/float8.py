"""Float8 training (issue 49): a LitGPT training step under eager, torch.compile, torch.compile + torchao's float8
and fulmen in bf16 and with each float8 recipe, side by side; and a loss-curve mode.

    python benchmarks/float8.py [--model_name tiny-llama-1.1b] [--micro_batch_size 4] [--seq_len 2048]
        [--compilers eager,torch.compile,torchao-tensorwise,torchao-rowwise,fulmen,fulmen-tensorwise,...]
        [--out benchmarks/float8.json]
    python benchmarks/float8.py --steps 300 [--config configs/tinyllama.yaml] [--recipe tensorwise]
        [--out benchmarks/float8_loss.json]          # the loss curves, plotted beside the JSON (.svg, .png)
    python benchmarks/float8.py --tiny ...           # CPU smoke run of either mode (a 1-layer pythia-14m / the
                                                     # embedded tiny pretraining model)

Step mode: step.py's measurements (whose helpers this script imports) for these rows, every one on a fresh model
from the same seed and the same batch, the lm_head in bf16 in every float8 row:

* `eager`, `torch.compile`: no float8.
* `torchao-<recipe>` (when torchao is installed): torchao's `convert_to_float8_training` with
  `Float8LinearConfig.from_recipe_name(recipe)` on every nn.Linear but the lm_head, then `torch.compile` of
  `forward_and_loss` (torchao's documented use).
* `fulmen`: `fulmen.jit(forward_and_loss)`, bf16.
* `fulmen-<recipe>`: the same with `JitOptions(float8=Float8Options(recipe))`; the trace's own float8 casts and
  `torch._scaled_mm` calls (`float8_matmuls` in the JSON: what fulmen converted and kept).

Per row: ms/step synchronised every step (median) and free-running (one synchronize after `--iters` steps, as a
training loop runs), the first step (compilation), peak allocated memory, tokens/s, the final loss, and on CUDA the
GPU time per kernel family from torch.profiler, with float8 matmuls (cuBLAS's / CUTLASS's e4m3 and e5m2 kernels)
as a family of their own (`matmul-float8`). The JSON records the GPU's name, torch, torchao and fulmen versions, and
each row's ratios to torch.compile.

Loss-curve mode (`--steps N`): the pretraining run of `--config` (configs/tinyllama.yaml by default, its
micro-batch 4 x 2048 tokens of the shipped corpus, AdamW, warmup then cosine) for N steps, twice: in bf16 and with
`float8: <recipe>`, both through `python -m fulmen.pretrain` itself. The JSON holds both loss curves and the
difference of their last `--tail` steps' mean; a plot of both curves is written beside it (an SVG, and a PNG where
matplotlib is installed).

    python benchmarks/float8.py --tiny --compilers eager,fulmen,fulmen-tensorwise --out /tmp/float8.json
    python benchmarks/float8.py --tiny --steps 6 --out /tmp/float8_loss.json
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BENCHMARKS = Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:  # step.py sits beside this file
    sys.path.insert(0, str(BENCHMARKS))
import step  # noqa: E402

fulmen = step.fulmen
from fulmen.ops.float8 import RECIPES  # noqa: E402
from fulmen.transforms.float8 import notes_of  # noqa: E402

FLOAT8_ROWS = tuple(f"fulmen-{recipe}" for recipe in RECIPES)
TORCHAO_ROWS = ("torchao-tensorwise", "torchao-rowwise", "torchao-rowwise_with_gw_hp")
COMPILERS = ("eager", "torch.compile", *TORCHAO_ROWS, "fulmen", *FLOAT8_ROWS)
DEFAULT_COMPILERS = ("eager", "torch.compile", "torchao-tensorwise", "torchao-rowwise", "fulmen", *FLOAT8_ROWS)
# torch._scaled_mm's kernels name their float8 operand types: cuBLAS's nvjet kernels on Hopper as `nvjet_sm90_qq...`
# (e4m3 x e4m3), `..._qr...` (e4m3 x e5m2), where bf16's are `nvjet_sm90_tst...`; CUTLASS's spell them out
FLOAT8_KERNELS = (
    "matmul-float8",
    ("e4m3", "e5m2", "f8f8", "fp8", "float8", "nvjet_sm90_q", "nvjet_sm90_r", "nvjet_sm100_q", "nvjet_sm100_r"),
)
TINY_STEP = [
    "--device",
    "cpu",
    "--dtype",
    "fp32",
    "--model_name",
    "pythia-14m",
    "--n_layer",
    "1",
    "--seq_len",
    "32",
    "--micro_batch_size",
    "2",
    "--iters",
    "2",
    "--warmup",
    "1",
    "--profile_steps",
    "0",
]
TINY_CURVE = [
    "--config",
    str(BENCHMARKS.parent / "configs" / "tiny.yaml"),
    "--train.micro_batch_size",
    "4",
    "--train.global_batch_size",
    "4",
    "--train.max_seq_length",
    "64",
    "--train.lr_warmup_steps",
    "2",
]


def torchao_version() -> str | None:
    return step.version("torchao") if importlib.util.find_spec("torchao") is not None else None


def make_loss_fn(name: str, model: torch.nn.Module, executors: list[str] | None) -> tuple[Callable, Any]:
    """`loss_fn(x, y)` for one row and what it compiled (the jitted function for fulmen's rows)."""
    loss = step.forward_and_loss
    if name == "eager":
        return (lambda x, y: loss(model, x, y)), None
    if name == "torch.compile":
        compiled = torch.compile(loss)
        return (lambda x, y: compiled(model, x, y)), None
    if name in TORCHAO_ROWS:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(name.removeprefix("torchao-"))
        convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn != "lm_head")
        compiled = torch.compile(loss)
        return (lambda x, y: compiled(model, x, y)), None
    float8 = fulmen.Float8Options(recipe=name.removeprefix("fulmen-")) if name in FLOAT8_ROWS else None
    jitted = fulmen.jit(loss, executors=executors, options=fulmen.JitOptions(float8=float8))
    return (lambda x, y: jitted(model, x, y)), jitted


def run_row(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """step.run_compiler for one row of this benchmark: a fresh model, 1 + warmup + iters steps, the measurements."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = step.build_model(args, device, dtype)
    params = list(model.parameters())
    x, y = step.make_batch(args, model.config, device)
    loss_fn, jitted = make_loss_fn(name, model, args.executors)
    timed = step.time_steps(loss_fn, params, x, y, args, lambda: step.sync(device))
    median_s = statistics.median(timed["iter_ms"]) / 1e3
    result = {
        "status": "ok",
        "mode": "function",
        "ms_per_iter": median_s * 1e3,
        "free_running_ms_per_iter": timed["free_running_ms_per_iter"],
        "iter_ms": timed["iter_ms"],
        "first_step_s": timed["first_step_s"],
        "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9 if device.type == "cuda" else None,
        "tokens_per_s": args.micro_batch_size * args.seq_len / median_s,
        "mfu": None,
        "first_loss": timed["first_loss"],
        "final_loss": timed["final_loss"],
        "params_with_grad": timed["params_with_grad"],
        **timed.get("profile", {}),
    }
    if jitted is not None:
        result["float8_matmuls"] = notes_of(fulmen.last_traces(jitted))
    return result


def benchmark(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    if name in TORCHAO_ROWS and torchao_version() is None:
        return {"status": "skipped", "reason": "torchao is not installed"}
    try:
        return run_row(name, args, device, dtype)
    except Exception as error:  # noqa: BLE001 - recorded, the next row still runs
        return {"status": "oom" if step.is_oom(error) else "error", "error": f"{type(error).__name__}: {error}"}
    finally:
        step.cleanup("torch.compile" if "torch" in name else name, device)


def step_mode(args: argparse.Namespace) -> dict:
    step.KERNEL_FAMILIES = (FLOAT8_KERNELS, *step.KERNEL_FAMILIES)  # the profile's families, float8 matmuls first
    device, dtype = torch.device(args.device), step.DTYPES[args.dtype]
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    results: dict[str, dict] = {}

    def report() -> dict:
        return {
            "benchmark": f"float8 training step of {args.model_name}: forward, cross-entropy, backward, AdamW step",
            **environment(device),
            "args": vars(args),
            "tokens_per_step": args.micro_batch_size * args.seq_len,
            "results": results,
            "ratios_vs_eager": step.ratios_to(results, "eager"),
            "ratios_vs_torch_compile": step.ratios_to(results, "torch.compile"),
            "ratios_vs_fulmen_bf16": step.ratios_to(results, "fulmen"),
        }

    for name in args.compilers:
        print(f"{name}: running", flush=True)
        results[name] = benchmark(name, args, device, dtype)
        status = results[name]
        print(
            f"{name}: {status['status']}"
            + (f" ({status.get('error') or status.get('reason')})" if status["status"] != "ok" else ""),
            flush=True,
        )
        step.write_report(report(), args.out)
    final = report()
    step.print_table(final["results"], final["ratios_vs_eager"])
    return final


def environment(device: torch.device) -> dict:
    return {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torchao": torchao_version(),
        "fulmen": step.version("fulmen"),
        "fulmen_git": step.git_revision(),
        "litgpt": step.version("litgpt"),
    }


# --- loss curves ----------------------------------------------------------------------------------------------------
def pretrain_losses(argv: list[str]) -> list[float]:
    from fulmen.pretrain import cli

    with tempfile.TemporaryDirectory() as out:
        return cli.parse_and_run([*argv, "--out_dir", out])["losses"]


def svg_plot(curves: dict[str, list[float]], path: Path, title: str) -> None:
    """Both curves as polylines in one SVG (no plotting library needed on the device machine)."""
    width, height, margin = 800, 450, 50
    values = [v for losses in curves.values() for v in losses]
    low, high = min(values), max(values)
    steps = max(len(losses) for losses in curves.values())

    def point(i: int, v: float) -> str:
        x = margin + (width - 2 * margin) * (i / max(steps - 1, 1))
        y = height - margin - (height - 2 * margin) * ((v - low) / ((high - low) or 1))
        return f"{x:.1f},{y:.1f}"

    colours = ("#1f77b4", "#d62728", "#2ca02c")
    lines = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        f'<text x="{margin}" y="20">{title}</text>',
        f'<text x="{margin}" y="{height - 10}">step 1 .. {steps}; loss {low:.3f} .. {high:.3f}</text>',
    ]
    for (label, losses), colour, row in zip(curves.items(), colours, range(len(curves))):
        points = " ".join(point(i, v) for i, v in enumerate(losses))
        lines.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1" points="{points}"/>')
        lines.append(f'<text x="{width - 250}" y="{40 + 16 * row}" fill="{colour}">{label}</text>')
    path.write_text("\n".join([*lines, "</svg>"]) + "\n")


def plot(curves: dict[str, list[float]], path: Path, title: str) -> list[str]:
    """Both curves in one plot: an SVG always, a PNG too where matplotlib is installed. The files written."""
    svg_plot(curves, path.with_suffix(".svg"), title)
    written = [str(path.with_suffix(".svg"))]
    if importlib.util.find_spec("matplotlib") is None:
        return written
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    for label, losses in curves.items():
        axes.plot(range(1, len(losses) + 1), losses, label=label, linewidth=1)
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    axes.set_title(title, fontsize=9)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path.with_suffix(".png"), dpi=120)
    plt.close(figure)
    return [*written, str(path.with_suffix(".png"))]


def curve_mode(args: argparse.Namespace) -> dict:
    common = [
        "--train.max_steps",
        str(args.steps),
        "--train.log_interval",
        str(max(1, args.steps // 20)),
        "--train.save_interval",
        "0",
        "--eval.interval",
        "0",
        "--eval.final_validation",
        "false",
    ]
    config = TINY_CURVE if args.tiny else ["--config", args.config]
    curves = {}
    for label, float8 in (("fulmen without float8", "null"), (f"fulmen float8 {args.recipe}", args.recipe)):
        print(f"{label}: {args.steps} steps", flush=True)
        curves[label] = pretrain_losses([*config, *common, "--float8", float8])
    (bf16, f8), tail = curves.values(), min(args.tail, args.steps)
    end_bf16, end_f8 = statistics.fmean(bf16[-tail:]), statistics.fmean(f8[-tail:])
    out = Path(args.out)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    report = {
        "benchmark": f"loss curves of {args.steps} pretraining steps ({' '.join(config)}), bf16 and float8",
        **environment(device),
        "args": vars(args),
        "losses": curves,
        "final_loss_bf16": end_bf16,
        "final_loss_float8": end_f8,
        "tail_steps": tail,
        "relative_difference": (end_f8 - end_bf16) / end_bf16,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    report["plots"] = plot(curves, out, f"{args.steps} pretraining steps: without float8 and float8 {args.recipe}")
    step.write_report(report, out)
    difference = report["relative_difference"]
    print(f"last {tail} steps' mean loss: without float8 {end_bf16:.4f}, float8 {end_f8:.4f} ({difference:+.2%})")
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = step.make_parser(__doc__, COMPILERS, "benchmarks/float8.json", DEFAULT_COMPILERS)
    parser.add_argument("--tiny", action="store_true", help="a CPU smoke run (see the module docstring)")
    parser.add_argument("--steps", type=int, default=None, help="loss-curve mode: this many pretraining steps")
    parser.add_argument(
        "--config",
        default=str(BENCHMARKS.parent / "configs" / "tinyllama.yaml"),
        help="loss-curve mode: the pretrain config",
    )
    parser.add_argument("--recipe", default="tensorwise", choices=sorted(RECIPES), help="loss-curve mode's recipe")
    parser.add_argument("--tail", type=int, default=20, help="loss-curve mode: steps averaged at the end")
    if "--tiny" in argv and "--steps" not in argv:  # the smoke run's sizes, which the flags given override
        argv = [*TINY_STEP, *argv]
    args = step.parse_common(parser, argv, COMPILERS)
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.steps is not None:
        return curve_mode(args)
    step.set_tf32(args.tf32)
    return step_mode(args)


if __name__ == "__main__":
    main()
