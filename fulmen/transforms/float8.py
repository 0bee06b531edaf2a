"""Float8 training as a pass: the linears and matmuls of the acquired program computed with `torch._scaled_mm`.

`JitOptions(float8=Float8Options(recipe="tensorwise"))` rewrites, before autodiff, each `F.linear(x, w, b)`,
`x @ w` / `torch.matmul` / `torch.mm` with a 2-D right operand and `torch.addmm(b, x, w)` whose dimensions suit
float8 into `float8.linear(x, w)` (fulmen.ops.float8) plus the bias in the program's dtype. Its grad rule casts
inputs and weights to float8_e4m3fn with dynamic scales (per tensor or per row, by the recipe) and the output
gradient to float8_e5m2 (tensorwise; e4m3 for the rowwise recipes, as torchao's) in the backward; outputs and
gradients keep the original dtypes. Parameters, optimizer state and every other op are left as they are.

A matmul stays in high precision, with the reason in the provenance of this pass's trace (`fulmen.last_traces`,
`fulmen.examine`), when:

* its weight is named by `Float8Options.skip` (a parameter's or module's qualified name, or a prefix of it such as
  `"transformer.h.0"`; or a predicate of the parameter's name),
* it is the model's head (its weight is an `lm_head`'s, or its output feeds a cross-entropy) and
  `Float8Options.lm_head` is False; a head fused with its loss (JitOptions.fuse_linear_cross_entropy) is no longer
  a matmul here and stays in high precision either way,
* torch._scaled_mm cannot take it: the contracted and output dimensions (K, N) must be multiples of 16, and so must
  the rows M where the weight's gradient is a float8 matmul (M is its contracted dimension); operands of one
  floating dtype among bfloat16, float16 and float32 on a CPU or CUDA device; a 2-D weight,
* it is a batched matmul (both operands batched) or has a vector operand.

Under autocast, a float32 weight that the program converts only for the matmuls being converted is cast to float8
from float32 directly (as torchao casts it), and its gradient's matmul writes float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import fulmen.torch as ft
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, iter_proxies
from fulmen.core.trace import Trace, TraceBuilder
from fulmen.ops import float8, fused_loss
from fulmen.ops.registry import SYMBOLS
from fulmen.transforms.common import dce
from fulmen.transforms.transform import TracePass, input_names

PROVENANCE = "Float8 matmuls"

LINEAR = SYMBOLS["torch.nn.functional.linear"]
MATMUL = SYMBOLS["torch.matmul"]
ADDMM = SYMBOLS["torch.addmm"]
CROSS_ENTROPY = SYMBOLS["torch.nn.functional.cross_entropy"]
TO = SYMBOLS["torch.Tensor.to"]
# What a head's logits may pass through on their way to the loss (a reshape to rows, an upcast).
_TO_LOSS = frozenset(
    SYMBOLS[name]
    for name in (
        "torch.reshape",
        "torch.Tensor.reshape",
        "torch.Tensor.view",
        "torch.flatten",
        "torch.Tensor.flatten",
        "torch.Tensor.contiguous",
        "torch.Tensor.to",
    )
)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MULTIPLE = 16  # torch._scaled_mm's CUDA kernels take dimensions that are multiples of 16
HEAD_NAMES = ("lm_head",)  # the module name of a language model's head (LitGPT, Hugging Face)

Skip = Sequence[str] | Callable[[str], bool]


@dataclass(frozen=True, slots=True)
class _Matmul:
    """One matmul of the trace as `x @ weight.T (+ bias)`: `weight` is (N, K), given transposed when `transposed`
    (the right operand of a matmul, (K, N))."""

    bsym: BoundSymbol
    x: TensorProxy
    weight: TensorProxy
    transposed: bool
    bias: TensorProxy | None

    @property
    def sizes(self) -> tuple[int, int, int]:
        k = self.x.shape[-1]
        n = self.weight.shape[1] if self.transposed else self.weight.shape[0]
        return self.x.numel() // k if k else 0, k, n


def _arg(bsym: BoundSymbol, position: int, name: str, default: Any = None) -> Any:
    return bsym.args[position] if len(bsym.args) > position else bsym.kwargs.get(name, default)


def _as_matmul(bsym: BoundSymbol) -> _Matmul | str | None:
    """`bsym` as a matmul with a weight, why it cannot be one, or None for a call that is no matmul."""
    if bsym.sym is LINEAR:
        x, weight, bias, transposed = bsym.args[0], _arg(bsym, 1, "weight"), _arg(bsym, 2, "bias"), False
    elif bsym.sym is MATMUL:
        x, weight, bias, transposed = bsym.args[0], _arg(bsym, 1, "other"), None, True
    elif bsym.sym is ADDMM:
        if _arg(bsym, 3, "beta", 1) != 1 or _arg(bsym, 4, "alpha", 1) != 1:
            return "an addmm that scales its terms (beta, alpha)"
        bias, x, weight, transposed = bsym.args[0], _arg(bsym, 1, "mat1"), _arg(bsym, 2, "mat2"), True
    else:
        return None
    if any(type(t) is not TensorProxy for t in (x, weight)) or (bias is not None and type(bias) is not TensorProxy):
        return "an operand is not a tensor"
    if x.dim() < 2 or weight.dim() < 2:
        return "a vector operand"
    if weight.dim() > 2:
        return "a batched matmul (torch._scaled_mm multiplies matrices)"
    return _Matmul(bsym, x, weight, transposed, bias)


def _names(weight: TensorProxy) -> tuple[str, ...]:
    return input_names(weight) or (weight.pname,)


def _skipped(names: tuple[str, ...], skip: Skip) -> bool:
    if callable(skip):
        return any(skip(name) for name in names)
    return any(name == given or name.startswith(given + ".") for name in names for given in skip)


def _feeds_loss(value: TensorProxy, readers: dict[str, list[BoundSymbol]]) -> bool:
    """Whether `value` reaches a cross-entropy through reshapes and conversions alone."""
    for reader in readers.get(value.pname, ()):
        if reader.sym is CROSS_ENTROPY and reader.args and reader.args[0] is value:
            return True
        if reader.sym in _TO_LOSS and any(_feeds_loss(out, readers) for out in reader.proxy_outputs()):
            return True
    return False


def _is_head(matmul: _Matmul, names: tuple[str, ...], readers: dict[str, list[BoundSymbol]]) -> str | None:
    for name in names:
        module = name.rsplit(".", 1)[0] if "." in name else ""
        if module.rsplit(".", 1)[-1] in HEAD_NAMES:
            return f"the model's head ({module})"
    if any(_feeds_loss(out, readers) for out in matmul.bsym.proxy_outputs()):
        return "the model's head (its output feeds the cross-entropy)"
    return None


def _unsuited(matmul: _Matmul, recipe: float8.Recipe) -> str | None:
    """Why torch._scaled_mm cannot compute `matmul`, if it cannot."""
    x, weight = matmul.x, matmul.weight
    if x.dtype != weight.dtype or x.dtype not in DTYPES:
        return f"its operands are {x.dtype} and {weight.dtype}; float8 takes one of bfloat16, float16, float32"
    if matmul.bias is not None and matmul.bias.dtype != x.dtype:
        return f"its bias is {matmul.bias.dtype}, its operands {x.dtype}"
    if any(t.device.type not in ("cpu", "cuda") for t in (x, weight)):
        return f"it runs on {x.device}"
    m, k, n = matmul.sizes
    if m == 0:
        return "it is empty"
    odd = [f"{label}={size}" for label, size in (("K", k), ("N", n)) if size % MULTIPLE]
    if recipe.grad_weight_in_float8 and weight.requires_grad and m % MULTIPLE:
        odd.append(f"M={m} (the weight gradient's contracted dimension)")
    if odd:
        return f"{', '.join(odd)} not a multiple of {MULTIPLE} (torch._scaled_mm's kernels)"
    return None


def _describe(matmul: _Matmul) -> str:
    m, k, n = matmul.sizes
    name = _names(matmul.weight)[0]
    at = f" at {matmul.bsym.source.short()}" if matmul.bsym.source is not None else ""
    return f"{name}{at} ({m}x{k} @ {k}x{n})"


def _upcast_sources(
    trace: Trace, converted: list[_Matmul], readers: dict[str, list[BoundSymbol]]
) -> dict[str, TensorProxy]:
    """Weights the program converts from float32 (autocast's `w.to(bfloat16)`) only for matmuls being converted: the
    float32 tensor, by the converted weight's name, cast to float8 from float32 directly."""
    producer = {name: b for b in trace.bound_symbols for name in b.output_names()}
    outputs = {p.pname for p in iter_proxies(trace.output)}
    converted_ids = {id(m.bsym) for m in converted}
    sources = {}
    for matmul in converted:
        weight = matmul.weight
        conversion = producer.get(weight.pname)
        if conversion is None or conversion.sym is not TO or weight.pname in outputs:
            continue
        source = conversion.args[0]
        if (
            type(source) is not TensorProxy
            or source.dtype != torch.float32
            or source.device != weight.device
            or tuple(source.shape) != tuple(weight.shape)
        ):
            continue
        if all(id(reader) in converted_ids for reader in readers.get(weight.pname, ())):
            sources[weight.pname] = source
    return sources


class _Rewrite:
    """The calls replacing converted matmuls, with one float8 cast per tensor and scaling (`float8.Casts`): made
    where the first matmul reading the tensor was, shared by those after it. The matmuls that read one input (a
    SwiGLU's two) have their weights cast together with it, before the first of them: a weight's cast alone between
    two matmuls would be a fusion region of one call, its ops run one kernel each."""

    def __init__(self, trace: Trace, recipe: str, all_gather: bool) -> None:
        self.namespace = trace.namespace
        self.recipe = recipe
        self.casts = float8.Casts(float8.RECIPES[recipe].power_of_2, all_gather)
        self.transposed: dict[str, TensorProxy] = {}

    def weight_rows(self, matmul: _Matmul, weight: TensorProxy) -> TensorProxy:
        """The weight as (N, K): a matmul's right operand transposed (one view, shared)."""
        if not matmul.transposed:
            return weight
        if weight.pname not in self.transposed:
            self.transposed[weight.pname] = ft.t(weight)
        return self.transposed[weight.pname]

    def __call__(
        self, matmul: _Matmul, weight: TensorProxy, siblings: Sequence[tuple[_Matmul, TensorProxy]] = ()
    ) -> list[BoundSymbol]:
        bsym = matmul.bsym
        out = bsym.proxy_outputs()[0]
        with TraceBuilder(self.namespace) as builder, torch.set_grad_enabled(out.requires_grad):
            builder.source = bsym.source
            builder.checkpoint_region = bsym.checkpoint_region
            for sibling, its_weight in siblings:  # their casts made now; their calls find them made
                self.casts.for_linear(sibling.x, self.weight_rows(sibling, its_weight), float8.RECIPES[self.recipe])
            rows = self.weight_rows(matmul, weight)
            args, kwargs = self.casts.for_linear(matmul.x, rows, float8.RECIPES[self.recipe])
            y = float8.LINEAR(matmul.x, rows, *args, recipe=self.recipe, **kwargs)
            if matmul.bias is not None:
                y = ft.add(y, matmul.bias)
        builder.adopt_results(builder.bound_symbols, [y], [out], bsym.source)
        return builder.bound_symbols


def float8_matmuls(
    trace: Trace, recipe: str = "tensorwise", skip: Skip = (), lm_head: bool = False, all_gather: bool = False
) -> Trace:
    """`trace` with each matmul that suits float8 computed by `float8.linear` (see the module docstring); the trace
    itself when it has no matmul. `all_gather`: the weights' casts say that fulmen's FSDP gathers them cast
    (fulmen.distributed.float8)."""
    r = float8.RECIPES[recipe]
    readers: dict[str, list[BoundSymbol]] = {}
    for bsym in trace.bound_symbols:
        for name in bsym.arg_names():
            readers.setdefault(name, []).append(bsym)
    converted: list[_Matmul] = []
    notes: list[str] = []
    for bsym in trace.bound_symbols:
        if bsym.sym is fused_loss.LINEAR_CROSS_ENTROPY:
            at = f" at {bsym.source.short()}" if bsym.source is not None else ""
            notes.append(
                f"kept {_names(bsym.args[1])[0]}{at}: the model's head, fused with its loss (the fused "
                "linear + cross-entropy computes it chunk by chunk in high precision)"
            )
            continue
        found = _as_matmul(bsym)
        if found is None:
            continue
        if isinstance(found, str):
            at = f" at {bsym.source.short()}" if bsym.source is not None else ""
            notes.append(f"kept {bsym.sym.printed}{at}: {found}")
            continue
        names = _names(found.weight)
        reason = (
            "skipped by Float8Options.skip"
            if _skipped(names, skip)
            else None
            if lm_head
            else _is_head(found, names, readers)
        )
        if reason is not None and "head" in reason:
            reason += ", which Float8Options(lm_head=True) converts"
        reason = reason or _unsuited(found, r)
        if reason is not None:
            notes.append(f"kept {_describe(found)}: {reason}")
            continue
        converted.append(found)
        notes.append(f"converted {_describe(found)}")
    if not notes:
        return trace
    if not converted:
        return trace.from_trace(f"{PROVENANCE} ({recipe}): {'; '.join(notes)}")
    sources = _upcast_sources(trace, converted, readers)
    weights = {id(m.bsym): sources.get(m.weight.pname, m.weight) for m in converted}
    position = {id(b): i for i, b in enumerate(trace.bound_symbols)}
    made_at = {p.pname: -1 for p in trace.inputs} | {
        n: i for i, b in enumerate(trace.bound_symbols) for n in b.output_names()
    }
    rewrite = _Rewrite(trace, recipe, all_gather)
    replaced = {}
    for m in converted:
        here = position[id(m.bsym)]
        siblings = [
            (s, weights[id(s.bsym)])
            for s in converted
            if s.x.pname == m.x.pname
            and position[id(s.bsym)] > here
            and made_at.get(weights[id(s.bsym)].pname, here) < here
        ]
        replaced[id(m.bsym)] = rewrite(m, weights[id(m.bsym)], siblings)
    bsyms = [new for b in trace.bound_symbols for new in replaced.get(id(b), [b])]
    result = dce(trace.from_trace("", bound_symbols=bsyms))
    return result.from_trace(f"{PROVENANCE} ({recipe}): {'; '.join(notes)}")


def notes_of(traces: Sequence[Trace]) -> list[str]:
    """What this pass did to each matmul (`converted ...`, `kept ...: why`), read off the provenance of its trace
    among `traces`; empty where it did not run or found no matmul."""
    for trace in traces:
        if trace.provenance.startswith(PROVENANCE):
            return trace.provenance.split(": ", 1)[1].split("; ")
    return []


class Float8Matmuls(TracePass):
    """`float8_matmuls` of the acquired program (stage ACQUIRED; JitOptions.float8), after the fused loss took the
    head it fuses."""

    title = PROVENANCE

    def __init__(
        self, recipe: str = "tensorwise", skip: Skip = (), lm_head: bool = False, all_gather: bool = False
    ) -> None:
        self.recipe, self.skip, self.lm_head, self.all_gather = recipe, skip, lm_head, all_gather

    def run(self, trace: Trace) -> Trace:
        return float8_matmuls(trace, self.recipe, self.skip, self.lm_head, self.all_gather)
