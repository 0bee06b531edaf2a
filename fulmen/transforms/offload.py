"""CPU offloading of the tensors the forward saves for the backward, as a GRAD-stage `Transform`.

    jitted = fulmen.jit(model, options=fulmen.JitOptions(offload=fulmen.OffloadOptions(fraction=0.5)))

The forward copies each chosen saved tensor to pinned host memory on a side stream right after computing it
(`impls.offload_to_host`) and saves the host copy instead; the device tensor is freed after its last forward use
(codegen's `del`) once the copy is done. The backward starts copying it back on the side stream ahead of its first
use (`impls.reload_to_device`, at most `prefetch` tensors ahead) and waits for that copy right before the use
(`impls.wait_for_copy`), so copies overlap with compute both ways.

Which tensors: those on a CUDA device that the forward computes (program inputs, views of them and outputs are held
by the caller anyway), of at least `min_bytes`, whose last forward use and first backward use are at least
`min_distance` trace operations apart; of those, the longest-lived first, until `fraction` of their bytes. Each tensor
is on the device from its computation to its last forward use and from its reload to its last backward use,
never longer than without offloading, so the device's peak memory is never higher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Tag
from fulmen.core.trace import Trace, TraceBuilder
from fulmen.ops.kernels import impls
from fulmen.ops.registry import impl_symbol
from fulmen.transforms.remat import nbytes
from fulmen.transforms.transform import GradTraces, Transform

if TYPE_CHECKING:  # fulmen.options builds on this layer
    from fulmen.options import OffloadOptions

OFFLOAD = impl_symbol(impls.offload_to_host, tags=Tag.IMPURE, meta=lambda builder, x: builder.make_proxy(
    torch.empty_like(x.meta), torch.device("cpu"), name=f"{x.pname}_host"))
RELOAD = impl_symbol(impls.reload_to_device, tags=Tag.IMPURE, meta=lambda builder, x, device: builder.make_proxy(
    torch.empty_like(x.meta), device))
WAIT = impl_symbol(impls.wait_for_copy, tags=Tag.IMPURE)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A tensor the forward saves for the backward, and how long it waits there."""

    name: str
    nbytes: int
    produced: int  # position of the forward call computing it
    last_forward_use: int  # position of the last forward call reading it (`produced` when none does)
    first_backward_use: int  # position of the first backward call reading it (the call count: only returned)
    distance: int  # forward calls after its last use plus backward calls before its first use


def first_uses(backward: Trace) -> dict[str, int]:
    """Each value's first reader in `backward` (the call count for values it only returns)."""
    first: dict[str, int] = {}
    for position, bsym in enumerate(backward.bound_symbols):
        for name in bsym.arg_names():
            first.setdefault(name, position)
    for proxy in backward.output:
        if type(proxy) is TensorProxy:
            first.setdefault(proxy.pname, len(backward.bound_symbols))
    return first


def candidates(traces: GradTraces, device_types: tuple[str, ...]) -> list[Candidate]:
    """The saved tensors on `device_types` that the forward computes and the backward reads."""
    forward, backward = traces.forward, traces.backward
    n_outputs = len(forward.output) - traces.n_saved
    returned = {p.pname for p in forward.output[:n_outputs] if type(p) is TensorProxy}
    produced: dict[str, int] = {}
    last_use: dict[str, int] = {}
    viewed: dict[str, str] = {}  # a view -> the value it views (its first argument)
    for position, bsym in enumerate(forward.bound_symbols):
        for name in bsym.arg_names():
            last_use[name] = position
        for proxy in bsym.proxy_outputs():
            produced.setdefault(proxy.pname, position)
            args = bsym.proxy_args()
            if args and proxy.meta._is_view():
                viewed[proxy.pname] = args[0].pname
    first_use = first_uses(backward)
    inputs = {p.pname for p in forward.inputs}

    def views_an_input(name: str) -> bool:  # offloading it would free nothing: the caller holds the input
        while name in viewed:
            name = viewed[name]
        return name in inputs

    found = []
    for saved in traces.saved_by_forward:
        name = saved.pname
        if (saved.device.type not in device_types or name not in produced or name in returned
                or name not in first_use or views_an_input(name)):
            continue
        last = max(last_use.get(name, produced[name]), produced[name])
        distance = len(forward.bound_symbols) - 1 - last + first_use[name]
        found.append(Candidate(name, nbytes(saved), produced[name], last, first_use[name], distance))
    return found


def choose(found: list[Candidate], fraction: float, min_bytes: int, min_distance: int) -> list[Candidate]:
    """The candidates to offload: large and long-lived enough, the longest-lived first, up to `fraction` of the
    eligible bytes."""
    eligible = [c for c in found if c.nbytes >= min_bytes and c.distance >= min_distance]
    budget = fraction * sum(c.nbytes for c in eligible)
    chosen, total = [], 0
    for c in sorted(eligible, key=lambda c: (-c.distance, -c.nbytes, c.produced)):
        if total >= budget:
            break
        chosen.append(c)
        total += c.nbytes
    return chosen


def offload_forward(traces: GradTraces, names: set[str]) -> Trace:
    """The forward copying the saved tensors `names` to the host right after computing them, and saving the
    host copies instead."""
    forward = traces.forward
    bsyms: list[BoundSymbol] = []
    host: dict[str, TensorProxy] = {}
    with TraceBuilder(forward.namespace) as builder:
        for bsym in forward.bound_symbols:
            bsyms.append(bsym)
            for proxy in bsym.proxy_outputs():
                if proxy.pname in names and proxy.pname not in host:
                    builder.source = bsym.source
                    host[proxy.pname] = OFFLOAD(proxy)
                    bsyms.extend(builder.bound_symbols)
                    builder.bound_symbols.clear()
    n_outputs = len(forward.output) - traces.n_saved
    saved = tuple(host.get(p.pname, p) if type(p) is TensorProxy else p for p in forward.output[n_outputs:])
    return forward.from_trace(f"CPU offloading: {len(host)} saved tensors copied to the host",
                              bound_symbols=bsyms, output=tuple(forward.output[:n_outputs]) + saved)


def offloaded_saves(traces: GradTraces) -> dict[int, TensorProxy]:
    """Saved position -> host copy, for the saved tensors the forward offloads."""
    copies = {b.output.pname for b in traces.forward.bound_symbols if b.sym is OFFLOAD}
    return {i: p for i, p in enumerate(traces.saved_by_forward) if type(p) is TensorProxy and p.pname in copies}


def reload_backward(traces: GradTraces, prefetch: int) -> Trace:
    """The backward taking the host copies the forward saved, each copied back to its device `prefetch`
    offloaded tensors ahead of its first use and waited for right before it."""
    backward = traces.backward
    offloaded = offloaded_saves(traces)
    if not offloaded:
        return backward
    inputs = list(backward.inputs)
    originals = {}
    for i, host in offloaded.items():
        originals[host.pname] = inputs[i]
        inputs[i] = host
    first_use = first_uses(backward)
    order = sorted((first_use[p.pname], host) for host, p in originals.items() if p.pname in first_use)
    starts: dict[int, list[str]] = {}  # a reload starts before the call at this position
    for k, (use, host) in enumerate(order):
        start = 0 if k < prefetch else order[k - prefetch][0] + 1  # after the first use `prefetch` places before
        starts.setdefault(min(start, use), []).append(host)
    waits: dict[int, list[str]] = {}
    for use, host in order:
        waits.setdefault(use, []).append(host)
    bsyms: list[BoundSymbol] = []
    in_flight: dict[str, TensorProxy] = {}
    hosts = {p.pname: p for p in offloaded.values()}
    with TraceBuilder(backward.namespace) as builder:
        for position in range(len(backward.bound_symbols) + 1):
            for host in starts.get(position, ()):
                original = originals[host]
                in_flight[host] = RELOAD(hosts[host], original.device)
            for host in waits.get(position, ()):
                builder.bound_symbols.append(BoundSymbol(WAIT, (in_flight.pop(host),), {}, originals[host]))
            bsyms.extend(builder.bound_symbols)
            builder.bound_symbols.clear()
            if position < len(backward.bound_symbols):
                bsyms.append(backward.bound_symbols[position])
    return backward.from_trace(f"CPU offloading: {len(order)} saved tensors copied back ahead of use",
                               inputs=inputs, bound_symbols=bsyms)


class OffloadTransform(Transform):
    """The built-in transform behind `JitOptions.offload` (see the module docstring).

    `device_types` are the devices whose tensors are offloaded; "cpu" makes the rewrite copy host tensors to host
    tensors, which frees nothing but runs the rewritten traces without a GPU (the tests use it).
    """

    def __init__(self, options: OffloadOptions, device_types: tuple[str, ...] = ("cuda",)) -> None:
        self.options = options
        self.device_types = tuple(device_types)

    @property
    def name(self) -> str:
        return "CPU offloading"

    def transform_forward(self, traces: GradTraces) -> Trace:
        options = self.options
        chosen = choose(candidates(traces, self.device_types), options.fraction, options.min_bytes,
                        options.min_distance)
        return offload_forward(traces, {c.name for c in chosen}) if chosen else traces.forward

    def transform_backward(self, traces: GradTraces) -> Trace:
        return reload_backward(traces, self.options.prefetch)
