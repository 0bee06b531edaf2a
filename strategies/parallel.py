"""What ThunderDDPStrategy and ThunderFSDPStrategy share: processes and the process group, setting a module up
(the `fulmen.distributed` transform, then `fulmen.jit`), gradient accumulation and clipping, collectives for the
user, and checkpoints through `fabric.save` / `fabric.load`."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.plugins.io import CheckpointIO, TorchCheckpointIO
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import TBroadcast, _BackwardSyncControl, _validate_keys_for_strict_loading
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch import nn
from torch.optim import Optimizer

import fulmen
from fulmen.distributed import checkpoint, clip_grad_norm_, distributed_state, no_sync
from fulmen.distributed.optimizers import has_stepped, shard_optimizer_state
from fulmen.executors.base import Executor
from fulmen.jit.jitted_module import JittedModule
from fulmen.strategies.checkpoint_io import FulmenCheckpointIO


class _NoBackwardSync(_BackwardSyncControl):
    def __init__(self, strategy: str) -> None:
        self._strategy = strategy

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        try:
            distributed_state(module)
        except ValueError:
            raise TypeError(f"no_backward_sync needs a module set up by the {self._strategy} "
                            f"(fabric.setup(model)), got {type(module).__name__}") from None
        return no_sync(module)


class FulmenParallelStrategy(ParallelStrategy):
    """One process per device; `setup_module` applies the strategy's `fulmen.distributed` transform, then
    `fulmen.jit` (with `jit=False`, only the transform: for programs that jit their own `forward_and_loss`)."""

    transform: ClassVar[Callable[..., nn.Module]]
    # transform arguments the strategy sets itself, so they are not accepted as extra keyword arguments
    controlled: ClassVar[frozenset[str]] = frozenset({"process_group"})

    def __init__(self, accelerator: Accelerator | None = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: ClusterEnvironment | None = None, checkpoint_io: CheckpointIO | None = None,
                 precision: Precision | None = None, jit: bool = True,
                 executors: Sequence[Executor | str] | None = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, **transform_options: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision)
        name = type(self).__name__
        if not isinstance(jit, bool):
            raise ValueError(f"{name}(jit=...) must be True or False, got {jit!r}")
        if executors is not None and not jit:
            raise ValueError(f"{name}(executors=...) needs jit=True: with jit=False the strategy does not jit, pass "
                             "the executors to your own fulmen.jit call")
        if timeout is not None and not isinstance(timeout, timedelta):
            raise ValueError(f"{name}(timeout=...) must be a datetime.timedelta, got {timeout!r}")
        self.jit = jit
        self.executors = fulmen.resolve_executors(executors) if executors is not None else None
        self.transform_options = MappingProxyType(self._check_transform_options(transform_options))
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self._backward_sync_control = _NoBackwardSync(name)

    def __deepcopy__(self, memo: dict[int, Any]) -> FulmenParallelStrategy:
        """Itself: it stands for the processes and their group. `copy.deepcopy` of a module Fabric set up (an EMA or
        a reference model) copies the strategy with it, and the copy goes on running in this one."""
        return self

    @classmethod
    def _check_transform_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        transform = cls.transform
        known = {p.name for p in inspect.signature(transform).parameters.values()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY} - cls.controlled
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"{cls.__name__} got unknown argument(s) {unknown}: extra keyword arguments go to "
                             f"fulmen.distributed.{transform.__name__}, which takes {sorted(known)}")
        return options

    # --- processes ------------------------------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Under torchrun or SLURM the processes exist already and the launcher only checks that.
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        super().setup_environment()
        self._set_world_ranks()
        assert self.cluster_environment is not None
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device)
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                              device_id=device_id)

    # --- modules and optimizers -----------------------------------------------------------------------------------
    def _transform_arguments(self) -> dict[str, Any]:
        """The keyword arguments `setup_module` calls the transform with."""
        return dict(self.transform_options)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Applies the transform (to the module inside, for one jitted but not yet run) and then `fulmen.jit`."""
        name = type(self).__name__
        if isinstance(module, JittedModule) and self.executors is not None:
            raise ValueError(f"the module is already jitted with its own executors; pass executors to either "
                             f"fulmen.jit or {name}, not both")
        self.transform(module, **self._transform_arguments())
        if self.jit and not isinstance(module, JittedModule):
            module = fulmen.jit(module, executors=self.executors)
        return module

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer],
                                    scheduler: Any = None) -> tuple[nn.Module, list[Optimizer], Any]:
        for optimizer in optimizers:  # before the transform changes the module
            self._check_optimizer(optimizer, module)
        module = self.setup_module(module)
        for optimizer in optimizers:
            self._adopt_optimizer(optimizer)
        return module, optimizers, scheduler

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self._check_optimizer(optimizer)
        self._adopt_optimizer(optimizer)
        return optimizer

    @staticmethod
    def _adopt_optimizer(optimizer: Optimizer) -> None:
        shard_optimizer_state(optimizer)
        # optimizer.load_state_dict(optimizer.state_dict()): the state dict the strategy gives (gathered or DTensors)
        optimizer.register_load_state_dict_pre_hook(checkpoint.local_optimizer_state)

    def _check_optimizer(self, optimizer: Optimizer, module: nn.Module | None = None) -> None:
        """`module`: the module set up with the optimizer, not yet transformed."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if any(p.is_meta for p in params):
            raise RuntimeError("the optimizer holds meta-device parameters, which the strategy replaces when it "
                               "materialises the model: set the model up first (model = fabric.setup_module(model)), "
                               "then create the optimizer and set it up (fabric.setup_optimizers(optimizer))")
        if has_stepped(optimizer):
            raise RuntimeError("the optimizer has already stepped: set it up with the model before training, or "
                               "load its state after setup with fabric.load")

    def module_to_device(self, module: nn.Module) -> None:
        module.to(self.root_device)

    # --- gradients ------------------------------------------------------------------------------------------------
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        """Clips by the norm of the whole model's gradients (sharded ones included), the same on every rank."""
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(module, max_norm, norm_type, error_if_nonfinite)

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float) -> None:
        """Elementwise, so each rank clips its (reduced) gradients or gradient shards on its own."""
        self.precision.unscale_gradients(optimizer)
        torch.nn.utils.clip_grad_value_(module.parameters(), clip_value=clip_val)

    # --- collectives ----------------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor | Any, group: Any | None = None,
                   reduce_op: ReduceOp | str | None = "mean") -> torch.Tensor | Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # --- checkpoints ----------------------------------------------------------------------------------------------
    @property
    def state_dict_type(self) -> str:
        return "full"

    @property
    def _state_dict_options(self) -> checkpoint.StateDictOptions:
        return checkpoint.FULL if self.state_dict_type == "full" else checkpoint.StateDictOptions()

    def _group(self) -> dist.ProcessGroup | None:
        return dist.group.WORLD if _distributed_is_initialized() else None

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """Full: gathered on rank 0 (CPU), `{}` elsewhere. Sharded: DTensors of each rank's rows."""
        return checkpoint.get_model_state_dict(module, self._state_dict_options)

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        checkpoint.load_model_state_dict(module, state_dict, strict=strict)

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """torch's layout, the state of sharded parameters gathered (full) or as DTensors (sharded)."""
        return checkpoint.get_optimizer_state_dict(optimizer, self._state_dict_options)

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """FulmenCheckpointIO unless a plugin is given: files with manifests, checked on load."""
        if self._checkpoint_io is None:
            self._checkpoint_io = FulmenCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    def _plain_torch_io(self) -> bool:
        """True when the CheckpointIO plugin only does `torch.save` / `torch.load`, so the strategy calls them
        itself (streaming to the file, mapping it on load)."""
        return type(self.checkpoint_io) in (TorchCheckpointIO, FulmenCheckpointIO)

    def save_checkpoint(self, path: _PATH, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """Full: one file written by rank 0 (through a custom CheckpointIO plugin, when there is one). Sharded: a
        directory (DCP), every rank writing its rows. Either is written beside `path`, fsync'd, renamed into place
        and certified by a manifest written last (see fulmen.distributed.manifest). Paths are on a local or shared
        filesystem."""
        collected = self._convert_stateful_objects_in_state(state, filter or {})
        if storage_options is not None and (self.state_dict_type == "sharded" or self._plain_torch_io()):
            writer = "torch.distributed.checkpoint" if self.state_dict_type == "sharded" else "torch.save"
            raise TypeError(f"{type(self).__name__} writes {self.state_dict_type} checkpoints with {writer}, not a "
                            "custom CheckpointIO plugin, so storage_options are not supported")
        if self.state_dict_type == "sharded":
            checkpoint.write_sharded(collected, path, self._group())
        elif self._plain_torch_io():
            checkpoint.write_full(collected, path, self._group())
        else:

            def write(obj: Any, where: Path) -> None:
                self.checkpoint_io.save_checkpoint(obj, where, storage_options=storage_options)

            checkpoint.write_full(collected, path, self._group(), write)

    def _read_full(self, path: Path, weights_only: bool | None) -> Any:
        if self._plain_torch_io():  # every rank reads it: map it rather than copy it
            return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)

    def _restore(self, obj: Any, value: Any, strict: bool) -> None:
        if isinstance(obj, nn.Module):
            self.load_module_state_dict(obj, value, strict=strict)
        elif isinstance(obj, Optimizer):
            checkpoint.load_optimizer_state_dict(obj, value)
        else:
            obj.load_state_dict(value)

    def load_checkpoint(self, path: _PATH, state: nn.Module | Optimizer | dict[str, Any] | None = None,
                        strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        """Reads either kind (a file: full; a directory: sharded, at any world size) into the live objects;
        returns what the checkpoint holds beyond them (all of it when `state` is empty)."""
        path = Path(path)
        if not path.exists():
            raise checkpoint.missing_checkpoint(path)
        checkpoint.verify(path, self._group())  # every rank checks its share; CheckpointError on all of them
        sharded = checkpoint.is_sharded_checkpoint(path)
        if isinstance(state, nn.Module | Optimizer):  # fabric.load_raw
            if sharded:
                raise ValueError(f"{path} is a sharded checkpoint (a directory); fabric.load_raw reads one file "
                                 "holding a module's or an optimizer's state dict: load the directory with "
                                 "fabric.load(path, {'model': model, ...})")
            self._restore(state, self._read_full(path, weights_only), strict)
            return {}
        if sharded:
            owners = {(key,): obj for key, obj in (state or {}).items() if isinstance(obj, nn.Module | Optimizer)}
            loaded = checkpoint.read_sharded(path, owners, self._group(), weights_only)
        else:
            loaded = self._read_full(path, weights_only)
        if not state:
            return loaded
        _validate_keys_for_strict_loading(state.keys(), loaded.keys(), strict=strict)
        for name, obj in list(state.items()):
            if name not in loaded:
                continue
            value = loaded.pop(name)
            if isinstance(obj, _Stateful):  # modules and optimizers included
                self._restore(obj, value, strict)
            else:
                state[name] = value
        return loaded
