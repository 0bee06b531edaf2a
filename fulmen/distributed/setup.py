"""`ddp` and `fsdp`: mark a module's parameters as replicated or sharded before it is jitted.

Neither wraps the module: they broadcast or shard the parameters in place (each `nn.Parameter` keeps its
identity, so optimizers and state dicts see the same objects) and attach a `ParamSpec` to each. The collectives
themselves are inserted into the traces when the module (or a function that calls it) is jitted.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from fulmen.distributed.loading import keep_parameters, shard_on_load
from fulmen.distributed.prims import group_name, make_checker
from fulmen.distributed.specs import (
    DistributedState,
    FSDPBucketingStrategy,
    FSDPType,
    local_shard,
    spec_of,
)
from fulmen.distributed.transform import DistributedProgram
from fulmen.transforms.distribution import ModuleWrapper


def _unwrap(model: nn.Module, what: str) -> nn.Module:
    if isinstance(model, ModuleWrapper):  # fulmen.jit's result: it reads the specs this package attaches
        if model.has_run:
            raise RuntimeError(f"fulmen.distributed.{what} must be applied before the jitted module first runs: "
                               f"apply it to the module, then call fulmen.jit")
        return model.wrapped_module
    if not isinstance(model, nn.Module):
        raise TypeError(f"fulmen.distributed.{what} expects an nn.Module, got {type(model).__name__}")
    if getattr(model, "_fulmen_dist", None) is not None:
        raise RuntimeError(f"this module is already distributed with fulmen.distributed.{model._fulmen_dist.kind}")
    # A parameter shared with a module distributed earlier would get a second hook and spec: each backward would then
    # be refused as computed outside the programs. Refused here, before anything is broadcast or sharded.
    for name, param in model.named_parameters():
        if (spec := spec_of(param)) is not None:
            raise RuntimeError(f"fulmen.distributed.{what}: parameter {name!r} is already distributed with "
                               f"fulmen.distributed.{spec.state.kind} (shared with another module, as {spec.name!r}); "
                               f"apply {what} once, to a module that holds every module sharing it")
    return model


def _state(kind: str, process_group: dist.ProcessGroup | None, **options) -> DistributedState:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"fulmen.distributed.{kind} needs an initialized process group "
                           "(torch.distributed.init_process_group) or a process_group argument")
    group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    state = DistributedState(kind, group, group_name(group), world, rank, DistributedProgram, **options)
    state.checker = make_checker(state, group)
    return state


def _check_broadcast_from(broadcast_from: int | None, state: DistributedState) -> None:
    # bool is an int; a rank outside the group fails in the first broadcast, after other checks passed
    if broadcast_from is not None and (isinstance(broadcast_from, bool) or not isinstance(broadcast_from, int)
                                       or not 0 <= broadcast_from < state.world):
        raise ValueError(f"broadcast_from must be None or a rank of the process group (0 to {state.world - 1}), got "
                         f"{broadcast_from!r}")


def _check_same_model(module: nn.Module, state: DistributedState) -> None:
    """Raises on every rank unless every rank distributes the same parameters and buffers (names, shapes, dtypes).

    Nothing else would notice: gloo broadcasts and gathers tensors of different sizes without an error, and each
    rank would train its own model with the others' gradients mixed in."""
    mine = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for name, t in itertools.chain(module.named_parameters(), module.named_buffers())]
    everyone: list = [None] * state.world
    dist.all_gather_object(everyone, mine, group=state.group)
    for rank, theirs in enumerate(everyone[1:], start=1):
        for first, other in itertools.zip_longest(everyone[0], theirs):
            if first != other:
                raise ValueError(f"fulmen.distributed.{state.kind}: the ranks' models differ, rank 0 has "
                                 f"{_describe(first)} where rank {rank} has {_describe(other)}; every rank must "
                                 "build the same model")


def _describe(entry: tuple[str, tuple[int, ...], str] | None) -> str:
    if entry is None:
        return "nothing"
    name, shape, dtype = entry
    return f"{name!r} of shape {shape} and dtype {dtype}"


def _broadcast(tensor: torch.Tensor, state: DistributedState, source: int) -> None:
    dist.broadcast(tensor, src=dist.get_global_rank(state.group, source), group=state.group)


def ddp(model: nn.Module, *, broadcast_from: int | None = 0, bucket_size_in_mb: float = 25.0,
        process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Data parallelism: every rank holds the whole model and gradients are averaged with bucketed all_reduce.

    Parameters and buffers are broadcast from rank `broadcast_from` of the group (None: already equal), once, here:
    buffers a forward updates (BatchNorm's running statistics) then evolve on each rank from its own batches, as with
    torch's `DistributedDataParallel(broadcast_buffers=False)` (its default broadcasts them before each forward). The
    backward starts each bucket's all_reduce as soon as its last gradient is computed and waits for all of them
    at its end, so communication overlaps the rest of the backward. `bucket_size_in_mb=0` gives one all_reduce
    per parameter. Only the jitted programs' gradients are reduced, so a gradient term computed outside them (a
    regulariser on a parameter) is refused with the parameter's name (fulmen.distributed.specs.watch); so under fsdp.
    """
    module = _unwrap(model, "ddp")
    if (isinstance(bucket_size_in_mb, bool) or not isinstance(bucket_size_in_mb, int | float)
            or not 0 <= bucket_size_in_mb < math.inf):
        raise ValueError(f"bucket_size_in_mb must be a number >= 0, got {bucket_size_in_mb!r}")
    state = _state("ddp", process_group, bucket_bytes=int(bucket_size_in_mb * 2**20))
    _check_broadcast_from(broadcast_from, state)
    _check_same_model(module, state)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if broadcast_from is not None:
                _broadcast(param.data, state, broadcast_from)
            state.distribute(param, name, None, name)
        if broadcast_from is not None:
            for buffer in module.buffers():
                _broadcast(buffer, state, broadcast_from)
    for sub in module.modules():
        if any(param is not None for param in sub._parameters.values()):
            sub.register_load_state_dict_pre_hook(keep_parameters)
    module._fulmen_dist = state
    return model


def _bucket_keys(module: nn.Module, strategy: FSDPBucketingStrategy) -> dict[str, str]:
    """Parameter name -> the name of the collective it travels in."""
    # In named_modules' (pre-)order, so with nested lists (a block's experts) the outermost block matches first; an
    # order that differs between processes would give ranks different collectives.
    blocks: list[str] = []
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList):
            blocks.extend(f"{name}.{child}" if name else child for child, _ in sub.named_children())
    keys: dict[str, str] = {}
    for owner, sub in module.named_modules():
        for pname, _ in sub.named_parameters(recurse=False):
            name = f"{owner}.{pname}" if owner else pname
            if strategy is FSDPBucketingStrategy.NONE:
                key = name
            elif strategy is FSDPBucketingStrategy.LAYER:
                key = owner
            else:
                block = next((b for b in blocks if owner == b or owner.startswith(b + ".")), None)
                key = block if block is not None else owner
            keys.setdefault(name, key)
    return keys


def parse_enum(value: object, kind: type, what: str):
    if isinstance(value, kind):
        return value
    if isinstance(value, str) and value.upper() in kind.__members__:
        return kind[value.upper()]
    raise ValueError(f"{what} must be one of {', '.join(kind.__members__)}, got {value!r}")


def fsdp(model: nn.Module, *, device: torch.device | str | None = None, broadcast_from: int | None = None,
         sharding_strategy: FSDPType | str = FSDPType.ZERO2,
         bucketing_strategy: FSDPBucketingStrategy | str = FSDPBucketingStrategy.NONE,
         process_group: dist.ProcessGroup | None = None, max_in_flight: int = 2) -> nn.Module:
    """Fully sharded data parallelism: each rank keeps a dim-0 shard of every parameter.

    The forward all-gathers parameters before their first use (at most `max_in_flight` collectives ahead);
    ZERO3 frees them after their last use and gathers them again in the backward, ZERO2 keeps them for it. The
    backward reduce-scatters gradients, one collective per bucket (`bucketing_strategy`). Parameters are moved
    to `device` shard by shard; parameters on the meta device are materialised module by module with
    `reset_parameters()` and sharded at once, so no rank ever holds the whole model. `broadcast_from` broadcasts
    each full parameter from that rank before sharding it (None: every rank already has the same values).

    Outside the jitted program each parameter and its `.grad` hold this rank's shard, so a computation over the
    whole model made there needs every rank's part: clip with `fulmen.distributed.clip_grad_norm_` (or
    `fabric.clip_gradients`), not `torch.nn.utils.clip_grad_norm_`, which would scale each rank by its own shard's norm.
    `module.load_state_dict` takes full tensors (each rank keeps its rows; fulmen.distributed.loading), so a
    checkpoint one process wrote loads on every rank as it would there.
    """
    module = _unwrap(model, "fsdp")
    sharding = parse_enum(sharding_strategy, FSDPType, "sharding_strategy")
    bucketing = parse_enum(bucketing_strategy, FSDPBucketingStrategy, "bucketing_strategy")
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise ValueError(f"max_in_flight must be an integer >= 1, got {max_in_flight!r}")
    state = _state("fsdp", process_group, sharding=sharding, bucketing=bucketing, max_in_flight=max_in_flight)
    _check_broadcast_from(broadcast_from, state)
    _check_same_model(module, state)
    device = torch.device(device) if device is not None else None
    keys = _bucket_keys(module, bucketing)
    with torch.no_grad():
        for owner, sub in module.named_modules():
            own = [t for t in (*sub._parameters.values(), *sub._buffers.values()) if t is not None]
            if any(t.is_meta for t in own):
                sub.to_empty(device=device or torch.device("cpu"), recurse=False)
                if hasattr(sub, "reset_parameters"):
                    sub.reset_parameters()
            for pname, param in sub._parameters.items():
                if param is None or spec_of(param) is not None:  # shared with a module seen earlier
                    continue
                name = f"{owner}.{pname}" if owner else pname
                if param.dim() == 0:
                    raise ValueError(f"fsdp cannot shard the 0-dimensional parameter {name!r}")
                full = param.data if device is None else param.data.to(device)
                if broadcast_from is not None:
                    _broadcast(full, state, broadcast_from)
                shape = full.shape
                param.data = local_shard(full, state.rank, state.world)
                del full
                state.distribute(param, name, shape, keys[name])
            if any(param is not None for param in sub._parameters.values()):
                # module.load_state_dict(full) takes this rank's rows, as on one process (shared parameters included)
                sub.register_load_state_dict_pre_hook(shard_on_load)
            for bname, buffer in sub._buffers.items():
                if buffer is None:
                    continue
                if device is not None and buffer.device != device:
                    sub._buffers[bname] = buffer = buffer.to(device)
                if broadcast_from is not None:
                    _broadcast(buffer, state, broadcast_from)
    module._fulmen_dist = state
    return model


def unwrap_module(model: nn.Module) -> nn.Module:
    """The user's module behind a `fulmen.jit` result."""
    return model.wrapped_module if isinstance(model, ModuleWrapper) else model


def distributed_state(model: nn.Module) -> DistributedState:
    state = getattr(unwrap_module(model), "_fulmen_dist", None)
    if state is None:
        raise ValueError("this module was not set up with fulmen.distributed.ddp or fulmen.distributed.fsdp")
    return state


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Gradient accumulation: forwards run inside skip gradient communication in their backward.

    The local gradients of replicated (`ddp`) parameters accumulate in `.grad`, as with torch's DDP, and the next
    synced backward reduces what `.grad` holds with its own: `zero_grad()` in between discards them. Those of sharded
    (`fsdp`) parameters, full-shaped, are held back (`.grad` holds the shard) and folded into the next synced
    reduction, as torch's FSDP2 keeps them (`zero_grad()` does not reach them). Either way the gradient after the
    synced backward is the average over ranks of the sum over micro-batches.
    """
    state = distributed_state(model)
    previous, state.sync = state.sync, False
    try:
        yield
    finally:
        state.sync = previous
