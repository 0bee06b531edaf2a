"""Dynamo's symbolic sizes through fulmen (torch.compile(..., dynamic=True), or a size Dynamo made dynamic once it
changed).

A graph Dynamo captures with symbolic sizes takes each size as an int input of its own (an `s77: torch.SymInt`
placeholder) beside the tensors whose dimensions they are, and its example values say which dimension that is. Given
to fulmen as it stands, the int would be a Python value of the call, fixed in each trace: one trace per size. So the
piece fulmen runs reads each such int from that tensor dimension itself (`x.size(1)`, `from_tensors`), takes only
the tensors, and marks the dimensions Dynamo made symbolic as symbolic in its own trace from the first one
(fulmen.jit.dynamic_shapes.DynamicDims.declare): one fulmen trace for every size Dynamo's graph stands for. An int
that is no tensor's dimension stays an input, traced as the value it has.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx


def _symbol(value: Any) -> Any:
    """The sympy symbol a SymInt is, or None (a constant, an expression of several symbols)."""
    if not isinstance(value, torch.SymInt):
        return None
    expr = value.node.expr
    return expr if expr.is_Symbol else None


@dataclass(frozen=True, slots=True)
class SizeInputs:
    """Which inputs of a Dynamo graph are sizes of its tensor inputs, and which tensor dimensions are symbolic."""

    read: dict[int, tuple[int, int]]  # placeholder index of an int input -> (placeholder index of a tensor, dim)
    dims: dict[int, frozenset[int]]  # position among the tensor inputs -> the dims Dynamo made symbolic

    @staticmethod
    def of(graph: torch.fx.GraphModule) -> SizeInputs | None:
        """None when no input of `graph` is symbolic (or its example values are not known)."""
        placeholders = [node for node in graph.graph.nodes if node.op == "placeholder"]
        values = [node.meta.get("example_value") for node in placeholders]
        where: dict[Any, tuple[int, int]] = {}
        dims: dict[int, frozenset[int]] = {}
        position = 0
        for index, value in enumerate(values):
            if not isinstance(value, torch.Tensor):
                continue
            symbolic = set()
            for dim, size in enumerate(value.shape):
                symbol = _symbol(size)
                if symbol is not None:
                    where.setdefault(symbol, (index, dim))
                    symbolic.add(dim)
                elif isinstance(size, torch.SymInt):
                    symbolic.add(dim)  # an expression of symbols (Dynamo's 2*s77): symbolic in fulmen's trace too
            if symbolic:
                dims[position] = frozenset(symbolic)
            position += 1
        read = {
            index: where[_symbol(value)]
            for index, value in enumerate(values)
            if _symbol(value) is not None and _symbol(value) in where
        }
        return SizeInputs(read, dims) if read or dims else None

    def from_tensors(self, graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """A copy of `graph` that reads its int inputs of `read` from the tensors' sizes instead of taking them."""
        if not self.read:
            return graph
        copied = torch.fx.GraphModule(graph, copy.deepcopy(graph.graph), graph.__class__.__name__)
        placeholders = [node for node in copied.graph.nodes if node.op == "placeholder"]
        with copied.graph.inserting_after(placeholders[-1]):
            for index, (tensor, dim) in self.read.items():
                size = copied.graph.call_method("size", (placeholders[tensor], dim))
                size.meta = dict(placeholders[index].meta)
                placeholders[index].replace_all_uses_with(size)
        for index in self.read:
            copied.graph.erase_node(placeholders[index])
        copied.recompile()
        return copied

    def arguments(self, args: tuple) -> tuple:
        """The arguments of the copy `from_tensors` makes: `args` without the int inputs it reads."""
        return tuple(arg for index, arg in enumerate(args) if index not in self.read)
