"""Outputs of a jitted program that other outputs were computed from, and the grads autograd shows for them.

The program runs as one autograd node, so every output is an output of that node: with `a = x * 2` and
`b = a.sin()` both returned, eager's graph runs b's grad through a's node, fulmen's does not. The grad autograd
gives `a` (what a hook on `a` sees and may replace, what `a.retain_grad()` keeps) is then only the part that reached
`a` directly, without what came through `b`. The backward cannot give a hook the whole grad, so it refuses when a
hook or `retain_grad` watches such an output while a grad arrives through an output computed from it
(`check_watched`). Known limit: `torch.autograd.grad(b, a)` captures `a`'s grad without running the node, so
fulmen cannot see it; torch then reports `a` as unused (or returns None with `allow_unused=True`).

`y.retain_grad()` inside the program is done by each call on the tensor it gives the caller for `y` (`Retained`): an
output (a feeding one is then refused by `check_watched`, as a hook on it), a module tensor the program reassigned, an
input. A value that does not leave the program cannot be looked at, so its retain_grad changes nothing.

Known limit, for the same reason: a hook (`register_hook`) on an output that gets no grad while another output of
the call does is called with None, where eager, whose output has a node of its own that never runs, does not call it
(torch calls the tensor hooks of a node's outputs whenever the node runs). Avoiding it would take a node per output
or hooks wrapped at registration; a hook written for eager that does not expect None fails loudly on it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fulmen.core.errors import TraceError
from fulmen.core.source import SourceLocation
from fulmen.core.trace import Trace


@dataclass(frozen=True, slots=True)
class FeedingOutput:
    """Program output `output`, from which the outputs `dependents` were computed (differentiably)."""

    output: int
    dependents: tuple[int, ...]
    name: str
    where: SourceLocation | None  # the line that computed it
    places: tuple[str, ...] = ()  # where each output of the program is for it (`output['logits']`), when known

    def describe(self, output: int) -> str:
        return self.places[output] if output < len(self.places) else f"output #{output}"


def feeding_outputs(trace: Trace, differentiable: Sequence[bool], places: tuple[str, ...] = ()
                    ) -> tuple[FeedingOutput, ...]:
    """The differentiable outputs of `trace` that other differentiable outputs depend on through values that
    require grad; `places`: where the outputs sit in what the program returns (`output['hidden_states'][1]`)."""
    index: dict[str, list[int]] = {}
    for i, (out, wanted) in enumerate(zip(trace.output, differentiable)):
        if wanted:
            index.setdefault(out.pname, []).append(i)
    reaches: dict[str, frozenset[int]] = {}  # value -> the outputs it was computed from
    where: dict[str, SourceLocation | None] = {}
    for bsym in trace.bound_symbols:
        sources = frozenset().union(*(reaches.get(p.pname, ()) for p in bsym.proxy_args() if p.requires_grad))
        for out in bsym.proxy_outputs():
            if out.requires_grad:
                reaches[out.pname] = sources | frozenset(index.get(out.pname, ()))
            where.setdefault(out.pname, bsym.source)
    feeding = []
    for name, outputs in index.items():
        for i in outputs:
            dependents = tuple(
                j
                for j, out in enumerate(trace.output)
                if differentiable[j] and out.pname != name and i in reaches.get(out.pname, ())
            )
            if dependents:
                feeding.append(FeedingOutput(i, dependents, name, where.get(name), places))
    return tuple(sorted(feeding, key=lambda f: f.output))


@dataclass(frozen=True, slots=True)
class Retained:
    """The tensors of a call whose grad autograd keeps, as the program's `retain_grad()` calls asked: outputs by
    position among the trace's outputs (a rebind's value after the returned ones), inputs by position."""

    outputs: tuple[int, ...]
    inputs: tuple[int, ...]

    def apply(self, returned: Sequence[torch.Tensor], produced: Sequence[torch.Tensor],
              inputs: Sequence[torch.Tensor]) -> None:
        """`returned`: what the call returns (views of inputs taken again); `produced`: the trace's outputs."""
        for i in self.outputs:
            (returned[i] if i < len(returned) else produced[i]).retain_grad()
        for i in self.inputs:
            inputs[i].retain_grad()


def watch(feeding: tuple[FeedingOutput, ...], outputs: Sequence[torch.Tensor]) -> list[weakref.ref]:
    """Weak references to the feeding outputs a call returns (the backward looks at their hooks)."""
    return [weakref.ref(outputs[f.output]) for f in feeding]


def check_watched(feeding: tuple[FeedingOutput, ...], refs: list[weakref.ref], present: Sequence[bool]) -> None:
    """Refuses the backward when a hook or `retain_grad` watches a feeding output that would see a partial grad."""
    for f, ref in zip(feeding, refs):
        tensor = ref()
        if tensor is None or not any(present[j] for j in f.dependents):
            continue
        if tensor.retains_grad or tensor._backward_hooks:
            what = "retain_grad()" if tensor.retains_grad else "a hook (register_hook)"
            dependents = ", ".join(f.describe(j) for j in f.dependents[:4]) + (", ..." if len(f.dependents) > 4
                                                                                 else "")
            were = "was" if len(f.dependents) == 1 else "were"
            raise TraceError(
                f"{f.describe(f.output)} ({f.name}) of the jitted program has {what}, and {dependents} {were} "
                "computed from it: fulmen runs the program as one autograd "
                "node, so the grad autograd would show for that output lacks what reaches it through the others. "
                "Compute the outputs that use it in a second jitted call (or eagerly) taking it as an argument",
                f.where,
            )


def rewatch(feeding: tuple[FeedingOutput, ...], node_outputs: Sequence[torch.Tensor],
            returned: Sequence[torch.Tensor]) -> None:
    """The call returns `returned[i]` in place of the node's output i (a view of an input, taken again from the
    input; a copy, distinct_outputs.py): the backward watches the tensor the caller holds, whose hooks would otherwise
    see a
    partial grad (one past them, assigned to a module or a base the call took a view of, is the node's own)."""
    for k, f in enumerate(feeding):
        if f.output >= len(returned):
            continue
        node = node_outputs[f.output].grad_fn  # a custom Function's node is its ctx
        if node is not None and not hasattr(node, "watched"):  # the node's output was copied (distinct_outputs.py)
            node = node.next_functions[0][0]
        if returned[f.output] is not node_outputs[f.output] and node is not None:
            node.watched[k] = weakref.ref(returned[f.output])
