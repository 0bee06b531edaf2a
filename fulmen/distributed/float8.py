"""Float8 all-gather under fulmen's FSDP (`Float8Options(all_gather=True)`): a weight the program only casts to
float8 per tensor is gathered already cast, in half the bytes of bfloat16 (a quarter of float32).

fulmen.transforms.float8 marks such casts (`float8.cast_weight(w, ..., all_gather=True)`). Where the weight is a sharded
parameter and those casts are its only readers, the forward drops them: each rank takes the amax of its own shard,
one `dist.all_reduce_max` per bucket makes it the amax of the whole weight, each rank casts its shard with the scale
of that amax (`float8.cast_by_amax`) and the float8 shards are gathered in the bucket's `dist.all_gather`. These are
the bits the dropped cast would have made of the gathered weight: the cast is elementwise with one scale, and the
zeros padding the last rank's shard do not change an amax. ZeRO-3 saves the float8 shard for the backward and
gathers it again there, like any saved parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

import fulmen.torch as ft
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, iter_proxies
from fulmen.core.trace import TraceBuilder
from fulmen.distributed import prims as collectives
from fulmen.ops import float8


@dataclass(frozen=True, slots=True)
class Float8Gather:
    """A cast of a sharded weight that the forward replaces by gathering the cast shards."""

    weight: TensorProxy  # the full parameter, as the program reads it
    bits: TensorProxy  # the cast's float8 weight: what the gather now gives
    scale: TensorProxy  # its inverse scale
    power_of_2: bool


def _gathered_cast(bsym: BoundSymbol, weight: TensorProxy) -> bool:
    return (
        bsym.sym is float8.CAST_WEIGHT
        and bool(bsym.kwargs.get("all_gather"))
        and bsym.kwargs.get("dim") is None
        and bool(bsym.args)
        and type(bsym.args[0]) is TensorProxy
        and bsym.args[0].pname == weight.pname
    )


def float8_gathers(
    bsyms: Sequence[BoundSymbol], outputs: Sequence, full: dict[str, TensorProxy]
) -> tuple[list[BoundSymbol], dict[str, Float8Gather]]:
    """`bsyms` without the casts of sharded weights (`full`, by name) that are gathered cast instead, and those
    gathers by the name of the float8 weight each gives. A weight read by anything else (a matmul left in high
    precision, the program's outputs) is gathered as it is, and its casts stay."""
    readers: dict[str, list[BoundSymbol]] = {}
    for bsym in bsyms:
        for name in bsym.arg_names():
            readers.setdefault(name, []).append(bsym)
    returned = {p.pname for p in iter_proxies(tuple(outputs))}
    found: dict[str, Float8Gather] = {}
    dropped: set[int] = set()
    for name, weight in full.items():
        users = readers.get(name, [])
        if not users or name in returned or not all(_gathered_cast(b, weight) for b in users):
            continue
        for bsym in users:
            bits, scale = bsym.output
            found[bits.pname] = Float8Gather(weight, bits, scale, bool(bsym.kwargs.get("power_of_2")))
            dropped.add(id(bsym))
    return [b for b in bsyms if id(b) not in dropped], found


def _float32(x: TensorProxy) -> TensorProxy:
    return x if x.dtype == torch.float32 else ft.to(x, torch.float32)


def cast_shards(
    builder: TraceBuilder,
    shards: list[TensorProxy],
    targets: list[TensorProxy],
    gathers: list[Float8Gather | None],
    group: str,
) -> list[TensorProxy]:
    """Records, in `builder`, the float8 shards of the members of one bucket that `gathers` names (one amax
    all_reduce for all of them), named as `targets` (the float8 shards' proxies) with their scales named as the
    casts' were; the other shards are returned as they are."""
    casting = [i for i, gather in enumerate(gathers) if gather is not None]
    if not casting:
        return shards
    # the amax in float32 (exact: it is one of the values) for the collective; the cast takes it to float64
    local = [_float32(ft.amax(ft.abs(shards[i]), tuple(range(shards[i].dim())))) for i in casting]
    amaxes = collectives.wait(collectives.all_reduce_max(ft.stack(local), group))
    result = list(shards)
    for position, i in enumerate(casting):
        gather = gathers[i]
        bits, scale = float8.CAST_BY_AMAX(
            shards[i], ft.select(amaxes, 0, position), gather.bits.dtype, power_of_2=gather.power_of_2
        )
        builder.adopt_results(builder.bound_symbols, [bits, scale], [targets[i], gather.scale], None)
        result[i] = bits
    return result
