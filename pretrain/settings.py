"""The pretraining run's settings and everything that can be wrong with them, checked before anything is written:
each error names the setting, its value and what is allowed."""

from __future__ import annotations

import importlib.util
import math
import os
import tempfile
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config, name_to_config
from litgpt.data import DataModule
from litgpt.model import GPT
from litgpt.utils import instantiate_torch_optimizer

import fulmen
from fulmen.distributed import FSDPBucketingStrategy, FSDPType
from fulmen.pretrain.corpus import ShippedCorpus

# the embedded default model: 2 Llama-style layers, a byte vocabulary (configs/tiny.yaml spells it out)
TINY = Config(name="fulmen-tiny", block_size=128, vocab_size=256, padded_vocab_size=256, n_layer=2, n_head=4,
              n_embd=64, n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False,
              norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=176)


@dataclass
class FSDPArgs:
    """ThunderFSDPStrategy's options (strategy: fsdp)."""

    sharding_strategy: Literal["ZERO2", "ZERO3"] = "ZERO3"
    bucketing_strategy: Literal["NONE", "LAYER", "BLOCK"] = "BLOCK"
    state_dict_type: Literal["full", "sharded"] = "full"
    float8_all_gather: bool = False  # with float8: tensorwise, all-gather the weights in float8 (fulmen's, not torch's)

    def __post_init__(self) -> None:  # the enums' own spellings are accepted too
        self.sharding_strategy = FSDPType[str(self.sharding_strategy).upper()].name
        self.bucketing_strategy = FSDPBucketingStrategy[str(self.bucketing_strategy).upper()].name


@dataclass
class Settings:
    """`fulmen.pretrain.setup`'s arguments."""

    model_name: str | None
    model_config: Config | None
    out_dir: Path
    precision: str | None
    resume: bool | Literal["auto"] | Path
    allow_model_change: bool
    data: DataModule | None
    tokenizer_dir: Path | None
    train: TrainArgs
    eval: EvalArgs
    optimizer: str | dict | Callable[[Iterable], torch.optim.Optimizer]
    devices: int | str
    num_nodes: int
    compiler: str | None
    executors: list[str] | None
    offload: float | None
    cuda_graphs: bool
    activation_memory_budget: float
    float8: str | None
    whole_step: bool
    strategy: str
    fsdp: FSDPArgs
    logger_name: str
    seed: int

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)


@dataclass(frozen=True)
class Rule:
    """`key` (a dotted path into Settings) must satisfy `test`; `allowed` says what that means."""

    key: str
    allowed: str
    test: Callable[[Any], bool]


def _int(low: int, none: bool = False) -> Callable[[Any], bool]:
    return lambda v: (none and v is None) or (isinstance(v, int) and not isinstance(v, bool) and v >= low)


def _number(positive: bool, none: bool = False) -> Callable[[Any], bool]:
    return lambda v: (none and v is None) or (isinstance(v, int | float) and not isinstance(v, bool)
                                              and math.isfinite(v) and (v > 0 if positive else v >= 0))


def _unsupported(default: Any) -> Callable[[Any], bool]:
    return lambda v: v == default


RULES = (
    Rule("train.global_batch_size", "a positive integer", _int(1)),
    Rule("train.micro_batch_size", "a positive integer", _int(1)),
    Rule("train.log_interval", "a positive number of steps", _int(1)),
    Rule("train.save_interval", "a positive number of steps, or 0 / null (only the final checkpoint)",
         _int(0, none=True)),
    Rule("train.max_steps", "a positive integer or null", _int(1, none=True)),
    Rule("train.max_tokens", "a positive integer or null", _int(1, none=True)),
    Rule("train.max_seq_length", "a positive integer, or null (the model's block_size)", _int(1, none=True)),
    Rule("train.lr_warmup_steps", "an integer >= 0, or null", _int(0, none=True)),
    Rule("train.max_norm", "a positive number, or null (no clipping)", _number(True, none=True)),
    Rule("train.min_lr", "a finite number >= 0", _number(False)),
    Rule("train.lr_warmup_fraction", "null: fulmen.pretrain warms up over train.lr_warmup_steps",
         _unsupported(None)),
    Rule("train.epochs", "null: fulmen.pretrain stops after train.max_steps or train.max_tokens", _unsupported(None)),
    Rule("train.max_time", "null: fulmen.pretrain stops after train.max_steps or train.max_tokens",
         _unsupported(None)),
    Rule("train.tie_embeddings", "null or false: fulmen.pretrain does not tie embeddings",
         lambda v: v is None or v is False),
    Rule("eval.interval", "a number of steps >= 0 (0: no validation during training)", _int(0)),
    Rule("eval.max_iters", "a positive integer", _int(1)),
    Rule("eval.max_new_tokens", "null: LitGPT's finetuning generates text, pretraining does not",
         _unsupported(None)),
    Rule("eval.evaluate_example", "'first': LitGPT's finetuning generates text, pretraining does not",
         _unsupported("first")),
    Rule("devices", "a positive integer or 'auto'", lambda v: v == "auto" or _int(1)(v)),
    Rule("num_nodes", "a positive integer", _int(1)),
    Rule("seed", "an integer in [0, 2**32 - 1] (Lightning seeds 0 instead of one outside)",
         lambda v: _int(0)(v) and v < 2**32),
)
MODEL_RULES = tuple(Rule(f"model_config.{key}", "a positive integer", _int(1)) for key in (
    "block_size", "vocab_size", "n_layer", "n_head", "n_embd")) + tuple(
    Rule(f"model_config.{key}", "a positive integer, or null (derived from the others)", _int(1, none=True))
    for key in ("padded_vocab_size", "n_query_groups", "intermediate_size", "head_size")) + (
    Rule("model_config.rotary_percentage", "a number in (0, 1]", lambda v: isinstance(v, int | float) and 0 < v <= 1),)


def _lookup(root: Any, key: str) -> Any:
    for part in key.split("."):
        root = getattr(root, part)
    return root


def _apply(rules: Iterable[Rule], root: Any, prefix: str = "") -> None:
    for rule in rules:
        value = _lookup(root, rule.key[len(prefix):])
        if not rule.test(value):
            raise SettingsError(f"{rule.key} must be {rule.allowed}, got {value!r}")


def model_config(settings: Settings) -> Config:
    """The model the run trains."""
    if settings.model_name is not None and settings.model_name not in name_to_config:
        close = sorted(n for n in name_to_config if settings.model_name.lower()[:6] in n.lower())[:8]
        raise SettingsError(f"model_name {settings.model_name!r} is not a LitGPT config name"
                            + (f"; close ones: {close}" if close else ""))
    if settings.model_name is not None and settings.model_config is not None:
        raise SettingsError(f"model_name ({settings.model_name}) and model_config are mutually exclusive: give one. "
                            "On the command line, --model_config.<key> flags change the named model")
    if settings.model_name is None:
        return settings.model_config or TINY
    return Config.from_name(settings.model_name)


def world_size(settings: Settings) -> int:
    devices = max(1, torch.cuda.device_count()) if settings.devices == "auto" else settings.devices
    return devices * settings.num_nodes


def optimizer_factory(optimizer: str | dict | Callable) -> Callable[[Iterable], torch.optim.Optimizer]:
    if isinstance(optimizer, dict) and not ("class_path" in optimizer and set(optimizer) <= {"class_path",
                                                                                            "init_args"}):
        raise SettingsError(f"optimizer must be a torch.optim class name or {{class_path, init_args}}, got "
                            f"{optimizer!r} (on the command line: --optimizer.lr 0.5 or --optimizer.init_args.lr 0.5)")
    if isinstance(optimizer, str | dict):
        return partial(instantiate_torch_optimizer, {"init_args": {}, **optimizer}
                       if isinstance(optimizer, dict) else optimizer)
    if callable(optimizer):
        return optimizer
    raise SettingsError(f"optimizer must be a torch.optim class name, {{class_path, init_args}} or a callable, got "
                        f"{optimizer!r}")


def _check_optimizer(settings: Settings) -> Callable[[Iterable], torch.optim.Optimizer]:
    """The optimizer's factory, after making one (for a stand-in parameter) so torch checks its arguments now."""
    make = optimizer_factory(settings.optimizer)
    try:
        lr = make([torch.nn.Parameter(torch.zeros(1))]).param_groups[0]["lr"]
    except (ValueError, TypeError, ImportError, AttributeError, KeyError) as error:
        raise SettingsError(f"optimizer: {describe_optimizer(settings.optimizer)} refuses its arguments: "
                            f"{type(error).__name__}: {error}") from None
    if settings.train.min_lr > float(lr):
        raise SettingsError(f"train.min_lr ({settings.train.min_lr}) must be at most the optimizer's lr ({float(lr)}): "
                            "the schedule decays from lr down to min_lr")
    return make


def describe_optimizer(optimizer: Any) -> str:
    if isinstance(optimizer, partial) and optimizer.args and isinstance(optimizer.args[0], type):
        return f"{optimizer.args[0].__module__}.{optimizer.args[0].__qualname__}"  # as jsonargparse makes it
    return repr(optimizer)


class SettingsError(ValueError):
    """A setting the run refuses, found before anything is written: the command line prints it as one `error:` line
    and exits with status 2, as jsonargparse does for a value of the wrong type."""


def _check_out_dir(out_dir: Path) -> None:
    existing = out_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if out_dir.exists() and not out_dir.is_dir():
        raise SettingsError(f"out_dir {out_dir} is a file, not a directory")
    if not existing.is_dir():
        raise SettingsError(f"out_dir {out_dir} cannot be made: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SettingsError(f"out_dir {out_dir}: no permission to write in {existing}")
    try:  # permissions are not everything (a read-only or virtual file system): make a folder there and remove it
        os.rmdir(tempfile.mkdtemp(dir=existing))
    except OSError as error:
        raise SettingsError(f"out_dir {out_dir} cannot be made in {existing}: {error.strerror}") from None


def make_config(values: dict[str, Any]) -> Config:
    """LitGPT's `Config(**values)`, its refusals (bare asserts, divisions by zero) named by key and value."""
    given = SimpleNamespace(**{**{rule.key.split(".", 1)[1]: None for rule in MODEL_RULES}, **values})
    _apply(MODEL_RULES, given, "model_config.")
    groups, heads = given.n_query_groups, given.n_head
    if groups is not None and heads % groups:
        raise SettingsError(f"model_config.n_query_groups ({groups}) must divide model_config.n_head ({heads})")
    try:
        return Config(**values)
    except (AssertionError, ValueError, TypeError, ZeroDivisionError) as error:
        where = traceback.extract_tb(error.__traceback__)[-1].line
        raise SettingsError(f"model_config: LitGPT's Config refuses it: {error or where}") from None


def _check_model(config: Config) -> None:
    _apply(MODEL_RULES, config, "model_config.")  # (a Config made from Python passed its own checks)
    try:
        with torch.device("meta"):
            GPT(config)
    except (AssertionError, ValueError, TypeError, ZeroDivisionError, RuntimeError) as error:
        raise SettingsError(f"model_config: LitGPT cannot build this model ({type(error).__name__}: {error})") from None


@dataclass(frozen=True)
class Plan:
    """What the checked settings come to."""

    config: Config
    world: int  # data-parallel ranks
    accumulate: int  # micro-batches per optimizer step
    seq: int  # tokens per sample
    make_optimizer: Callable[[Iterable], torch.optim.Optimizer]


def _fulmen_refusal(make: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """`make(...)`, fulmen's own check of a setting, its refusal (a ValueError) made a SettingsError."""
    try:
        make(*args, **kwargs)
    except ValueError as error:
        raise SettingsError(str(error)) from None


def check(settings: Settings) -> Plan:
    """Everything that can be wrong with the settings, before anything is written."""
    _apply(RULES, settings)
    config = model_config(settings)
    _check_model(config)
    train = settings.train
    world = world_size(settings)
    per_step = train.micro_batch_size * world
    if train.global_batch_size % per_step:
        raise SettingsError(f"train.global_batch_size ({train.global_batch_size}) must be a multiple of "
                            f"train.micro_batch_size ({train.micro_batch_size}) x {world} data-parallel ranks")
    if (train.max_steps is None) == (train.max_tokens is None):
        raise SettingsError("give exactly one of train.max_steps and train.max_tokens")
    if settings.executors is not None and settings.compiler != "fulmen":
        raise SettingsError(f"executors are fulmen's and need compiler: fulmen, got compiler: {settings.compiler}")
    if settings.executors is not None:
        _fulmen_refusal(fulmen.resolve_executors, settings.executors)  # unknown names fail here
    if settings.cuda_graphs and settings.compiler != "fulmen":
        raise SettingsError(f"cuda_graphs is fulmen's and needs compiler: fulmen, got compiler: {settings.compiler}")
    if settings.activation_memory_budget != 1.0:
        if settings.compiler != "fulmen":
            raise SettingsError("activation_memory_budget is fulmen's and needs compiler: fulmen, got compiler: "
                                f"{settings.compiler}")
        _fulmen_refusal(fulmen.JitOptions, activation_memory_budget=settings.activation_memory_budget)  # not in [0, 1]
    if settings.offload is not None:
        if settings.compiler != "fulmen":
            raise SettingsError(f"offload is fulmen's and needs compiler: fulmen, got compiler: {settings.compiler}")
        _fulmen_refusal(fulmen.OffloadOptions, fraction=settings.offload)  # a fraction outside (0, 1] fails here
    if settings.float8 is not None:
        if settings.compiler != "fulmen":
            raise SettingsError(f"float8 is fulmen's and needs compiler: fulmen, got compiler: {settings.compiler}")
        _fulmen_refusal(fulmen.Float8Options, recipe=settings.float8)  # an unknown recipe fails here
    if settings.fsdp.float8_all_gather:
        if settings.strategy != "fsdp" or settings.float8 != "tensorwise":
            raise SettingsError("fsdp.float8_all_gather needs strategy: fsdp and float8: tensorwise, got strategy: "
                                f"{settings.strategy}, float8: {settings.float8}")
    if settings.strategy == "fsdp" and settings.compiler != "fulmen":
        raise SettingsError(f"strategy fsdp is fulmen's ThunderFSDPStrategy and needs compiler: fulmen, got "
                            f"compiler: {settings.compiler}")
    seq = train.max_seq_length or config.block_size
    if seq > config.block_size:
        raise SettingsError(f"train.max_seq_length ({seq}) exceeds the model's block_size ({config.block_size})")
    _check_data(settings, config)
    if settings.logger_name == "tensorboard" and not any(importlib.util.find_spec(m) for m in ("tensorboard",
                                                                                               "tensorboardX")):
        raise SettingsError("logger_name: tensorboard needs the tensorboard package (pip install tensorboard), or use "
                            "logger_name: csv")
    _check_out_dir(settings.out_dir)
    return Plan(config, world, train.global_batch_size // per_step, seq, _check_optimizer(settings))


def _check_data(settings: Settings, config: Config) -> None:
    data = settings.data
    if settings.tokenizer_dir is not None and not Path(settings.tokenizer_dir).is_dir():
        raise SettingsError(f"tokenizer_dir: no directory at {settings.tokenizer_dir}")
    if data is None or isinstance(data, ShippedCorpus):
        if data is not None and not Path(data.path).is_file():
            raise SettingsError(f"data.path: no text file at {data.path}")
        if settings.tokenizer_dir is None and config.padded_vocab_size < 256:
            raise SettingsError(f"the shipped corpus is read as bytes (256 token ids) without a tokenizer, but the "
                                f"model's padded_vocab_size is {config.padded_vocab_size}: give tokenizer_dir or a "
                                "larger vocab")
    elif settings.tokenizer_dir is None:
        raise SettingsError(f"data: {type(data).__name__} needs a tokenizer: give tokenizer_dir (a LitGPT checkpoint "
                            "directory with tokenizer files)")
