"""Data parallelism as trace transforms: `ddp`, `fsdp` (ZeRO-2/3, bucketing), `no_sync`, `clip_grad_norm_`.

    model = fulmen.distributed.fsdp(model, sharding_strategy="ZERO3", bucketing_strategy="BLOCK")
    model = fulmen.jit(model)   # the printed traces show dist.all_gather / dist.reduce_scatter / dist.wait

State dicts (full and sharded through torch.distributed.checkpoint) are in `fulmen.distributed.checkpoint`.
"""

from fulmen.distributed.grads import clip_grad_norm_
from fulmen.distributed.setup import ddp, distributed_state, fsdp, no_sync
from fulmen.distributed.specs import FSDPBucketingStrategy, FSDPType

__all__ = ["FSDPBucketingStrategy", "FSDPType", "clip_grad_norm_", "ddp", "distributed_state", "fsdp", "no_sync"]
