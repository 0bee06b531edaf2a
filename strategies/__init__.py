"""Lightning Fabric strategies built on fulmen's trace transforms:

    from fulmen.strategies import ThunderDDPStrategy, ThunderFSDPStrategy

    fabric = L.Fabric(devices=2, strategy=ThunderFSDPStrategy(sharding_strategy="ZERO3", bucketing_strategy="BLOCK"))
    fabric.launch()
    model = fabric.setup(model)   # fulmen.distributed.fsdp + fulmen.jit happen here

Their checkpoints (fabric.save / fabric.load) carry a manifest and are checked on load; FulmenCheckpointIO gives
Lightning's own strategies the same (`L.Fabric(..., plugins=[FulmenCheckpointIO()])`).
"""

from fulmen.strategies.checkpoint_io import FulmenCheckpointIO
from fulmen.strategies.ddp import ThunderDDPStrategy
from fulmen.strategies.fsdp import ThunderFSDPStrategy

__all__ = ["FulmenCheckpointIO", "ThunderDDPStrategy", "ThunderFSDPStrategy"]
