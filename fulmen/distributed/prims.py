"""Collectives as trace symbols: each starts asynchronously and `wait` completes it.

A trace prints them as `dist.all_gather(t, 'pg0', 2)` ... `t9 = dist.wait(t8)`: the start returns the output
buffer with the collective's work attached, `wait` blocks on that work and returns the same buffer. Keeping the
in-flight value a tensor lets every pass (dead code, `del` after last use, executors) treat it as one. Process
groups appear by name (`GROUPS`), so printed traces stay readable and re-runnable in the process that made them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fulmen.core.symbol import Symbol, Tag
from fulmen.core.trace import TraceBuilder

GROUPS: dict[str, dist.ProcessGroup] = {}

# torch 2.13 renamed the single-tensor collectives; earlier versions have only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_name(group: dist.ProcessGroup) -> str:
    """The name traces use for `group`, registered on first use."""
    for name, known in GROUPS.items():
        if known is group:
            return name
    name = f"pg{len(GROUPS)}"
    GROUPS[name] = group
    return name


def _group(name: str) -> dist.ProcessGroup:
    group = GROUPS.get(name)
    if group is None:
        raise RuntimeError(f"process group {name!r} is not registered in this process (traces with collectives run "
                           "only where fulmen.distributed set them up)")
    return group


def _in_flight(out: torch.Tensor, work: Any) -> torch.Tensor:
    out._fulmen_work = work  # type: ignore[attr-defined]
    return out


def _all_gather_impl(x: torch.Tensor, group: str, world: int) -> torch.Tensor:
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    return _in_flight(out, _all_gather(out, x.contiguous(), group=_group(group), async_op=True))


def _reduce_scatter_impl(x: torch.Tensor, group: str, world: int) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    return _in_flight(out, _reduce_scatter(out, x.contiguous(), group=_group(group), async_op=True))


def _all_reduce_impl(x: torch.Tensor, group: str) -> torch.Tensor:
    # In place on `x`: the transforms pass only buffers they just made (packed and divided gradients).
    return _in_flight(x, dist.all_reduce(x, group=_group(group), async_op=True))


def _wait_impl(x: torch.Tensor) -> torch.Tensor:
    work = x.__dict__.pop("_fulmen_work", None)
    if work is not None:
        work.wait()
    return x


def _check_plan_impl(group: str, what: str, digest: int, plan: tuple[str, ...]) -> None:
    """Raises on every rank unless all ranks of `group` are about to run the same collectives (`digest`).

    A program whose path depends on rank-local data (a branch on the batch) would otherwise pair one rank's
    collective with another's of a different parameter: equal shapes sum or gather unrelated tensors silently."""
    process_group = _group(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(process_group) == "nccl" else None
    extremes = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=process_group)
    high, low = extremes.tolist()
    if high == digest and low == -digest:
        return
    plans: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(plans, plan, group=process_group)
    raise RuntimeError(f"the ranks ran different programs, so their {what} collectives do not match: "
                       f"{_first_difference(plans)}. The program's path depends on data that differs between ranks "
                       "(a branch on the batch, a rank-dependent argument): every rank must read the same distributed "
                       "parameters in the same order")


def _first_difference(plans: list[tuple[str, ...]]) -> str:
    for index in range(max(len(plan) for plan in plans)):
        seen = [plan[index] if index < len(plan) else "nothing" for plan in plans]
        if len(set(seen)) > 1:
            return f"collective {index}: " + ", ".join(f"rank {rank} {item}" for rank, item in enumerate(seen))
    return "the ranks' collectives differ in shape or dtype"


def _like(builder: TraceBuilder, x: Any, shape: tuple[int, ...]) -> Any:
    return builder.make_proxy(torch.empty(shape, dtype=x.dtype, device="meta"), x.device)


def _symbol(name: str, impl: Any, meta: Any) -> Symbol:
    # IMPURE: never dropped, merged or recomputed, so each collective runs exactly where the transform put it.
    return Symbol(name=name, printed=f"dist.{name}", impl=impl, meta=meta, tags=Tag.IMPURE)


all_gather = _symbol("all_gather", _all_gather_impl,
                     lambda b, x, group, world: _like(b, x, (world * x.shape[0], *x.shape[1:])))
reduce_scatter = _symbol("reduce_scatter", _reduce_scatter_impl,
                         lambda b, x, group, world: _like(b, x, (x.shape[0] // world, *x.shape[1:])))
all_reduce = _symbol("all_reduce", _all_reduce_impl, lambda b, x, group: _like(b, x, tuple(x.shape)))
wait = _symbol("wait", _wait_impl, lambda b, x: _like(b, x, tuple(x.shape)))

# Returns nothing: a check the transforms put before a trace's first collective.
check_plan = _symbol("check_plan", _check_plan_impl, lambda b, group, what, digest, plan: None)

COLLECTIVES = (all_gather, reduce_scatter, all_reduce)
