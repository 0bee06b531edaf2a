"""Running a function on several ranks in fresh processes, each rank's result or error brought back.

Unlike `torch.multiprocessing.spawn`, a rank that raises does not take the others down: every rank reports what
happened to it (a failing-rank test needs to see how the survivors end), and a rank that is still running at the
deadline is killed and reported as hung.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass
class RankResult:
    value: Any = None
    error: str | None = None  # "ExceptionType: message"
    traceback: str | None = None
    seconds: float = 0.0  # from the rank's start to its result or error
    hung: bool = False  # still running at the deadline (killed)
    exitcode: int | None = None  # of a rank that died without reporting (a crash in C++, a kill)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, out: str, backend: str | None,
           pg_timeout: float, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if backend is None:  # what torchrun sets: Fabric finds a TorchElasticEnvironment and does not spawn
        os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0",
                          TORCHELASTIC_RUN_ID="fulmen-tests")
    torch.set_num_threads(1)
    start = time.perf_counter()
    result = RankResult()
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if backend is not None:
            dist.init_process_group(backend, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=pg_timeout))
        result.value = fn(rank, world, *args)
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which decides
        result.error = f"{type(error).__name__}: {error}"
        result.traceback = traceback.format_exc()
    result.seconds = time.perf_counter() - start
    torch.save(result, Path(out) / f"rank{rank}.pt")
    if result.error is None and dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)  # a rank whose peer died must not block in the process group's destructor


def run_ranks(fn: Callable[..., Any], world: int = 2, *args: Any, timeout: float = 600, pg_timeout: float = 120,
              backend: str | None = "gloo") -> list[RankResult]:
    """Runs `fn(rank, world, *args)` on `world` fresh processes; `fn` must be importable (defined at module level).

    `backend=None`: no process group is created; the ranks get torchrun's environment instead, for Fabric.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        port = _free_port()
        procs = [ctx.Process(target=_entry, args=(fn, rank, world, port, out, backend, pg_timeout, args))
                 for rank in range(world)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        results = []
        for rank, proc in enumerate(procs):
            hung = proc.is_alive()
            if hung:
                proc.kill()
                proc.join()
            path = Path(out) / f"rank{rank}.pt"
            if path.exists():
                results.append(torch.load(path, weights_only=False))
            else:
                results.append(RankResult(error=f"died with exit code {proc.exitcode}" if not hung else None,
                                          hung=hung, exitcode=None if hung else proc.exitcode))
        return results


def values(results: list[RankResult]) -> list[Any]:
    """The ranks' return values; raises with every rank's error if one failed or hung."""
    problems = [f"rank {rank}: {'hung' if r.hung else r.traceback or r.error}" for rank, r in enumerate(results)
                if r.hung or r.error is not None]
    if problems:
        raise AssertionError("\n".join(problems))
    return [r.value for r in results]
