"""A Hugging Face `LlamaForCausalLM` training step with a padding attention mask, under several compilers.

    python benchmarks/hf_step.py [--micro_batch_size 4] [--seq_len 2048]
        [--compilers eager,torch.compile,fulmen,fulmen.dynamo] [--executors NAME,...] [--out benchmarks/hf_step.json]

The model is transformers' own Llama at TinyLlama-1.1B's shape (22 layers, hidden 2048, 32 heads, 4 KV heads, MLP
5632, vocabulary 32000), random weights in the benchmark dtype, SDPA attention. Every row trains it on the same
batch: `model(input_ids, attention_mask=mask, labels=input_ids).loss` (the loss is the model's own shifted
cross-entropy), where the mask left-pads the first sequence by an eighth of its length, so the masked attention
path runs, as in fine-tuning on padded batches. `fulmen` is `fulmen.jit` of that function; `fulmen.dynamo` is
`torch.compile(..., backend=fulmen.dynamo.backend(executors))`: Dynamo captures, fulmen compiles, Inductor takes
what fulmen refuses (the JSON lists the pieces). Timing, memory and the JSON are benchmarks/step.py's (same
`time_steps`: AdamW, a first step, warmup, median of timed steps), so the rows compare with that script's.
CPU smoke test:

    python benchmarks/hf_step.py --device cpu --dtype fp32 --tiny --seq_len 32 --micro_batch_size 2 --iters 2 \\
        --warmup 1 --compilers eager,fulmen,fulmen.dynamo --out /tmp/hf_step.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step  # noqa: E402 - the shared measurement code (benchmarks/step.py)

import fulmen  # noqa: E402

COMPILERS = ("eager", "torch.compile", "fulmen", "fulmen.dynamo")
TINYLLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5,
                 rope_theta=10000.0, tie_word_embeddings=False)
TINY = dict(TINYLLAMA, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def forward_and_loss(model: LlamaForCausalLM, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, attention_mask=mask, labels=input_ids).loss


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(**(TINY if args.tiny else TINYLLAMA), attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    with torch.device(device), step.default_dtype(dtype):
        model = LlamaForCausalLM(config)
    return model.to(dtype)


def make_batch(args: argparse.Namespace, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (args.micro_batch_size, args.seq_len), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, : args.seq_len // 8] = 0
    return ids.to(device), mask.to(device)


def flops_per_step(model: LlamaForCausalLM, args: argparse.Namespace) -> float:
    """LitGPT's estimate (what benchmarks/step.py reports): 3 * (2 * n_params * T + 4 * n_layer * n_embd * T**2)
    per sequence."""
    config, t = model.config, args.seq_len
    n_params = sum(p.numel() for p in model.parameters())
    return 3 * (2 * n_params * t + 4 * config.num_hidden_layers * config.hidden_size * t**2) * args.micro_batch_size


def make_loss_fn(name: str, mode: str, model: LlamaForCausalLM, args: argparse.Namespace,
                 backends: list[fulmen.dynamo.FulmenBackend]) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    if name == "eager":
        return lambda ids, mask: forward_and_loss(model, ids, mask)
    if name == "fulmen":
        compile_: Callable[[Any], Any] = lambda fn: fulmen.jit(fn, executors=args.executors)
    elif name == "torch.compile":
        compile_ = torch.compile
    else:
        backends.append(fulmen.dynamo.backend(executors=args.executors))
        compile_ = lambda fn: torch.compile(fn, backend=backends[-1])
    if mode == "function":
        compiled = compile_(forward_and_loss)
        return lambda ids, mask: compiled(model, ids, mask)
    compiled_model = compile_(model)
    return lambda ids, mask: forward_and_loss(compiled_model, ids, mask)


def run(name: str, mode: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = build(args, device, dtype)
    params = list(model.parameters())
    ids, mask = make_batch(args, model.config.vocab_size, device)
    backends: list[fulmen.dynamo.FulmenBackend] = []
    timed = step.time_steps(make_loss_fn(name, mode, model, args, backends), params, ids, mask, args,
                            lambda: step.sync(device))
    median_s = statistics.median(timed["iter_ms"]) / 1e3
    peak = step.peak_flops(device, dtype)
    result = {"status": "ok", "mode": mode, "ms_per_iter": median_s * 1e3, "iter_ms": timed["iter_ms"],
              "first_step_s": timed["first_step_s"],
              "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
              "tokens_per_s": args.micro_batch_size * args.seq_len / median_s,
              "mfu": flops_per_step(model, args) / (median_s * peak) if peak else None,
              "first_loss": timed["first_loss"], "final_loss": timed["final_loss"],
              "params_with_grad": timed["params_with_grad"]}
    if backends:
        result["dynamo_report"] = backends[-1].report()
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = step.make_parser(__doc__, COMPILERS, "benchmarks/hf_step.json")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide Llama (smoke tests)")
    args = step.parse_common(parser, argv, COMPILERS)
    device, dtype = torch.device(args.device), step.DTYPES[args.dtype]
    results: dict[str, dict] = {}
    for name in args.compilers:
        print(f"{name}: running", flush=True)
        errors: dict[str, str] = {}
        for mode in ("function",) if name == "eager" else ("function", "module"):
            try:
                results[name] = run(name, mode, args, device, dtype)
                break
            except Exception as error:  # noqa: BLE001 - recorded, the next compiler still runs
                errors[mode] = f"{type(error).__name__}: {error}"
            finally:
                step.cleanup("torch.compile" if name in ("torch.compile", "fulmen.dynamo") else name, device)
        else:
            results[name] = {"status": "error", "error": errors["function"], "errors": errors}
        if errors and results[name]["status"] == "ok":
            results[name]["function_mode_error"] = errors["function"]
        print(f"{name}: {results[name]['status']}", flush=True)
    eager = results.get("eager", {})
    ratios = {name: {"ms_per_iter": r["ms_per_iter"] / eager["ms_per_iter"]} for name, r in results.items()
              if r["status"] == "ok" and eager.get("status") == "ok"}
    step.print_table(results, ratios)
    report = {"benchmark": "Hugging Face LlamaForCausalLM training step with a padding mask", "device": str(device),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "torch": torch.__version__, "transformers": step.version("transformers"),
              "fulmen_git": step.git_revision(), "args": vars(args), "results": results,
              "ratios_vs_eager": ratios}
    step.write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
