"""Collectives as trace symbols: each starts asynchronously and `wait` completes it.

A trace prints them as `dist.all_gather(t, 'pg0', 2)` ... `t9 = dist.wait(t8)`: the start returns the output
buffer with the collective's work attached, `wait` blocks on that work and returns the same buffer. Keeping the
in-flight value a tensor lets every pass (dead code, `del` after last use, executors) treat it as one. Process
groups appear by name (`GROUPS`), so printed traces stay readable and re-runnable in the process that made them.
"""

from __future__ import annotations

import datetime
import weakref
from typing import Any

import torch
import torch.distributed as dist

from fulmen.core.symbol import Symbol, Tag
from fulmen.core.trace import TraceBuilder

# Process groups by the names traces give them, and the gloo groups `check_plan` runs on (`make_checker`): a
# `DistributedState` names its checker here and unregisters it when it dies.
GROUPS: dict[str, Any] = {}

# torch 2.13 renamed the single-tensor collectives; earlier versions have only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_name(group: dist.ProcessGroup) -> str:
    """The name traces use for `group`, registered on first use."""
    for name, known in GROUPS.items():
        if known is group:
            return name
    index = len(GROUPS)
    while f"pg{index}" in GROUPS:  # (a released checker's name may be free below)
        index += 1
    name = f"pg{index}"
    GROUPS[name] = group
    return name


def _group(name: str) -> Any:
    group = GROUPS.get(name)
    if group is None:
        raise RuntimeError(f"process group {name!r} is not registered in this process (traces with collectives run "
                           "only where fulmen.distributed set them up)")
    return group


_BYTES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


def _in_flight(out: torch.Tensor, work: Any) -> torch.Tensor:
    out._fulmen_work = work  # type: ignore[attr-defined]
    return out


def _all_gather_impl(x: torch.Tensor, group: str, world: int) -> torch.Tensor:
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    x = x.contiguous()
    if x.dtype in _BYTES:  # float8 weights (fulmen.distributed.float8) travel as their bytes: gloo has no float8
        return _in_flight(out, _all_gather(out.view(torch.uint8), x.view(torch.uint8), group=_group(group),
                                           async_op=True))
    return _in_flight(out, _all_gather(out, x, group=_group(group), async_op=True))


def _reduce_scatter_impl(x: torch.Tensor, group: str, world: int) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    return _in_flight(out, _reduce_scatter(out, x.contiguous(), group=_group(group), async_op=True))


def _all_reduce_impl(x: torch.Tensor, group: str) -> torch.Tensor:
    # In place on `x`: the transforms pass only buffers they just made (packed and divided gradients).
    return _in_flight(x, dist.all_reduce(x, group=_group(group), async_op=True))


def _all_reduce_max_impl(x: torch.Tensor, group: str) -> torch.Tensor:
    # In place on `x`: the transforms pass only buffers they just made (the amaxes of float8 weight shards).
    return _in_flight(x, dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_group(group), async_op=True))


def _wait_impl(x: torch.Tensor) -> torch.Tensor:
    work = x.__dict__.pop("_fulmen_work", None)
    if work is not None:
        work.wait()
    return x


def make_checker(owner: object, group: dist.ProcessGroup, host: bool | None = None) -> str | None:
    """The name of the group `check_plan` runs `group`'s checks on, for as long as `owner` (a `DistributedState`)
    lives: one whose tensors live on the host (gloo), so that reading the answer does not wait for the device to
    finish the work queued before it. None where gloo is missing: the checks then run on `group` itself, read back as
    they wait. Called on every rank of the group at the same point (a gloo group connects its ranks when made).

    `host`: make a gloo group of `group`'s ranks (True) or use `group` itself (False); None: only when `group` is not
    gloo already."""
    if host is None:
        host = dist.get_backend(group) != "gloo"
    if not host:
        return group_name(group)
    if not dist.is_gloo_available():
        return None
    checker = _host_group(group)
    name = group_name(checker)
    # Not registered with torch.distributed, so destroy_process_group does not reach it: it lives as long as the state
    # whose traces name it (a DistributedProgram holds its specs, so its traces cannot outlive the state).
    weakref.finalize(owner, _release, name)
    return name


def _release(name: str) -> None:
    checker = GROUPS.pop(name, None)
    if checker is not None:
        checker.shutdown()


def _host_group(group: dist.ProcessGroup) -> Any:
    """A gloo group of `group`'s ranks (a backend, not registered with torch.distributed: only these ranks make it,
    and nothing else can pair a collective with its own), with `group`'s timeout."""
    store = dist.distributed_c10d._get_default_store()
    # Each rank counts the checkers it made for `group` (every rank makes the same ones, in the same order), so each
    # gets a rendezvous prefix of its own, the same on every rank.
    made = store.add(f"fulmen/check_plan/{group.group_name}/made/{group.rank()}", 1)
    prefixed = dist.PrefixStore(f"fulmen/check_plan/{group.group_name}/{made}", store)
    return dist.ProcessGroupGloo(prefixed, group.rank(), group.size(), _timeout(group))


def _timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    """`group`'s own timeout (init_process_group's or new_group's `timeout`), else torch's default. torch has no
    public way to read it: this reads its backend's private `options._timeout` and falls back if that moves."""
    try:
        device = group._device_types[0]
        timeout = group._get_backend(torch.device(device)).options._timeout
    except (AttributeError, IndexError, RuntimeError, TypeError):
        return dist.default_pg_timeout
    return timeout if isinstance(timeout, datetime.timedelta) else dist.default_pg_timeout


def _max(tensor: torch.Tensor, group: str, checker: str | None) -> torch.Tensor:
    if checker is None:  # no gloo in this build
        process_group = _group(group)
        if dist.get_backend(process_group) == "nccl":
            tensor = tensor.cuda()
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=process_group)
        return tensor
    on = _group(checker)
    if isinstance(on, dist.ProcessGroup):  # the group itself (gloo)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=on)
        return tensor
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    on.allreduce([tensor], options).wait()
    return tensor


def _check_plan_impl(group: str, checker: str | None, what: str, digest: int, plan: tuple[str, ...]) -> None:
    """Raises on every rank unless all ranks of `group` are about to run the same collectives (`digest`).

    A program whose path depends on rank-local data (a branch on the batch) would otherwise pair one rank's
    collective with another's of a different parameter: equal shapes sum or gather unrelated tensors silently. The
    digests meet on the host (on `checker`, `make_checker`): a device all_reduce read back on the host would wait, on
    every call, for all the work queued before it, and the host could no longer run ahead of the device."""
    high, low = _max(torch.tensor([digest, -digest], dtype=torch.int64), group, checker).tolist()
    if high == digest and low == -digest:
        return
    process_group = _group(group)
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
all_reduce_max = _symbol("all_reduce_max", _all_reduce_max_impl, lambda b, x, group: _like(b, x, tuple(x.shape)))
wait = _symbol("wait", _wait_impl, lambda b, x: _like(b, x, tuple(x.shape)))

# Returns nothing: a check the transforms put before a trace's first collective.
check_plan = _symbol("check_plan", _check_plan_impl, lambda b, group, checker, what, digest, plan: None)

COLLECTIVES = (all_gather, reduce_scatter, all_reduce)
