"""`python -m fulmen.pretrain [--config configs/<name>.yaml] [--train.micro_batch_size 8] ...`: LitGPT-style
pretraining with fulmen as the compiler.

The arguments are those of `setup` below (jsonargparse: `--print_config` prints the full configuration, a YAML
file sets any of them, dotted flags override single fields). Without any, it trains the embedded tiny default: a
2-layer Llama-style model with a byte vocabulary on the corpus shipped with fulmen, on CPU when there is no GPU.

As in LitGPT (and jsonargparse), a later argument overrides an earlier one; a `--config` file that would override
a flag given before it is refused (put `--config` first). `--optimizer.lr 0.5`, `--optimizer.init_args.lr 0.5` and
`--optimizer SGD --optimizer.momentum 0.9` change the optimizer; `--model_config.<key> <value>` changes one key of
the model the run would otherwise train (the embedded tiny one, a `--model_name`, or a config file's).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace
from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config, name_to_config
from litgpt.data import DataModule

from fulmen.pretrain.run import run
from fulmen.pretrain.settings import TINY, FSDPArgs, Settings, SettingsError, make_config

OptimizerFactory = Callable[[Iterable], torch.optim.Optimizer]
DEFAULT_OPTIMIZER = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-3, "weight_decay": 0.1,
                                                                      "betas": [0.9, 0.95]}}


def setup(
    model_name: str | None = None,
    model_config: Config | None = None,
    out_dir: Path = Path("out/pretrain/fulmen-tiny"),
    precision: Literal["bf16-true", "bf16-mixed", "32-true", "16-mixed"] | None = None,
    resume: bool | Literal["auto"] | Path = False,
    allow_model_change: bool = False,
    data: DataModule | None = None,
    tokenizer_dir: Path | None = None,
    train: TrainArgs = TrainArgs(save_interval=100, log_interval=20, global_batch_size=16, micro_batch_size=8,
                                 max_steps=400, max_seq_length=128, lr_warmup_steps=20, max_norm=1.0, min_lr=1e-4),
    eval: EvalArgs = EvalArgs(interval=100, max_iters=10, initial_validation=False, final_validation=True),
    optimizer: str | dict | OptimizerFactory = DEFAULT_OPTIMIZER,
    devices: int | str = "auto",
    num_nodes: int = 1,
    compiler: Literal["fulmen", "torch"] | None = "fulmen",
    executors: list[str] | None = None,
    offload: float | None = None,
    cuda_graphs: bool = False,
    activation_memory_budget: float = 1.0,
    float8: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = None,
    whole_step: bool = True,
    strategy: Literal["auto", "ddp", "fsdp"] = "auto",
    fsdp: FSDPArgs = FSDPArgs(),
    logger_name: Literal["csv", "tensorboard"] = "csv",
    seed: int = 42,
) -> dict:
    """Pretrain a LitGPT model with fulmen.

    Arguments:
        model_name: a LitGPT config name (e.g. tiny-llama-1.1b); mutually exclusive with model_config.
        model_config: a LitGPT `Config`; without either, the embedded tiny model.
        out_dir: where checkpoints (`step-XXXXXXXX/`, `final/`), logs and the configuration go.
        precision: "bf16-true", "bf16-mixed", "32-true" or "16-mixed"; default bf16-true on a GPU with bf16,
            32-true on CPU.
        resume: False, "auto" (the newest complete checkpoint in out_dir, if there is one), True (there must be
            one) or a checkpoint path.
        allow_model_change: resume even when the checkpoint's model_config.yaml differs from this run's model.
        data: a LitGPT data module; default: the corpus shipped with fulmen (`fulmen.pretrain.ShippedCorpus`).
        tokenizer_dir: a LitGPT checkpoint directory holding the tokenizer, for data modules that need one.
        train: LitGPT's training arguments (batch sizes, max_tokens or max_steps, warmup, min_lr, max_norm, ...).
        eval: LitGPT's evaluation arguments (interval, max_iters, initial/final validation).
        optimizer: a torch.optim class ({class_path, init_args}, or its name); from Python also a callable that
            makes the optimizer from the parameters.
        devices: devices per node ("auto": every GPU, or 1 CPU process).
        num_nodes: nodes (launch the same command on each, or under torchrun / SLURM).
        compiler: "fulmen" jits forward_and_loss (the loss is in the trace), "torch" uses torch.compile, null eager.
        executors: fulmen's executor list, e.g. [sdpa, torchcompile, torch]; default fulmen's.
        offload: the share of the activations saved for the backward that fulmen offloads to CPU memory (CUDA),
            in (0, 1], the longest-lived first; null: none.
        cuda_graphs: fulmen replays the step's forward and backward as CUDA graphs (`JitOptions.cuda_graphs`),
            for small models and batches whose steps are launch-bound; a program it cannot capture (CPU, ddp, fsdp)
            runs without, with a warning.
        activation_memory_budget: the bytes fulmen's forward saves for the backward, as a share of its default
            (`JitOptions.activation_memory_budget`); below 1 the backward recomputes matmuls to fit.
        float8: fulmen computes the linears with float8 matmuls, by torchao's recipe of this name
            (`JitOptions.float8`; the lm_head stays in high precision); null: as eager.
        whole_step: fulmen jits each step's last micro-batch whole: forward, backward, gradient clipping and the
            optimizer's step in one trace (`fulmen.jit(train_step)`: one program per step, each parameter updated
            right after its gradient), where that applies: compiler fulmen, one process, an SGD, Adam or AdamW
            optimizer, a precision without a gradient scaler, and none of offload, cuda_graphs, float8 or an
            activation_memory_budget below 1 (the run says which kept it off); false: forward_and_loss is jitted
            and the backward and the step run outside.
        strategy: "auto" (one device: none; several: ddp), "ddp" or "fsdp" (fulmen's Fabric strategies).
        fsdp: the FSDP strategy's options (`float8_all_gather`: with float8 tensorwise, gather weights in float8).
        logger_name: "csv" or "tensorboard".
        seed: seeds the weights and the data order.
    """
    return run(Settings(**locals()))  # exactly the parameters above


def make_parser() -> ArgumentParser:
    parser = ArgumentParser(default_meta=False, allow_abbrev=False,  # a misspelt key is an error, not a guess
                            description=(setup.__doc__ or "").splitlines()[0])
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file of these arguments")
    parser.add_function_arguments(setup, as_positional=False, skip={"optimizer"})
    # jsonargparse's subclass type: --optimizer.lr, --optimizer.init_args.lr and --optimizer SGD work and are typed
    parser.add_argument("--optimizer", type=OptimizerFactory, default=DEFAULT_OPTIMIZER,
                        help="a torch.optim class: its name or class_path, and init_args")
    return parser


def _quiet(argv: list[str]) -> list[str]:
    """`argv` without `--print_config` (and its value), to parse it without printing and exiting."""
    kept: list[str] = []
    skip_value = False
    for arg in argv:
        if skip_value and not arg.startswith("-"):
            skip_value = False
            continue
        skip_value = arg == "--print_config"
        if not arg.startswith("--print_config"):
            kept.append(arg)
    return kept


def _flags(argv: list[str]) -> list[tuple[str, int, int]]:
    """(key, start, end) of every `--key value`, `--key=value` and `--key` (no value follows) in `argv`."""
    found, index = [], 0
    while index < len(argv):
        arg = argv[index]
        if not arg.startswith("--"):
            index += 1
            continue
        valued = "=" not in arg and index + 1 < len(argv) and not argv[index + 1].startswith("--")
        found.append((arg[2:].split("=", 1)[0], index, index + 1 + valued))
        index += 1 + valued
    return found


def _differences(first: Namespace, second: Namespace) -> list[str]:
    a, b = first.as_dict(), second.as_dict()

    def walk(x: Any, y: Any, prefix: str) -> list[str]:
        if isinstance(x, dict) and isinstance(y, dict):
            return [d for key in sorted(set(x) | set(y), key=str)
                    for d in walk(x.get(key), y.get(key), f"{prefix}.{key}" if prefix else str(key))]
        return [] if x == y else [prefix]

    return walk(a, b, "")


def _check_config_order(parser: ArgumentParser, argv: list[str], parsed: Namespace) -> None:
    """Refuses a `--config` that overrides a flag given before it (the later one wins, silently otherwise)."""
    flags = _flags(argv)
    configs = [(start, end) for key, start, end in flags if key == "config"]
    if not configs or all(key == "config" for key, start, _ in flags if start < configs[-1][0]):
        return
    first = [arg for start, end in configs for arg in argv[start:end]]
    rest = [arg for index, arg in enumerate(argv) if not any(start <= index < end for start, end in configs)]
    clobbered = _differences(parsed, parser.parse_args(first + rest))
    if clobbered:
        raise SettingsError(f"a --config file given after other flags overrides them: {', '.join(clobbered)}. The "
                            "later argument wins (as in LitGPT), so those flags would be ignored: put --config first")


def _model_base(parser: ArgumentParser, argv: list[str], parsed: Namespace) -> list[str]:
    """`--model_config.<key>` flags without a whole model_config to change would change LitGPT's default `Config`
    (16 layers, 4096 wide). They change the model the run would otherwise train: the named model, or the tiny one."""
    dotted = [(start, end) for key, start, end in _flags(argv) if key.startswith("model_config.")]
    if not dotted or parsed.model_config is None:
        return argv
    without = [arg for index, arg in enumerate(argv) if not any(start <= index < end for start, end in dotted)]
    base = parser.parse_args(_quiet(without))
    if base.model_config is not None or (base.model_name is not None and base.model_name not in name_to_config):
        return argv  # a config file or a whole --model_config is there to change (or the name is unknown: refused)
    model = Config.from_name(base.model_name) if base.model_name is not None else TINY
    start = dotted[0][0]
    whole = f"--model_config={json.dumps(dataclasses.asdict(model))}"
    return [*argv[:start], whole, *argv[start:], "--model_name=null"]


def resolve_arguments(parser: ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` checked for a `--config` that overrides earlier flags, with `--model_config.<key>` flags given the
    model they change."""
    if any(arg in ("-h", "--help") or arg.split("=")[0].endswith(".help") for arg in argv):
        return argv
    quiet = _quiet(argv)
    parsed = parser.parse_args(quiet)
    _check_config_order(parser, quiet, parsed)
    return _model_base(parser, argv, parsed)


def parse_and_run(argv: list[str]) -> dict:
    """The command line `argv` run; returns what `setup` returns (losses, validation losses, a summary)."""
    parser = make_parser()
    parsed = parser.parse_args(resolve_arguments(parser, argv))
    if parsed.model_config is not None:  # LitGPT's Config asserts: say which key is wrong before it does
        make_config(parsed.model_config.as_dict())
    arguments = parser.instantiate_classes(parsed).as_dict()
    arguments.pop("config", None)
    return setup(**arguments)


def main(argv: list[str] | None = None) -> None:
    try:
        parse_and_run(list(sys.argv[1:] if argv is None else argv))
    except SettingsError as error:  # a refused setting, found before anything was written: no traceback
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
