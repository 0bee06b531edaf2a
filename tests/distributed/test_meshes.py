"""The device mesh a sharded state dict's DTensors use is kept by the distributed module's state, not by a
process-wide table: exported again, the same mesh; the module gone, its mesh goes too (a table by id(group) kept
every mesh, and with it its group, for the life of the process)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

from torch import nn

import fulmen.distributed as fd
from fulmen.distributed import checkpoint
from fulmen.distributed.specs import spec_of
from tests.distributed.launch import run_ranks, values


def _meshes(rank: int, world: int) -> dict[str, Any]:
    model = fd.fsdp(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)), sharding_strategy="ZERO3",
                    bucketing_strategy="LAYER")
    first = checkpoint.get_model_state_dict(model)
    second = checkpoint.get_model_state_dict(model)
    weight = "0.weight"
    mesh = first[weight].device_mesh
    state = spec_of(model[0].weight).state
    result = {
        "same mesh": second[weight].device_mesh is mesh and list(state.meshes.values()) == [mesh],
        "shard rows": tuple(first[weight].to_local().shape),
        "full shape": tuple(first[weight].shape),
    }
    alive = weakref.ref(mesh)
    del model, first, second, mesh, state
    gc.collect()
    result["mesh released"] = alive() is None
    return result


def test_a_sharded_state_dicts_mesh_lives_with_the_distributed_module():
    for result in values(run_ranks(_meshes, 2)):
        assert result == {"same mesh": True, "shard rows": (3, 4), "full shape": (6, 4), "mesh released": True}
