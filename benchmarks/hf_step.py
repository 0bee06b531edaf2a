"""Hugging Face causal-LM training steps with a padding attention mask, under several compilers, per model family.

    python benchmarks/hf_step.py [--families llama] [--shape tinyllama] [--micro_batch_size 4] [--seq_len 2048]
        [--compilers eager,torch.compile,fulmen,fulmen.dynamo] [--executors NAME,...] [--out benchmarks/hf_step.json]

The family sweep (each family's own transformers model class, at about 1B parameters):

    python benchmarks/hf_step.py --families llama,qwen2,mistral,gemma2,gemma3,phi3 --shape llama-3.2-1b \\
        --out benchmarks/hf_step_sweep_h200.json

Every family is built from its own config class with the sizes of `--shape` and the family's defaults otherwise
(Qwen2's q/k/v biases, Mistral's sliding window, Gemma 2's logit soft-capping, alternating local/global layers and
sandwich norms, Gemma 3's query/key norms and 512-token local windows, Phi-3's fused qkv and gate/up projections):
`tinyllama` is TinyLlama-1.1B's shape (22 layers, hidden 2048, 32 heads, 4 KV heads, MLP 5632, vocabulary 32000),
`llama-3.2-1b` Llama-3.2-1B's blocks (16 layers, hidden 2048, 32 heads of 64, 8 KV heads, MLP 8192) with a
32000-token vocabulary (about 1.1B parameters; fewer layers than TinyLlama keep torch.compile's first step, the
sweep's largest cost, shorter). Random weights in the benchmark dtype, SDPA attention. Every row trains a family on
the same batch: `model(input_ids, attention_mask=mask, labels=input_ids).loss` (the loss is the model's own shifted
cross-entropy), where the mask left-pads the first sequence by an eighth of its length, so the masked attention
path runs, as in fine-tuning on padded batches. `fulmen` is `fulmen.jit` of that function; `fulmen.dynamo` is
`torch.compile(..., backend=fulmen.dynamo.backend(executors))`: Dynamo captures, fulmen compiles, Inductor takes
what fulmen refuses (the JSON lists the pieces). Timing, memory, the kernel families of the GPU time (torch.profiler
over `--profile_steps` steps) and the JSON are benchmarks/step.py's (same `time_steps`: AdamW, a first step,
warmup, median of timed steps), so the rows compare with that script's; each family also reports every row's ms/step
and peak memory over torch.compile's. CPU smoke test:

    python benchmarks/hf_step.py --device cpu --dtype fp32 --shape tiny --seq_len 32 --micro_batch_size 2 --iters 2 \\
        --warmup 1 --families llama,gemma3 --compilers eager,fulmen,fulmen.dynamo --out /tmp/hf_step.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step  # noqa: E402 - the shared measurement code (benchmarks/step.py)

import fulmen  # noqa: E402

COMPILERS = ("eager", "torch.compile", "fulmen", "fulmen.dynamo")
SHAPES = {
    "tinyllama": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=64),
    "llama-3.2-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
}
COMMON = dict(max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, attention_dropout=0.0)
# Each family's config class and what it sets beyond the shape (its other settings are the family's defaults).
FAMILIES: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "llama": (LlamaConfig, dict(tie_word_embeddings=False)),
    "qwen2": (Qwen2Config, dict(tie_word_embeddings=False)),
    "mistral": (MistralConfig, dict(tie_word_embeddings=False)),
    "gemma2": (Gemma2Config, dict(query_pre_attn_scalar=64)),
    "gemma3": (Gemma3TextConfig, dict(query_pre_attn_scalar=64, sliding_window=512)),
    "phi3": (Phi3Config, dict(tie_word_embeddings=False)),
}


def forward_and_loss(model: PreTrainedModel, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, attention_mask=mask, labels=input_ids).loss


def make_config(family: str, shape: str) -> PretrainedConfig:
    config_class, settings = FAMILIES[family]
    return config_class(**SHAPES[shape], **COMMON, **settings, attn_implementation="sdpa")


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    config = make_config(args.family, args.shape)
    torch.manual_seed(args.seed)
    with torch.device(device), step.default_dtype(dtype):
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype)


def make_batch(args: argparse.Namespace, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (args.micro_batch_size, args.seq_len), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, : args.seq_len // 8] = 0
    return ids.to(device), mask.to(device)


def flops_per_step(model: PreTrainedModel, args: argparse.Namespace) -> float:
    """LitGPT's estimate (what benchmarks/step.py reports): 3 * (2 * n_params * T + 4 * n_layer * n_embd * T**2)
    per sequence."""
    config, t = model.config, args.seq_len
    n_params = sum(p.numel() for p in model.parameters())
    return 3 * (2 * n_params * t + 4 * config.num_hidden_layers * config.hidden_size * t**2) * args.micro_batch_size


def make_loss_fn(name: str, mode: str, model: PreTrainedModel, args: argparse.Namespace,
                 backends: list[Any]) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """The row's `loss_fn(ids, mask)`; fulmen's rows append what `fulmen.last_traces` reads to `backends`."""
    if name == "eager":
        return lambda ids, mask: forward_and_loss(model, ids, mask)
    if name == "fulmen":
        def compile_(fn: Any) -> Any:
            backends.append(fulmen.jit(fn, executors=args.executors))
            return backends[-1]
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
              "free_running_ms_per_iter": timed["free_running_ms_per_iter"],
              "first_step_s": timed["first_step_s"],
              "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
              "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9 if device.type == "cuda" else None,
              "tokens_per_s": args.micro_batch_size * args.seq_len / median_s,
              "mfu": flops_per_step(model, args) / (median_s * peak) if peak else None,
              "n_params": sum(p.numel() for p in params),
              "first_loss": timed["first_loss"], "final_loss": timed["final_loss"],
              "params_with_grad": timed["params_with_grad"], **timed.get("profile", {})}
    if name == "fulmen.dynamo":
        result["dynamo_report"] = backends[-1].report()
    if args.traces and name.startswith("fulmen"):
        write_traces(backends[-1], Path(args.traces) / f"{args.family}_{name}")
    return result


def write_traces(jitted: Any, stem: Path) -> None:
    """The final forward and backward traces fulmen ran (one file each per fulmen piece under fulmen.dynamo)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    kinds = {"forward": fulmen.last_traces(jitted), "backward": fulmen.last_backward_traces(jitted)}
    if not isinstance(jitted, fulmen.dynamo.FulmenBackend):  # fulmen.jit: every pass's trace, the last one ran
        kinds = {kind: traces[-1:] for kind, traces in kinds.items()}
    for kind, traces in kinds.items():
        stem.with_name(f"{stem.name}_{kind}.py").write_text("\n\n".join(str(trace) for trace in traces))


def run_family(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """Every compiler on one family: its results, and their ratios to eager's and torch.compile's."""
    results: dict[str, dict] = {}
    for name in args.compilers:
        print(f"{args.family} {name}: running", flush=True)
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
        print(f"{args.family} {name}: {results[name]['status']}", flush=True)
    ratios = step.ratios_to(results, "eager")
    print(f"\n{args.family} ({args.shape})")
    step.print_table(results, ratios)
    return {"config": make_config(args.family, args.shape).to_diff_dict(), "results": results,
            "ratios_vs_eager": ratios, "ratios_vs_torch_compile": step.ratios_to(results, "torch.compile")}


def print_sweep(families: dict[str, dict]) -> None:
    """Each family's rows over torch.compile's: ms/step, peak memory and first step."""
    print(f"\n{'family':10}{'compiler':16}{'ms/step':>9}{'x t.c':>7}{'free ms':>9}{'x t.c':>7}{'peak GB':>9}"
          f"{'x t.c':>7}{'1st s':>8}")
    for family, report in families.items():
        for name, r in report["results"].items():
            ratio = report["ratios_vs_torch_compile"].get(name, {})
            cells = (f"{r['ms_per_iter']:9.1f}{step.fmt(ratio.get('ms_per_iter'), '.3f'):>7}"
                     f"{step.fmt(r.get('free_running_ms_per_iter'), '.1f'):>9}"
                     f"{step.fmt(ratio.get('free_running_ms_per_iter'), '.3f'):>7}"
                     f"{step.fmt(r['peak_gb'], '.1f'):>9}{step.fmt(ratio.get('peak_gb'), '.3f'):>7}"
                     f"{r['first_step_s']:8.1f}") if r["status"] == "ok" else f"  {r['status']}: {r.get('error')}"
            print(f"{family:10}{name:16}{cells}")


def main(argv: list[str] | None = None) -> dict:
    parser = step.make_parser(__doc__, COMPILERS, "benchmarks/hf_step.json")
    parser.add_argument("--families", default="llama", help=f"comma list from {','.join(FAMILIES)}")
    parser.add_argument("--shape", default="tinyllama", choices=sorted(SHAPES), help="the models' sizes")
    parser.add_argument("--tiny", action="store_true", help="--shape tiny (smoke tests)")
    parser.add_argument("--traces", default=None, help="a folder for the fulmen rows' final traces")
    args = step.parse_common(parser, argv, COMPILERS)
    if args.tiny:
        args.shape = "tiny"
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {list(FAMILIES)}")
    device, dtype = torch.device(args.device), step.DTYPES[args.dtype]
    report = {"benchmark": "Hugging Face causal-LM training steps with a padding mask, per family",
              "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "torch": torch.__version__, "transformers": step.version("transformers"),
              "fulmen_git": step.git_revision(), "args": vars(args), "families": {}}
    for family in families:
        args.family = family
        report["families"][family] = run_family(args, device, dtype)
        report["args"] = {**vars(args), "family": None}
        step.write_report(report, args.out)  # after every family: a run cut short keeps the families it finished
    print_sweep(report["families"])
    return report


if __name__ == "__main__":
    main()
