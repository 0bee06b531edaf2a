"""State dicts and checkpoints of distributed models and their optimizers: full (gathered on rank 0) or sharded
(torch.distributed.checkpoint).

A sharded state dict holds each sharded tensor (a parameter, or optimizer state shaped like one) as a `DTensor`
(`Shard(0)` over the model's process group, its local rows without padding), so DCP records where every row lives
and a checkpoint saved at one world size loads at another (a plain, undistributed module included). Replicated
tensors (DDP parameters, buffers, optimizer step counts) are plain tensors, written once. Optimizer state dicts keep
torch's layout (state keyed by the parameter's position in the param groups), so a full checkpoint is exactly what
the same training on one process would save: `torch.optim.Optimizer.load_state_dict` and `nn.Module` take it as is.

A checkpoint is a file (full: `torch.save` of the state, from rank 0) or a directory (sharded: DCP's files for the
tensors plus `meta.pt`, everything else), on a local or shared filesystem. Either is written beside `path`,
fsync'd, renamed into place and certified by a manifest written last (`<path>.manifest.json`: sizes and CRC-32
checksums, see fulmen.distributed.manifest), so a kill at any moment leaves a complete checkpoint or one that is
refused; loading checks the manifest first (`CheckpointError`: nothing was read).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from fulmen.core import pytree
from fulmen.distributed import manifest
from fulmen.distributed.loading import import_value
from fulmen.distributed.manifest import CheckpointError as CheckpointError  # re-exported
from fulmen.distributed.manifest import verify as verify  # re-exported
from fulmen.distributed.prims import _all_gather
from fulmen.distributed.setup import unwrap_module
from fulmen.distributed.specs import DistributedState, ParamSpec, spec_of, valid_rows

T = TypeVar("T")
META_FILE = "meta.pt"  # a sharded checkpoint's non-tensor state and the places of its tensors


@dataclass(frozen=True, slots=True)
class StateDictOptions:
    """full_state_dict: gathered tensors (else sharded DTensors); cpu_offload: full tensors on CPU;
    rank0_only: only rank 0 gets the full state dict (the others take part in the gathers and get `{}`)."""

    full_state_dict: bool = False
    cpu_offload: bool = False
    rank0_only: bool = False


FULL = StateDictOptions(full_state_dict=True, cpu_offload=True, rank0_only=True)  # what a full checkpoint holds


def _sharded_spec(value: Any) -> ParamSpec | None:
    spec = spec_of(value) if isinstance(value, torch.Tensor) else None
    return spec if spec is not None and spec.sharded else None


def _gather(shard: torch.Tensor, spec: ParamSpec) -> torch.Tensor:
    state = spec.state
    out = shard.new_empty((state.world * shard.shape[0], *shard.shape[1:]))
    _all_gather(out, shard.contiguous(), group=state.group)
    return out[: spec.full_shape[0]]


def _as_dtensor(shard: torch.Tensor, spec: ParamSpec) -> DTensor:
    state = spec.state
    # kept by the state, for its group: a process-wide table by id(group) kept every mesh (and its group) alive, and
    # a group made after one was destroyed could take its id
    mesh = state.meshes.get(shard.device.type)
    if mesh is None:
        mesh = state.meshes[shard.device.type] = DeviceMesh.from_group(state.group, shard.device.type)
    local = shard[: valid_rows(spec.full_shape[0], state.rank, state.world)]
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=spec.full_shape,
                              stride=torch.empty(spec.full_shape, device="meta").stride())


def _export(value: Any, spec: ParamSpec | None, options: StateDictOptions, keep: bool = True) -> Any:
    """A state tensor as a state dict holds it: gathered or a DTensor when it is sharded like `spec`'s parameter.
    `keep=False` (a rank that gets `{}`): only takes part in the gather, copying nothing."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    if spec is not None:
        value = _gather(value, spec) if options.full_state_dict else _as_dtensor(value, spec)
    if not keep:
        return None
    if options.cpu_offload and not isinstance(value, DTensor):
        value = value.cpu()
    return value


def _rank0_only(module_state: DistributedState | None, options: StateDictOptions) -> bool:
    """True on the ranks that get `{}` because only rank 0 keeps the full state."""
    return options.full_state_dict and options.rank0_only and module_state is not None and module_state.rank != 0


def get_model_state_dict(model: nn.Module, options: StateDictOptions = StateDictOptions()) -> dict[str, Any]:
    """The model's state dict with sharded parameters gathered (full) or as DTensors (sharded)."""
    module = unwrap_module(model)
    keep = not _rank0_only(getattr(module, "_fulmen_dist", None), options)
    result = {key: _export(value, _sharded_spec(value), options, keep)
              for key, value in module.state_dict(keep_vars=True).items()}
    return result if keep else {}


def load_model_state_dict(model: nn.Module, state_dict: dict[str, Any], strict: bool = True):
    """Loads a full state dict (every rank takes its rows) or a sharded one (DTensors) into the model. The entries
    named as the model's are checked and converted before anything is loaded; one the model's own loading renames
    is converted where it lands (fulmen.distributed.loading)."""
    module = unwrap_module(model)
    own = module.state_dict(keep_vars=True)
    converted = {}
    for key, value in state_dict.items():
        spec = _sharded_spec(own.get(key))
        converted[key] = import_value(value, spec, own.get(key), f"state dict entry {key!r}")
    return module.load_state_dict(converted, strict=strict)


def _optimizer_params(optimizer: Optimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def _state_spec(param: torch.Tensor, value: Any, full: bool, what: str) -> ParamSpec | None:
    """The spec of the sharded parameter whose rows this optimizer state tensor holds; None for a scalar (a step
    count) or the state of a parameter that is not sharded. `full`: `value` comes from a full state dict."""
    spec = _sharded_spec(param)
    if spec is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    if isinstance(value, DTensor):
        return spec
    expected = tuple(spec.full_shape if full else param.shape)
    if tuple(value.shape) != expected:
        # e.g. a factored second moment: its rows are not the parameter's, so how it is sharded is unknown
        raise ValueError(f"{what} has shape {tuple(value.shape)}; the state of the sharded parameter {spec.name!r} "
                         f"must be a scalar or shaped like it ({expected})")
    return spec


def get_optimizer_state_dict(optimizer: Optimizer, options: StateDictOptions = StateDictOptions()) -> dict[str, Any]:
    """`optimizer.state_dict()` with the state of sharded parameters gathered (full) or as DTensors (sharded).

    Every rank must call it (the gathers are collectives); they walk the state in the same order because the
    optimizer's parameters, and so its state, are the same on every rank.
    """
    plain = optimizer.state_dict()
    params = _optimizer_params(optimizer)
    specs = {spec.state for p in params if (spec := spec_of(p)) is not None}
    keep = not _rank0_only(next(iter(specs)) if len(specs) == 1 else None, options)
    state: dict[int, dict[str, Any]] = {}
    for index in sorted(plain["state"]):
        param = params[index]
        state[index] = {key: _export(value, _state_spec(param, value, False, f"optimizer state {key!r} of "
                                                                              f"parameter {index}"), options, keep)
                        for key, value in sorted(plain["state"][index].items())}
    return {"state": state, "param_groups": plain["param_groups"]} if keep else {}


def load_optimizer_state_dict(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Loads an optimizer state dict in torch's layout, full (every rank takes its rows of sharded parameters'
    state) or sharded (DTensors); the state of parameter `i` goes to the optimizer's parameter `i`."""
    optimizer.load_state_dict(local_optimizer_state(optimizer, state_dict))


def local_optimizer_state(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict in torch's layout as the optimizer holds it: a sharded parameter's state as this rank's
    rows, from a full tensor, a DTensor or this rank's rows already (the plain optimizer's own `state_dict()`). Also a
    `load_state_dict` pre-hook (torch's signature), so `optimizer.load_state_dict` takes what
    `optimizer.state_dict()` gives through a strategy."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        raise ValueError("an optimizer state dict has the keys 'state' and 'param_groups' "
                         f"(torch.optim.Optimizer.state_dict()), got {type(state_dict).__name__} "
                         f"{sorted(state_dict) if isinstance(state_dict, dict) else ''}")
    params = _optimizer_params(optimizer)
    state: dict[int, dict[str, Any]] = {}
    for index, entry in state_dict["state"].items():
        position = int(index)
        if not 0 <= position < len(params):
            raise ValueError(f"the optimizer state dict has state for parameter {position}, the optimizer has "
                             f"{len(params)} parameters")
        param = params[position]
        state[position] = {}
        for key, value in entry.items():
            what = f"optimizer state {key!r} of parameter {position}"
            if _local_rows(param, value):
                state[position][key] = value
            else:
                state[position][key] = import_value(value, _state_spec(param, value, True, what), param, what)
    return {"state": state, "param_groups": state_dict["param_groups"]}


def _local_rows(param: torch.Tensor, value: Any) -> bool:
    """Whether `value` is already this rank's rows of a sharded parameter's state. (Where the rows are the whole
    shape, one row, a full value's rows are the same: the other ranks' rows are padding.)"""
    spec = _sharded_spec(param)
    return (spec is not None and isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
            and value.shape == param.shape != spec.full_shape)


# --- checkpoints on disk ------------------------------------------------------------------------------------------


def _group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if group is not None else 0


def _on_rank0(group: dist.ProcessGroup | None, action: Callable[[], T], what: str) -> T:
    """Runs `action` on rank 0 and tells every rank how it went and what it returned: a failure raises on all of
    them, so none is left waiting in a collective for a rank that gave up."""
    error: BaseException | None = None
    result = None
    if _group_rank(group) == 0:
        try:
            result = action()
        except BaseException as caught:  # noqa: BLE001 - re-raised below, after the other ranks are told
            error = caught
    message = None if error is None else f"{type(error).__name__}: {error}"
    if group is not None:
        box = [message, result]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        message, result = box
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(f"rank 0 failed to {what}: {message}")
    return result


def missing_checkpoint(path: str | os.PathLike) -> FileNotFoundError:
    """The error for a checkpoint that is not there, naming what an interrupted save left instead."""
    path = Path(path)
    left = sorted(p.name for p in path.parent.glob(f"{path.name}{manifest.PARTIAL_MARK}*")) \
        if path.parent.is_dir() else []
    if left:
        return FileNotFoundError(f"no checkpoint at {path}, only what an interrupted save left ({', '.join(left)}); "
                                 "the next save there removes it")
    return FileNotFoundError(f"no checkpoint at {path}")


def _stored_whole(obj: Any) -> bool:
    """A tensor, or a tuple, list or dict pytree keeps whole (an unregistered subclass): not looked into."""
    return isinstance(obj, torch.Tensor) or pytree.kept_whole(obj)


def _flatten(tree: Any) -> tuple[Any, dict[tuple, torch.Tensor]]:
    """`tree` with its tensors taken out (None in their place) and the tensors by their path of keys (see
    fulmen.core.pytree: positions, mapping keys, dataclass fields)."""
    tensors: dict[tuple, torch.Tensor] = {}
    for path, leaf in pytree.leaves_with_paths(tree, _stored_whole):
        if isinstance(leaf, torch.Tensor):
            tensors[path] = leaf
        else:
            pytree.refuse_tensors_kept_whole(leaf, "a sharded checkpoint")
    return pytree.tree_map(lambda leaf: None if isinstance(leaf, torch.Tensor) else leaf, tree, _stored_whole), tensors


def _storage_key(path: tuple) -> str:
    return "/".join(str(part) for part in path)


def _prepare(path: Path) -> Path:
    """Rank 0, before a save: the parent directory made, what interrupted saves of `path` left removed, and the
    name the data is written under until it is complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    manifest.remove_partials(path.parent, path.name)
    return manifest.partial_path(path)


def write_full(checkpoint: Any, path: str | os.PathLike, group: dist.ProcessGroup | None = None,
               write: Callable[[Any, Path], None] | None = None) -> None:
    """Rank 0 writes `checkpoint` (already gathered) with `write(checkpoint, path)` (default `torch.save`), beside
    `path` first, then fsync'd, renamed into place and certified by its manifest (see fulmen.distributed.manifest)."""
    path = Path(path)

    def save() -> None:
        partial = _prepare(path)
        try:
            (write or torch.save)(checkpoint, partial)
            manifest.fsync_tree(partial)
            manifest.commit(partial, path, manifest.checksums(partial))
        except BaseException:
            manifest.remove(partial)
            raise

    _on_rank0(group, save, f"write the checkpoint {path}")


def write_sharded(checkpoint: Any, path: str | os.PathLike, group: dist.ProcessGroup | None = None) -> None:
    """Writes the tensors of `checkpoint` (DTensors for sharded ones) with DCP and the rest to `meta.pt`, into a
    directory beside `path`; every rank checksums its share of the files, and rank 0 renames the directory into
    place and writes the manifest."""
    path = Path(path)
    skeleton, tensors = _flatten(checkpoint)
    keys = {_storage_key(p): p for p in tensors}
    if len(keys) != len(tensors):
        raise ValueError("two checkpoint entries have the same storage key (a key holds '/'); rename one")
    partial = _on_rank0(group, lambda: _prepare(path), f"prepare to write {path}")
    try:
        # DCP tells every rank when one fails to write (a CheckpointException on all of them), and fsyncs its files.
        dcp.save({key: tensors[p] for key, p in keys.items()}, checkpoint_id=partial, process_group=group,
                 no_dist=group is None)
        _on_rank0(group, lambda: torch.save({"skeleton": skeleton, "tensors": list(tensors)}, partial / META_FILE),
                  f"write {partial / META_FILE}")
        contents = manifest.checksums(partial, group)

        def finish() -> None:
            manifest.fsync_tree(partial)
            manifest.commit(partial, path, contents)

        _on_rank0(group, finish, f"write the checkpoint {path}")
    except BaseException:
        if _group_rank(group) == 0:
            manifest.remove(partial)
        raise


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path).is_dir()


def _model_targets(owner: nn.Module) -> Callable[[tuple, TensorStorageMetadata], torch.Tensor | None]:
    live = get_model_state_dict(owner)
    return lambda rest, meta: live.get(rest[0]) if len(rest) == 1 else None


def _optimizer_targets(owner: Optimizer) -> Callable[[tuple, TensorStorageMetadata], torch.Tensor | None]:
    params = _optimizer_params(owner)

    def target(rest: tuple, meta: TensorStorageMetadata) -> torch.Tensor | None:
        if len(rest) == 3 and rest[0] == "state" and 0 <= int(rest[1]) < len(params):
            param = params[int(rest[1])]
            spec = _sharded_spec(param)
            if spec is not None and tuple(meta.size) == tuple(spec.full_shape):
                return _as_dtensor(param.new_zeros(param.shape, dtype=meta.properties.dtype), spec)
        return None

    return target


def read_sharded(path: str | os.PathLike, owners: dict[tuple, Any], group: dist.ProcessGroup | None = None,
                 weights_only: bool | None = None) -> Any:
    """The checkpoint `write_sharded` wrote, its tensors read into the layout of the live objects: `owners` maps
    a path of keys to the module or optimizer whose state is there (its sharded tensors come back as DTensors of
    this rank's rows); every other tensor comes back whole, on CPU. So does a model's entry the live model lacks by
    that name: the model's own loading may take it under another (LitGPT's LoRA model maps a base model's
    `lm_head.weight` to `lm_head.linear.weight`, and `shard_on_load` keeps this rank's rows), or strictness decides
    about it. `weights_only` as `torch.load`'s, for `meta.pt`."""
    path = Path(path)
    meta = torch.load(path / META_FILE, weights_only=weights_only)
    storage = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    resolvers = {prefix: (_model_targets(o) if isinstance(o, nn.Module) else _optimizer_targets(o))
                 for prefix, o in owners.items() if isinstance(o, nn.Module | Optimizer)}
    targets: dict[str, torch.Tensor] = {}
    places: dict[str, tuple] = {}
    for place in meta["tensors"]:
        key = _storage_key(place)
        info = storage[key]
        target = None
        prefix = next((p for p in resolvers if place[: len(p)] == p), None)
        if prefix is not None:
            target = resolvers[prefix](place[len(prefix):], info)
            if target is not None and tuple(target.shape) != tuple(info.size):
                # DCP would raise a CheckpointException (a BaseException, past `except Exception`) from its planner
                raise ValueError(f"the checkpoint {path} holds {key!r} of shape {tuple(info.size)}, the live "
                                 f"{type(owners[prefix]).__name__}'s has {tuple(target.shape)}: it was saved from "
                                 "another model configuration")
        if target is None:
            target = torch.empty(tuple(info.size), dtype=info.properties.dtype)
        targets[key], places[key] = target, place
    dcp.load(targets, checkpoint_id=path, process_group=group, no_dist=group is None)
    loaded = {place: targets[key] for key, place in places.items()}
    return pytree.tree_map_with_paths(lambda place, leaf: loaded.get(place, leaf), meta["skeleton"],
                                      lambda obj: pytree.is_leaf(obj) or pytree.kept_whole(obj))


# --- a model alone ------------------------------------------------------------------------------------------------


def _group_of(module: nn.Module) -> dist.ProcessGroup | None:
    state = getattr(module, "_fulmen_dist", None)
    return state.group if state is not None else None


def save(model: nn.Module, path: str | os.PathLike, options: StateDictOptions = StateDictOptions()) -> None:
    """Writes the model's state dict: one `torch.save` file from rank 0 (full) or a DCP directory (sharded)."""
    module = unwrap_module(model)
    if options.full_state_dict:
        write_full(get_model_state_dict(module, FULL), path, _group_of(module))
    else:
        write_sharded(get_model_state_dict(module), path, _group_of(module))


def load(model: nn.Module, path: str | os.PathLike, *, strict: bool = True):
    """Reads what `save` wrote (either kind, told apart by file or directory), at any world size, after checking it
    against its manifest (`CheckpointError` when it does not match)."""
    module = unwrap_module(model)
    path = Path(path)
    if not path.exists():
        raise missing_checkpoint(path)
    group = _group_of(module)
    verify(path, group)
    if is_sharded_checkpoint(path):
        state_dict = read_sharded(path, {(): module}, group)
    else:
        state_dict = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    return load_model_state_dict(module, state_dict, strict=strict)
