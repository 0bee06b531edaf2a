"""Grouped-query attention without the repeated heads: `sdpa(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1))`
becomes `sdpa(q, k, v, enable_gqa=True)`.

Models written for attention kernels without grouped-query support (LitGPT among them) repeat each key and value head
for the r query heads sharing it before calling `scaled_dot_product_attention`. The copies cost a kernel in the forward,
memory or a recomputation for the backward, and in the backward a reduction summing the r repeated heads' gradients: on
an H200, TinyLlama's step spends 2.9 ms of 110 on them; grouped, its GPU time was 0.9 to 3.9 ms lower over four runs,
its wall time 1.7 ms over two rounds (the `fulmen-repeated-heads` row of benchmarks/step.py). On by default; off with
`JitOptions(grouped_query_attention=False)`. torch's cuDNN and flash kernels take the shared heads as they are,
`enable_gqa=True` meaning exactly that repeat_interleave (torch's documentation and its math kernel).

The rewrite applies only where the call keeps its kernel: `kernel_of` (by default torch's own selector, for tensors
on CUDA) must pick the same fused kernel for the grouped call as for the repeated one. Elsewhere (CPU, a mask,
dropout, another repeat) the trace stays as it is, with the reason in the provenance of the pass's trace. Values
equal eager's up to the order of additions in the key and value gradients (the kernel sums the query heads'
contributions itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.nn.attention import SDPBackend

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, iter_proxies
from fulmen.core.trace import Trace
from fulmen.ops.kernels.sdpa_kernels import eager_choice
from fulmen.ops.registry import SYMBOLS
from fulmen.transforms.common import dce
from fulmen.transforms.transform import TracePass

PROVENANCE = "Grouped-query attention"
SDPA = SYMBOLS["torch.nn.functional.scaled_dot_product_attention"]
REPEAT_INTERLEAVE = SYMBOLS["torch.repeat_interleave"]
_SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
_FUSED = frozenset({int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.FLASH_ATTENTION)})

# (q, k, v, grouped k, grouped v, is_causal, scale) -> whether the grouped call runs the repeated call's kernel
KernelCheck = Callable[[TensorProxy, TensorProxy, TensorProxy, TensorProxy, TensorProxy, bool, Any], bool]


def same_fused_kernel(q, k, v, grouped_k, grouped_v, is_causal, scale) -> bool:
    """Whether torch picks the same fused kernel (cuDNN or flash) for the grouped call as for the repeated one."""
    if any(t.device.type != "cuda" for t in (q, k, v)):
        return False
    repeated = eager_choice(q, k, v, is_causal, scale)
    return repeated in _FUSED and eager_choice(q, grouped_k, grouped_v, is_causal, scale, True) == repeated


def _arguments(bsym: BoundSymbol) -> dict[str, Any] | None:
    if len(bsym.args) > len(_SDPA_PARAMETERS) or set(bsym.kwargs) - set(_SDPA_PARAMETERS):
        return None
    return {**_SDPA_DEFAULTS, **dict(zip(_SDPA_PARAMETERS, bsym.args)), **bsym.kwargs}


def _repeated_heads(value: Any, producer: dict[str, BoundSymbol]) -> tuple[TensorProxy, int] | str | None:
    """(the tensor whose heads `value` repeats, the repeats) when `value = x.repeat_interleave(r, dim=1)`; None
    when `value` is no repeat_interleave at all; why not, for another repeat_interleave."""
    bsym = producer.get(value.pname) if type(value) is TensorProxy else None
    if bsym is None or bsym.sym is not REPEAT_INTERLEAVE:
        return None
    names = ("input", "repeats", "dim", "output_size")
    a = {**dict(zip(names, bsym.args)), **bsym.kwargs}
    x, repeats, dim = a.get("input", a.get("self")), a.get("repeats"), a.get("dim")
    if type(x) is not TensorProxy or x.dim() != 4 or type(repeats) is not int or dim not in (1, -3):
        return f"{value.pname} repeats something other than the heads (dim 1) of a 4-D tensor a whole number of times"
    return x, repeats


def _grouped(bsym: BoundSymbol, producer: dict[str, BoundSymbol],
             kernel_of: KernelCheck) -> BoundSymbol | str | None:
    """The grouped call replacing `bsym`, why not (its key or value repeats heads), or None (they do not)."""
    a = _arguments(bsym)
    if a is None or a["enable_gqa"]:
        return None
    q = a["query"]
    key, value = _repeated_heads(a["key"], producer), _repeated_heads(a["value"], producer)
    if key is None and value is None:
        return None
    for found in (key, value):
        if found is None:
            return "only one of its key and value repeats heads"
        if isinstance(found, str):
            return found
    if a["attn_mask"] is not None or a["dropout_p"] != 0.0:
        return "it has an attention mask or dropout"
    (k, repeats), (v, v_repeats) = key, value
    if type(q) is not TensorProxy or q.dim() != 4 or repeats != v_repeats or k.shape[1] != v.shape[1] \
            or k.shape[1] * repeats != q.shape[1]:
        return "its key and value heads are not repeated once per query head"
    if not kernel_of(q, a["key"], a["value"], k, v, bool(a["is_causal"]), a["scale"]):
        return "torch would not run the grouped call with the kernel of the repeated one"
    kwargs = {name: a[name] for name in _SDPA_PARAMETERS[3:] if a[name] != _SDPA_DEFAULTS[name]}
    return BoundSymbol(SDPA, (q, k, v), {**kwargs, "enable_gqa": True}, bsym.output, [], bsym.source,
                       bsym.checkpoint_region)


def group_query_attention(trace: Trace, kernel_of: KernelCheck = same_fused_kernel, prune: bool = True) -> Trace:
    """`trace` with each attention over repeated key/value heads calling the kernel with the shared heads; the trace
    itself when it has no attention. `prune=False` leaves the repeats for a later dead-code elimination (as
    fused_loss.fuse_linear_cross_entropy's)."""
    producer = {name: b for b in trace.bound_symbols for name in b.output_names()}
    notes: list[str] = []
    replaced: dict[int, BoundSymbol] = {}
    for bsym in trace.bound_symbols:
        if bsym.sym is not SDPA:
            continue
        at = f" at {bsym.source.short()}" if bsym.source is not None else ""
        grouped = _grouped(bsym, producer, kernel_of)
        if grouped is None:
            continue
        if isinstance(grouped, str):
            note = f"declined{at}: {grouped}"
        else:
            replaced[id(bsym)] = grouped
            k, out = grouped.args[1], next(iter_proxies(bsym.output))
            note = f"grouped{at}: {out.pname} reads {k.pname}'s {k.shape[1]} heads for {grouped.args[0].shape[1]}"
        if note not in notes:
            notes.append(note)
    if not notes:
        return trace
    result = trace.from_trace("", bound_symbols=[replaced.get(id(b), b) for b in trace.bound_symbols])
    return (dce(result) if replaced and prune else result).from_trace(f"{PROVENANCE}: {'; '.join(notes)}")


class GroupQueryAttention(TracePass):
    """`group_query_attention` of the acquired program (stage ACQUIRED; JitOptions.grouped_query_attention)."""

    title = PROVENANCE

    def __init__(self, kernel_of: KernelCheck = same_fused_kernel, prune: bool = True) -> None:
        self.kernel_of = kernel_of
        self.prune = prune

    def run(self, trace: Trace) -> Trace:
        return group_query_attention(trace, self.kernel_of, self.prune)
