"""The DDP / FSDP trace transforms: collectives inserted into the split forward and backward traces.

They run after the grad transform, on its results, and touch only the traces' interface (inputs, saved values,
gradient outputs), so changes to autodiff cannot silently move or drop a collective:

- forward: each sharded parameter input becomes its shard; the full parameter is all-gathered (one collective
  per bucket) before its first use, at most `max_in_flight` buckets ahead. ZeRO-3 saves the shard instead of the
  full parameter, so the full one dies after its last forward use.
- backward: ZeRO-3 gathers the saved shards again before their first use. Gradients of distributed parameters
  are packed per bucket and their reduction (all_reduce for DDP, reduce_scatter for FSDP) starts right after the
  bucket's last gradient is computed; all waits sit at the end, so communication overlaps the rest of the
  backward. Gradients are divided by the world size before the reduction (an average, as torch's DDP computes).
- under `no_sync` (GradSync.LOCAL) the backward keeps its full local gradients: a replicated parameter's go to
  `.grad`, as in torch's DDP, a sharded one's are held back (`hold_back`) in the parameters' `DistributedState`;
  the next synced backward (GradSync.PENDING) takes either (`take_pending`: `.grad` as it is then) as a `pending`
  input group and adds them before the reduction.

`DistributedProgram` implements fulmen.transforms.distribution's `DistributionTransform`, the only surface
fulmen.jit sees.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import fulmen.torch as ft
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol
from fulmen.core.trace import Namespace, Trace, TraceBuilder
from fulmen.distributed import prims as collectives
from fulmen.distributed.float8 import Float8Gather, cast_shards, float8_gathers
from fulmen.distributed.specs import ParamSpec, deliver_grad
from fulmen.transforms.distribution import GradSync

__all__ = ["DistributedProgram", "GradSync"]


@dataclass(frozen=True, slots=True)
class _Collective:
    """What one collective carries, for checking that every rank runs the same ones (`dist.check_plan`)."""

    group: str
    checker: str | None  # the group its plan check runs on (the state's)
    label: str  # what the error names: the kind and the parameters ("reduce_scatter a.weight,a.bias")
    key: str  # everything that must agree between ranks: the label, the shape and the dtype


def _collective(kind: str, specs: Sequence[ParamSpec], value: TensorProxy) -> _Collective:
    label = f"{kind} {','.join(spec.name for spec in specs)}"
    state = specs[0].state
    return _Collective(state.group_name, state.checker, label, f"{label} {tuple(value.shape)} {value.dtype}")


def _digest(keys: Sequence[str]) -> int:
    """The same on every process (unlike `hash`, which is seeded per process), and within int64."""
    return int.from_bytes(hashlib.blake2b("\n".join(keys).encode(), digest_size=8).digest(), "big") >> 2


@dataclass(slots=True)
class _Bucket:
    names: list[str]  # the full parameters (forward) or the gradient owners (backward), in pack order
    ready: int  # forward: first use; backward: position of the last gradient computed
    start: list[BoundSymbol] = field(default_factory=list)
    finish: list[BoundSymbol] = field(default_factory=list)


def _first_uses(bsyms: list[BoundSymbol], outputs: Sequence, names: set[str]) -> dict[str, int]:
    # Iterated in argument order, never over a set: every rank must issue its collectives in the same order, and
    # set order follows each process's string-hash seed.
    first: dict[str, int] = {}
    for index, bsym in enumerate(bsyms):
        for proxy in bsym.proxy_args():
            if proxy.pname in names:
                first.setdefault(proxy.pname, index)
    for out in outputs:
        if type(out) is TensorProxy and out.pname in names:
            first.setdefault(out.pname, len(bsyms))
    return first


def _shard_layout(spec: ParamSpec) -> tuple[int, int, int]:
    """(rows per rank, elements per rank, rows of padding)."""
    rows = spec.rows
    rest = math.prod(spec.full_shape[1:])
    return rows, rows * rest, rows * spec.state.world - spec.full_shape[0]


def _frozen(spec: ParamSpec) -> bool:
    param = spec.param() if spec.param is not None else None
    return param is not None and not param.requires_grad


def _take_grad(spec: ParamSpec) -> torch.Tensor | None:
    spec.state.accumulated.discard(spec)
    param = spec.param() if spec.param is not None else None
    if param is None:
        return None
    grad, param.grad = param.grad, None
    return grad


class DistributedProgram:
    """The distribution of one jitted program's inputs and the transforms that follow from it."""

    def __init__(self, inputs: Sequence[TensorProxy], specs: Sequence[ParamSpec | None], namespace: Namespace):
        self.inputs = list(inputs)  # the acquired trace's inputs, in the (full) shapes the program sees
        self.specs = tuple(specs)
        self.namespace = namespace
        self.by_name = {p.pname: s for p, s in zip(inputs, specs) if s is not None}
        self.sharded = {name: spec for name, spec in self.by_name.items() if spec.sharded}
        self._shards: dict[str, TensorProxy] = {}
        self._casting: dict[str, Float8Gather] = {}  # while a forward is built: its float8 gathers
        self.states = tuple({id(s.state): s.state for s in self.by_name.values()}.values())
        # The gradient outputs that belong to distributed parameters requiring grad.
        self.grad_owners = [i for i, (p, spec) in enumerate(zip(inputs, specs)) if spec is not None and p.requires_grad]
        # Those the backward gives a gradient (from the first synced backward trace, every output differentiated);
        # fulmen.jit passes the others in detached, so a gradient added to theirs would be dropped.
        self.differentiated: list[int] | None = None

    @property
    def sync(self) -> bool:
        """Read once by each forward (fulmen.jit's autograd bridge): False inside no_sync. A synced forward also
        records the parameters its backward will reduce, so a synced backward can tell gradients accumulated under
        no_sync that no backward of this round reduces (`take_pending` refuses them)."""
        synced = all(state.sync for state in self.states)
        if synced:
            for i in self._reducing():
                self.specs[i].state.synced_forward.add(self.specs[i])
        return synced

    def _reducing(self) -> list[int]:
        return self.grad_owners if self.differentiated is None else self.differentiated

    # --- gradients accumulated under no_sync (in .grad, or held in each parameter's DistributedState) -----------
    def hold_back(self, grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """A LOCAL backward's grads: a replicated parameter's go to `.grad` (where zero_grad can discard them, as in
        torch's DDP), a sharded one's are added to those held back. The next synced backward reduces their sum."""
        grads = list(grads)
        for i in self.grad_owners:
            spec, grad = self.specs[i], grads[i]
            if not spec.sharded:
                if grad is not None:  # (not a parameter this program leaves out, whose .grad may be older)
                    spec.state.accumulated.add(spec)
                grads[i] = deliver_grad(spec, grad, synced=False)
                continue
            if grad is not None:
                held = spec.state.pending.get(spec)
                spec.state.pending[spec] = grad if held is None else held + grad
            grads[i] = None
        return tuple(grads)

    def deliver(self, grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """A synced backward's grads as autograd is to take them: the parameters' hooks refuse any other gradient
        (fulmen.distributed.specs.watch)."""
        grads = list(grads)
        for i in self.grad_owners:
            grads[i] = deliver_grad(self.specs[i], grads[i], synced=True)
        return tuple(grads)

    def take_pending(self) -> list[torch.Tensor] | None:
        """The gradients accumulated under no_sync, one per gradient owner (zeros where there are none), released;
        None when none of this program's parameters has any. A replicated parameter's are its `.grad`, taken
        (autograd then sets it to the reduced sum)."""
        self._refuse_left_out()
        specs = [self.specs[i] for i in self._reducing()]
        for spec in specs:
            spec.state.synced_forward.discard(spec)
        if not any(spec in spec.state.pending or spec in spec.state.accumulated for spec in specs):
            return None
        pending = []
        for i in self.grad_owners:
            spec, full = self.specs[i], self.inputs[i]
            held = None
            if spec in specs:
                held = _take_grad(spec) if spec in spec.state.accumulated else spec.state.pending.pop(spec, None)
            pending.append(held if held is not None else
                           torch.zeros(full.shape, dtype=full.dtype, device=full.device))
        return pending

    def _refuse_left_out(self) -> None:
        """Raises, before any reduction, when gradients accumulated under no_sync belong to parameters no forward of
        this synced round differentiates: no backward would reduce them (fulmen.jit drops a gradient it adds to a
        parameter the program does not differentiate), and the optimizer would step without them."""
        for state in self.states:
            left = [spec for spec in state.pending if spec not in state.synced_forward]
            left += [spec for spec in state.accumulated if spec not in state.synced_forward
                     and spec.param is not None and (param := spec.param()) is not None and param.grad is not None]
            if not left:
                continue
            frozen = sorted(spec.name for spec in left if _frozen(spec))
            if frozen:  # the forward may well use them: they stopped requiring grad after their no_sync backward
                raise RuntimeError(
                    f"the gradients of {', '.join(frozen)} were accumulated under no_sync, then "
                    f"{'these parameters were' if len(frozen) > 1 else 'the parameter was'} frozen "
                    "(requires_grad=False) before the synced micro-batch, so no synced backward reduces them and each "
                    "rank would keep its own (eager on one process would step with them): change requires_grad "
                    "between optimizer steps, after zero_grad(), not between the micro-batches of one step")
            raise RuntimeError(
                f"the gradients of {', '.join(sorted(spec.name for spec in left))} were accumulated under no_sync, "
                "but the forward run outside no_sync does not use these parameters, so no synced backward reduces "
                "them and they would be lost (torch's DDP needs find_unused_parameters=True here, which fulmen does "
                "not offer): use them in the synced micro-batch's jitted forward too (even as `0 * p.sum()`), or "
                "discard them with zero_grad() before it (DDP)")

    def shard(self, full: TensorProxy) -> TensorProxy:
        """The trace input holding `full`'s local shard (one proxy per parameter, shared by forward and backward)."""
        proxy = self._shards.get(full.pname)
        if proxy is None:
            spec = self.sharded[full.pname]
            meta = torch.empty((spec.rows, *spec.full_shape[1:]), dtype=full.dtype, device="meta")
            proxy = TensorProxy(self.namespace.create(f"{full.pname}_shard"), meta, full.device, full.requires_grad)
            self._shards[full.pname] = proxy
        return proxy

    # --- forward ---------------------------------------------------------------------------------------------
    def forward(self, trace: Trace, n_outputs: int) -> Trace:
        """`trace` (outputs, then saved values from position `n_outputs`) reading shards and gathering them."""
        if not self.sharded:
            return trace
        full = {p.pname: p for p in trace.inputs if p.pname in self.sharded}
        # weights gathered cast to float8 (fulmen.distributed.float8): their float8 copies are gathered as they are
        forward_bsyms, self._casting = float8_gathers(trace.bound_symbols, trace.output, full)
        for name, gather in self._casting.items():
            self.sharded[name] = self.sharded[gather.weight.pname]
            full[name] = gather.bits
        outputs = list(trace.output)
        for i in range(n_outputs, len(outputs)):
            out = outputs[i]
            if type(out) is TensorProxy and out.pname in self.sharded and self.sharded[out.pname].state.zero3:
                outputs[i] = self.shard(out)
        plan: dict[int, _Collective] = {}
        bsyms = self._checked(self._with_gathers(forward_bsyms, outputs, full, plan), plan, "forward")
        self._casting = {}
        inputs = [self.shard(p) if p.pname in self.sharded else p for p in trace.inputs]
        return trace.from_trace("FSDP: shards gathered before use", inputs=inputs, bound_symbols=bsyms,
                                output=tuple(outputs))

    def _checked(self, bsyms: list[BoundSymbol], plan: dict[int, _Collective], what: str) -> list[BoundSymbol]:
        """`bsyms` after one `dist.check_plan` per process group: every rank must be about to start the same
        collectives (`plan`: each collective's start by `id`), or every rank raises before the first."""
        ordered = [plan[id(bsym)] for bsym in bsyms if id(bsym) in plan]
        with TraceBuilder(self.namespace) as builder:
            for group in dict.fromkeys(c.group for c in ordered):
                mine = [c for c in ordered if c.group == group]
                collectives.check_plan(group, mine[0].checker, what, _digest([c.key for c in mine]),
                                       tuple(c.label for c in mine))
        return builder.bound_symbols + bsyms

    def _with_gathers(self, bsyms: list[BoundSymbol], outputs: Sequence, full: dict[str, TensorProxy],
                      plan: dict[int, _Collective]) -> list[BoundSymbol]:
        first = _first_uses(bsyms, outputs, set(full))
        groups: dict[tuple, list[str]] = {}
        for name in sorted(first, key=first.__getitem__):
            spec = self.sharded[name]
            groups.setdefault((id(spec.state), spec.bucket, full[name].dtype), []).append(name)
        buckets = sorted((_Bucket(names, first[names[0]]) for names in groups.values()), key=lambda b: b.ready)
        for bucket in buckets:
            self._gather(bucket, [full[name] for name in bucket.names])
            specs = [self.sharded[n] for n in bucket.names]
            plan[id(bucket.start[-1])] = _collective("all_gather", specs, bucket.start[-1].args[0])
            for bsym in bucket.start[:-1]:
                if bsym.sym is collectives.all_reduce_max:  # the amaxes of a float8 gather
                    plan[id(bsym)] = _collective("all_reduce_max", specs, bsym.args[0])
        in_flight = self.sharded[buckets[0].names[0]].state.max_in_flight if buckets else 1
        result: list[BoundSymbol] = []
        started = 0

        def start_next() -> None:
            nonlocal started
            if started < len(buckets):
                result.extend(buckets[started].start)
                started += 1

        for _ in range(in_flight):
            start_next()
        finishing = {}
        for index, bucket in enumerate(buckets):
            finishing.setdefault(bucket.ready, []).append(index)
        for position in range(len(bsyms) + 1):
            # buckets finish in order and each finish starts one more, so bucket `index` has always started here
            for index in finishing.get(position, ()):
                result.extend(buckets[index].finish)
                start_next()  # the next bucket takes the freed slot
            if position < len(bsyms):
                result.append(bsyms[position])
        return result

    def _gather(self, bucket: _Bucket, fulls: list[TensorProxy]) -> None:
        specs = [self.sharded[p.pname] for p in fulls]
        state = specs[0].state
        world = state.world
        with TraceBuilder(self.namespace) as builder:
            shards = [self.shard(p) for p in fulls]
            if self._casting:  # the forward computes the float8 shards it gathers; ZeRO-3's backward saved them
                gathers = [self._casting.get(p.pname) for p in fulls]
                sources = [self.shard(g.weight) if g is not None else s for g, s in zip(gathers, shards)]
                shards = cast_shards(builder, sources, shards, gathers, state.group_name)
            flat = shards[0] if len(shards) == 1 else ft.cat([ft.reshape(s, (-1,)) for s in shards], 0)
            gathered = collectives.all_gather(flat, state.group_name, world)
        bucket.start = builder.bound_symbols
        with TraceBuilder(self.namespace) as builder:
            done = collectives.wait(gathered)
            results = []
            if len(shards) == 1:
                padded = [done]
            else:
                table = ft.reshape(done, (world, -1))
                padded, offset = [], 0
                for spec in specs:
                    rows, numel, _ = _shard_layout(spec)
                    piece = ft.narrow(table, 1, offset, numel)
                    padded.append(ft.reshape(piece, (rows * world, *spec.full_shape[1:])))
                    offset += numel
            for value, spec in zip(padded, specs):
                n = spec.full_shape[0]
                results.append(ft.narrow(value, 0, 0, n) if value.shape[0] != n else value)
        builder.adopt_results(builder.bound_symbols, results, fulls, None)
        bucket.finish = builder.bound_symbols

    # --- backward --------------------------------------------------------------------------------------------
    def backward(self, trace: Trace, mode: GradSync) -> Trace:
        """The backward trace with ZeRO-3's gathers and, unless `mode` is LOCAL, the gradient reduction."""
        if self.differentiated is None and mode is GradSync.SYNC:
            self.differentiated = [i for i in self.grad_owners if trace.output[i] is not None]
        saved_count = trace.input_groups[0][1] if trace.input_groups else 0
        regather = {p.pname: p for p in trace.inputs[:saved_count]
                    if p.pname in self.sharded and self.sharded[p.pname].state.zero3}
        bsyms = list(trace.bound_symbols)
        inputs = list(trace.inputs)
        plan: dict[int, _Collective] = {}
        if regather:
            bsyms = self._with_gathers(bsyms, trace.output, regather, plan)
            inputs = [self.shard(p) if p.pname in regather else p for p in inputs]
        groups = tuple(trace.input_groups)
        output = list(trace.output)
        provenance = "FSDP: ZeRO-3 gathers" if regather else trace.provenance
        if mode is not GradSync.LOCAL:
            pending = self._pending_inputs() if mode is GradSync.PENDING else {}
            bsyms, output = self._reduce_grads(bsyms, output, pending, plan)
            if pending:
                inputs += list(pending.values())
                groups += (("pending", len(pending)),)
            provenance = "Distributed: gradients reduced across ranks"
        return trace.from_trace(provenance, inputs=inputs, bound_symbols=self._checked(bsyms, plan, "backward"),
                                output=tuple(output), input_groups=groups)

    def _pending_inputs(self) -> dict[int, TensorProxy]:
        pending = {}
        for i in self.grad_owners:
            full = self.inputs[i]
            meta = torch.empty(full.shape, dtype=full.dtype, device="meta")
            pending[i] = TensorProxy(self.namespace.create(f"pending_{full.pname}"), meta, full.device)
        return pending

    def _reduce_grads(self, bsyms: list[BoundSymbol], grads: list, pending: dict[int, TensorProxy],
                      plan: dict[int, _Collective]) -> tuple[list[BoundSymbol], list]:
        producer = {name: index for index, bsym in enumerate(bsyms) for name in bsym.output_names()}
        after: dict[int, list[BoundSymbol]] = {}
        ready: dict[int, int] = {}
        values: dict[int, TensorProxy] = {}
        for i in self.grad_owners:
            grad = grads[i]
            position = producer.get(grad.pname, -1) if grad is not None else -1
            if i in pending:
                if grad is None:
                    grad = pending[i]
                else:
                    with TraceBuilder(self.namespace) as builder:
                        grad = ft.add(grad, pending[i])
                    after.setdefault(position, []).extend(builder.bound_symbols)
            if grad is not None:
                values[i], ready[i] = grad, position
        buckets = self._grad_buckets(values, ready)
        finish: list[BoundSymbol] = []
        for owners in buckets:
            start, end = self._reduce(owners, values, grads)
            kind = "reduce_scatter" if self.specs[owners[0]].sharded else "all_reduce"
            plan[id(start[-1])] = _collective(kind, [self.specs[i] for i in owners], start[-1].args[0])
            after.setdefault(max(ready[i] for i in owners), []).extend(start)
            finish.extend(end)
        result = list(after.get(-1, ()))
        for index, bsym in enumerate(bsyms):
            result.append(bsym)
            result.extend(after.get(index, ()))
        return result + finish, grads

    def _grad_buckets(self, values: dict[int, TensorProxy], ready: dict[int, int]) -> list[list[int]]:
        """Gradient owners per collective, in the order their buckets become ready."""
        buckets: list[list[int]] = []
        open_ddp: dict[tuple, tuple[list[int], list[int]]] = {}  # (state, dtype) -> (owners, [bytes])
        fsdp: dict[tuple, list[int]] = {}
        for i in sorted(values, key=lambda i: ready[i]):
            spec, grad = self.specs[i], values[i]
            if spec.sharded:
                fsdp.setdefault((id(spec.state), spec.bucket, grad.dtype), []).append(i)
                continue
            key = (id(spec.state), grad.dtype)
            if key not in open_ddp:
                open_ddp[key] = ([], [0])
                buckets.append(open_ddp[key][0])
            owners, size = open_ddp[key]
            owners.append(i)
            size[0] += grad.numel() * grad.element_size()
            if size[0] >= spec.state.bucket_bytes:
                del open_ddp[key]
        buckets.extend(fsdp.values())
        return sorted(buckets, key=lambda owners: max(ready[i] for i in owners))

    def _reduce(self, owners: list[int], values: dict[int, TensorProxy], grads: list
                ) -> tuple[list[BoundSymbol], list[BoundSymbol]]:
        """The pack + start and the wait + unpack of one bucket; `grads` gets the reduced gradients."""
        specs = [self.specs[i] for i in owners]
        state = specs[0].state
        world = state.world
        with TraceBuilder(self.namespace) as builder:
            if state.kind == "fsdp":
                pieces = []
                for i, spec in zip(owners, specs):
                    grad = values[i]
                    _, numel, padding = _shard_layout(spec)
                    if padding:
                        grad = ft.pad(grad, (0, 0) * (grad.dim() - 1) + (0, padding))
                    pieces.append(ft.reshape(grad, (world, numel)))
                table = pieces[0] if len(pieces) == 1 else ft.cat(pieces, 1)
                flat = ft.div(ft.reshape(table, (-1,)), world)
                started = collectives.reduce_scatter(flat, state.group_name, world)
            else:
                pieces = [ft.reshape(values[i], (-1,)) for i in owners]
                flat = ft.div(pieces[0] if len(pieces) == 1 else ft.cat(pieces, 0), world)
                started = collectives.all_reduce(flat, state.group_name)
        start = builder.bound_symbols
        with TraceBuilder(self.namespace) as builder:
            done = collectives.wait(started)
            offset = 0
            for i, spec in zip(owners, specs):
                if spec.sharded:
                    rows, numel, _ = _shard_layout(spec)
                    shape = (rows, *spec.full_shape[1:])
                else:
                    shape, numel = tuple(values[i].shape), values[i].numel()
                piece = done if len(owners) == 1 else ft.narrow(done, 0, offset, numel)
                grads[i] = ft.reshape(piece, shape)
                offset += numel
        return start, builder.bound_symbols
