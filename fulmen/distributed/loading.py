"""State loaded into sharded parameters: a full tensor, or a DTensor of a sharded state dict, becomes this rank's rows.

`fsdp` registers `shard_on_load` as a `load_state_dict` pre-hook on every module that owns a sharded parameter, so a
plain `model.load_state_dict(full_state_dict)` on every rank loads as it does on one process. The hook runs where the
parameter is copied, after the parents' own `_load_from_state_dict` have renamed or rebuilt entries: LitGPT's LoRA
model takes a base checkpoint's `lm_head.weight` and `attn.qkv.weight` as `lm_head.linear.weight` and
`attn.qkv.linear.weight` (litgpt's `finetune lora` loads the base model into the LoRA model so), keys no lookup by
the live model's own names finds beforehand.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fulmen.distributed.specs import ParamSpec, local_shard, spec_of


def import_value(value: Any, spec: ParamSpec | None, like: torch.Tensor | None, what: str) -> Any:
    """A state dict's tensor as the live object holds it: this rank's padded rows when it is sharded like `spec`'s
    parameter (`like`: that parameter), the whole tensor otherwise. A full value has the parameter's full shape."""
    if not isinstance(value, torch.Tensor):
        return value
    if spec is None:
        return value.full_tensor() if isinstance(value, DTensor) else value
    if isinstance(value, DTensor):
        local = value.to_local()
        shard = local.new_zeros((spec.rows, *local.shape[1:]))
        shard[: local.shape[0]] = local
        return shard
    if tuple(value.shape) != tuple(spec.full_shape):
        raise ValueError(f"{what} has shape {tuple(value.shape)}, the model's parameter {spec.name!r} has "
                         f"{tuple(spec.full_shape)}")
    return local_shard(value.to(like.device if like is not None else value.device), spec.state.rank, spec.state.world)


def keep_parameters(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                    *_: Any) -> None:
    """Refuses a `load_state_dict` that would take a distributed parameter's distribution away (torch's pre-hook
    signature): `assign=True` puts a new `nn.Parameter` in its place, and under
    `torch.__future__.set_swap_module_params_on_conversion(True)` torch swaps a new tensor into the parameter, its
    attributes (the distribution) going with the old contents. Neither would then be reduced nor, when sharded,
    gathered (each rank would train on its own rows as if they were the whole), and an assigned one is not in the
    optimizer: training would go on silently wrong."""
    assign = local_metadata.get("assign_to_params_buffers", False)
    if not assign and not torch.__future__.get_swap_module_params_on_conversion():
        return
    for name, param in module._parameters.items():
        spec = spec_of(param) if param is not None else None
        if spec is None or prefix + name not in state_dict:
            continue
        if assign:
            raise RuntimeError(
                f"load_state_dict(..., assign=True) would replace the parameter {prefix + name!r}, distributed by "
                f"fulmen.distributed.{spec.state.kind}, with a new one that is not (nor in the optimizer): load "
                "without assign=True, which copies the values into the distributed parameters (a full tensor into "
                "this rank's rows)")
        raise RuntimeError(
            f"load_state_dict would swap a new tensor into the parameter {prefix + name!r}, distributed by "
            f"fulmen.distributed.{spec.state.kind}, taking its distribution away "
            "(torch.__future__.set_swap_module_params_on_conversion(True) is set): load with it set to False, "
            "which copies the values into the distributed parameters (a full tensor into this rank's rows)")


def shard_on_load(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                  *rest: Any) -> None:
    """`module`'s sharded parameters' entries in `state_dict` (torch's pre-hook signature) as this rank's rows. An
    entry shaped like the shard and not like the whole parameter is this rank's already (the sharded module's own
    `state_dict()`, or `checkpoint.load_model_state_dict`'s conversion); where the two shapes are equal (one row, or
    one rank) either reading gives the same rows."""
    keep_parameters(module, state_dict, prefix, local_metadata, *rest)
    for name, param in module._parameters.items():
        key = prefix + name
        spec = spec_of(param) if param is not None else None
        if spec is None or not spec.sharded or key not in state_dict:
            continue
        value = state_dict[key]
        if (isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
                and tuple(value.shape) == tuple(param.shape) != tuple(spec.full_shape)):
            continue
        state_dict[key] = import_value(value, spec, param, f"state dict entry {key!r}")
