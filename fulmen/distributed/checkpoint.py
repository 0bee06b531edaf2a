"""State dicts of distributed models: full (gathered, on rank 0, on CPU) or sharded (torch.distributed.checkpoint).

A sharded state dict holds each sharded parameter as a `DTensor` (`Shard(0)` over the model's process group, its
local rows without padding), so DCP records where every row lives and a checkpoint saved at one world size loads
at another (a plain, undistributed module included). Replicated tensors (DDP parameters, buffers) are plain
tensors, written once. Saving never destroys the previous checkpoint at `path` before the new one is complete.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fulmen.distributed.prims import _all_gather
from fulmen.distributed.setup import unwrap_module
from fulmen.distributed.specs import DistributedState, ParamSpec, local_shard, spec_of, valid_rows


@dataclass(frozen=True, slots=True)
class StateDictOptions:
    """full_state_dict: gathered parameters (else sharded DTensors); cpu_offload: full tensors on CPU;
    rank0_only: only rank 0 gets the full state dict (the others take part in the gathers and get `{}`)."""

    full_state_dict: bool = False
    cpu_offload: bool = False
    rank0_only: bool = False


def _state(module: nn.Module) -> DistributedState | None:
    return getattr(module, "_fulmen_dist", None)


def _sharded_spec(value: Any) -> ParamSpec | None:
    spec = spec_of(value) if isinstance(value, torch.Tensor) else None
    return spec if spec is not None and spec.sharded else None


def _gather(shard: torch.Tensor, spec: ParamSpec) -> torch.Tensor:
    state = spec.state
    out = shard.new_empty((state.world * shard.shape[0], *shard.shape[1:]))
    _all_gather(out, shard.contiguous(), group=state.group)
    return out[: spec.full_shape[0]]


_MESHES: dict[tuple[int, str], DeviceMesh] = {}


def _as_dtensor(shard: torch.Tensor, spec: ParamSpec) -> DTensor:
    state = spec.state
    key = (id(state.group), shard.device.type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(state.group, shard.device.type)
    local = shard[: valid_rows(spec.full_shape[0], state.rank, state.world)]
    return DTensor.from_local(local, _MESHES[key], [Shard(0)], run_check=False, shape=spec.full_shape,
                              stride=torch.empty(spec.full_shape, device="meta").stride())


def get_model_state_dict(model: nn.Module, options: StateDictOptions = StateDictOptions()) -> dict[str, Any]:
    """The model's state dict with sharded parameters gathered (full) or as DTensors (sharded)."""
    module = unwrap_module(model)
    result: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        spec = _sharded_spec(value)
        if isinstance(value, torch.Tensor):
            value = value.detach()
        if spec is not None:
            value = _gather(value, spec) if options.full_state_dict else _as_dtensor(value, spec)
        if options.cpu_offload and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            value = value.cpu()
        result[key] = value
    state = _state(module)
    if options.full_state_dict and options.rank0_only and state is not None and state.rank != 0:
        return {}
    return result


def load_model_state_dict(model: nn.Module, state_dict: dict[str, Any], strict: bool = True):
    """Loads a full state dict (every rank takes its rows) or a sharded one (DTensors) into the model."""
    module = unwrap_module(model)
    own = module.state_dict(keep_vars=True)
    converted: dict[str, Any] = {}
    for key, value in state_dict.items():
        spec = _sharded_spec(own.get(key))
        if isinstance(value, DTensor):
            if spec is None:
                value = value.full_tensor()
            else:
                local = value.to_local()
                value = local.new_zeros((spec.rows, *local.shape[1:]))
                value[: local.shape[0]] = local
        elif spec is not None:
            if tuple(value.shape) != tuple(spec.full_shape):
                raise ValueError(f"state dict entry {key!r} has shape {tuple(value.shape)}, the model's parameter "
                                 f"has {tuple(spec.full_shape)}")
            value = local_shard(value.to(own[key].device), spec.state.rank, spec.state.world)
        converted[key] = value
    return module.load_state_dict(converted, strict=strict)


def _rank(state: DistributedState | None) -> int:
    return state.rank if state is not None else 0


def _barrier(state: DistributedState | None) -> None:
    if state is not None:
        dist.barrier(group=state.group)


def _replace(tmp: Path, path: Path) -> None:
    """Puts `tmp` at `path`, keeping the previous checkpoint until the new one is in place."""
    if path.is_dir():
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old)
    else:
        os.replace(tmp, path)


def save(model: nn.Module, path: str | os.PathLike, options: StateDictOptions = StateDictOptions()) -> None:
    """Writes the model's state: one `torch.save` file from rank 0 (full) or a DCP directory (sharded)."""
    module = unwrap_module(model)
    state = _state(module)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if options.full_state_dict:
        full = get_model_state_dict(module, StateDictOptions(full_state_dict=True, cpu_offload=True, rank0_only=True))
        if _rank(state) == 0:
            torch.save(full, tmp)
            _replace(tmp, path)
    else:
        if _rank(state) == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier(state)
        dcp.save(get_model_state_dict(module), checkpoint_id=tmp, process_group=state.group if state else None,
                 no_dist=state is None)
        _barrier(state)
        if _rank(state) == 0:
            _replace(tmp, path)
    _barrier(state)


def load(model: nn.Module, path: str | os.PathLike, options: StateDictOptions = StateDictOptions(),
         strict: bool = True):
    """Reads what `save` wrote, at any world size (a DCP checkpoint is resharded to this model's layout)."""
    module = unwrap_module(model)
    state = _state(module)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if options.full_state_dict:
        full = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return load_model_state_dict(module, full, strict=strict)
    sharded = get_model_state_dict(module)
    dcp.load(sharded, checkpoint_id=path, process_group=state.group if state else None, no_dist=state is None)
    return load_model_state_dict(module, sharded, strict=strict)
