"""The pretraining run behind the CLI: settings checked before anything is written, Fabric with fulmen's
strategies, `forward_and_loss` jitted with the loss in the trace, the loop, its logs and checkpoints."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from litgpt.config import Config
from litgpt.model import GPT
from litgpt.tokenizer import Tokenizer
from litgpt.utils import CycleIterator, choose_logger, estimate_flops
from tqdm import tqdm

import fulmen
from fulmen.distributed.manifest import CheckpointError
from fulmen.jit.optimizer_steps import KNOWN
from fulmen.pretrain.corpus import ShippedCorpus
from fulmen.pretrain.flops import peak_flops
from fulmen.pretrain.resume import CHECKPOINT_FILE, Resume, check_model, remove_partials, save_config
from fulmen.pretrain.resume import plan as resume_plan
from fulmen.pretrain.settings import Plan, Settings, check
from fulmen.strategies import FulmenCheckpointIO, ThunderDDPStrategy, ThunderFSDPStrategy


def forward_and_loss(model: torch.nn.Module, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor,
               targets: torch.Tensor, accumulate: int, max_norm: float | None) -> tuple[torch.Tensor, Any]:
    """A step's last micro-batch, jitted whole (`whole_step`): its loss and backward, the gradient clipping and the
    optimizer's step, as the loop's other path runs them (clip_grad_norm_ as Fabric's clip_gradients calls it, its
    foreach=False path: fulmen traces the single-tensor ops). The earlier micro-batches' grads are in `.grad`
    already. Returns the loss and the total grad norm (None without clipping)."""
    loss = forward_and_loss(model, input_ids, targets) / accumulate
    loss.backward()
    norm = None
    if max_norm is not None:  # the non-finite check is the loop's, after the step (a trace cannot raise before it)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=False)
    optimizer.step()
    optimizer.zero_grad()
    return loss, norm


def accumulation_step(model: torch.nn.Module, input_ids: torch.Tensor, targets: torch.Tensor,
                      accumulate: int) -> torch.Tensor:
    """An earlier micro-batch of a whole step (`whole_step` with accumulation): its loss and backward jitted together,
    adding into the grads the step's last micro-batch then reads."""
    loss = forward_and_loss(model, input_ids, targets) / accumulate
    loss.backward()
    return loss


def whole_step_refusal(settings: Settings, world: int, optimizer: Any) -> str | None:
    """Why the whole step does not apply to this run (None: it does)."""
    if not settings.whole_step:
        return "whole_step: false"
    reasons = [(settings.compiler != "fulmen", f"compiler: {settings.compiler}"),
               (world > 1 or settings.strategy != "auto", "more than one process (ddp / fsdp)"),
               (settings.offload is not None, "offload"), (settings.cuda_graphs, "cuda_graphs"),
               (settings.float8 is not None, "float8"),
               (settings.activation_memory_budget != 1.0, "activation_memory_budget below 1"),
               (settings.precision == "16-mixed", "precision 16-mixed (a gradient scaler)"),
               (type(optimizer) not in KNOWN, f"the optimizer {type(optimizer).__qualname__} (fulmen steps "
                                              "SGD, Adam and AdamW)")]
    found = [why for refused, why in reasons if refused]
    return ", ".join(found) if found else None


def compile_step(settings: Settings) -> tuple[Any, Any]:
    """The whole step's two programs: a micro-batch's forward and backward, and the last one's with the step."""
    return (fulmen.jit(accumulation_step, executors=settings.executors),
            fulmen.jit(train_step, executors=settings.executors))


def make_strategy(settings: Settings, world: int) -> Any:
    kind = settings.strategy
    if kind == "auto":
        kind = "ddp" if world > 1 else "auto"
    if kind == "auto":
        return "auto"
    if settings.compiler != "fulmen":  # (fsdp needs fulmen: settings.check refuses it)
        return "ddp"
    if kind == "ddp":
        return ThunderDDPStrategy(jit=False)
    return ThunderFSDPStrategy(jit=False, sharding_strategy=settings.fsdp.sharding_strategy,
                               bucketing_strategy=settings.fsdp.bucketing_strategy,
                               state_dict_type=settings.fsdp.state_dict_type)


def compile_loss(settings: Settings) -> Any:
    if settings.compiler == "fulmen":
        offload = None if settings.offload is None else fulmen.OffloadOptions(fraction=settings.offload)
        float8 = None if settings.float8 is None else fulmen.Float8Options(
            recipe=settings.float8, all_gather=settings.fsdp.float8_all_gather)
        return fulmen.jit(forward_and_loss, executors=settings.executors,
                          options=fulmen.JitOptions(offload=offload, cuda_graphs=settings.cuda_graphs,
                                                    activation_memory_budget=settings.activation_memory_budget,
                                                    float8=float8))
    if settings.compiler == "torch":
        return torch.compile(forward_and_loss)
    return forward_and_loss


def default_precision() -> str:
    return "bf16-true" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"


def learning_rate(step: int, base: float, warmup: int, total: int, minimum: float) -> float:
    """Linear warmup over `warmup` steps, then cosine from `base` down to `minimum` at step `total`."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return minimum + 0.5 * (base - minimum) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def validate(fabric: L.Fabric, loss_fn: Any, model: torch.nn.Module, loader: Any, max_iters: int) -> float:
    losses = []
    for index, batch in enumerate(loader):
        if index >= max_iters:
            break
        losses.append(loss_fn(model, batch[:, :-1], batch[:, 1:]))
    loss = torch.stack(losses).mean() if losses else torch.tensor(float("nan"), device=fabric.device)
    return fabric.all_reduce(loss).item()


def run(settings: Settings) -> dict[str, Any]:
    plan = check(settings)
    resume = resume_plan(settings, plan.config)
    settings.precision = precision = settings.precision or default_precision()
    logger = choose_logger(settings.logger_name, settings.out_dir, name=f"pretrain-{plan.config.name}",
                           resume=bool(resume.candidates), log_interval=settings.train.log_interval)
    fabric = L.Fabric(devices=settings.devices, num_nodes=settings.num_nodes, precision=precision, loggers=[logger],
                      strategy=make_strategy(settings, plan.world), plugins=[FulmenCheckpointIO()])
    fabric.launch()
    fabric.seed_everything(settings.seed)
    if fabric.global_rank == 0 and (removed := remove_partials(settings.out_dir)):
        fabric.print(f"removed what interrupted saves left: {', '.join(str(p) for p in removed)}")
    for note in resume.notes:
        fabric.print(note)
    return fit(fabric, settings, plan, resume)


def load_newest(fabric: L.Fabric, state: dict[str, Any], resume: Resume, settings: Settings,
                config: Config) -> Path | None:
    """Loads the first of `resume.candidates` that matches its manifest into `state`; None when none does and the
    run may start afresh (resume: auto)."""
    errors = []
    for index, path in enumerate(resume.candidates):
        if index:  # the first one's model was compared before anything was written
            for note in check_model(path, config, settings.allow_model_change):
                fabric.print(note)
        try:
            fabric.load(path, state)  # checks the manifest's checksums before reading anything
        except CheckpointError as error:
            errors.append(str(error))
            fabric.print(f"resume: skipping {path}: {error}")
            continue
        newest = " (the newest complete checkpoint)" if settings.resume is True or settings.resume == "auto" else ""
        fabric.print(f"resume: from {path}{newest}, step {state['step_count']}")
        return path
    if resume.required:
        raise CheckpointError("resume: no checkpoint could be loaded:\n  " + "\n  ".join(errors))
    if resume.notes or errors:
        fabric.print(f"resume: no complete checkpoint in {settings.out_dir}: starting from step 0")
    return None


def fit(fabric: L.Fabric, settings: Settings, plan: Plan, resume: Resume) -> dict[str, Any]:
    train, config, accumulate, seq = settings.train, plan.config, plan.accumulate, plan.seq
    tokenizer = Tokenizer(settings.tokenizer_dir) if settings.tokenizer_dir is not None else None
    data = settings.data or ShippedCorpus(seed=settings.seed)
    data.connect(tokenizer=tokenizer, batch_size=train.micro_batch_size, max_seq_length=seq)
    with fabric.rank_zero_first():
        data.prepare_data()
    data.setup()
    train_loader, val_loader = fabric.setup_dataloaders(data.train_dataloader(), data.val_dataloader())

    sharded_init = isinstance(fabric.strategy, ThunderFSDPStrategy)
    with fabric.init_module(empty_init=sharded_init):
        model = GPT(config)
        model.max_seq_length = seq
    flops = estimate_flops(model, training=True) * train.micro_batch_size  # per micro-batch, per device
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(plan.make_optimizer(model.parameters()))
    base_lr = optimizer.param_groups[0]["lr"]  # before a checkpoint's param groups (the lr of its step) load
    loss_fn = compile_loss(settings)
    torch_optimizer = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper steps this one
    off = whole_step_refusal(settings, plan.world, torch_optimizer)
    accumulate_fn, step_fn = compile_step(settings) if off is None else (None, None)
    if off is not None and settings.whole_step and settings.compiler == "fulmen":
        fabric.print(f"whole_step: each step runs as forward_and_loss, backward and optimizer.step ({off})")
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}
    load_newest(fabric, state, resume, settings, config)

    tokens_per_iter = train.micro_batch_size * seq * fabric.world_size
    max_steps = train.max_steps if train.max_steps is not None else max(1, train.max_tokens // (tokens_per_iter *
                                                                                                 accumulate))
    warmup = train.lr_warmup_steps or 0
    peak = peak_flops(fabric.device, torch.bfloat16 if "bf16" in settings.precision else torch.float32)  # MFU

    batches = CycleIterator(train_loader)
    for _ in range(state["iter_num"]):  # the samples the checkpointed run already consumed
        next(batches)
    losses: list[float] = []
    window: list[float] = []
    step_ms: list[float] = []
    val_losses: dict[int, float] = {}
    started = time.perf_counter()
    step_started = time.perf_counter()
    if fabric.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(fabric.device)
    progress = tqdm(total=max_steps, initial=state["step_count"], desc="steps", unit="step", leave=False,
                    disable=fabric.global_rank != 0)
    if settings.eval.initial_validation:
        val_losses[state["step_count"]] = validate(fabric, loss_fn, model, val_loader, settings.eval.max_iters)
        say(fabric, f"step {state['step_count']} | val_loss {val_losses[state['step_count']]:.4f}")
    while state["step_count"] < max_steps:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(state["step_count"], base_lr, warmup, max_steps, train.min_lr)
        total = torch.zeros((), device=fabric.device)
        for micro in range(accumulate):
            batch = next(batches)
            state["iter_num"] += 1
            if step_fn is not None and micro == accumulate - 1:  # the last micro-batch and the step, one program
                loss, norm = step_fn(model, torch_optimizer, batch[:, :-1], batch[:, 1:], accumulate, train.max_norm)
                if norm is not None and not torch.isfinite(norm):  # Fabric's clip_gradients error, after the step
                    raise RuntimeError("The total norm of order 2.0 for gradients from `parameters` is non-finite, "
                                       "so it cannot be clipped.")
            elif step_fn is not None:
                loss = accumulate_fn(model, batch[:, :-1], batch[:, 1:], accumulate)
            else:
                with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                    loss = loss_fn(model, batch[:, :-1], batch[:, 1:]) / accumulate
                    fabric.backward(loss)
            total += loss.detach().float()
        if step_fn is None:
            if train.max_norm is not None:
                fabric.clip_gradients(model, optimizer, max_norm=train.max_norm)
            optimizer.step()
            optimizer.zero_grad()
        state["step_count"] += 1
        progress.update()
        step_loss = fabric.all_reduce(total).item()
        losses.append(step_loss)
        window.append(step_loss)
        now = time.perf_counter()
        step_ms.append((now - step_started) * 1e3)
        step_started = now
        step = state["step_count"]
        if step % train.log_interval == 0 or step == max_steps:
            ms = statistics.median(step_ms[-len(window):])
            metrics = {"iter": state["iter_num"], "step": step, "loss": statistics.fmean(window), "ms_per_iter": ms,
                       "tokens_per_s": tokens_per_iter * accumulate / (ms / 1e3),
                       "lr": optimizer.param_groups[0]["lr"]}
            if peak:
                metrics["mfu"] = flops * accumulate / (ms / 1e3 * peak)
            if fabric.device.type == "cuda":
                metrics["memory_gb"] = torch.cuda.max_memory_allocated(fabric.device) / 1e9
            fabric.log_dict(metrics, step=step)
            say(fabric, line(metrics))
            progress.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)
            window = []
        if settings.eval.interval and step % settings.eval.interval == 0 and step < max_steps:
            val_losses[step] = validate(fabric, loss_fn, model, val_loader, settings.eval.max_iters)
            fabric.log_dict({"val_loss": val_losses[step]}, step=step)
            say(fabric, f"step {step} | val_loss {val_losses[step]:.4f}")
        if train.save_interval and step % train.save_interval == 0:
            save(fabric, settings.out_dir / f"step-{step:08d}", state, config)
    progress.close()
    if settings.eval.final_validation:
        val_losses[state["step_count"]] = validate(fabric, loss_fn, model, val_loader, settings.eval.max_iters)
        fabric.print(f"final val_loss {val_losses[state['step_count']]:.4f}")
    save(fabric, settings.out_dir / "final", state, config)
    warm = step_ms[min(len(step_ms) - 1, 5):]  # the steps after compilation and warm-up
    median_s = statistics.median(warm) / 1e3 if warm else None
    summary = {"steps": len(losses), "median_ms_per_iter": median_s * 1e3 if median_s else None,
               "tokens_per_s": tokens_per_iter * accumulate / median_s if median_s else None,
               "mfu": flops * accumulate / (median_s * peak) if median_s and peak else None,
               "peak_memory_gb": torch.cuda.max_memory_allocated(fabric.device) / 1e9
               if fabric.device.type == "cuda" else None,
               "total_s": time.perf_counter() - started}
    fabric.log_dict({f"summary/{k}": v for k, v in summary.items() if v is not None}, step=state["step_count"])
    fabric.print("summary: " + line(summary))
    for logger in fabric.loggers:
        logger.finalize("success")
    return {"losses": losses, "val_losses": val_losses, "summary": summary, "step_count": state["step_count"]}


def line(values: dict[str, Any]) -> str:
    return " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items()
                      if v is not None)


def say(fabric: L.Fabric, text: str) -> None:
    """A line on rank 0 that keeps the progress bar below it."""
    if fabric.global_rank == 0:
        tqdm.write(text)


def save(fabric: L.Fabric, directory: Path, state: dict[str, Any], config: Config) -> None:
    if fabric.global_rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        save_config(config, directory)
    fabric.barrier()
    fabric.save(directory / CHECKPOINT_FILE, state)
