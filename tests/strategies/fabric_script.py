"""A Fabric training script as users run it (by Fabric's own launcher, torchrun, SLURM or by hand per node): trains
a case with the fulmen strategy and rank 0 writes what it saw to --out as JSON."""

from __future__ import annotations

import argparse
import json

import torch

from tests.strategies import workers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    case = workers.Case(f"script-{args.strategy}", args.strategy)
    fabric = workers.make_fabric(case, args.devices, num_nodes=args.num_nodes)
    world = fabric.world_size
    run = workers.setup(fabric, case)
    workers.train(run, range(workers.STEPS), world)
    ranks = fabric.all_gather(torch.tensor([fabric.global_rank, fabric.node_rank, fabric.local_rank]))
    if fabric.global_rank == 0:
        facts = {"losses": run.losses, "world": world, "ranks": ranks.tolist(),
                 "environment": type(fabric.strategy.cluster_environment).__name__,
                 "sampler": fabric.strategy.distributed_sampler_kwargs}
        with open(args.out, "w") as file:
            json.dump(facts, file)


if __name__ == "__main__":
    main()
