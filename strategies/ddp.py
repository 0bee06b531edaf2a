"""ThunderDDPStrategy: replicated data parallelism with fulmen's DDP transform (bucketed all_reduce in the trace)."""

from __future__ import annotations

from fulmen.distributed import checkpoint, ddp
from fulmen.strategies.parallel import FulmenParallelStrategy


class ThunderDDPStrategy(FulmenParallelStrategy):
    """Every rank holds the whole model; the backward averages gradients with bucketed, overlapped all_reduce.

        strategy = ThunderDDPStrategy(executors=("sdpa", "torchcompile", "torch"))
        fabric = L.Fabric(devices=2, strategy=strategy); fabric.launch()
        model, optimizer = fabric.setup(model, optimizer)   # ddp + fulmen.jit happen here

    Arguments: Fabric's (accelerator, parallel_devices, cluster_environment, checkpoint_io, precision), `jit`,
    `executors` (names or executor objects, with jit=True), `process_group_backend`, `timeout`; extra keyword
    arguments (`broadcast_from`, `bucket_size_in_mb`) go to `fulmen.distributed.ddp`. Checkpoints are full: one file
    from rank 0, the model's and the optimizer's plain state dicts.
    """

    transform = staticmethod(ddp)

    @property
    def _state_dict_options(self) -> checkpoint.StateDictOptions:
        # Nothing is sharded: every rank holds the whole state, and `optimizer.state_dict()` gives it on every rank, as
        # with Lightning's DDPStrategy (so the state loads back on every rank); rank 0's, which fabric.save writes,
        # is moved to the CPU.
        return checkpoint.StateDictOptions(full_state_dict=True, cpu_offload=self.global_rank == 0)
