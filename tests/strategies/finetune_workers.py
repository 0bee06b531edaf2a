"""What each Fabric rank runs in the finetuning tests (module level, so spawned processes import it), and the
single-process eager finetuning it is compared with: a tiny LitGPT LoRA model, only LoRA (in some cases the biases
too) trainable, as `litgpt finetune lora` trains it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from litgpt import lora

import fulmen
from fulmen.distributed import checkpoint
from fulmen.distributed import prims as dist_prims
from fulmen.distributed.setup import unwrap_module
from fulmen.distributed.specs import spec_of
from tests.distributed.workers import global_batches, loss_fn
from tests.strategies.workers import DATA_WORLD, _error, make_fabric
from tests.strategies.workers import Case as StrategyCase

# vocab 67, the MLP's 45 rows and the LoRA B matrices of those layers (67 x 4, 45 x 4) do not split evenly over 2
# ranks: padded shards, frozen and trainable. lora_key=False: LitGPT's default, the QKV layer registers `lora_ind`
# on its first call.
CONFIG = dict(block_size=16, vocab_size=67, padded_vocab_size=67, n_layer=2, n_head=4, n_embd=32, n_query_groups=2,
              head_size=8, intermediate_size=45, bias=True, mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm",
              rotary_percentage=1.0, parallel_residual=False, lora_r=4, lora_alpha=8, lora_dropout=0.0,
              lora_query=True, lora_key=False, lora_value=True, lora_projection=True, lora_mlp=True, lora_head=True)
STEPS = 4
ACCUMULATE = 2  # micro-batches per step, all but the last under fabric.no_backward_sync
LR = 1e-2
RESUME_AT = 2
UNFROZEN = "lm_head.linear.weight"  # made trainable after the first step in the "unfreeze" cases
REFROZEN = "transformer.h.0.attn.qkv.lora_A"  # frozen after the first step in the "unfreeze" cases
MAX_NORM = 0.2  # below the LoRA gradients' norm (about 0.34 at the first step), so clipping really scales them
EVERY_RANK = checkpoint.StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on every rank


@dataclass(frozen=True)
class Case:
    name: str
    strategy: str  # "ddp" | "fsdp"
    options: tuple[tuple[str, Any], ...] = ()
    bias: str = "none"  # mark_only_lora_as_trainable's: "all" puts trainable biases beside frozen weights
    unfreeze: bool = False  # after the first step: UNFROZEN trainable (a new param group), REFROZEN frozen
    clip: bool = False  # fabric.clip_gradients by norm (MAX_NORM) before each step
    # on the meta device, the base weights from a base model's checkpoints and the LoRA weights from their own;
    # saved after RESUME_AT steps (the LoRA weights, as litgpt does) and resumed in a fresh model
    loaded: bool = False

    def strategy_case(self) -> StrategyCase:
        return StrategyCase(self.name, self.strategy, self.options)


def make_lora(seed: int = 0, bias: str = "none") -> lora.GPT:
    """Every weight from `seed`, LoRA's B nonzero so that LoRA changes the output from the first step."""
    torch.manual_seed(seed)
    model = lora.GPT(lora.Config(**CONFIG))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1)
    lora.mark_only_lora_as_trainable(model, bias=bias)
    return model


def base_state_dict(model: lora.GPT) -> dict[str, torch.Tensor]:
    """The weights of the base (non-LoRA) model the LoRA model wraps, by the base model's names (`attn.qkv.weight`
    for the LoRA model's `attn.qkv.linear.weight`): a pretrained checkpoint as `litgpt download` gives it."""
    return {k.replace(".linear.", "."): v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def named(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters by the names the user's module gives them (not Fabric's wrapper's)."""
    return dict(unwrap_module(getattr(model, "module", model)).named_parameters())


def unfreeze(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Between steps, as a freeze schedule does: a frozen weight joins the training (its own param group), a LoRA
    matrix leaves it (it stays in the optimizer, which skips it without a gradient)."""
    params = named(model)
    params[UNFROZEN].requires_grad_(True)
    params[REFROZEN].requires_grad_(False)
    optimizer.add_param_group({"params": [params[UNFROZEN]]})


# --- the single-process reference ---------------------------------------------------------------------------------
def eager_finetuning(bias: str = "none", unfreezing: bool = False, clip: bool = False) -> dict[str, Any]:
    """One process, the whole global batch of each step at once; the grads of the first step (before clipping)."""
    model = make_lora(bias=bias)
    optimizer = torch.optim.AdamW(trainable(model), lr=LR)
    losses, grads, norms = [], {}, []
    for step, (x, y) in enumerate(global_batches(DATA_WORLD, ACCUMULATE)[:STEPS]):
        if step == 1 and unfreezing:
            unfreeze(model, optimizer)
        loss = loss_fn(model, x, y)
        loss.backward()
        if step == 0:
            grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "norms": norms,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


# --- the ranks ----------------------------------------------------------------------------------------------------
def _full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The parameter's gradient as one process would hold it (a sharded one's rows gathered from every rank)."""
    spec = spec_of(param)
    grad = param.grad
    if spec is None or not spec.sharded or grad is None:
        return None if grad is None else grad.detach().clone()
    pieces = [torch.empty_like(grad) for _ in range(spec.state.world)]
    torch_dist.all_gather(pieces, grad.contiguous(), group=spec.state.group)
    return torch.cat(pieces)[: spec.full_shape[0]]


def _communicated(jitted: Any) -> dict[str, list[str]]:
    """The parameters the last traces' collectives carry, from their plan checks' labels: gathered in the forward,
    gathered again in the backward (ZeRO-3), and whose gradients are reduced."""
    carried: dict[str, list[str]] = {"forward_gather": [], "backward_gather": [], "reduce": []}
    traces = {"forward": fulmen.last_traces(jitted)[-1], "backward": fulmen.last_backward_traces(jitted)[-1]}
    for part, trace in traces.items():
        for bsym in trace.bound_symbols:
            if bsym.sym is dist_prims.check_plan:
                for label in bsym.args[-1]:
                    kind, names = label.split(" ")
                    carried[f"{part}_gather" if kind == "all_gather" else "reduce"].extend(names.split(","))
    return carried


@dataclass
class Run:
    fabric: Any
    model: Any
    optimizer: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    # after each no_sync micro-batch: the trainable parameters' .grad holds their local gradients (DDP, as torch's) or
    # nothing (FSDP: held back), and the frozen ones' none
    local_grads_as_torch: list[bool] = field(default_factory=list)


def setup(fabric: Any, case: Case) -> Run:
    if case.loaded:
        with fabric.init_module(empty_init=True):
            model = lora.GPT(lora.Config(**CONFIG))
        lora.mark_only_lora_as_trainable(model, bias=case.bias)
    else:
        model = make_lora(bias=case.bias)
    model = fabric.setup_module(model)
    return Run(fabric, model, fabric.setup_optimizers(torch.optim.AdamW(trainable(model), lr=LR)))


def train(run: Run, case: Case, steps: range, record: dict[str, Any] | None = None) -> None:
    fabric, world = run.fabric, run.fabric.world_size
    batches = global_batches(DATA_WORLD, ACCUMULATE)
    for step in steps:
        if step == 1 and case.unfreeze:
            unfreeze(run.model, run.optimizer)
        x, y = (t.chunk(world)[fabric.global_rank].chunk(ACCUMULATE) for t in batches[step])
        total = torch.zeros(())
        for micro in range(ACCUMULATE):
            syncing = micro == ACCUMULATE - 1
            with fabric.no_backward_sync(run.model, enabled=not syncing):
                loss = loss_fn(run.model, x[micro], y[micro]) / ACCUMULATE
                fabric.backward(loss)
            if not syncing:
                run.local_grads_as_torch.append(all((p.grad is None) == (case.strategy == "fsdp" or not p.requires_grad)
                                                    for p in run.model.parameters()))
            total += loss.detach()
        if record is not None and step == 0:
            record["grads"] = {n: _full_grad(p) for n, p in named(run.model).items()}
        if case.clip:
            run.norms.append(fabric.clip_gradients(run.model, run.optimizer, max_norm=MAX_NORM).item())
        run.optimizer.step()
        run.optimizer.zero_grad()
        run.losses.append(fabric.all_reduce(total, reduce_op="mean").item())


def _summary(run: Run) -> dict[str, Any]:
    params = named(run.model)
    return {"losses": run.losses, "norms": run.norms, "local_grads_as_torch": run.local_grads_as_torch,
            "params": checkpoint.get_model_state_dict(run.model, EVERY_RANK),
            "trainable": sorted(n for n, p in params.items() if p.requires_grad),
            "frozen_with_grads": sorted(n for n, p in params.items() if not p.requires_grad and p.grad is not None),
            "communicated": _communicated(run.model)}


def finetune_suite(rank: int, world: int, cases: list[Case], directory: str) -> dict[str, Any]:
    """Every case in one launch, each from the same weights; every rank returns what it saw."""
    results: dict[str, Any] = {}
    for case in cases:
        fabric = make_fabric(case.strategy_case(), world)
        if case.loaded:
            results[case.name] = _loaded_and_resumed(fabric, case, Path(directory))
            continue
        run = setup(fabric, case)
        record: dict[str, Any] = {}
        train(run, case, range(RESUME_AT), record)
        saved = Path(directory) / case.name
        fabric.save(saved, {"model": run.model, "optimizer": run.optimizer, "step": RESUME_AT},
                    filter={"model": _ever_trained})
        train(run, case, range(RESUME_AT, STEPS))
        results[case.name] = {**record, **_summary(run), "resumed": _resumed_in_place(run, case, saved)}
        results[case.name]["assign"] = _load_assigning(run)
        if case.unfreeze:
            results[case.name]["frozen_between_micro_batches"] = _freeze_between_micro_batches(run)
    return results


def _ever_trained(key: str, value: Any) -> bool:
    """The entries a checkpoint of a case's training keeps: what any of its steps trains."""
    return "lora_" in key or key.endswith(".bias") or key == UNFROZEN


def _resumed_in_place(run: Run, case: Case, saved: Path) -> list[float]:
    """The checkpoint saved after RESUME_AT steps (the case's strategy's kind: DDP full, FSDP sharded; the trained
    entries only) loaded back into the trained model and optimizer, and the remaining steps trained again (the same
    traces: no compilation): their losses."""
    state = {"model": run.model, "optimizer": run.optimizer, "step": 0}
    run.fabric.load(saved, state, strict=False)
    assert state["step"] == RESUME_AT
    again = Run(run.fabric, run.model, run.optimizer)
    train(again, case, range(RESUME_AT, STEPS))
    return again.losses


def _load_assigning(run: Run) -> tuple[str | None, str | None, bool]:
    """`load_state_dict(..., assign=True)` and `load_state_dict` swapping tensors in (a torch.__future__ flag):
    refused (they would put undistributed parameters in place of the distributed ones); whether every parameter is
    still the one the optimizer holds, distributed."""
    params = {name: (param, spec_of(param)) for name, param in named(run.model).items()}
    full = checkpoint.get_model_state_dict(run.model, EVERY_RANK)
    assigning = _error(lambda: run.model.load_state_dict(full, assign=True))
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        swapping = _error(lambda: run.model.load_state_dict(full))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    kept = all(named(run.model)[name] is param and spec_of(param) is spec for name, (param, spec) in params.items())
    return assigning, swapping, kept


def _freeze_between_micro_batches(run: Run) -> str | None:
    """A LoRA matrix frozen after its no_sync micro-batch, before the synced one: refused (its local gradients
    would never be reduced)."""
    x, y = global_batches(DATA_WORLD, ACCUMULATE)[0]
    x, y = x[:2], y[:2]
    frozen = named(run.model)["transformer.h.1.attn.proj.lora_B"]
    with run.fabric.no_backward_sync(run.model):
        run.fabric.backward(loss_fn(run.model, x, y))
    frozen.requires_grad_(False)
    return _error(lambda: run.fabric.backward(loss_fn(run.model, x, y)))


def _loaded_and_resumed(fabric: Any, case: Case, directory: Path) -> dict[str, Any]:
    """As `litgpt finetune lora` starts and resumes under FSDP: the model on the meta device, the base model's
    weights loaded non-strictly (its names mapped by LitGPT's LoRA model), here from a sharded checkpoint and, on
    resuming, by `model.load_state_dict` (litgpt's `load_checkpoint` outside Lightning's FSDPStrategy); the LoRA
    weights, optimizer state and step from a checkpoint of the LoRA weights only."""
    base, base_sharded, lora_weights = directory / "base.pt", directory / "base-sharded", directory / "lora.pt"
    if fabric.global_rank == 0:
        initial = make_lora()
        torch.save(base_state_dict(initial), base)
        checkpoint.write_sharded({"model": base_state_dict(initial)}, base_sharded)
        torch.save({k: v for k, v in initial.state_dict().items() if "lora_" in k}, lora_weights)
    fabric.barrier()
    first = setup(fabric, case)
    fabric.load(base_sharded, {"model": first.model}, strict=False)
    fabric.load_raw(lora_weights, first.model, strict=False)
    train(first, case, range(RESUME_AT))
    saved = directory / "lora-finetuned.pth"
    fabric.save(saved, {"model": first.model, "optimizer": first.optimizer, "step": RESUME_AT},
                filter={"model": lora.lora_filter})
    train(first, case, range(RESUME_AT, STEPS))
    second = setup(fabric, case)
    second.model.load_state_dict(torch.load(base, weights_only=True), strict=False)
    state = {"model": second.model, "optimizer": second.optimizer, "step": 0}
    fabric.load(saved, state, strict=False)
    train(second, case, range(RESUME_AT, STEPS))
    return {"first": _summary(first), "resumed": _summary(second), "step": state["step"]}
