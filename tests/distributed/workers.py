"""What each rank runs in the distributed tests (module level, so spawned processes can import it), and the
single-process eager training they are compared with."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from litgpt import GPT, Config

import fulmen
import fulmen.distributed as fd
from fulmen.distributed import checkpoint
from fulmen.distributed import prims as dist_prims
from fulmen.distributed.transform import GradSync
from fulmen.jit.jitted_module import core

# Odd sizes on purpose: vocab 67 and the MLP's 45 rows do not split evenly over 2 ranks (padded shards).
CONFIG = dict(block_size=16, vocab_size=67, padded_vocab_size=67, n_layer=2, n_head=4, n_embd=32, n_query_groups=2,
              intermediate_size=45, bias=True, mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm",
              rotary_percentage=1.0, parallel_residual=False)
STEPS = 5
MICRO = 2  # rows per rank per micro-batch
SEQ = 16
LR = 1e-2
MAX_NORM = 0.5  # below the gradients' norm, so clipping really scales them
FULL = checkpoint.FULL


@dataclass(frozen=True)
class Setup:
    mode: str  # "ddp", "zero2-none", ..., "zero3-block"
    accumulate: int = 1  # micro-batches per step; all but the last under no_sync
    clip: bool = False
    device: str = "cpu"  # "cuda": each rank on its own GPU
    dtype: torch.dtype = torch.float32

    def place(self, rank: int = 0) -> torch.device:
        return torch.device("cuda", rank) if self.device == "cuda" else torch.device("cpu")

    @property
    def name(self) -> str:
        return f"{self.mode}-{'accumulate' if self.accumulate > 1 else 'clip' if self.clip else 'plain'}"


def make_model(seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(Config(**CONFIG))
    return model.to(dtype) if device != "meta" else model


def distribute(model: torch.nn.Module, mode: str, **kwargs: Any) -> torch.nn.Module:
    if mode == "ddp":
        return fd.ddp(model, **kwargs)
    sharding, bucketing = mode.split("-")
    return fd.fsdp(model, sharding_strategy=sharding, bucketing_strategy=bucketing, **kwargs)


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def global_batches(world: int, accumulate: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    rows = world * MICRO * accumulate
    return [(torch.randint(0, CONFIG["vocab_size"], (rows, SEQ), generator=generator),
             torch.randint(0, CONFIG["vocab_size"], (rows, SEQ), generator=generator)) for _ in range(STEPS)]


# (rows per rank and micro-batch, length) of each step of `train_over_lengths`: the second step changes both
LENGTH_SHAPES = [(2, 5), (3, 9), (2, 12), (3, 7)]


def length_batches(world: int, accumulate: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [(torch.randint(0, CONFIG["vocab_size"], (world * rows * accumulate, length), generator=generator),
             torch.randint(0, CONFIG["vocab_size"], (world * rows * accumulate, length), generator=generator))
            for rows, length in LENGTH_SHAPES]


def eager_training(setup: Setup, world: int = 2, splits: int = 1, lengths: bool = False) -> dict[str, Any]:
    """One process, the whole global batch per step: what the distributed runs must reproduce. `splits` > 1
    accumulates the batch in that many chunks: the same training summed in another order. `lengths`: the batches of
    `length_batches`."""
    model = make_model(device=setup.place(), dtype=setup.dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for x, y in (length_batches if lengths else global_batches)(world, setup.accumulate):
        loss = torch.zeros((), device=setup.place())
        for xs, ys in zip(x.chunk(splits), y.chunk(splits)):
            part = loss_fn(model, xs.to(setup.place()), ys.to(setup.place())) / splits
            part.backward()
            loss += part.detach()
        if setup.clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


def assert_matches_eager(got: dict[str, Any], want: dict[str, Any]) -> None:
    """A distributed run's losses and final parameters against single-process eager's on the same batches."""
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=0)
    assert set(got["params"]) == set(want["params"])
    for name, value in want["params"].items():
        # atol: AdamW divides by sqrt(v), so float32 summation-order noise on a near-zero gradient becomes ~1e-6
        torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-5, msg=name)
    assert not torch.equal(want["params"]["lm_head.weight"], make_model().lm_head.weight)  # it trained
    if want["norms"]:  # clipped by norm
        torch.testing.assert_close(got["norms"], want["norms"], rtol=1e-5, atol=0)
        assert min(want["norms"]) > MAX_NORM  # every step was clipped


def count_collectives(trace: Any) -> dict[str, int]:
    """How many of each collective the trace starts."""
    counts = {sym.name: 0 for sym in dist_prims.COLLECTIVES}
    for bsym in trace.bound_symbols:
        if bsym.sym in dist_prims.COLLECTIVES:
            counts[bsym.sym.name] += 1
    return counts


def _trace_facts(jitted: Any) -> dict[str, Any]:
    forward = fulmen.last_traces(jitted)[-1]
    backward = fulmen.last_backward_traces(jitted)[-1]
    program = core(jitted).last_entry.program
    local = program.finalize(program.plan.backward(program.plan.differentiable), GradSync.LOCAL)[-1]
    n_outputs = program.plan.n_outputs
    all_reduce_bytes = [b.args[0].numel() * b.args[0].element_size() for b in backward.bound_symbols
                        if b.sym is dist_prims.all_reduce]
    return {
        "forward": count_collectives(forward),
        "backward": count_collectives(backward),
        "local_backward": count_collectives(local),
        "saved": [p.pname for p in forward.output[n_outputs:]],
        "forward_source": str(forward),
        "backward_source": str(backward),
        "all_reduce_bytes": all_reduce_bytes,
    }


def _train_steps(rank: int, world: int, setup: Setup, model: torch.nn.Module, jitted: Any,
                 batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 check_local_grads: bool = False) -> tuple[list[float], list[float]]:
    """AdamW steps of `jitted` over the global `batches`, this rank's rows of each micro-batch (a view into the
    global batch), all but the last micro-batch of a step under no_sync: the losses averaged over the ranks, and the
    clipped norms. `check_local_grads`: after each no_sync backward, the local gradients are where torch keeps them."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for x, y in batches:
        rows = x.shape[0] // world // setup.accumulate
        total = torch.zeros((), device=device)
        for micro in range(setup.accumulate):
            start = (micro * world + rank) * rows
            xs, ys = x[start : start + rows].to(device), y[start : start + rows].to(device)
            syncing = micro == setup.accumulate - 1
            with contextlib.nullcontext() if syncing else fd.no_sync(jitted):
                loss = loss_fn(jitted, xs, ys) / setup.accumulate
                loss.backward()
            if check_local_grads and not syncing:  # in .grad as torch's DDP keeps them, held back (full) under FSDP
                assert all((p.grad is None) == (setup.mode != "ddp") for p in model.parameters())
            total += loss.detach()
        if setup.clip:
            norms.append(fd.clip_grad_norm_(jitted, MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        torch_dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses, norms


def train(rank: int, world: int, setup: Setup, **distribute_kwargs: Any) -> dict[str, Any]:
    device = setup.place(rank)
    model = distribute(make_model(device=device, dtype=setup.dtype), setup.mode, **distribute_kwargs)
    param_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
    jitted = fulmen.jit(model)
    losses, norms = _train_steps(rank, world, setup, model, jitted, global_batches(world, setup.accumulate), device,
                                 check_local_grads=True)
    params = checkpoint.get_model_state_dict(jitted, FULL)
    return {"losses": losses, "norms": norms, "params": params, "param_bytes": param_bytes,
            "traces": _trace_facts(jitted) if rank == 0 else None}


def train_over_lengths(rank: int, world: int, setups: list[tuple[Setup, dict[str, Any]]]) -> dict[str, Any]:
    """Each setup with its JitOptions fields, trained on `length_batches` (each rank's rows a view into the global
    batch, at an offset on rank 1) with static traces (dynamic=False) and with the default's symbolic sizes."""
    results = {}
    for setup, options in setups:
        for dynamic in (False, None):
            model = distribute(make_model(), setup.mode)
            jitted = fulmen.jit(model, options=fulmen.JitOptions(dynamic=dynamic, **options))
            losses, norms = _train_steps(rank, world, setup, model, jitted, length_batches(world, setup.accumulate),
                                         torch.device("cpu"))
            results[setup.name, dynamic] = {
                "losses": losses, "norms": norms, "params": checkpoint.get_model_state_dict(jitted, FULL),
                "shards": shards_of(model),  # the full parameters on rank 0 only; each rank's own
                "misses": fulmen.cache_misses(jitted), "reasons": fulmen.last_cache_miss_reasons(jitted),
                "forward": str(fulmen.last_traces(jitted)[-1]),
            }
    return results


def parity_suite(rank: int, world: int, setups: list[Setup]) -> dict[str, Any]:
    """Every setup in turn in one process group (one launch for the whole suite)."""
    results = {}
    for setup in setups:
        results[setup.name] = train(rank, world, setup)
    for mb in (0.0, 0.01):  # DDP bucket caps: one all_reduce per parameter, and buckets of >= 10 KiB
        results[f"ddp-bucket-{mb}"] = train(rank, world, Setup("ddp"), bucket_size_in_mb=mb)
    group = torch_dist.new_group(list(range(world)))  # a process group passed in rather than the default one
    results["zero3-block-group"] = train(rank, world, Setup("zero3-block"), process_group=group)
    results["zero3-block-inflight1"] = train(rank, world, Setup("zero3-block"), max_in_flight=1)
    return results


# --- checkpoints ------------------------------------------------------------------------------------------------
def shards_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def save_checkpoints(rank: int, world: int, directory: str) -> dict[str, Any]:
    model = distribute(make_model(), "zero3-block")
    checkpoint.save(model, Path(directory) / "full.pt", checkpoint.StateDictOptions(full_state_dict=True))
    checkpoint.save(model, Path(directory) / "sharded")
    return {"full": checkpoint.get_model_state_dict(model, FULL)}


def load_checkpoints(rank: int, world: int, directory: str) -> dict[str, Any]:
    results = {}
    for name in ("full", "sharded"):
        model = distribute(make_model(seed=123), "zero3-block")  # other values than the checkpoint's
        checkpoint.load(model, Path(directory) / f"world1_{name}")
        results[name] = {"full": checkpoint.get_model_state_dict(model, FULL), "shards": shards_of(model)}
    return results


# --- meta-device initialisation -----------------------------------------------------------------------------------
def materialize_from_meta(rank: int, world: int) -> dict[str, Any]:
    """Creates the model on the meta device and lets fsdp materialise it, recording the most parameter bytes this
    rank held while doing so."""
    model = make_model(device="meta")
    torch.manual_seed(7)
    peak = [0]

    def held() -> int:
        return sum(p.untyped_storage().nbytes() for p in model.parameters() if not p.is_meta)

    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            original = module.reset_parameters

            def reset(original=original) -> None:
                original()
                peak[0] = max(peak[0], held())

            module.reset_parameters = reset
    distribute(model, "zero3-block", device="cpu")
    peak[0] = max(peak[0], held())
    return {"peak_bytes": peak[0], "full": checkpoint.get_model_state_dict(model, FULL)}


def eager_from_meta() -> dict[str, torch.Tensor]:
    """The same initialisation on one process: each module materialised and reset in the order fsdp visits them."""
    model = make_model(device="meta")
    torch.manual_seed(7)
    for module in model.modules():
        own = [*module._parameters.values(), *module._buffers.values()]
        if any(t is not None and t.is_meta for t in own):
            module.to_empty(device="cpu", recurse=False)
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- a failing rank -----------------------------------------------------------------------------------------------
def one_rank_fails(rank: int, world: int, how: str, stall_seconds: float = 0.0) -> float:
    """Rank 1 raises (its process ends) or stalls before its second backward; rank 0 must end with an error from
    the collective. Returns when rank 0 started waiting."""
    model = fd.ddp(make_model())
    jitted = fulmen.jit(model)
    started = time.perf_counter()
    for step, (x, y) in enumerate(global_batches(world, 1)):
        if step == 1 and rank == 1:
            if how == "raises":
                raise RuntimeError("rank 1 fails on purpose")
            time.sleep(stall_seconds)
            return started
        started = time.perf_counter()
        loss_fn(jitted, x[rank * MICRO : (rank + 1) * MICRO], y[rank * MICRO : (rank + 1) * MICRO]).backward()
    return started
