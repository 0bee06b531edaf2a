"""ThunderFSDPStrategy: fully sharded data parallelism with fulmen's FSDP transform (ZeRO-2/3, bucketing)."""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from typing import Any, ClassVar

import torch
from lightning.fabric.plugins.precision import MixedPrecision
from torch import nn
from torch.optim import Optimizer

from fulmen.distributed import FSDPBucketingStrategy, FSDPType, fsdp
from fulmen.distributed.optimizers import refuse_unexact_on_shards
from fulmen.distributed.setup import parse_enum
from fulmen.distributed.specs import spec_of
from fulmen.strategies.parallel import FulmenParallelStrategy

STATE_DICT_TYPES = ("full", "sharded")


class ThunderFSDPStrategy(FulmenParallelStrategy):
    """Each rank keeps a dim-0 shard of every parameter (and of its gradient and optimizer state).

        strategy = ThunderFSDPStrategy(sharding_strategy="ZERO3", bucketing_strategy="BLOCK", state_dict_type="full")
        fabric = L.Fabric(devices=8, num_nodes=2, strategy=strategy); fabric.launch()
        with fabric.init_module(empty_init=True):   # on the meta device: no rank ever holds the whole model
            model = GPT(config)
        model = fabric.setup_module(model)            # materialised shard by shard, fsdp + fulmen.jit
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))

    `sharding_strategy`: "ZERO2" | "ZERO3" (or the `FSDPType`), `bucketing_strategy`: "NONE" | "LAYER" | "BLOCK",
    in any case; `state_dict_type`: "full" (one file from rank 0, model and optimizer state gathered: the
    checkpoint one process would write) or "sharded" (a torch.distributed.checkpoint directory, every rank writing
    its rows; loads at any world size). Extra keyword arguments (`broadcast_from`, default 0 so every rank starts from
    rank 0's weights, and `max_in_flight`) go to `fulmen.distributed.fsdp`. The other arguments are
    ThunderDDPStrategy's. Each rank's optimizer steps its own rows of every parameter: optimizers whose update is not
    elementwise (LBFGS, Adafactor, Muon) are refused at setup (fulmen.distributed.optimizers). A gradient scaler
    driven by hand must be torch's `ShardedGradScaler`: `torch.amp.GradScaler` sees infs in this rank's shards only.
    """

    transform = staticmethod(fsdp)
    controlled: ClassVar[frozenset[str]] = frozenset({"process_group", "device", "sharding_strategy",
                                                      "bucketing_strategy"})

    def __init__(self, *args: Any, sharding_strategy: FSDPType | str = FSDPType.ZERO3,
                 bucketing_strategy: FSDPBucketingStrategy | str = FSDPBucketingStrategy.NONE,
                 state_dict_type: str = "sharded", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sharding_strategy = parse_enum(sharding_strategy, FSDPType, "sharding_strategy")
        self.bucketing_strategy = parse_enum(bucketing_strategy, FSDPBucketingStrategy, "bucketing_strategy")
        if not isinstance(state_dict_type, str) or state_dict_type.lower() not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type must be one of {', '.join(STATE_DICT_TYPES)}, got {state_dict_type!r}")
        self._state_dict_type = state_dict_type.lower()

    @property
    def state_dict_type(self) -> str:
        return self._state_dict_type

    def _transform_arguments(self) -> dict[str, Any]:
        return {"broadcast_from": 0, **self.transform_options, "device": self.root_device,
                "sharding_strategy": self.sharding_strategy, "bucketing_strategy": self.bucketing_strategy}

    def setup_environment(self) -> None:
        # GradScaler finds infs in this rank's gradient shards only: ranks would skip different steps
        if isinstance(self.precision, MixedPrecision) and self.precision.scaler is not None:
            raise ValueError("ThunderFSDPStrategy does not support precision='16-mixed' (a gradient scaler checks "
                             "only this rank's shards for infs, so ranks would disagree on which steps to skip): "
                             "use 'bf16-mixed' or 'bf16-true'")
        super().setup_environment()

    def _check_optimizer(self, optimizer: Optimizer, module: nn.Module | None = None) -> None:
        super()._check_optimizer(optimizer, module)
        # set up with the module: all its parameters are about to be sharded; afterwards their specs say which are
        if module is not None:
            sharded = list(module.named_parameters())
        else:
            sharded = [(spec.name, p) for group in optimizer.param_groups for p in group["params"]
                       if (spec := spec_of(p)) is not None and spec.sharded]
        refuse_unexact_on_shards(optimizer, sharded, type(self).__name__)

    def module_to_device(self, module: nn.Module) -> None:
        """Nothing: `fsdp` moves each parameter's shard (not the whole model) to the device."""

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """empty_init=True: on the meta device, materialised (`reset_parameters`) module by module and sharded at
        setup. Otherwise on CPU in the precision's dtype, sharded to the device at setup."""
        stack = ExitStack()
        if empty_init:
            stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack
