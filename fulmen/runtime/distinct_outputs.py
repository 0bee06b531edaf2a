"""Tensors that eager gives as distinct objects come back as distinct objects, and one object given twice as one.

The trace's common-subexpression elimination merges two equal computations (two `torch.zeros(2)`, two LoRA layers'
`torch.tensor(lora_ind)`) into one value, and a trace returning both returned that one tensor twice: the caller got
one object where eager gives two, so an in-place update of one changed the other (two modules' buffers, registered
by the program, were one tensor). Each output the program returned as an object of its own is copied where the
trace gives an object it gave before.

The reverse happens too: a view the program returned twice (`return y, y` with `y = x[1:]`) came back as two view
objects, each of the autograd bridge's outputs its own, where eager gives one: an attribute set on one, or
`requires_grad_`/`retain_grad`, was not seen through the other. Such a repeat is the object given first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def identity_pattern(values: Sequence[Any]) -> tuple[int, ...] | None:
    """For each value the program returned (or stored), the position of the first that is the same object; None
    when there is at most one (nothing can be merged)."""
    if len(values) < 2:
        return None
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(value), i) for i, value in enumerate(values))


def kept_distinct(outputs: tuple, pattern: tuple[int, ...]) -> tuple:
    """`outputs` (the trace's, a prefix of which `pattern` covers) with a copy in place of each tensor that the
    program returned as an object of its own and the trace gives as an object given before it."""
    result: list[Any] | None = None
    given: set[int] = set()
    for i, first in enumerate(pattern):
        out = outputs[i]
        if first == i and id(out) in given and isinstance(out, torch.Tensor):
            result = result if result is not None else list(outputs)
            result[i] = out.clone()  # keeps strides, and the autograd history (the copy's grad flows back)
        given.add(id(out))
    return outputs if result is None else tuple(result)


def repeats_as_first(outputs: list[Any], pattern: tuple[int, ...]) -> list[Any]:
    """`outputs` (the call's, a prefix of those `pattern` covers) with the object given first in place of each that
    the program returned as an object it returned before (a view remade from its input, or the bridge's second
    output, is another object)."""
    for i in range(len(outputs)):
        if pattern[i] != i:
            outputs[i] = outputs[pattern[i]]
    return outputs
