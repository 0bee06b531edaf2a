"""Complex numbers: the views between complex and real tensors, the parts and constructors of complex values, and
which derivatives hold for them.

`view_as_real`, `view_as_complex`, `real`, `imag` and `conj` are views, as in eager: acquisition reads the view
off torch's meta kernels, so an in-place update through one reaches the tensor it views (and back). Where eager
gives the input itself (`torch.real` of a real tensor, `conj` of one, `resolve_conj` of a tensor without the bit),
the program holds the same object.

Derivatives follow torch's convention for complex values (conjugate Wirtinger derivatives: the grad of `a * b`
for `a` is `g * b.conj()`), which fulmen's real rules do not state. A call touching a complex value that carries a
grad or a tangent therefore takes only rules declared to hold for complex values (the COMPLEX_GRAD and COMPLEX_JVP
tables): the ones below, written as eager's derivatives.yaml states them, and the real rules of the prims whose
derivatives have real coefficients (data movement, sums, `add`, `sub`, `neg`), declared valid as they stand. A
composite whose parts all have one is differentiated through them; any other call runs eager's own derivative of
the op (torch autograd or forward-mode AD on its callable), which is eager's convention by construction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Symbol, Tag
from fulmen.ops import prims, shape
from fulmen.ops.registry import lookup, method, methods, symbol_of, torch_symbol
from fulmen.ops.rules.batch import Batch, elementwise, same_call
from fulmen.ops.rules.grad import differentiated_by_eager, get_grad, not_differentiable, put_grad, wants_grad
from fulmen.ops.rules.grad_formulas import sum_to
from fulmen.ops.rules.jvp import Dot, linear, tangent_or_zero
from fulmen.ops.rules.tables import RuleKind, register, rule

T = torch.Tensor
GRAD, JVP, BATCH = RuleKind.COMPLEX_GRAD, RuleKind.COMPLEX_JVP, RuleKind.BATCH


def _real_dtype(x: Any) -> bool:
    return not x.dtype.is_complex


# --- the views -----------------------------------------------------------------------------------------------------
view_as_real = torch_symbol(torch.view_as_real, tags=Tag.VIEW)
view_as_complex = torch_symbol(torch.view_as_complex, tags=Tag.VIEW)
real = torch_symbol(torch.real, aliases=(T.real.__get__,), tags=Tag.VIEW, returns_input=_real_dtype)
imag = torch_symbol(torch.imag, aliases=(T.imag.__get__,), tags=Tag.VIEW)
conj = torch_symbol(torch.conj, aliases=methods("conj"), tags=Tag.VIEW, returns_input=_real_dtype)
resolve_conj = torch_symbol(
    torch.resolve_conj, aliases=methods("resolve_conj"), returns_input=lambda x: not x.is_conj()
)
resolve_neg = torch_symbol(torch.resolve_neg, aliases=methods("resolve_neg"), returns_input=lambda x: not x.is_neg())
conj_physical = torch_symbol(
    torch.conj_physical, aliases=methods("conj_physical"), inplace=methods("conj_physical_"), returns_input=_real_dtype
)

# --- the parts and the constructors --------------------------------------------------------------------------------
complex_ = torch_symbol(torch.complex)
polar = torch_symbol(torch.polar)
angle = torch_symbol(torch.angle, aliases=methods("angle"))
sgn = torch_symbol(torch.sgn, aliases=methods("sgn"), inplace=methods("sgn_"))
isreal = torch_symbol(torch.isreal, aliases=methods("isreal"))
not_differentiable(isreal)


def _to_complex(dtype: torch.dtype) -> Callable[..., Any]:
    def decomposition(x: torch.Tensor, memory_format: torch.memory_format = torch.preserve_format) -> Any:
        if memory_format is not torch.preserve_format:
            return NotImplemented
        return prims.convert_element_type(x, dtype) if x.dtype != dtype else prims.alias(x)

    return decomposition


for _name, _dtype in (("cfloat", torch.complex64), ("cdouble", torch.complex128), ("chalf", torch.complex32)):
    torch_symbol(method(_name), decomposition=_to_complex(_dtype))

# Eager's backward wherever no rule below holds (a real input: the grads of angle and sgn are zeros there).
differentiated_by_eager(
    view_as_real,
    view_as_complex,
    real,
    imag,
    conj,
    resolve_conj,
    resolve_neg,
    conj_physical,
    complex_,
    polar,
    angle,
    sgn,
)


# --- grads (eager's derivatives.yaml) -------------------------------------------------------------------------------
def _unary_grad(sym: Symbol, back: Callable[[T, T], T]) -> None:
    """A grad rule of the COMPLEX_GRAD table: the input's grad `back(g, x)` from the output's cotangent."""

    def grad_rule(x, *args, **kwargs):
        y = sym(x, *args, **kwargs)
        put_grad(x, back(get_grad(y), x))
        return y

    register(GRAD, sym, grad_rule)


_unary_grad(view_as_real, lambda g, x: torch.view_as_complex(g.contiguous()))
_unary_grad(view_as_complex, lambda g, x: torch.view_as_real(g.contiguous().resolve_conj()))
# real and imag are a select of view_as_real in eager: their backward puts g into zeros at its part
_unary_grad(real, lambda g, x: g.to(x.dtype))
_unary_grad(imag, lambda g, x: torch.complex(torch.zeros_like(g), g))
_unary_grad(conj, lambda g, x: g.conj())
_unary_grad(conj_physical, lambda g, x: g.conj_physical())
_unary_grad(resolve_conj, lambda g, x: g)
_unary_grad(resolve_neg, lambda g, x: g)


@register(GRAD, complex_)
def _complex_grad(re, im):
    z = complex_(re, im)
    g = get_grad(z)
    if wants_grad(re):
        put_grad(re, sum_to(torch.real(g), tuple(re.shape)))
    if wants_grad(im):
        put_grad(im, sum_to(torch.imag(g), tuple(im.shape)))
    return z


# --- the prims' rules for complex values ----------------------------------------------------------------------------
# Their real rules hold: the derivatives of data movement, sums and these arithmetic ops have real coefficients.
_SAME_RULES = (
    "add sub neg sum where alias clone device_put reshape permute expand squeeze unsqueeze slice select cat flip pad "
    "take take_along_axis slice_scatter select_scatter index_put index_copy scatter_add"
).split()
for _name in _SAME_RULES:
    _prim = prims.PRIMS[_name]
    for _real_kind, _complex_kind in ((RuleKind.GRAD, GRAD), (RuleKind.JVP, JVP)):
        _rule = rule(_real_kind, _prim)
        if _rule is not None:
            register(_complex_kind, _prim, _rule)
# The functional forms of in-place updates: their grads are eager's backward of the update (shape._overwrite_grad)
# or pass the cotangent on (keep_history, autograd_leaf); their tangents are linear.
for _update in (shape.setitem, shape.copy, shape.fill, shape.view_scatter, shape.keep_history, shape.autograd_leaf):
    for _real_kind, _complex_kind in ((RuleKind.GRAD, GRAD), (RuleKind.JVP, JVP)):
        _rule = rule(_real_kind, _update)
        if _rule is not None:
            register(_complex_kind, _update, _rule)


def _conj(x: Any) -> Any:
    return x.conj() if isinstance(x, torch.Tensor) else x.conjugate() if isinstance(x, complex) else x


def _times(g: Any, alpha: Any) -> Any:
    """eager's maybe_multiply: `g * alpha`, or `g` itself for alpha 1."""
    return g if alpha is None or alpha == 1 else g * _conj(alpha)


def _as_input(grad: T, x: T) -> T:
    """A grad for `x` as eager's formula and engine finish it: a real input's is the real part (handle_r_to_c), then
    summed to its shape (a broadcast operand) and cast to its dtype."""
    if grad.dtype.is_complex and not x.dtype.is_complex:
        grad = torch.real(grad)
    grad = sum_to(grad, tuple(x.shape))
    return grad if grad.dtype == x.dtype else grad.to(x.dtype)


def _binary_grad(target: Callable[..., Any], grads: Callable[..., tuple[Any, Any]]) -> None:
    """A COMPLEX_GRAD rule of a torch-level binary op: `grads(a, b, g, **kwargs)` gives eager's formulas for both
    operands, on the operands as the program passed them (eager's kernels broadcast them: the values differ in the
    last bit from products of expanded operands, whose vectorized loops differ)."""
    sym = symbol_of(target, GRAD.value)

    def grad_rule(a, b, **kwargs):
        y = sym(a, b, **kwargs)
        if kwargs.get("rounding_mode") is not None:
            return NotImplemented
        grad_a, grad_b = grads(a, b, get_grad(y), **kwargs)
        for x, grad in ((a, grad_a), (b, grad_b)):
            if wants_grad(x):
                put_grad(x, _as_input(grad, x))
        return y

    register(GRAD, sym, grad_rule)


# eager's derivatives.yaml: add, sub (with alpha), mul_tensor_backward, div_tensor_self/other_backward
_binary_grad(torch.add, lambda a, b, g, alpha=None: (g, _times(g, alpha)))
_binary_grad(torch.sub, lambda a, b, g, alpha=None: (g, _times(-g, alpha)))
_binary_grad(torch.rsub, lambda a, b, g, alpha=None: (_times(-g, alpha), g))
_binary_grad(torch.mul, lambda a, b, g: (g * _conj(b), g * _conj(a)))
_binary_grad(torch.div, lambda a, b, g, rounding_mode=None: (g / _conj(b), -g * _conj((a / b) / b)))
_unary_grad(lookup(torch.neg).symbol, lambda g, x: g.neg())


@register(GRAD, prims.convert_element_type)
def _convert_grad(x, dtype):
    y = prims.convert_element_type(x, dtype)
    g = get_grad(y)
    # a complex cotangent of a real input: its real part, as eager's engine takes it (a cast would warn)
    put_grad(x, torch.real(g).to(x.dtype) if g.dtype.is_complex and not x.dtype.is_complex else g.to(x.dtype))
    return y


# --- tangents (forward mode): holomorphic ops and the real-linear parts -----------------------------------------------
register(JVP, prims.convert_element_type, linear(prims.convert_element_type, (0,)))
for _sym in (view_as_real, view_as_complex, real, imag, conj, conj_physical, resolve_conj, resolve_neg):
    register(JVP, _sym, linear(_sym, (0,)))


@register(JVP, complex_)
def _complex_jvp(dot: Dot, args: tuple, kwargs: dict):
    re, im = args
    z = complex_(re, im)
    t_re, t_im = tangent_or_zero(dot, re), tangent_or_zero(dot, im)
    if isinstance(t_re, float):
        t_re = torch.zeros_like(re)
    if isinstance(t_im, float):
        t_im = torch.zeros_like(im)
    return z, torch.complex(t_re, t_im).expand(z.shape)


def _binary_jvp(prim: Symbol, tangent: Callable[[Any, Any, T, Any, Any], T]) -> None:
    def jvp_rule(dot: Dot, args: tuple, kwargs: dict):
        a, b = args
        y = prim(a, b)
        ta = dot(a) if isinstance(a, torch.Tensor) else None
        tb = dot(b) if isinstance(b, torch.Tensor) else None
        return y, tangent(a, b, y, ta, tb)

    register(JVP, prim, jvp_rule)


def _product_tangent(a, b, y, ta, tb):
    parts = [t for t in (None if ta is None else ta * b, None if tb is None else a * tb) if t is not None]
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


def _quotient_tangent(a, b, y, ta, tb):
    parts = [t for t in (None if ta is None else ta / b, None if tb is None else -(tb * (y / b))) if t is not None]
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


_binary_jvp(prims.mul, _product_tangent)
_binary_jvp(prims.div, _quotient_tangent)


# --- batching: elementwise, or views whose last dims are one example's -----------------------------------------------
for _sym in (real, imag, conj, conj_physical, resolve_conj, resolve_neg, complex_, polar, angle, sgn, isreal):
    register(BATCH, _sym, elementwise(_sym))
register(BATCH, view_as_real, same_call(view_as_real))


@register(BATCH, view_as_complex)
def _view_as_complex_batch(batch: Batch, args: tuple, kwargs: dict):
    (x,) = args
    return view_as_complex(x) if x.stride(-1) == 1 else NotImplemented


# --- which rule a call on complex values takes -----------------------------------------------------------------------
def complex_values(bsym: BoundSymbol, carries: Callable[[TensorProxy], bool]) -> bool:
    """Whether `bsym` reads or makes a complex value that `carries` a derivative (requires grad, has a tangent)."""
    return any(p.dtype.is_complex and carries(p) for p in (*bsym.proxy_args(), *bsym.proxy_outputs()))


def complex_rule(bsym: BoundSymbol, kind: RuleKind) -> Callable[..., Any] | None:
    """The `kind` rule (COMPLEX_GRAD, COMPLEX_JVP) of a call on complex values: None when it has none."""
    return rule(kind, bsym.sym)


def through_parts(bsym: BoundSymbol, kind: RuleKind, carries: Callable[[TensorProxy], bool]) -> bool:
    """Whether a call on complex values without a `kind` rule of its own is differentiated through its
    decomposition: each part a derivative flows through is on complex values and has a `kind` rule (or parts that
    do). Else eager's derivative of the call: for grads a real part is not taken either, since the real rules of
    parts (softmax's of a complex input's real part) are not eager's formula for the call, bit for bit."""
    if not bsym.subsymbols or bsym.draws_random():
        return False
    for sub in bsym.subsymbols:
        if not any(carries(p) for p in sub.proxy_args()):
            continue
        if not complex_values(sub, carries):
            if kind is RuleKind.COMPLEX_GRAD:
                return False
            continue
        if rule(kind, sub.sym) is None and not through_parts(sub, kind, carries):
            return False
    return True
