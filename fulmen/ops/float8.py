"""Float8 matmuls with dynamic scaling: the casts, `torch._scaled_mm`, and a linear made of them with its grad rule.

fulmen.transforms.float8 replaces the linears and matmuls of a program by `float8.linear` (`x @ weight.T`, no
bias); traces print these symbols as `float8.NAME(...)`:

* `float8.cast(x, dtype, dim, power_of_2)` -> `(x8, inverse_scale)`: the scale `finfo(dtype).max / amax(|x|)` (one
  per tensor, or one per row along `dim`, computed in float64 and stored in float32, rounded down to a power of two
  when asked), `x8 = clamp(x.float() * scale, -max, max).to(dtype)` and the scale's reciprocal, which is what
  `torch._scaled_mm` multiplies by. Made of elementwise ops and one reduction (its decomposition), so fusion
  executors merge it into the regions around it. `float8.cast_weight` is the same cast of a weight, made once per
  step (the backward reads its saved copy), where an activation's may be made again in the backward.
* `float8.scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum)`: `torch._scaled_mm`, a row-major `a` and a
  column-major `b` (the layouts its CUDA kernels take; the grad rule makes them), with the scales' shapes saying
  per-tensor `()` or per row of `a` `(M, 1)` / per column of `b` `(1, N)`.
* `float8.linear(x, weight, x8, x_scale, w8, w_scale, recipe)`: `x @ weight.T` from the casts of its operands, in
  `x`'s dtype. The casts are made before it (`Casts`), once per tensor and scaling however many matmuls read it;
  its grad rule writes the backward's two matmuls (grad_input, grad_weight) as its recipe (`RECIPES`) says.

The recipes are torchao's (`torchao.float8.Float8LinearRecipeName`), with the same scaling rules:

| recipe | output = x @ w.T | grad_input = g @ w | grad_weight = g.T @ x |
|---|---|---|---|
| tensorwise | x, w: e4m3, per tensor | g: e5m2, w: e4m3, per tensor | g: e5m2, x: e4m3, per tensor |
| rowwise | x, w: e4m3, per row (along K) | g, w: e4m3, per row (along N) | g, x: e4m3, per row (along M) |
| rowwise_with_gw_hp | x, w: e4m3, per row (along K) | g: e4m3 per row, w: e4m3 per tensor | high precision |

"Per row" scales each operand along the dimension the matmul contracts. The rowwise recipes round scales down to
powers of two. The output matmul accumulates fast (`use_fast_accum`); the backward's do not, and a rowwise one
among those runs with unit scales and multiplies the output by the outer product of its scales afterwards (torchao's
choice: the rowwise kernel without fast accumulation is slow). Rowwise matmuls write bfloat16, converted to the
output dtype where that differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import fulmen.torch as ft
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import Symbol, Tag
from fulmen.core.trace import TraceBuilder
from fulmen.ops.registry import add_symbol
from fulmen.ops.rules.grad import get_grad, put_grad, wants_grad
from fulmen.ops.rules.tables import RuleKind, register

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12  # the smallest amax a scale is computed from (an all-zero tensor gets a finite scale)


@dataclass(frozen=True, slots=True)
class Cast:
    """How one operand of one matmul is cast: to `dtype` (None: it stays in high precision), per row or per tensor."""

    dtype: torch.dtype | None
    rowwise: bool = False


HIGH = Cast(None)


@dataclass(frozen=True, slots=True)
class Recipe:
    """The casts of the three matmuls of a linear and whether each accumulates fast (output, grad_input,
    grad_weight)."""

    name: str
    input: Cast
    weight: Cast
    grad_output: Cast
    weight_for_grad_input: Cast
    grad_output_for_grad_weight: Cast
    input_for_grad_weight: Cast
    power_of_2: bool
    fast_accum: tuple[bool, bool, bool] = (True, False, False)

    @property
    def grad_weight_in_float8(self) -> bool:
        return self.input_for_grad_weight.dtype is not None


_TENSOR, _ROW = Cast(E4M3), Cast(E4M3, rowwise=True)
RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("tensorwise", _TENSOR, _TENSOR, Cast(E5M2), _TENSOR, Cast(E5M2), _TENSOR, power_of_2=False),
        Recipe("rowwise", _ROW, _ROW, _ROW, _ROW, _ROW, _ROW, power_of_2=True),
        Recipe("rowwise_with_gw_hp", _ROW, _ROW, _ROW, _TENSOR, HIGH, HIGH, power_of_2=True),
    )
}


# --- the casts ------------------------------------------------------------------------------------------------------
def _amax(x: Any, dim: tuple[int, ...] | None) -> Any:
    magnitude = ft.abs(x)
    return ft.amax(magnitude, tuple(range(x.dim()))) if dim is None else ft.amax(magnitude, dim, keepdim=True)


def _cast(x: Any, amax: Any, dtype: torch.dtype, power_of_2: bool) -> tuple[Any, Any]:
    # torchao's arithmetic, step for step: the scale in float64 (max / amax is `reciprocal(amax) * max`, as Python's
    # `max / tensor` computes it), stored in float32; the product in float32, saturated, then rounded to float8
    largest = torch.finfo(dtype).max
    scale = ft.to(ft.mul(ft.reciprocal(ft.clamp(ft.to(amax, torch.float64), min=EPS)), largest), torch.float32)
    if power_of_2:
        scale = ft.exp2(ft.floor(ft.log2(scale)))
    scaled = ft.clamp(ft.mul(ft.to(x, torch.float32), scale), min=-largest, max=largest)
    return ft.to(scaled, dtype), ft.reciprocal(scale)


def cast(
    x: torch.Tensor, dtype: torch.dtype, dim: tuple[int, ...] | None = None, power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` in float8 `dtype`, scaled by its amax over `dim` (kept as size-1 dims; None: the whole tensor, one
    scale), and the inverse scale (float32) that multiplies it back."""
    return _cast(x, _amax(x, dim), dtype, power_of_2)


def cast_weight(
    x: torch.Tensor,
    dtype: torch.dtype,
    dim: tuple[int, ...] | None = None,
    power_of_2: bool = False,
    all_gather: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cast` of a weight: made once per step, its float8 copy kept for the backward. `all_gather`: where the
    weight is a parameter fulmen's FSDP shards, it gathers it cast (fulmen.distributed.float8); the same values."""
    return _cast(x, _amax(x, dim), dtype, power_of_2)


def cast_by_amax(
    x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cast` with the amax given: a shard of a weight scaled by the amax over every rank's shard
    (fulmen.distributed.float8), which casts it as the whole weight would be."""
    return _cast(x, amax, dtype, power_of_2)


def _cast_meta(
    builder: TraceBuilder,
    x: TensorProxy,
    dtype: torch.dtype,
    dim: tuple[int, ...] | None = None,
    power_of_2: bool = False,
    all_gather: bool = False,
) -> tuple[TensorProxy, TensorProxy]:
    scale_shape = () if dim is None else tuple(1 if d in dim else n for d, n in enumerate(x.shape))
    bits = builder.make_proxy(torch.empty_strided(x.shape, x.stride(), dtype=dtype, device="meta"), x.device)
    inverse = builder.make_proxy(torch.empty(scale_shape, dtype=torch.float32, device="meta"), x.device)
    return bits, inverse


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """`(a * scale_a) @ (b * scale_b)` in `out_dtype`: torch._scaled_mm."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum)


def _scaled_mm_meta(
    builder: TraceBuilder,
    a: TensorProxy,
    b: TensorProxy,
    scale_a: TensorProxy,
    scale_b: TensorProxy,
    *,
    out_dtype: torch.dtype,
    use_fast_accum: bool = False,
) -> TensorProxy:
    return builder.make_proxy(torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device="meta"), a.device)


def _symbol(fn: Any, meta: Any, decomposition: Any = None, tags: Tag = Tag.NONE) -> Symbol:
    return add_symbol(
        Symbol(
            name=fn.__name__,
            printed=f"float8.{fn.__name__}",
            impl=fn,
            meta=meta,
            decomposition=decomposition,
            tags=tags,
        )
    )


# An activation's (or a gradient's) cast is RECOMPUTABLE: the backward casts again where the activation is at hand
# anyway (a norm's output, recomputed from what the norm's backward reads) and keeps the float8 copy, 1 byte per
# element instead of 2, where it is not. A weight's cast is not (a reduction, never rerun): it is made once per step
# and its copy kept for the backward.
CAST = _symbol(cast, _cast_meta, decomposition=cast, tags=Tag.NO_GRAD | Tag.RECOMPUTABLE)
CAST_WEIGHT = _symbol(cast_weight, _cast_meta, decomposition=cast_weight, tags=Tag.NO_GRAD)
CAST_BY_AMAX = _symbol(
    cast_by_amax,
    lambda builder, x, amax, dtype, power_of_2=False: _cast_meta(builder, x, dtype),
    decomposition=cast_by_amax,
    tags=Tag.NO_GRAD,
)
# NO_GRAD: float8 bits and their products carry no grad; float8.linear's grad rule differentiates around them.
SCALED_MM = _symbol(scaled_mm, _scaled_mm_meta, tags=Tag.NO_GRAD)


# --- matmuls of casts -------------------------------------------------------------------------------------------------
def _row_major(t: Any) -> Any:
    return t if t.stride(1) == 1 and t.stride(0) >= t.shape[1] else ft.contiguous(t)


def _column_major(t: Any) -> Any:
    return t if t.stride(0) == 1 and t.stride(1) >= t.shape[0] else ft.t(ft.contiguous(ft.t(t)))


def _as_row_scales(scale: Any, rows: int) -> Any:
    """A scale of one operand as one per row of `a` (`(rows, 1)`), a per-tensor one repeated."""
    if scale.dim() == 0:
        return ft.contiguous(ft.expand(ft.reshape(scale, (1, 1)), (rows, 1)))
    return ft.reshape(scale, (rows, 1))


def _as_column_scales(scale: Any, columns: int) -> Any:
    if scale.dim() == 0:
        return ft.contiguous(ft.expand(ft.reshape(scale, (1, 1)), (1, columns)))
    return ft.reshape(scale, (1, columns))


def _matmul(a: Any, scale_a: Any, b: Any, scale_b: Any, out_dtype: torch.dtype, fast_accum: bool) -> Any:
    """`(a * scale_a) @ (b * scale_b)` of float8 `a` (M, K) and `b` (K, N) in `out_dtype`, each scale per tensor
    `()` or per row of `a` / column of `b` (any shape with M or N elements)."""
    a, b = _row_major(a), _column_major(b)
    if scale_a.dim() == 0 and scale_b.dim() == 0:
        return SCALED_MM(a, b, scale_a, scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum)
    # rowwise: both scales per row / column (one per tensor repeated); the rowwise kernel writes bfloat16
    scale_a, scale_b = _as_row_scales(scale_a, a.shape[0]), _as_column_scales(scale_b, b.shape[1])
    if fast_accum:
        out = SCALED_MM(a, b, scale_a, scale_b, out_dtype=torch.bfloat16, use_fast_accum=True)
    else:
        one = ft.ones((), dtype=torch.float32, device=a.device)
        out = SCALED_MM(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=False)
        out = ft.to(ft.mul(out, ft.mul(scale_a, scale_b)), torch.bfloat16)
    return out if out_dtype == torch.bfloat16 else ft.to(out, out_dtype)


def _same(forward: Cast, backward: Cast) -> bool:
    """Whether the backward's matmul takes the forward's cast of an operand: a rowwise one scales it along the other
    dimension there (the one that matmul contracts)."""
    return forward == backward and not forward.rowwise


class Casts:
    """Float8 casts made once each: the matmuls that take a tensor cast alike (two linears reading one input, as a
    SwiGLU's do, or one tied weight; the forward's and the backward's matmul of one operand under tensorwise
    scaling) share one cast, computed once and saved once."""

    def __init__(self, power_of_2: bool, all_gather: bool = False) -> None:
        self.power_of_2 = power_of_2
        self.all_gather = all_gather  # weights' tensorwise casts say so (Float8Options.all_gather)
        self.made: dict[tuple, tuple[Any, Any]] = {}

    def __call__(self, x: Any, how: Cast, per_row: bool, weight: bool = False) -> tuple[Any, Any]:
        """`x` (..., C) as a float8 matrix (rows, C) and its inverse scale: one per tensor, or for a rowwise `how` one
        per row (over the last dim: `per_row`) or one per column (over the leading dims), size-1 dims kept."""
        dims = None if not how.rowwise else (x.dim() - 1,) if per_row else tuple(range(x.dim() - 1))
        key = (x.pname if type(x) is TensorProxy else id(x), how.dtype, dims)
        if key not in self.made:
            if weight:
                gather = {"all_gather": True} if self.all_gather and dims is None else {}
                bits, scale = CAST_WEIGHT(x, how.dtype, dim=dims, power_of_2=self.power_of_2, **gather)
            else:
                bits, scale = CAST(x, how.dtype, dim=dims, power_of_2=self.power_of_2)
            columns = x.shape[-1]
            self.made[key] = (bits if bits.dim() == 2 else ft.reshape(bits, (bits.numel() // columns, columns)), scale)
        return self.made[key]

    def for_linear(self, x: Any, weight: Any, recipe: Recipe) -> tuple[tuple, dict[str, Any]]:
        """The arguments of `float8.linear(x, weight, ...)` after `x` and `weight`: the forward's casts, and those
        the backward's matmuls take where the recipe casts an operand otherwise for them (only for a gradient that
        will be computed: `requires_grad`)."""
        x8, sx = self(x, recipe.input, per_row=True)
        w8, sw = self(weight, recipe.weight, per_row=True, weight=True)
        extra = {}
        if x.requires_grad and not _same(recipe.weight, recipe.weight_for_grad_input):
            extra["weight_for_grad_input"] = self(weight, recipe.weight_for_grad_input, per_row=False, weight=True)
        if (
            weight.requires_grad
            and recipe.grad_weight_in_float8
            and not _same(recipe.input, recipe.input_for_grad_weight)
        ):
            extra["input_for_grad_weight"] = self(x, recipe.input_for_grad_weight, per_row=False)
        return (x8, sx, w8, sw), extra


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    x8: torch.Tensor,
    x_scale: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    recipe: str,
    weight_for_grad_input: tuple | None = None,
    input_for_grad_weight: tuple | None = None,
) -> torch.Tensor:
    """`x @ weight.T` (x: (..., K), weight: (N, K)) in x's dtype, from the float8 casts `recipe` makes of them
    (`Casts.for_linear`): `x8` (M, K) and `w8` (N, K) with their inverse scales. `weight_for_grad_input` and
    `input_for_grad_weight` are (bits, scale) where the backward's matmuls take an operand cast otherwise (None: the
    forward's cast, or the recipe keeps it in high precision)."""
    out = _matmul(x8, x_scale, ft.t(w8), w_scale, x.dtype, RECIPES[recipe].fast_accum[0])
    return ft.reshape(out, (*x.shape[:-1], weight.shape[0]))


def _linear_meta(
    builder: TraceBuilder, x: TensorProxy, weight: TensorProxy, *args: Any, recipe: str, **casts: Any
) -> TensorProxy:
    requires_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    meta = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device="meta")
    return builder.make_proxy(meta, x.device, requires_grad)


# REGION: executors run it as its parts (the matmul and its scales; without a grad it is what runs).
LINEAR = _symbol(linear, _linear_meta, decomposition=linear, tags=Tag.REGION)


@register(RuleKind.GRAD, LINEAR)
def linear_grad(x, weight, x8, x_scale, w8, w_scale, *, recipe, weight_for_grad_input=None, input_for_grad_weight=None):
    r = RECIPES[recipe]
    y = linear(x, weight, x8, x_scale, w8, w_scale, recipe=recipe)
    g = get_grad(y)
    casts = Casts(r.power_of_2)  # of the output's gradient: the one the backward computes
    # every cast and layout copy first, then the matmuls: consecutive, they make one fusion region
    wants_input, wants_weight = wants_grad(x), wants_grad(weight)
    if wants_input:
        g8, sg = casts(g, r.grad_output, per_row=True)
        wg8, swg = weight_for_grad_input or (w8, w_scale)
        g8, wg8 = _row_major(g8), _column_major(wg8)
    if wants_weight and r.grad_weight_in_float8:
        gt8, sgt = casts(g, r.grad_output_for_grad_weight, per_row=False)
        xg8, sxg = input_for_grad_weight or (x8, x_scale)
        gt8, xg8 = _row_major(ft.t(gt8)), _column_major(xg8)
    if wants_input:
        put_grad(x, ft.reshape(_matmul(g8, sg, wg8, swg, x.dtype, r.fast_accum[1]), tuple(x.shape)))
    if wants_weight:
        if r.grad_weight_in_float8:
            grad = _matmul(gt8, sgt, xg8, sxg, weight.dtype, r.fast_accum[2])
        else:
            rows = x.numel() // x.shape[-1]
            grad = ft.matmul(ft.t(ft.reshape(g, (rows, g.shape[-1]))), ft.reshape(x, (rows, x.shape[-1])))
            grad = grad if grad.dtype == weight.dtype else ft.to(grad, weight.dtype)
        put_grad(weight, grad)
    return y
