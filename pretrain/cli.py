"""`python -m fulmen.pretrain [--config configs/<name>.yaml] [--train.micro_batch_size 8] ...`: LitGPT-style
pretraining with fulmen as the compiler.

The arguments are those of `setup` below (jsonargparse: `--print_config` prints the full configuration, a YAML
file sets any of them, dotted flags override single fields). Without any, it trains the embedded tiny default: a
2-layer Llama-style model with a byte vocabulary on the corpus shipped with fulmen, on CPU when there is no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from jsonargparse import CLI
from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.data import DataModule

from fulmen.distributed import FSDPBucketingStrategy, FSDPType

TINY = Config(name="fulmen-tiny", block_size=128, vocab_size=256, padded_vocab_size=256, n_layer=2, n_head=4,
              n_embd=64, n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False,
              norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=176)


@dataclass
class FSDPArgs:
    """ThunderFSDPStrategy's options (strategy: fsdp)."""

    sharding_strategy: Literal["ZERO2", "ZERO3"] = "ZERO3"
    bucketing_strategy: Literal["NONE", "LAYER", "BLOCK"] = "BLOCK"
    state_dict_type: Literal["full", "sharded"] = "full"

    def __post_init__(self) -> None:  # the enums' own spellings are accepted too
        self.sharding_strategy = FSDPType[str(self.sharding_strategy).upper()].name
        self.bucketing_strategy = FSDPBucketingStrategy[str(self.bucketing_strategy).upper()].name


def setup(
    model_name: str | None = None,
    model_config: Config | None = None,
    out_dir: Path = Path("out/pretrain/fulmen-tiny"),
    precision: Literal["bf16-true", "bf16-mixed", "32-true", "16-mixed"] | None = None,
    resume: bool | Literal["auto"] | Path = False,
    data: DataModule | None = None,
    tokenizer_dir: Path | None = None,
    train: TrainArgs = TrainArgs(save_interval=100, log_interval=20, global_batch_size=16, micro_batch_size=8,
                                 max_steps=400, max_seq_length=128, lr_warmup_steps=20, max_norm=1.0, min_lr=1e-4),
    eval: EvalArgs = EvalArgs(interval=100, max_iters=10, initial_validation=False, final_validation=True),
    optimizer: str | dict = {"class_path": "torch.optim.AdamW",
                             "init_args": {"lr": 3e-3, "weight_decay": 0.1, "betas": [0.9, 0.95]}},
    devices: int | str = "auto",
    num_nodes: int = 1,
    compiler: Literal["fulmen", "torch"] | None = "fulmen",
    executors: list[str] | None = None,
    cuda_graphs: bool = False,
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
        resume: False, "auto" (the latest checkpoint in out_dir if there is one), True (it must exist) or a
            checkpoint path.
        data: a LitGPT data module; default: the corpus shipped with fulmen (`fulmen.pretrain.ShippedCorpus`).
        tokenizer_dir: a LitGPT checkpoint directory holding the tokenizer, for data modules that need one.
        train: LitGPT's training arguments (batch sizes, max_tokens or max_steps, warmup, min_lr, max_norm, ...).
        eval: LitGPT's evaluation arguments (interval, max_iters, initial/final validation).
        optimizer: an optimizer name from torch.optim or {class_path, init_args}.
        devices: devices per node ("auto": every GPU, or 1 CPU process).
        num_nodes: nodes (launch the same command on each, or under torchrun / SLURM).
        compiler: "fulmen" jits forward_and_loss (the loss is in the trace), "torch" uses torch.compile, null eager.
        executors: fulmen's executor list, e.g. [sdpa, torchcompile, torch]; default fulmen's.
        cuda_graphs: fulmen replays the step's forward and backward as CUDA graphs (`JitOptions.cuda_graphs`),
            for small models and batches whose steps are launch-bound; a program it cannot capture (CPU, ddp, fsdp)
            runs without, with a warning.
        strategy: "auto" (one device: none; several: ddp), "ddp" or "fsdp" (fulmen's Fabric strategies).
        fsdp: the FSDP strategy's options.
        logger_name: "csv" or "tensorboard".
        seed: seeds the weights and the data order.
    """
    arguments = dict(locals())  # exactly the parameters above
    from fulmen.pretrain.run import Settings, run  # run.py imports this module's defaults

    return run(Settings(**arguments))


def main(argv: list[str] | None = None) -> None:
    CLI(setup, args=argv, as_positional=False, allow_abbrev=False)  # a misspelt key is an error, not a guess


if __name__ == "__main__":
    main()
