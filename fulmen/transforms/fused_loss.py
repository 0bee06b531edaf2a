"""Never materialise the logits: `linear` + `cross_entropy` become one chunked symbol (fulmen.ops.fused_loss).

A language model's loss is `cross_entropy(linear(h, W).reshape(-1, V), target)`. For large vocabularies the logits
(and their float32 upcast, and their gradient) dominate activation memory. `fuse_linear_cross_entropy` rewrites the
acquired trace: where a cross-entropy reads a linear's output through row-preserving reshapes (`reshape`, `view`,
`flatten`, `contiguous`, ...) and dtype conversions (`.float()`, `.to(dtype)`), and nothing else reads those logits,
the chain becomes one `fused_loss.linear_cross_entropy` call. LitGPT's `chunked_cross_entropy` (a split of the logits
into row chunks, a reduction="none" cross-entropy per chunk, their concatenation) is recognised as one
cross-entropy, and a reduction="none" loss only summed becomes reduction="sum".

Its grad rule (fulmen.ops.fused_loss) computes each chunk's gradients for h, W and the bias in the forward
(reductions "mean" and "sum"), so the forward saves those gradients instead of logits; reduction "none" recomputes
the logits chunk by chunk in the backward. Where the pattern does not hold, the trace is left as it is and the
reason is stated in the provenance of the trace this pass produces (`fulmen.last_traces(fn)`, `fulmen.examine`):
the logits are also returned or read by another op, class weights, logits that do not come from a linear.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, iter_proxies
from fulmen.core.trace import Trace
from fulmen.ops import fused_loss
from fulmen.ops.registry import SYMBOLS
from fulmen.transforms.common import dce
from fulmen.transforms.transform import TracePass

PROVENANCE = "Fused linear + cross-entropy"

CROSS_ENTROPY = SYMBOLS["torch.nn.functional.cross_entropy"]
LINEAR = SYMBOLS["torch.nn.functional.linear"]
SUM = SYMBOLS["torch.sum"]
CAT = SYMBOLS["torch.cat"]
TO = SYMBOLS["torch.Tensor.to"]
# Reshapes that keep a tensor's element order: with the last dim (the vocabulary) kept, its rows stay in order.
RESHAPES = frozenset(SYMBOLS[name] for name in (
    "torch.reshape", "torch.Tensor.reshape", "torch.Tensor.view", "torch.Tensor.view_as", "torch.Tensor.reshape_as",
    "torch.flatten", "torch.Tensor.flatten", "torch.unflatten", "torch.Tensor.unflatten", "torch.squeeze",
    "torch.Tensor.squeeze", "torch.unsqueeze", "torch.Tensor.unsqueeze", "torch.Tensor.contiguous"))
SPLITS = frozenset(SYMBOLS[name] for name in (
    "torch.functional.split", "torch.Tensor.split", "torch.Tensor.split_with_sizes", "torch.split_with_sizes"))

_CROSS_ENTROPY = inspect.signature(F.cross_entropy)


# --- the pattern ----------------------------------------------------------------------------------------------------
@dataclass
class _Graph:
    producer: dict[str, BoundSymbol] = field(default_factory=dict)
    readers: dict[str, list[BoundSymbol]] = field(default_factory=dict)
    outputs: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, trace: Trace) -> _Graph:
        graph = cls(outputs={p.pname for p in iter_proxies(trace.output)})
        for bsym in trace.bound_symbols:
            for name in bsym.output_names():
                graph.producer[name] = bsym
            for name in bsym.arg_names():
                graph.readers.setdefault(name, []).append(bsym)
        return graph

    def sole_reader(self, value: TensorProxy) -> BoundSymbol | None:
        readers = self.readers.get(value.pname, [])
        return readers[0] if len(readers) == 1 and value.pname not in self.outputs else None

    def why_shared(self, value: TensorProxy, reader: BoundSymbol) -> str | None:
        """Why `value` is not read by `reader` alone, if it is not."""
        if value.pname in self.outputs:
            return f"the logits {value.pname} are also returned by the program"
        others = [b for b in self.readers.get(value.pname, []) if b is not reader]
        if others:
            return f"the logits {value.pname} are also read by {others[0].sym.printed}{_at(others[0])}"
        return None


def _at(bsym: BoundSymbol) -> str:
    return f" at {bsym.source.short()}" if bsym.source is not None else ""


def _keeps_rows(bsym: BoundSymbol) -> bool:
    """A reshape or dtype conversion after which row i of the (rows, vocab) view is still row i."""
    outputs = bsym.proxy_outputs()
    if len(outputs) != 1 or not bsym.args or type(bsym.args[0]) is not TensorProxy:
        return False
    x, out = bsym.args[0], outputs[0]
    if bsym.sym in RESHAPES:
        return x.dim() > 0 and out.dim() > 0 and x.shape[-1] == out.shape[-1]
    return (bsym.sym is TO and x.shape == out.shape and x.device == out.device and out.dtype.is_floating_point)


def _cross_entropy_arguments(bsym: BoundSymbol) -> dict[str, Any]:
    bound = _CROSS_ENTROPY.bind(*bsym.args, **bsym.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _unsupported(a: dict[str, Any]) -> str | None:
    logits, target = a["input"], a["target"]
    if a["weight"] is not None:
        return "class weights are not supported by the fused loss"
    if a["size_average"] is not None or a["reduce"] is not None:
        return "the deprecated size_average/reduce arguments are not supported by the fused loss"
    if type(logits) is not TensorProxy or logits.dim() != 2 or not logits.dtype.is_floating_point:
        return "the fused loss takes logits of shape (rows, classes)"
    if logits.numel() == 0:
        return "the logits are empty"
    if type(target) is not TensorProxy or target.dtype.is_floating_point or target.dim() != 1:
        return "the fused loss takes one class index per row as target"
    if a["reduction"] not in fused_loss.REDUCTIONS or type(a["ignore_index"]) is not int:
        return f"reduction {a['reduction']!r} is not supported by the fused loss"
    return None


@dataclass
class _Match:
    linear: BoundSymbol
    args: tuple[TensorProxy, TensorProxy, TensorProxy | None, TensorProxy]  # h, weight, bias, target
    terminal: BoundSymbol  # whose output the fused call computes
    removed: list[BoundSymbol]
    spec: dict[str, Any]


def _up(graph: _Graph, value: TensorProxy, reader: BoundSymbol) -> tuple[TensorProxy, list[BoundSymbol]] | str:
    """From `value`, read by `reader` alone, up through row-keeping ops: the first value no such op produced, and
    the ops on the way; or why a value on the way is read by something else too."""
    chain = []
    while True:
        why = graph.why_shared(value, reader)
        if why is not None:
            return why
        producer = graph.producer.get(value.pname)
        if producer is None or not _keeps_rows(producer):
            return value, chain
        chain.append(producer)
        value, reader = producer.args[0], producer


def _down(graph: _Graph, value: TensorProxy) -> tuple[BoundSymbol, list[BoundSymbol]] | None:
    """From `value` down through row-keeping ops, each the sole reader of the one before, to a cross-entropy."""
    chain = []
    while True:
        reader = graph.sole_reader(value)
        if reader is None or type(reader.args[0]) is not TensorProxy or reader.args[0].pname != value.pname:
            return None
        if reader.sym is CROSS_ENTROPY:
            return reader, chain
        if not _keeps_rows(reader):
            return None
        chain.append(reader)
        value = reader.output


def _same_loss(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a[key] == b[key] for key in ("ignore_index", "reduction", "label_smoothing"))


def _names(proxies: Any) -> list[str]:
    return [p.pname for p in iter_proxies(proxies)]


def _split_group(graph: _Graph, split: BoundSymbol, a: dict[str, Any]) -> tuple[Any, list[BoundSymbol]] | str:
    """For cross-entropies of the pieces of a split (LitGPT's chunked_cross_entropy): the whole (logits, target,
    concatenation of the per-piece losses) and the calls they replace, or why it is not that pattern."""
    logits = split.args[0]
    dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
    if dim % logits.dim() != 0:
        return f"the logits are split along dim {dim}, not into row chunks"
    removed, losses, targets, dtypes, conversions = [split], [], [], set(), 0
    for piece in split.proxy_outputs():
        found = _down(graph, piece)
        if found is None:
            return f"a piece of the split logits {logits.pname} is read by something other than a cross-entropy"
        ce, chain = found
        b = _cross_entropy_arguments(ce)
        if not _same_loss(a, b) or b["reduction"] != "none" or _unsupported(b) is not None:
            return "the cross-entropies of the split logits differ or do not use reduction='none'"
        removed.extend([*chain, ce])
        conversions = max(conversions, _conversions([piece, *(op.output for op in chain), b["input"]]))
        losses.append(ce.output)
        targets.append(b["target"])
        dtypes.add(b["input"].dtype)
    target_split = graph.producer.get(targets[0].pname)
    if (target_split is None or target_split.sym not in SPLITS or _names(target_split.output) != _names(targets)
            or [t.shape[0] for t in targets] != [p.shape[0] for p in split.proxy_outputs()] or len(dtypes) != 1):
        return "the targets of the split logits are not split the same way"
    cat = graph.sole_reader(losses[0])
    if (cat is None or cat.sym is not CAT or _names(cat.args[0]) != _names(losses)
            or cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0) != 0
            or any(graph.sole_reader(loss) is not cat for loss in losses)):
        return "the losses of the split logits are not concatenated in order"
    return (target_split.args[0], cat, dtypes.pop(), conversions), [*removed, cat]


def _conversions(values: list[TensorProxy]) -> int:
    """How many times the dtype changes along `values`."""
    return sum(a.dtype != b.dtype for a, b in zip(values, values[1:]))


def _match(graph: _Graph, ce: BoundSymbol) -> _Match | str:
    a = _cross_entropy_arguments(ce)
    reason = _unsupported(a)
    if reason is not None:
        return reason
    up = _up(graph, a["input"], ce)
    if isinstance(up, str):
        return up
    logits, chain = up
    target, terminal, dtype, removed, conversions = a["target"], ce, a["input"].dtype, [ce], 0
    producer = graph.producer.get(logits.pname)
    if producer is not None and producer.sym in SPLITS:
        group = _split_group(graph, producer, a)
        if isinstance(group, str):
            return group
        (target, terminal, dtype, conversions), removed = group
        up = _up(graph, producer.args[0], producer)
        if isinstance(up, str):
            return up
        logits, chain = up
        producer = graph.producer.get(logits.pname)
    if producer is None:
        return f"its logits {logits.pname} are an input of the program, not the output of a linear"
    if producer.sym is not LINEAR:
        return f"its logits come from {producer.sym.printed}{_at(producer)}, not from a linear"
    weight = producer.args[1] if len(producer.args) > 1 else producer.kwargs.get("weight")
    bias = producer.args[2] if len(producer.args) > 2 else producer.kwargs.get("bias")
    if type(weight) is not TensorProxy or weight.dim() != 2 or (bias is not None and type(bias) is not TensorProxy):
        return "the linear has no 2-D weight tensor"
    # the fused loss rounds the logits to the cross-entropy's dtype once
    if conversions + _conversions([producer.output, *(op.output for op in reversed(chain))]) > 1:
        return "the logits are converted through several dtypes"
    reduction = a["reduction"] if terminal is ce else "none"
    total = graph.sole_reader(terminal.output)
    if reduction == "none" and total is not None and total.sym is SUM and len(total.args) == 1 and not total.kwargs:
        reduction, terminal = "sum", total  # the per-row losses are only summed
        removed.append(total)
    spec = {"ignore_index": a["ignore_index"], "reduction": reduction, "label_smoothing": float(a["label_smoothing"]),
            "dtype": dtype}
    h = producer.args[0]
    return _Match(producer, (h, weight, bias, target), terminal, [producer, *chain, *removed], spec)


def fuse_linear_cross_entropy(trace: Trace, chunk_rows: int | None = None, prune: bool = True) -> Trace:
    """`trace` with each linear + cross-entropy it can fuse replaced by `fused_loss.linear_cross_entropy`; the trace
    itself when it has no cross-entropy. `chunk_rows`: rows per chunk (None: `fused_loss.chunk_rows_for`).
    `prune=False` replaces the cross-entropy alone and leaves the calls only it read (the head's linear) for a later
    dead-code elimination: a part of a program (a whole step's forward, grad_slots.py) whose later code may read
    them."""
    graph = _Graph.of(trace)
    notes: list[str] = []
    replaced: dict[int, BoundSymbol | None] = {}  # id(bsym) -> its replacement (None: dropped)
    for bsym in trace.bound_symbols:
        if bsym.sym is not CROSS_ENTROPY or id(bsym) in replaced:
            continue
        match = _match(graph, bsym)
        if isinstance(match, str):
            note = f"declined{_at(bsym)}: {match}"
            if note not in notes:  # the cross-entropies of one split decline together
                notes.append(note)
            continue
        h, weight, _, target = match.args
        rows, vocab = target.shape[0], weight.shape[0]
        if isinstance(rows, torch.SymInt):  # symbolic rows (fulmen.core.symbolic): the call chooses from its own rows
            rows_per_chunk = chunk_rows
        else:
            rows_per_chunk = min(chunk_rows or fused_loss.chunk_rows_for(rows, vocab, h.dtype), rows)
        fused = BoundSymbol(fused_loss.LINEAR_CROSS_ENTROPY, match.args, {**match.spec, "chunk_rows": rows_per_chunk},
                            match.terminal.output, [], bsym.source, bsym.checkpoint_region)
        if prune:
            for removed in match.removed:
                replaced[id(removed)] = None
        replaced[id(match.terminal)] = fused
        notes.append(f"fused{_at(bsym)}: {match.linear.output.pname} -> {match.terminal.output.pname} "
                     f"({rows} rows x {vocab} classes, {match.spec['reduction']}, "
                     f"{_chunks(rows_per_chunk)})")
    if not notes:
        return trace
    bsyms = [replaced.get(id(b), b) for b in trace.bound_symbols]
    result = trace.from_trace("", bound_symbols=[b for b in bsyms if b is not None])
    return (dce(result) if prune else result).from_trace(f"{PROVENANCE}: {'; '.join(notes)}")


def _chunks(rows_per_chunk: int | None) -> str:
    return f"chunks of {rows_per_chunk} rows" if rows_per_chunk is not None else "chunks chosen from the rows per call"


class FuseLinearCrossEntropy(TracePass):
    """`fuse_linear_cross_entropy` of the acquired program (stage ACQUIRED; JitOptions.fuse_linear_cross_entropy,
    with JitOptions.cross_entropy_chunk_rows as `chunk_rows`)."""

    title = PROVENANCE

    def __init__(self, chunk_rows: int | None = None, prune: bool = True) -> None:
        self.chunk_rows = chunk_rows
        self.prune = prune

    def run(self, trace: Trace) -> Trace:
        return fuse_linear_cross_entropy(trace, self.chunk_rows, prune=self.prune)
