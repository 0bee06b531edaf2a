"""What each Fabric rank runs in the strategy tests (module level, so spawned processes import it), and the
single-process eager training it is compared with. The model, batches and loss are the distributed tests' own."""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io import TorchCheckpointIO
from litgpt import GPT, Config

import fulmen
from fulmen.distributed import checkpoint, manifest
from fulmen.strategies import ThunderDDPStrategy, ThunderFSDPStrategy
from tests.distributed.workers import (
    CONFIG,
    LR,
    MAX_NORM,
    STEPS,
    count_collectives,
    global_batches,
    loss_fn,
    make_model,
)

DATA_WORLD = 2  # the global batches are those of 2 ranks, whatever the world size that trains on them
CLIP_VALUE = 2e-3  # below the largest gradient entries, so clipping by value really changes them
RESUME_AT = 3  # steps before the checkpoint in the save / resume runs


@dataclass(frozen=True)
class Case:
    name: str
    strategy: str  # "ddp" | "fsdp"
    options: tuple[tuple[str, Any], ...] = ()  # the strategy's keyword arguments
    accumulate: int = 2  # micro-batches per step, all but the last under fabric.no_backward_sync
    clip: str | None = "norm"  # fabric.clip_gradients by "norm" or "value"
    jit: bool = True  # False: the strategy only transforms; the program jits forward_and_loss itself
    prejit: bool = False  # the module reaches fabric.setup already jitted (not yet run)
    meta_init: bool = False  # fabric.init_module(empty_init=True), then the weights from a raw state dict
    joint: bool = False  # fabric.setup(model, optimizer) with the optimizer made before setup
    groups: bool = False  # two param groups (no decay first, out of module order) and a frozen parameter
    optimizer: str = "adamw"  # a key of OPTIMIZERS
    copied: bool = False  # trains copy.deepcopy of the module Fabric set up (as an EMA or a reference model is made)
    precision: str = "32-true"
    accelerator: str = "cpu"


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=LR),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=LR),  # makes its state at construction
}


def make_strategy(case: Case) -> ThunderDDPStrategy | ThunderFSDPStrategy:
    kind = ThunderDDPStrategy if case.strategy == "ddp" else ThunderFSDPStrategy
    return kind(jit=case.jit, **dict(case.options))


def make_fabric(case: Case, world: int, strategy: Any = None, **kwargs: Any) -> L.Fabric:
    fabric = L.Fabric(accelerator=case.accelerator, devices=world, strategy=strategy or make_strategy(case),
                      precision=case.precision, **kwargs)
    fabric.launch()
    return fabric


@dataclass
class Counter:
    """A stateful object in the checkpoint (Fabric saves its `state_dict()`)."""

    seen: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


@dataclass
class Training:
    fabric: L.Fabric
    case: Case
    model: Any
    optimizer: Any
    forward_and_loss: Callable[..., torch.Tensor]
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    # after each no_sync micro-batch: .grad holds the local gradients (DDP, as torch's) or nothing (FSDP: held back)
    local_grads_as_torch: list[bool] = field(default_factory=list)
    created_on_meta: bool = False
    original: Any = None  # the module set up, when the run trains a copy of it


def setup(fabric: L.Fabric, case: Case, seed: int = 0, raw_weights: str | None = None) -> Training:
    if case.meta_init:
        with fabric.init_module(empty_init=True):
            model = GPT(Config(**CONFIG))
    else:
        model = make_model(seed=seed)
    on_meta = all(p.is_meta for p in model.parameters())
    if case.prejit:
        model = fulmen.jit(model)
    if case.joint:  # the optimizer holds the parameters the strategy shards in place
        model, optimizer = fabric.setup(model, OPTIMIZERS[case.optimizer](model.parameters()))
    else:
        model = fabric.setup_module(model)
        if case.copied:
            original, model = model, copy.deepcopy(model)
        optimizer = fabric.setup_optimizers(OPTIMIZERS[case.optimizer](param_groups(model) if case.groups
                                                                       else model.parameters()))
    if raw_weights is not None:
        fabric.load_raw(raw_weights, model)
    step_fn = loss_fn if case.jit else fulmen.jit(loss_fn)
    return Training(fabric, case, model, optimizer, step_fn, created_on_meta=on_meta,
                    original=original if case.copied else None)


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Biases and norms without weight decay (listed first), the rest with it; the token embedding frozen but still
    in the optimizer, so it has no optimizer state."""
    model.transformer.wte.weight.requires_grad_(False)
    named = list(model.named_parameters())
    no_decay = [p for n, p in named if n.endswith(".bias") or "norm" in n]
    return [{"params": no_decay, "weight_decay": 0.0},
            {"params": [p for _, p in named if all(p is not q for q in no_decay)], "weight_decay": 0.1}]


def train(run: Training, steps: range, world: int) -> None:
    fabric, case = run.fabric, run.case
    batches = global_batches(DATA_WORLD, case.accumulate)
    for step in steps:
        x, y = (t.chunk(world)[fabric.global_rank].chunk(case.accumulate) for t in batches[step])
        total = torch.zeros((), device=fabric.device)
        for micro in range(case.accumulate):
            xs, ys = fabric.to_device((x[micro], y[micro]))
            syncing = micro == case.accumulate - 1
            with fabric.no_backward_sync(run.model, enabled=not syncing):
                loss = run.forward_and_loss(run.model, xs, ys) / case.accumulate
                fabric.backward(loss)
            if not syncing:
                run.local_grads_as_torch.append(all((p.grad is None) == (case.strategy == "fsdp" or not p.requires_grad)
                                                    for p in run.model.parameters()))
            total += loss.detach()
        if case.clip == "norm":
            run.norms.append(fabric.clip_gradients(run.model, run.optimizer, max_norm=MAX_NORM).item())
        elif case.clip == "value":
            fabric.clip_gradients(run.model, run.optimizer, clip_val=CLIP_VALUE)
        run.optimizer.step()
        run.optimizer.zero_grad()
        run.losses.append(fabric.all_reduce(total, reduce_op="mean").item())


def summary(run: Training) -> dict[str, Any]:
    jitted = run.model if run.case.jit else run.forward_and_loss
    return {
        "losses": run.losses,
        "norms": run.norms,
        "local_grads_as_torch": run.local_grads_as_torch,
        "created_on_meta": run.created_on_meta,
        "params": checkpoint.get_model_state_dict(run.model, checkpoint.FULL),
        "forward": count_collectives(fulmen.last_traces(jitted)[-1]),
        "backward": count_collectives(fulmen.last_backward_traces(jitted)[-1]),
        "forward_source": str(fulmen.last_traces(jitted)[-1]),
        # the module the trained one was copied from, as set up (gathered like the params)
        "original": None if run.original is None else checkpoint.get_model_state_dict(run.original, checkpoint.FULL),
    }


def raw_weights_file(fabric: L.Fabric, directory: str) -> str:
    """A plain `torch.save(model.state_dict())` of the model every run starts from (written by rank 0)."""
    path = os.path.join(directory, "raw_weights.pt")
    if fabric.global_rank == 0:
        torch.save(make_model(seed=0).state_dict(), path)
    fabric.barrier()
    return path


def collectives(fabric: L.Fabric) -> dict[str, Any]:
    """The strategy's collectives as a program calls them through Fabric."""
    rank, device = fabric.global_rank, fabric.device
    return {
        "all_reduce_sum": fabric.all_reduce(torch.tensor(rank + 1.0, device=device), reduce_op="sum").item(),
        "all_reduce_mean": fabric.all_reduce(torch.tensor(rank + 1.0, device=device)).item(),
        "all_gather": fabric.all_gather(torch.tensor([rank, 10 * rank], device=device)).tolist(),
        "broadcast": fabric.broadcast({"from": rank}, src=1),
        "all_true": fabric.strategy.reduce_boolean_decision(True, all=True),
        "all_of_rank0": fabric.strategy.reduce_boolean_decision(rank == 0, all=True),
        "any_of_rank0": fabric.strategy.reduce_boolean_decision(rank == 0, all=False),
    }


def training_suite(rank: int, world: int, cases: list[Case], directory: str) -> dict[str, Any]:
    """Every case in turn in one launch: each trains STEPS steps from the same weights."""
    results = {}
    for case in cases:
        fabric = make_fabric(case, world)
        raw = raw_weights_file(fabric, directory) if case.meta_init else None
        run = setup(fabric, case, raw_weights=raw)
        train(run, range(STEPS), world)
        results[case.name] = summary(run)
        fabric.barrier()
        results[case.name]["collectives"] = collectives(fabric)
        results[case.name]["optimizer_state_round_trip"] = optimizer_state_round_trip(run.optimizer, world)
    return results


def optimizer_state_round_trip(optimizer: Any, world: int) -> list[Any]:
    """Each rank's answer (True, or the error): `optimizer.state_dict()` (Fabric's optimizer asks the strategy: the
    whole state under DDP, as with Lightning's DDPStrategy, DTensors under FSDP) loads back into the optimizer and
    leaves its state as it was."""
    before = copy.deepcopy(optimizer.optimizer.state_dict())

    def round_trip() -> None:
        optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        after = optimizer.optimizer.state_dict()
        assert after["param_groups"] == before["param_groups"] and after["state"].keys() == before["state"].keys()
        for index, entry in before["state"].items():
            for key, value in entry.items():
                got = after["state"][index][key]
                assert type(got) is type(value) and torch.equal(got, value), f"state {key!r} of parameter {index}"

    every_rank: list[Any] = [None] * world
    torch.distributed.all_gather_object(every_rank, _error(round_trip) or True)
    return every_rank


# --- save and resume ----------------------------------------------------------------------------------------------
def resume_suite(rank: int, world: int, cases: list[Case], directory: str) -> dict[str, Any]:
    """For each case: an uninterrupted run, then RESUME_AT steps, save (model, optimizer, a step count, a
    stateful object), a fresh model and optimizer from other weights, load, and the remaining steps."""
    results = {}
    for case in cases:
        fabric = make_fabric(case, world)
        path = Path(directory) / case.name
        whole = setup(fabric, case)
        train(whole, range(STEPS), world)
        first = setup(fabric, case)
        train(first, range(RESUME_AT), world)
        counter = Counter(seen=RESUME_AT * 10)
        fabric.save(path, {"model": first.model, "optimizer": first.optimizer, "step": RESUME_AT, "counter": counter})
        second = setup(fabric, case, seed=99)
        state = {"model": second.model, "optimizer": second.optimizer, "step": 0, "counter": Counter()}
        remainder = fabric.load(path, state)
        train(second, range(RESUME_AT, STEPS), world)
        filtered = Path(directory) / f"{case.name}-filtered"
        fabric.save(filtered, {"model": second.model, "step": STEPS}, filter={"model": lambda k, v: "lm_head" in k})
        results[case.name] = {
            "filtered": {key: sorted(value) if isinstance(value, dict) else value
                         for key, value in fabric.load(filtered).items()},
            "losses": first.losses + second.losses,
            "uninterrupted": whole.losses,
            "step": state["step"],
            "counter": state["counter"].seen,
            "remainder": remainder,
            "is_dir": path.is_dir(),
            "leftovers": sorted(p.name for p in Path(directory).iterdir()
                                if p.name.startswith(case.name) and manifest.PARTIAL_MARK in p.name),
        }
    return results


def load_elsewhere(rank: int, world: int, cases: list[Case], directory: str) -> dict[str, Any]:
    """Loads the checkpoints `resume_suite` wrote (at another world size) and trains the remaining steps."""
    results = {}
    for case in cases:
        fabric = make_fabric(case, world)
        run = setup(fabric, case, seed=99)
        state = {"model": run.model, "optimizer": run.optimizer, "step": 0}
        fabric.load(Path(directory) / case.name, state)
        train(run, range(RESUME_AT, STEPS), world)
        results[case.name] = {"losses": run.losses, "step": state["step"]}
    return results


def eager_resume(path: str | Path, accumulate: int, clip: str | None) -> list[float]:
    """A full checkpoint loaded into plain PyTorch (torch.load, load_state_dict) and trained on one process."""
    saved = torch.load(path, weights_only=True)
    model = make_model(seed=99)
    model.load_state_dict(saved["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    optimizer.load_state_dict(saved["optimizer"])
    return eager_training(accumulate, clip, model=model, optimizer=optimizer, steps=range(RESUME_AT, STEPS))["losses"]


# --- the single-process reference ---------------------------------------------------------------------------------
def eager_training(accumulate: int, clip: str | None, model: torch.nn.Module | None = None,
                   optimizer: torch.optim.Optimizer | None = None, steps: range = range(STEPS), device: str = "cpu",
                   precision: str = "32-true", chunks: int = 1, optimizer_name: str = "adamw") -> dict[str, Any]:
    """One process, the whole global batch of each step at once (`chunks` > 1: summed over that many chunks, the
    same training in another summation order). `precision` as Fabric's: "bf16-true" trains a bf16 model,
    "bf16-mixed" runs the forward under autocast."""
    # made on CPU and moved, as the Fabric runs do (a model made on a GPU draws other initial weights)
    model = model or make_model(dtype=torch.bfloat16 if precision == "bf16-true" else torch.float32).to(device)
    optimizer = optimizer or OPTIMIZERS[optimizer_name](model.parameters())
    autocast = torch.autocast(device, torch.bfloat16, enabled=precision == "bf16-mixed")
    batches = global_batches(DATA_WORLD, accumulate)
    losses, norms = [], []
    for step in steps:
        loss = torch.zeros((), device=device)
        for x, y in zip(*(t.to(device).chunk(chunks) for t in batches[step])):
            with autocast:
                part = loss_fn(model, x, y) / chunks
            part.backward()
            loss += part.detach().float()
        if clip == "norm":
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        elif clip == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms,
            "params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}


# --- errors -------------------------------------------------------------------------------------------------------
def _error(action: Callable[[], Any]) -> str | None:
    try:
        action()
    except BaseException as error:  # noqa: BLE001 - the test reads the type and message (DCP raises a BaseException)
        return f"{type(error).__name__}: {error}"
    return None


class FailingIO(TorchCheckpointIO):
    """Writes half a file, then fails: a crash in the middle of saving."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        Path(path).write_bytes(b"half a checkpoint")
        raise OSError("disk full (on purpose)")


def error_paths(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Each misuse that needs launched ranks and the error it gets (None: no error), and what non-strict loading
    restored."""
    case = Case("errors", "fsdp")
    fabric = make_fabric(case, world)
    errors: dict[str, Any] = {}

    ran = fulmen.jit(make_model())
    ran(torch.zeros(1, 4, dtype=torch.long))
    errors["setup_after_run"] = _error(lambda: fabric.setup_module(ran))

    errors["prejit_with_executors"] = _error(lambda: make_fabric(
        case, world, strategy=ThunderFSDPStrategy(executors=["sdpa"])).setup_module(fulmen.jit(make_model())))

    with fabric.init_module(empty_init=True):
        meta_model = GPT(Config(**CONFIG))
    meta_optimizer = torch.optim.AdamW(meta_model.parameters())
    errors["meta_optimizer"] = _error(lambda: fabric.setup(meta_model, meta_optimizer))

    model = make_model()
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn(model, *global_batches(DATA_WORLD, 1)[0]).backward()
    stepped.step()
    errors["stepped_optimizer"] = _error(lambda: fabric.setup(model, stepped))

    run = setup(fabric, case)
    # not elementwise: on each rank's shards it would step other amounts than on the whole parameters
    errors["adafactor_on_shards"] = _error(lambda: fabric.setup_optimizers(torch.optim.Adafactor(
        [run.model.lm_head.weight])))
    train(run, range(1), world)
    full, sharded = Path(directory) / "full.pt", Path(directory) / "sharded"
    full_fabric = make_fabric(case, world, strategy=ThunderFSDPStrategy(state_dict_type="full"))
    full_fabric.save(full, {"model": run.model, "optimizer": run.optimizer})
    fabric.save(sharded, {"model": run.model, "optimizer": run.optimizer})
    trained = checkpoint.get_model_state_dict(run.model, checkpoint.FULL)
    for kind, path in (("full", full), ("sharded", sharded)):
        fresh = setup(fabric, case, seed=99)
        extra = {"model": fresh.model, "optimizer": fresh.optimizer, "missing": 0}
        errors[f"{kind}_strict_missing_key"] = _error(lambda p=path, e=extra: fabric.load(p, e))
        errors[f"{kind}_non_strict_missing_key"] = _error(lambda p=path, e=extra: fabric.load(p, e, strict=False))
        restored = checkpoint.get_model_state_dict(fresh.model, checkpoint.FULL)  # the non-strict load restored it
        errors[f"{kind}_non_strict_restored"] = all(torch.equal(restored[k], v) for k, v in trained.items())
    for kind, path in (("full", full), ("sharded", sharded)):  # one bit flipped in the largest file
        damaged = Path(directory) / f"damaged-{kind}"
        if rank == 0:
            (shutil.copytree if kind == "sharded" else shutil.copy)(path, damaged)
            shutil.copy(manifest.manifest_path(path), manifest.manifest_path(damaged))
            largest = damaged if kind == "full" else max(damaged.iterdir(), key=lambda f: f.stat().st_size)
            data = bytearray(largest.read_bytes())
            data[len(data) // 2] ^= 4
            largest.write_bytes(bytes(data))
        fabric.barrier()
        fresh = setup(fabric, case, seed=99)
        error = _error(lambda d=damaged, f=fresh: fabric.load(d, {"model": f.model, "optimizer": f.optimizer}))
        every_rank: list[Any] = [None] * world
        torch.distributed.all_gather_object(every_rank, error)
        errors[f"{kind}_bit_flip"] = every_rank
    partial = Path(directory) / "lm_head_only"
    fabric.save(partial, {"model": run.model}, filter={"model": lambda k, v: k == "lm_head.weight"})
    fresh = setup(fabric, case, seed=99)
    errors["partial_model_strict"] = _error(lambda: fabric.load(partial, {"model": fresh.model}))
    fabric.load(partial, {"model": fresh.model}, strict=False)
    restored = checkpoint.get_model_state_dict(fresh.model, checkpoint.FULL)
    if rank == 0:  # the full state dicts are rank 0's
        errors["partial_model_non_strict"] = (
            torch.equal(restored["lm_head.weight"], trained["lm_head.weight"]),
            not torch.equal(restored["transformer.wte.weight"], trained["transformer.wte.weight"]))
    errors["missing_path"] = _error(lambda: fabric.load(Path(directory) / "nothing", {"model": run.model}))
    errors["load_raw_directory"] = _error(lambda: fabric.load_raw(sharded, run.model))
    errors["storage_options_sharded"] = _error(lambda: fabric.strategy.save_checkpoint(
        sharded, {"model": run.model}, storage_options={"compress": True}))
    smaller = torch.optim.AdamW(list(run.model.parameters())[:3])
    raw_optimizer = Path(directory) / "optimizer.pt"
    if rank == 0:
        torch.save(torch.load(full, weights_only=True)["optimizer"], raw_optimizer)
    fabric.barrier()
    errors["load_raw_optimizer_too_few_params"] = _error(lambda: fabric.load_raw(raw_optimizer, smaller))
    mangled = torch.load(full, weights_only=True)["optimizer"]
    mangled["state"][0]["exp_avg"] = torch.zeros(3)
    errors["optimizer_state_wrong_shape"] = _error(
        lambda: checkpoint.load_optimizer_state_dict(run.optimizer, mangled))
    wrong = {k: torch.zeros(3) if k == "lm_head.weight" else v
             for k, v in torch.load(full, weights_only=True)["model"].items()}
    errors["full_state_dict_wrong_shape"] = _error(lambda: fabric.strategy.load_module_state_dict(run.model, wrong))
    return errors


def crash_while_saving(rank: int, world: int, directory: str) -> dict[str, Any]:
    """A save that fails midway (full: the CheckpointIO dies after writing half a file; sharded: rank 1's DCP
    writer fails) must leave the previous checkpoint loadable and unchanged."""
    results: dict[str, Any] = {}
    for kind in ("full", "sharded"):
        case = Case(f"crash-{kind}", "fsdp", options=(("state_dict_type", kind),))
        fabric = make_fabric(case, world)
        run = setup(fabric, case)
        path = Path(directory) / kind
        fabric.save(path, {"model": run.model})
        before = checkpoint.get_model_state_dict(run.model, checkpoint.FULL)
        train(run, range(1), world)
        if kind == "full":
            fabric.strategy.checkpoint_io = FailingIO()
            error = _error(lambda p=path, r=run, f=fabric: f.save(p, {"model": r.model}))
        else:
            from torch.distributed.checkpoint.filesystem import FileSystemWriter

            original = FileSystemWriter.write_data

            def fail(self, plan, planner):
                raise OSError("disk full (on purpose)")

            if rank == 1:
                FileSystemWriter.write_data = fail
            try:
                error = _error(lambda p=path, r=run, f=fabric: f.save(p, {"model": r.model}))
            finally:
                FileSystemWriter.write_data = original
        fabric.barrier()
        fresh = setup(make_fabric(case, world), case, seed=99)
        fabric.load(path, {"model": fresh.model})
        results[kind] = {"error": error, "before": before,
                         "after": checkpoint.get_model_state_dict(fresh.model, checkpoint.FULL),
                         "beside": sorted(p.name for p in Path(directory).iterdir() if p.name.startswith(kind))}
    return results

