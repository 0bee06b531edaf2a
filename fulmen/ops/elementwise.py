"""Elementwise torch-level symbols: unary and binary families, where, clamp, masked_fill."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fulmen.core.symbol import Symbol, Tag
from fulmen.core.trace import infer_device
from fulmen.ops import prims
from fulmen.ops.registry import lookup, method, methods, torch_symbol
from fulmen.ops.rules.batch import elementwise
from fulmen.ops.rules.grad import (
    differentiated_by_eager,
    eager_grad_rule,
    get_grad,
    not_differentiable,
    put_grad,
    wants_grad,
)
from fulmen.ops.rules.grad_formulas import sum_to, zeros_shaped
from fulmen.ops.rules.jvp import Dot, add_tangents, as_tangent, by_derivative, constant, tangent_or_zero
from fulmen.ops.rules.tables import RuleKind, register
from fulmen.ops.utils import broadcast_shape, convert, expand_to, is_real_number, is_tensor, result_dtype, to_float

# --- unary ---------------------------------------------------------------------------------------------------------
# name -> promotion kind: INT_TO_FLOAT ops give floats for integer inputs, DEFAULT ones keep the dtype,
# ALWAYS_BOOL ones give bool.
UNARY_KINDS: dict[str, str] = {
    **dict.fromkeys("abs neg sign floor ceil round trunc bitwise_not frac".split(), "DEFAULT"),
    **dict.fromkeys(
        "exp exp2 expm1 log log1p log2 log10 sqrt rsqrt sin cos tan asin acos atan sinh cosh tanh asinh acosh "
        "atanh erf erfc erfinv sigmoid reciprocal lgamma digamma".split(),
        "INT_TO_FLOAT",
    ),
    **dict.fromkeys("logical_not isfinite isnan isinf signbit".split(), "ALWAYS_BOOL"),
}
# Extra torch callables that are the same op.
UNARY_ALIASES: dict[str, tuple[Callable[..., Any], ...]] = {
    "neg": (torch.negative, torch.Tensor.__neg__, torch.Tensor.negative),
    "abs": (torch.absolute, torch.Tensor.__abs__, torch.Tensor.absolute),
    "bitwise_not": (torch.Tensor.__invert__,),
    "sigmoid": (F.sigmoid, torch.special.expit),
    "tanh": (F.tanh,),
    "erf": (torch.special.erf,),
    "erfc": (torch.special.erfc,),
    "erfinv": (torch.special.erfinv,),
    "exp2": (torch.special.exp2,),
    "expm1": (torch.special.expm1,),
    "log1p": (torch.special.log1p,),
    "asin": (torch.arcsin,),
    "acos": (torch.arccos,),
    "atan": (torch.arctan,),
    "asinh": (torch.arcsinh,),
    "acosh": (torch.arccosh,),
    "atanh": (torch.arctanh,),
    "trunc": (torch.fix,),
}


def _unary_decomposition(prim: Symbol, kind: str) -> Callable[..., Any]:
    def decomposition(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:  # e.g. round(x, decimals=3): left to torch
            return NotImplemented
        if kind == "INT_TO_FLOAT":
            x = convert(x, to_float(x.dtype))
        if prim is prims.bitwise_not and x.dtype == torch.bool:
            return prims.logical_not(x)
        if prim is prims.bitwise_not and (x.dtype.is_floating_point or x.dtype.is_complex):
            # torch's meta kernel accepts it; a fusion compiler could compile it to bits eager never computes
            raise TypeError(f"bitwise_not (~) is only implemented on integer and bool tensors, got {x.dtype} (as "
                            "in eager)")
        return prim(x)

    return decomposition


def _unary(name: str, kind: str) -> Symbol:
    return torch_symbol(
        getattr(torch, name),
        decomposition=_unary_decomposition(getattr(prims, name), kind),
        aliases=methods(name) + UNARY_ALIASES.get(name, ()),
        inplace=methods(f"{name}_"),
    )


for _name, _kind in UNARY_KINDS.items():
    _unary(_name, _kind)
# round(x, decimals=...) has no prim decomposition; its value is piecewise constant
register(RuleKind.JVP, torch.round, constant(lookup(torch.round).symbol))


def relu_decomposition(x: torch.Tensor, inplace: bool = False) -> Any:
    return prims.where(prims.le(x, convert(0, x.dtype)), convert(0, x.dtype), x)


torch_symbol(torch.relu, decomposition=relu_decomposition, aliases=(method("relu"),), inplace=(method("relu_"),))
torch_symbol(F.relu, decomposition=relu_decomposition)

# --- binary --------------------------------------------------------------------------------------------------------


def _binary_operands(a: Any, b: Any, kind: str) -> tuple[Any, Any, torch.dtype]:
    dtype = result_dtype(a, b, kind=kind)
    compute = result_dtype(a, b) if kind == "ALWAYS_BOOL" else dtype
    shape = broadcast_shape(a, b)
    device = infer_device((a, b), {})  # a 0-dim CPU tensor meets a CUDA one as a scalar: move it over
    a, b = (prims.device_put(x, device) if is_tensor(x) and x.device != device else x for x in (a, b))
    return expand_to(convert(a, compute), shape), expand_to(convert(b, compute), shape), dtype


def _reads_scalar_unrounded(a: Any, b: Any) -> bool:
    """Whether eager's kernel reads a one-element operand of another dtype unrounded: for a float16 or bfloat16
    result, mul and div (on CUDA also add and sub) take such an operand's own value at float32 (a half tensor times a
    float32 0-dim tensor multiplies by the float32 value), where the prims, whose operands have the result's dtype,
    would round it to half first. Those calls run eager's kernel."""
    dtype = result_dtype(a, b)
    return dtype in (torch.float16, torch.bfloat16) and any(
        is_tensor(x) and x.numel() == 1 and x.dtype != dtype for x in (a, b))


def _binary_decomposition(prim: Symbol, kind: str) -> Callable[..., Any]:
    # parameters named as torch's, which programs may pass by keyword (torch.mul(x, other=y))
    def decomposition(input: Any, other: Any) -> Any:  # noqa: A002
        if prim is prims.mul and _reads_scalar_unrounded(input, other):
            return NotImplemented
        a, b, _ = _binary_operands(input, other, kind)
        return prim(a, b)

    return decomposition


def _wrapped(value: int, dtype: torch.dtype) -> int | bool:
    """A Python integer as `dtype` holds it: two's complement wrapping, as eager's integer kernels wrap."""
    if dtype == torch.bool:
        return bool(value)
    info = torch.iinfo(dtype)
    return (value - info.min) % (info.max - info.min + 1) + info.min


def _scaled(b: Any, alpha: Any, dtype: torch.dtype) -> Any:
    """`alpha * b` for an integer or bool result, `b` already promoted: eager computes it in the result dtype, where
    integers wrap (uint8 254 * 3 is 250, not 762)."""
    if is_tensor(b):
        return prims.mul(b, _wrapped(int(alpha), dtype))
    return _wrapped(b * alpha, dtype)


def _alpha_operands(a: Any, b: Any, alpha: Any) -> tuple[Any, Any] | None:
    """The operands of `a + alpha * b` (or `a - alpha * b`), promoted as eager promotes them, without alpha; None where
    the prims cannot round as eager's kernel does: for floating results it computes a + alpha * b with one rounding
    (a fused multiply-add where vectorized, in float32 for half precision), which a product and a sum, each rounded
    to the dtype, are not. The executors then run eager's kernel."""
    if _reads_scalar_unrounded(a, b):
        return None
    a, b, dtype = _binary_operands(a, b, "DEFAULT")
    if alpha is None or (alpha == 1 and not isinstance(alpha, complex)):
        return a, b
    if dtype.is_floating_point or dtype.is_complex:
        return None
    return a, _scaled(b, alpha, dtype)


def _with_alpha(prim: Symbol) -> Callable[..., Any]:
    def decomposition(input: Any, other: Any, *, alpha: Any = None) -> Any:  # noqa: A002
        operands = _alpha_operands(input, other, alpha)
        return NotImplemented if operands is None else prim(*operands)

    return decomposition


# name -> (promotion kind, operator dunders that alias it, reflected dunders of a commutative op)
BINARY: dict[str, tuple[str, tuple[str, ...]]] = {
    "mul": ("DEFAULT", ("__mul__", "__rmul__", "multiply")),
    "maximum": ("DEFAULT", ()),
    "minimum": ("DEFAULT", ()),
    "remainder": ("DEFAULT", ("__mod__",)),
    "fmod": ("DEFAULT", ()),
    "atan2": ("INT_TO_FLOAT", ("arctan2",)),
    "copysign": ("INT_TO_FLOAT", ()),
    "hypot": ("DEFAULT", ()),
    "nextafter": ("DEFAULT", ()),
    "eq": ("ALWAYS_BOOL", ("__eq__",)),
    "ne": ("ALWAYS_BOOL", ("__ne__", "not_equal")),
    "lt": ("ALWAYS_BOOL", ("__lt__", "less")),
    "le": ("ALWAYS_BOOL", ("__le__", "less_equal")),
    "gt": ("ALWAYS_BOOL", ("__gt__", "greater")),
    "ge": ("ALWAYS_BOOL", ("__ge__", "greater_equal")),
    "bitwise_and": ("DEFAULT", ("__and__", "__rand__")),
    "bitwise_or": ("DEFAULT", ("__or__", "__ror__")),
    "bitwise_xor": ("DEFAULT", ("__xor__", "__rxor__")),
    "bitwise_left_shift": ("DEFAULT", ("__lshift__",)),
    "bitwise_right_shift": ("DEFAULT", ("__rshift__",)),
    "logical_and": ("ALWAYS_BOOL", ()),
    "logical_or": ("ALWAYS_BOOL", ()),
    "logical_xor": ("ALWAYS_BOOL", ()),
}
INPLACE_DUNDERS = {"mul": "__imul__", "remainder": "__imod__", "bitwise_and": "__iand__", "bitwise_or": "__ior__",
                   "bitwise_xor": "__ixor__", "bitwise_left_shift": "__ilshift__", "bitwise_right_shift": "__irshift__"}


def _logical_decomposition(prim: Symbol) -> Callable[..., Any]:
    def decomposition(input: Any, other: Any) -> Any:  # noqa: A002
        shape = broadcast_shape(input, other)
        a = expand_to(convert(input, torch.bool), shape)
        b = expand_to(convert(other, torch.bool), shape)
        return prim(a, b)

    return decomposition


for _name, (_kind, _dunders) in BINARY.items():
    _prim = getattr(prims, _name)
    _decomposition = (
        _logical_decomposition(_prim) if _name.startswith("logical") else _binary_decomposition(_prim, _kind)
    )
    _inplace = methods(f"{_name}_") + methods(*(INPLACE_DUNDERS.get(_name, "_"),))
    torch_symbol(
        getattr(torch, _name),
        decomposition=_decomposition,
        aliases=methods(_name, *_dunders) + tuple(getattr(torch, d) for d in _dunders if hasattr(torch, d)),
        inplace=_inplace,
    )

torch_symbol(
    torch.add,
    decomposition=_with_alpha(prims.add),
    aliases=methods("add", "__add__", "__radd__"),
    inplace=methods("add_", "__iadd__"),
)
torch_symbol(
    torch.sub,
    decomposition=_with_alpha(prims.sub),
    aliases=methods("sub", "__sub__", "subtract") + (torch.subtract,),
    inplace=methods("sub_", "__isub__", "subtract_"),
)


def rsub_decomposition(input: Any, other: Any, *, alpha: Any = None) -> Any:  # noqa: A002
    operands = _alpha_operands(other, input, alpha)
    return NotImplemented if operands is None else prims.sub(*operands)


torch_symbol(torch.rsub, decomposition=rsub_decomposition, aliases=methods("__rsub__"))


def div_decomposition(input: Any, other: Any, *, rounding_mode: str | None = None) -> Any:  # noqa: A002
    a, b = input, other
    if _reads_scalar_unrounded(a, b):
        return NotImplemented
    if rounding_mode is None:
        a, b, _ = _binary_operands(a, b, "INT_TO_FLOAT")
        return prims.div(a, b)
    a, b, dtype = _binary_operands(a, b, "DEFAULT")
    if not dtype.is_floating_point or rounding_mode == "floor":
        # Integer division, and floor division, stay with torch: eager floors Python's way (through fmod), which
        # floor(a / b) is not where a / b rounds up to an integer (0.9 // 0.1 is 8, floor(0.9 / 0.1) is 9) or b is
        # infinite (1 // -inf is -1).
        return NotImplemented
    if dtype in (torch.float16, torch.bfloat16):
        # eager's CPU kernel rounds the quotient to half before truncating where it vectorizes and not in its scalar
        # tail, and reads a number divisor rounded to half where div reads it at float32: no prims agree with it on
        # every element, so eager's kernel runs
        return NotImplemented
    return prims.trunc(prims.div(a, b))


torch_symbol(
    torch.div,
    decomposition=div_decomposition,
    aliases=methods("div", "divide", "true_divide", "__truediv__", "__div__") + (torch.divide, torch.true_divide),
    inplace=methods("div_", "__itruediv__", "divide_", "true_divide_", "__idiv__"),
)


@register(RuleKind.GRAD, torch.div)
def div_grad(a, b, *, rounding_mode=None):
    """A rounded quotient is piecewise constant: eager gives zeros, where floor(a / b)'s chain rule would give
    NaN at a zero divisor."""
    if rounding_mode is None:
        return NotImplemented
    y = torch.div(a, b, rounding_mode=rounding_mode)
    get_grad(y)  # read, so the backward reaches this rule and gives zeros (not None) as eager does
    for x in (a, b):
        if wants_grad(x):
            put_grad(x, zeros_shaped(x))
    return y


floor_divide = torch_symbol(
    torch.floor_divide,
    decomposition=lambda input, other: div_decomposition(input, other, rounding_mode="floor"),
    aliases=methods("floor_divide", "__floordiv__"),
    inplace=methods("floor_divide_", "__ifloordiv__"),
)
# Eager has no derivative for floor_divide: its backward raises, and so does ours, when a grad reaches it.
register(RuleKind.GRAD, floor_divide, eager_grad_rule(floor_divide))
torch_symbol(
    torch.Tensor.__rtruediv__,
    decomposition=lambda a, b: prims.mul(prims.reciprocal(convert(a, to_float(a.dtype))), b),
    aliases=methods("__rdiv__"),
)
torch_symbol(torch.Tensor.__rfloordiv__)
torch_symbol(torch.Tensor.__rmod__)
differentiated_by_eager(torch.Tensor.__rfloordiv__, torch.Tensor.__rmod__)


def _is_bool(x: Any) -> bool:
    return x.dtype == torch.bool if is_tensor(x) else isinstance(x, bool)


def pow_meta(builder: Any, input: Any, exponent: Any) -> Any:  # noqa: A002 - torch's keyword names
    """torch's meta kernel gives pow of two bools int64 (its reference promotes bool to long); eager's kernels keep a
    bool tensor to a bool number's power bool (x ** True is x, x ** False all True) and refuse the other bool pairs."""
    a, b = input, exponent
    operands = [x.meta if is_tensor(x) else x for x in (a, b)]
    if _is_bool(a) and _is_bool(b):
        if not (is_tensor(a) and not is_tensor(b)):
            raise NotImplementedError("\"pow\" not implemented for 'Bool'")
        out = torch.empty_like(operands[0])
    else:
        out = torch.pow(*operands)
    requires_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (a, b) if is_tensor(x))
    return builder.wrap_outputs(out, infer_device((a, b), {}), requires_grad)


def pow_decomposition(input: Any, exponent: Any) -> Any:  # noqa: A002 - torch's keyword names
    a, b = input, exponent
    if is_tensor(a) and a.dtype == torch.bool and isinstance(b, bool):  # pow_meta's one bool case
        return a if b else prims.full(tuple(a.shape), True, dtype=torch.bool, device=a.device)
    if not is_tensor(b) and b == 2 and is_tensor(a):
        return prims.mul(a, a)
    if is_tensor(a) and a.dtype.is_floating_point and is_real_number(b):
        return _pow_by_number(a, b)
    a, b, _ = _binary_operands(a, b, "DEFAULT")
    return prims.pow(a, b)


def _pow_by_number(a: Any, b: float) -> Any:
    """As eager's kernels compute a float tensor to a number's power: the exponent converted to the tensor's dtype
    first (`x ** 0.3` in bfloat16 raises to 0.30078125), and cubes and inverse squares as products, each rounded
    to the dtype (on CPU, float16 calls powf instead)."""
    try:
        exponent = float(torch.tensor(b, dtype=a.dtype))
    except (OverflowError, RuntimeError):
        exponent = b
    if exponent in (3, -2) and (a.device.type != "cpu" or a.dtype != torch.float16):
        square = prims.mul(a, a)
        return prims.mul(square, a) if exponent == 3 else prims.reciprocal(square)
    return prims.pow(a, exponent)


torch_symbol(torch.pow, decomposition=pow_decomposition, meta=pow_meta, aliases=methods("pow", "__pow__"),
             inplace=methods("pow_", "__ipow__"), tags=Tag.EAGER_ROUNDING)


@register(RuleKind.GRAD, torch.pow)
def pow_grad(a, b):
    """A float tensor to a number's power, differentiated as eager does with the exponent as given (the forward's
    decomposition converts it to the tensor's dtype, as eager's kernel does, which the prim's rule would then see)."""
    if not (is_tensor(a) and a.dtype.is_floating_point and is_real_number(b)) or b == 0:
        return NotImplemented
    y = torch.pow(a, b)
    if wants_grad(a):
        put_grad(a, get_grad(y) * (b * torch.pow(a, b - 1)))
    return y


torch_symbol(torch.Tensor.__rpow__, decomposition=lambda a, b: pow_decomposition(b, a),
             meta=lambda builder, a, b: pow_meta(builder, b, a))
torch_symbol(torch.float_power, aliases=methods("float_power"))
torch_symbol(torch.fmax)
torch_symbol(torch.fmin)
torch_symbol(torch.xlogy, aliases=methods("xlogy"))
torch_symbol(torch.lerp, aliases=methods("lerp"), inplace=methods("lerp_"))
torch_symbol(torch.addcmul, aliases=methods("addcmul"), inplace=methods("addcmul_"))
torch_symbol(torch.addcdiv, aliases=methods("addcdiv"), inplace=methods("addcdiv_"))
torch_symbol(torch.nan_to_num, aliases=methods("nan_to_num"), inplace=methods("nan_to_num_"))
torch_symbol(torch.isclose, aliases=methods("isclose"))
differentiated_by_eager(torch.float_power, torch.fmax, torch.fmin, torch.xlogy, torch.lerp, torch.addcmul,
                        torch.addcdiv, torch.nan_to_num)
not_differentiable(torch.isclose)  # bool


def _fmax_fmin_jvp(fn, keeps_first):
    """fmax / fmin: the first operand's tangent where it is chosen (NaNs lose), the second's elsewhere."""

    def rule(dot: Dot, args: tuple, kwargs: dict):
        a, b = args
        y = fn(a, b)
        chosen = keeps_first(a, b) | torch.isnan(b)
        ta, tb = tangent_or_zero(dot, a), tangent_or_zero(dot, b)
        return y, as_tangent(torch.where(chosen, ta, tb), y)

    return rule


register(RuleKind.JVP, torch.fmax, _fmax_fmin_jvp(lookup(torch.fmax).symbol, lambda a, b: a >= b))
register(RuleKind.JVP, torch.fmin, _fmax_fmin_jvp(lookup(torch.fmin).symbol, lambda a, b: a <= b))


@register(RuleKind.JVP, torch.xlogy)
def xlogy_jvp(dot: Dot, args: tuple, kwargs: dict):
    x, y_ = args
    out = torch.xlogy(x, y_)
    tx, ty = dot(x), dot(y_)
    return out, add_tangents(None if tx is None else as_tangent(tx * torch.xlogy((x != 0).to(out.dtype), y_), out),
                             None if ty is None else as_tangent(ty * x / y_, out))


@register(RuleKind.JVP, torch.lerp)
def lerp_jvp(dot: Dot, args: tuple, kwargs: dict):
    start, end, weight = args
    y = torch.lerp(start, end, weight)
    ts, te = tangent_or_zero(dot, start), tangent_or_zero(dot, end)
    t = ts + weight * (te - ts) + tangent_or_zero(dot, weight) * (end - start)
    return y, as_tangent(t, y)


def _scaled_term_jvp(fn: Callable[..., Any], term: Callable[[Dot, Any, Any], Any]):
    """The JVP of `fn(x, a, b, value=v)` = x + v * (a op b): x's tangent plus v times `term`, the tangent of a op b."""

    def rule(dot: Dot, args: tuple, kwargs: dict):
        x, a, b = args
        value = kwargs.get("value", 1)
        y = fn(x, a, b, value=value)
        return y, as_tangent(tangent_or_zero(dot, x) + value * term(dot, a, b), y)

    return rule


register(RuleKind.JVP, torch.addcmul, _scaled_term_jvp(
    torch.addcmul, lambda dot, a, b: tangent_or_zero(dot, a) * b + a * tangent_or_zero(dot, b)))
register(RuleKind.JVP, torch.addcdiv, _scaled_term_jvp(
    torch.addcdiv, lambda dot, a, b: tangent_or_zero(dot, a) / b - a * tangent_or_zero(dot, b) / (b * b)))


# elementwise in its input, with this derivative
register(RuleKind.JVP, torch.nan_to_num, by_derivative(
    lookup(torch.nan_to_num).symbol, lambda x, nan=0.0, posinf=None, neginf=None: torch.isfinite(x).to(x.dtype)))
torch_symbol(torch.square, decomposition=lambda x: prims.mul(x, x) if x.dtype != torch.bool else NotImplemented,
             aliases=methods("square"), inplace=methods("square_"))
torch_symbol(torch.positive, decomposition=lambda x: x, aliases=methods("positive", "__pos__"))


def where_decomposition(condition: Any, input: Any = None, other: Any = None) -> Any:
    a, b, dtype = _binary_operands(input, other, "NO_OPMATH")
    shape = broadcast_shape(condition, a, b)
    return prims.where(expand_to(condition, shape), expand_to(a, shape), expand_to(b, shape))


torch_symbol(torch.where, decomposition=where_decomposition, aliases=methods("where"))


def masked_fill_decomposition(x: Any, mask: Any, value: Any) -> Any:
    value = convert(value, x.dtype)
    shape = broadcast_shape(x, mask)
    x = expand_to(x, shape)
    return prims.where(expand_to(mask, shape), expand_to(value, shape), x)


torch_symbol(torch.masked_fill, decomposition=masked_fill_decomposition, aliases=methods("masked_fill"),
             inplace=methods("masked_fill_"))


def clamp_decomposition(x: Any, min: Any = None, max: Any = None) -> Any:
    if any(isinstance(b, float) and math.isnan(b) for b in (min, max)):
        return NotImplemented  # a NaN bound makes every element NaN: torch's kernel says so
    dtype = result_dtype(x, min, max)
    x = convert(x, dtype)
    for bound, outside, extremum in ((min, prims.lt, prims.maximum), (max, prims.gt, prims.minimum)):
        if bound is None:
            continue
        bound = expand_to(convert(bound, dtype), x.shape)
        # a tensor bound's NaN propagates, as in torch.clamp: maximum/minimum propagate it, a comparison would not
        x = extremum(x, bound) if is_tensor(bound) else prims.where(outside(x, bound), bound, x)
    return x


torch_symbol(torch.clamp, decomposition=clamp_decomposition, aliases=methods("clamp", "clip") + (torch.clip,),
             inplace=methods("clamp_", "clip_"))


def _put(x: torch.Tensor, grad: torch.Tensor) -> None:
    """`grad`, of the broadcast result, summed to `x`'s shape and cast to its dtype, as `x`'s grad."""
    put_grad(x, sum_to(grad, tuple(x.shape)).to(x.dtype))


@register(RuleKind.GRAD, torch.clamp)
def clamp_grad(x, min=None, max=None):
    """aten's clamp backward: `x` gets the cotangent where it lies within the bounds (NaN does not); a tensor bound
    gets it where it binds, the lower one only while it is below the upper one. (Differentiated through the
    decomposition, a NaN element of `x` would get the cotangent.)"""
    y = torch.clamp(x, min, max)
    g = get_grad(y)
    if wants_grad(x):
        within = (x >= min) & (x <= max) if min is not None and max is not None else (
            x >= min if min is not None else x <= max)
        _put(x, torch.where(within, g, 0.0))
    if wants_grad(min):
        binds = (x < min) & (min < max) if max is not None else x < min
        _put(min, torch.where(binds, g, 0.0))
    if wants_grad(max):
        binds = (x > max) | (max < min) if min is not None else x > max
        _put(max, torch.where(binds, g, 0.0))
    return y


clamp_min = torch_symbol(torch.clamp_min, aliases=methods("clamp_min"), inplace=methods("clamp_min_"))
clamp_max = torch_symbol(torch.clamp_max, aliases=methods("clamp_max"), inplace=methods("clamp_max_"))
differentiated_by_eager(torch.clamp_min, torch.clamp_max)


def _clamp_bound_jvp(fn, keep):
    """clamp_min / clamp_max: the input's tangent where it is kept, the bound's where the bound is."""

    def rule(dot: Dot, args: tuple, kwargs: dict):
        x, bound = args[0], args[1] if len(args) > 1 else next(iter(kwargs.values()))
        y = fn(x, bound)
        kept = keep(x, bound)
        tx, tb = dot(x), dot(bound)
        return y, add_tangents(None if tx is None else torch.where(kept, tx, 0.0).to(y.dtype),
                               None if tb is None else torch.where(kept, 0.0, tb).to(y.dtype))

    return rule


register(RuleKind.JVP, clamp_min, _clamp_bound_jvp(clamp_min, lambda x, b: x >= b))
register(RuleKind.JVP, clamp_max, _clamp_bound_jvp(clamp_max, lambda x, b: x <= b))

# --- the leaves that broadcast their tensors elementwise: vmap broadcasts each example's operands together ----------
ELEMENTWISE_LEAVES = (torch.nan_to_num, torch.clamp_min, torch.clamp_max, torch.fmax, torch.fmin, torch.xlogy,
                      torch.lerp, torch.addcmul, torch.addcdiv, torch.float_power, torch.isclose,
                      torch.Tensor.__rfloordiv__, torch.Tensor.__rmod__, torch.round)
for _fn in ELEMENTWISE_LEAVES:
    register(RuleKind.BATCH, _fn, elementwise(lookup(_fn).symbol))
