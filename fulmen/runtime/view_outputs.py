"""Outputs that eager returns as views of a tensor the program computed (an intermediate, another output, a tensor it
assigned to a module) are taken again outside the jitted call's autograd node, from that tensor.

The program runs as one `torch.autograd.Function`, and autograd marks each output of a custom Function that is a
view as made inside it: an in-place update of that output, or of a view of it, while it requires grad raised
("Output 0 of Select is a view ... created inside a custom Function"), where eager's update works, and its `_base`
was a tensor of the forward without a history. So the trace also returns the tensor the view is of (as an output of
its own when the program did not return it), and the call gives the caller that view taken again from the node's
output for it, by the program's view ops, each in the grad mode the program took it in: its `_base` is that output,
whose memory and version counter it shares, and an in-place update of it rebases it as eager's does (the base's
grad_fn becomes CopySlices over the node), so the grads after it are eager's. The node's own output for the view is
dropped: it never gets a grad, and the backward compiled first is the one without it (`GradProgram.retaken`).

An output that is a view of a tensor only the forward makes, which the program never sees (`F.linear` of a contiguous
3-d input is a view of its 2-d result, in eager and in the trace; the base of a view taken again may be one), leaves
the node as a detached alias of it, of the same memory and version counter (`unviewed`): nothing else holds that
tensor, so an update of the alias giving the alias itself its history is eager's update of its view (whose `_base`,
the internal tensor, the caller cannot otherwise reach; the alias is no view: `_is_view()` is False there).

A view taken by an op with a tensor argument (`view_as`) of another output stays the node's output, as before: an
in-place update of it while it requires grad is refused by autograd (clone it first).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fulmen.acquisition.functionalize import Functionalizer
from fulmen.core.proxies import TensorProxy
from fulmen.core.trace import Trace


@dataclass(frozen=True, slots=True)
class ViewStep:
    impl: Callable[..., Any]
    args: tuple
    kwargs: dict[str, Any]
    index: int | None  # which output, for ops returning several views (split, unbind)
    grad_enabled: bool  # the grad mode the program took it in

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(self.grad_enabled):
            out = self.impl(tensor, *self.args, **self.kwargs)
        return out if self.index is None else out[self.index]


@dataclass(frozen=True, slots=True)
class ViewOutput:
    """Output `output` of the trace, which the caller gets as a view of output `base`, taken by `steps`."""

    output: int
    base: int
    steps: tuple[ViewStep, ...]

    def take(self, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        tensor = outputs[self.base]
        for step in self.steps:
            tensor = step.take(tensor)
        return tensor


def view_outputs(functional: Functionalizer, leaves: Sequence[Any], values: list[Any], objects: dict[int, int]
                 ) -> tuple[ViewOutput, ...]:
    """The views of computed tensors among `leaves` (what the program returned, whose trace values are the first of
    `values`); `objects`: the position in `values` of each object the program returned or assigned, by id. The base
    of a view that is none of them is appended to `values`."""
    found = []
    for i, leaf in enumerate(leaves):
        chain = functional.tracked_views(leaf) if type(leaf) is TensorProxy else None
        if chain is None:
            continue
        root, steps = chain
        base = objects.get(id(root))
        if base is None:
            base = objects[id(root)] = len(values)
            values.append(functional.resolve(root))
        found.append(ViewOutput(i, base, tuple(ViewStep(s.sym.impl, s.args, s.kwargs, s.index, s.grad_enabled)
                                               for s in steps)))
    return tuple(found)


def take_views(views: tuple[ViewOutput, ...], outputs: list[torch.Tensor], produced: Sequence[torch.Tensor]
               ) -> list[torch.Tensor]:
    """`outputs` (what the call returns) with each of `views` taken from its base: a returned one as the caller gets
    it, one past them (assigned to a module, or returned by the trace only for this) as the trace gives it."""
    taken = list(outputs)
    source = [*outputs, *produced[len(outputs):]]
    for view in views:
        taken[view.output] = view.take(source)
    return taken


def retaken(views: tuple[ViewOutput, ...] | None) -> tuple[int, ...]:
    """The trace's outputs that the caller gets as views taken again, whose node outputs never get a grad."""
    return tuple(view.output for view in views) if views else ()


def internal_views(forward: Trace, n_outputs: int, excluded: Collection[int]) -> tuple[int, ...]:
    """The outputs of `forward` (but `excluded`: outputs the caller never gets from the node, or gets as an input it
    updated) whose metas say they are views of a tensor the forward alone makes: neither an input, nor another output,
    nor what another output is a view of."""
    outputs = forward.output[:n_outputs]
    held = [i for i, p in enumerate(outputs) if type(p) is TensorProxy and i not in excluded]
    roots = Counter(id(_root(outputs[i].meta)) for i in held)
    external = {id(_root(p.meta)) for p in forward.inputs if type(p) is TensorProxy}
    return tuple(i for i in held if outputs[i].meta._is_view() and id(_root(outputs[i].meta)) not in external
                 and roots[id(_root(outputs[i].meta))] == 1)


def unviewed(outputs: Sequence[torch.Tensor], positions: tuple[int, ...]) -> list[torch.Tensor]:
    """`outputs`, with a detached alias in place of each at `positions` (`internal_views`) that is a view when it
    runs: autograd marks a custom Function's view outputs as made inside it and refuses their in-place updates while
    they require grad ("... is a view and is being modified inplace"), where eager updates its view. A view whose base
    requires grad is not the forward's own (the forward runs without grad): it stays one."""
    result = list(outputs)
    for i in positions:
        out = result[i]
        if out._is_view() and not out._base.requires_grad:
            result[i] = out.detach()
    return result


def _root(meta: torch.Tensor) -> torch.Tensor:
    return meta._base if meta._is_view() else meta
