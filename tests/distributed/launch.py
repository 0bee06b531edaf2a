"""Running a function on several ranks in their own processes, each rank's result or error brought back.

Unlike `torch.multiprocessing.spawn`, a rank that raises does not take the others down: every rank reports what
happened to it (a failing-rank test needs to see how the survivors end), and a rank that is still running at the
deadline is killed and reported as hung.

Starting the ranks is most of a small launch's cost (each process imports torch, LitGPT and fulmen: ~6 CPU-s), so
the launches of one test module share their rank processes (`warm=True`, the default): a job runs in a process
group of its own (a new port, destroyed after it), from the seed a fresh process has, and a rank whose job raised
ends its process as before, so the pool is started anew for the next job; tests/conftest.py closes the pools at the
end of each module, so which jobs share processes does not depend on how pytest-xdist spreads the files.
`warm=False` starts fresh processes, for what must see a peer that never ran anything before.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
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


_TORCHRUN = dict(LOCAL_RANK="{rank}", LOCAL_WORLD_SIZE="{world}", GROUP_RANK="0", TORCHELASTIC_RUN_ID="fulmen-tests")


@dataclass(frozen=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple
    port: int
    out: str
    backend: str | None
    pg_timeout: float


def _run(job: _Job, rank: int, world: int) -> bool:
    """Runs one job on this rank and saves its RankResult; True where the process may run another job (it did not
    raise and left no state behind that a fresh process lacks)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port), RANK=str(rank), WORLD_SIZE=str(world))
    if job.backend is None:  # what torchrun sets: Fabric finds a TorchElasticEnvironment and does not spawn
        os.environ.update({key: value.format(rank=rank, world=world) for key, value in _TORCHRUN.items()})
    torch.set_num_threads(1)
    start = time.perf_counter()
    result = RankResult()
    try:
        if job.backend == "nccl":
            torch.cuda.set_device(rank)
        if job.backend is not None:
            dist.init_process_group(job.backend, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=job.pg_timeout))
        result.value = job.fn(rank, world, *job.args)
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which decides
        result.error = f"{type(error).__name__}: {error}"
        result.traceback = traceback.format_exc()
    result.seconds = time.perf_counter() - start
    torch.save(result, Path(job.out) / f"rank{rank}.pt")
    if result.error is not None:
        return False  # a rank whose peer died must not block in the process group's destructor
    if dist.is_initialized():
        dist.destroy_process_group()
    return torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32


def _next(jobs: Connection) -> _Job | None:
    try:
        return jobs.recv()
    except EOFError:  # the parent is gone
        return None


def _serve(rank: int, world: int, jobs: Connection) -> None:
    """A warm rank: runs the jobs it is sent, each from what a fresh process starts with, until told to stop or a
    job leaves it unfit for another."""
    environ, cwd, seed = dict(os.environ), os.getcwd(), torch.initial_seed()
    while (job := _next(jobs)) is not None:
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        torch.manual_seed(seed)
        reusable = _run(job, rank, world)
        if not reusable:
            break
        jobs.send(True)
    os._exit(0)


class _Pool:
    """`world` rank processes that run one job after another."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world, child))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, job: _Job, timeout: float) -> tuple[list[RankResult], bool]:
        """Every rank's result, and whether every rank is ready for another job."""
        for conn in self.conns:
            conn.send(job)
        deadline = time.monotonic() + timeout
        ready, results = True, []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs)):
            hung = not conn.poll(max(0.0, deadline - time.monotonic()))
            try:
                ready = not hung and conn.recv() and ready
            except EOFError:  # the rank's process is ending: its job raised, or it died
                ready = False
                proc.join(max(0.0, deadline - time.monotonic()))
                hung = proc.is_alive()
            if hung:
                proc.kill()
                proc.join()
            path = Path(job.out) / f"rank{rank}.pt"
            if path.exists():
                results.append(torch.load(path, weights_only=False))
            else:
                results.append(RankResult(error=f"died with exit code {proc.exitcode}" if not hung else None,
                                          hung=hung, exitcode=None if hung else proc.exitcode))
        return results, ready

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


_POOLS: dict[int, _Pool] = {}


def close_pools() -> None:
    """Ends the warm rank processes (tests/conftest.py: at the end of each test module)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(close_pools)


def run_ranks(fn: Callable[..., Any], world: int = 2, *args: Any, timeout: float = 600, pg_timeout: float = 120,
              backend: str | None = "gloo", warm: bool = True) -> list[RankResult]:
    """Runs `fn(rank, world, *args)` on `world` processes; `fn` must be importable (defined at module level).

    `backend=None`: no process group is created; the ranks get torchrun's environment instead, for Fabric.
    `warm=False`: on fresh processes, not this module's warm ones (which it leaves as they are).
    """
    pool = _POOLS.pop(world, None) if warm else None
    if pool is None:
        pool = _Pool(world)
    with tempfile.TemporaryDirectory() as out:
        results, ready = pool.run(_Job(fn, args, _free_port(), out, backend, pg_timeout), timeout)
    if warm and ready:
        _POOLS[world] = pool
    else:
        pool.close()
    return results


def values(results: list[RankResult]) -> list[Any]:
    """The ranks' return values; raises with every rank's error if one failed or hung."""
    problems = [f"rank {rank}: {'hung' if r.hung else r.traceback or r.error}" for rank, r in enumerate(results)
                if r.hung or r.error is not None]
    if problems:
        raise AssertionError("\n".join(problems))
    return [r.value for r in results]
