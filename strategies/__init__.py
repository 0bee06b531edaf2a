"""Lightning Fabric strategies built on fulmen's trace transforms:

    from fulmen.strategies import ThunderDDPStrategy, ThunderFSDPStrategy

    fabric = L.Fabric(devices=2, strategy=ThunderFSDPStrategy(sharding_strategy="ZERO3", bucketing_strategy="BLOCK"))
    fabric.launch()
    model = fabric.setup(model)   # fulmen.distributed.fsdp + fulmen.jit happen here
"""

from fulmen.strategies.ddp import ThunderDDPStrategy
from fulmen.strategies.fsdp import ThunderFSDPStrategy

__all__ = ["ThunderDDPStrategy", "ThunderFSDPStrategy"]
