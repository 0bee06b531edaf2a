"""Tensor factories: full, zeros, ones, arange, *_like, new_*, random draws (and in-place random fills), dropout and
`torch.tensor` constants, with their rules: the draws' grads, and which draws vmap shares under randomness='same'."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fulmen.core.errors import DataDependentError, UnsupportedOpError
from fulmen.core.proxies import TensorProxy
from fulmen.core.source import user_location
from fulmen.core.symbol import Tag, iter_proxies, map_proxies
from fulmen.core.trace import TraceBuilder, infer_device
from fulmen.ops import prims
from fulmen.ops.kernels import impls
from fulmen.ops.registry import TorchBinding, bind, impl_symbol, lookup, method, torch_symbol
from fulmen.ops.rules.batch import Batch, elementwise
from fulmen.ops.rules.grad import (
    differentiated_by_eager,
    differentiated_call,
    get_grad,
    not_differentiable,
    put_grad,
    wants_grad,
)
from fulmen.ops.rules.jvp import constant
from fulmen.ops.rules.tables import RuleKind, register
from fulmen.ops.utils import shape_arg


def _full_decomposition(value_of):
    def decomposition(*args, dtype=None, device=None, layout=None, pin_memory=False, requires_grad=False, **kwargs):
        shape, value = value_of(args, kwargs)
        dtype = dtype or (torch.result_type(torch.empty(0), value) if not isinstance(value, bool) else torch.bool)
        return prims.full(shape, value, dtype=dtype, device=torch.device(device or "cpu"))

    return decomposition


torch_symbol(torch.zeros, decomposition=_full_decomposition(lambda args, kwargs: (shape_arg(args), 0.0)))
torch_symbol(torch.ones, decomposition=_full_decomposition(lambda args, kwargs: (shape_arg(args), 1.0)))
torch_symbol(torch.full)
torch_symbol(torch.empty)
torch_symbol(torch.arange)
torch_symbol(torch.linspace)
torch_symbol(torch.eye)
torch_symbol(torch.tensor)
torch_symbol(torch.scalar_tensor)
torch_symbol(torch.as_tensor)
# their values are Python numbers or data: no grad reaches them (torch.tensor copies a tensor's values, detached)
not_differentiable(torch.full, torch.empty, torch.arange, torch.linspace, torch.eye, torch.tensor, torch.scalar_tensor)
differentiated_by_eager(torch.as_tensor)  # a tensor in another dtype or device is `.to` of it, with its grad


def _like_decomposition(value: Any):
    def decomposition(x, *, dtype=None, layout=None, device=None, pin_memory=False, requires_grad=False,
                      memory_format=None):
        return prims.full(tuple(x.shape), value, dtype=dtype or x.dtype, device=torch.device(device or x.device))

    return decomposition


torch_symbol(torch.zeros_like, decomposition=_like_decomposition(0))
torch_symbol(torch.ones_like, decomposition=_like_decomposition(1))
torch_symbol(torch.full_like)
torch_symbol(torch.empty_like)
for _name in ("new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"):
    torch_symbol(method(_name))
    not_differentiable(method(_name))
not_differentiable(torch.full_like, torch.empty_like)
for _fn in (torch.full_like, torch.empty_like):  # their values do not depend on the input's, only its shape
    register(RuleKind.JVP, _fn, constant(lookup(_fn).symbol))
    register(RuleKind.BATCH, _fn, elementwise(lookup(_fn).symbol))


def _legacy_new_sizes(x: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict[str, Any]]:
    """`x.new(*sizes)` or `x.new(torch.Size(...))`, the legacy constructor (torch.distributions draws into one), as
    `x.new_empty(sizes)`. Its other forms (`x.new([1.0])` holds that data; `x.new(t)` shares t's storage) are
    refused: a trace prints a torch.Size as a tuple, which `new` would read as data."""
    sizes = args[0] if len(args) == 1 and isinstance(args[0], torch.Size) else args
    if not all(type(size) is int for size in sizes) or set(kwargs) - {"device"}:
        raise UnsupportedOpError("fulmen supports Tensor.new(*sizes) only (a new uninitialised tensor); for data use "
                                 "x.new_tensor(data)", user_location())
    # `x.new()` is an empty 1-D tensor, where `x.new(torch.Size([]))` is 0-D
    return (x, tuple(sizes) if args else (0,)), kwargs


bind(method("new"), TorchBinding(lookup(method("new_empty")).symbol, normalize=_legacy_new_sizes))


def _draw_meta(fn, differentiable: bool):
    """The outputs of a draw, found without drawing. With no tensor argument (`torch.randn(3)`) the default meta
    path would run the draw for real on the default device, consuming the RNG once more than eager while tracing:
    the draw runs on the meta device instead. Only a `differentiable` draw's output requires grad (when a tensor it
    reads does), as eager's autograd records only those."""

    def meta(builder: TraceBuilder, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("generator") is not None:
            # a trace draws from the default generator of its device; it has no way to name the user's generator
            raise UnsupportedOpError(
                f"{fn.__name__}(generator=...): fulmen draws from the default generator only; seed it with "
                "torch.manual_seed instead, or draw outside the jitted function and pass the tensor in",
                builder.source)
        proxies = list(iter_proxies((args, kwargs)))
        device = infer_device(args, kwargs)
        meta_args, meta_kwargs = map_proxies(args, lambda p: p.meta), map_proxies(kwargs, lambda p: p.meta)
        if not proxies or "device" in meta_kwargs:
            meta_kwargs["device"] = "meta"
        requires_grad = differentiable and torch.is_grad_enabled() and any(p.requires_grad for p in proxies)
        return builder.wrap_outputs(fn(*meta_args, **meta_kwargs), device, requires_grad)

    return meta


# Random draws, and whether eager's autograd records them when a tensor they read requires grad (derivatives.yaml
# gives bernoulli and normal zero grads; the other draws' outputs never require grad).
_DRAWS: dict[Callable[..., Any], bool] = {
    torch.rand: False, torch.randn: False, torch.randint: False, torch.randperm: False, torch.rand_like: False,
    torch.randn_like: False, torch.randint_like: False, torch.multinomial: False,
    torch.bernoulli: True, torch.normal: True,
}
# They consume the RNG exactly as eager does, so they are never merged or reordered.
for _fn, _differentiable in _DRAWS.items():
    torch_symbol(_fn, tags=Tag.RANDOM, meta=_draw_meta(_fn, _differentiable),
                 aliases=(method("bernoulli"),) if _fn is torch.bernoulli else ())


# Grads of the draws eager's autograd records (derivatives.yaml): each gives the tensors it reads a zero grad. There
# is no reparameterisation: `torch.normal(mean, std)` gives `mean` and `std` zeros, as eager does. The other draws'
# outputs never require grad, so they need no rule. `bernoulli(input, p)` with a float p is recorded without a
# derivative: its backward raises eager's error when a grad reaches it. Each rule draws once, in the forward.
def _zero_grads(out: torch.Tensor, args: tuple, kwargs: dict) -> None:
    # made from the cotangent (as eager's zeros_like(grad)): backward work, run only when a grad reaches `out`
    grad = get_grad(out)
    for t in iter_proxies((args, kwargs)):
        if wants_grad(t):
            put_grad(t, grad.new_zeros(t.shape, dtype=t.dtype))


@register(RuleKind.GRAD, torch.normal)
def normal_grad(*args, **kwargs):
    out = torch.normal(*args, **kwargs)
    _zero_grads(out, args, kwargs)
    return out


def _no_derivative_meta(builder: TraceBuilder, grad, shape, dtype, message, not_implemented=False) -> TensorProxy:
    return builder.make_proxy(torch.empty(shape, dtype=dtype, device="meta"), grad.device)


no_derivative = impl_symbol(impls.no_derivative, meta=_no_derivative_meta)
differentiated_by_eager(no_derivative)  # it raises when it runs: its eager backward, run again, raises the same


@register(RuleKind.GRAD, torch.bernoulli)
def bernoulli_grad(x, *args, **kwargs):
    out = torch.bernoulli(x, *args, **kwargs)
    if args or "p" in kwargs:
        # `bernoulli(input, p)` with a float p: eager records it, and its backward raises when a grad reaches it
        grad = get_grad(out)
        source = differentiated_call().source
        where = f" (at {source.describe()})" if source is not None else ""
        put_grad(x, no_derivative(grad, list(x.shape), x.dtype,
                                  f"derivative for aten::bernoulli is not implemented: torch.bernoulli(input, p) "
                                  f"with a float p{where} has no grad in eager either; draw from input.detach()"))
    else:
        _zero_grads(out, (x,), kwargs)
    return out


# randomness='same' under vmap: one draw of one example's shape, shared by every example (torch.func draws from the
# first example's metadata). Draws that read their batched arguments' values (bernoulli, normal, multinomial) have
# no such rule: torch.func refuses them too.
def _like_same(sym):
    def rule(batch: Batch, args: tuple, kwargs: dict):
        x, *rest = args
        if any(batch.batched(p) for p in iter_proxies((rest, kwargs))):
            return NotImplemented
        return batch.materialize(sym(prims.select(x, 0, 0), *rest, **kwargs))

    return rule


for _fn in (torch.rand_like, torch.randn_like, torch.randint_like):
    register(RuleKind.BATCH_SAME_RANDOMNESS, _fn, _like_same(lookup(_fn).symbol))


torch_symbol(torch.nn.functional.dropout, tags=Tag.RANDOM)
torch_symbol(torch.dropout, tags=Tag.RANDOM)
native_dropout = torch_symbol(torch.native_dropout, tags=Tag.RANDOM)  # what dropout's grad rule records
# where eager's dropout runs the fused kernel, native_dropout (ATen's is_fused_kernel_acceptable)
FUSED_DROPOUT_DEVICES = frozenset({"cuda", "xpu", "lazy", "privateuseone"})


@register(RuleKind.GRAD, F.dropout)
def dropout_grad(x, p=0.5, training=True, inplace=False):
    if not training or p == 0.0:
        y = F.dropout(x, p, training)  # the identity
        put_grad(x, get_grad(y))
        return y
    y, mask = native_dropout(x, p, True)
    if x.device.type in FUSED_DROPOUT_DEVICES:  # native_dropout_backward: grad * mask * scale, rounded once
        put_grad(x, get_grad(y) * mask.to(x.dtype) * (1.0 / (1.0 - p)))
    else:  # eager multiplies by its noise, the mask divided by 1 - p in x's dtype (rounded there in half precision)
        put_grad(x, get_grad(y) * mask.to(x.dtype).div(1.0 - p))
    return y


# vmap: dropout outside training, or with p 0 or 1, draws nothing (and runs under randomness='error'), and
# randomness='same' shares one example's mask. Dropout spelling -> its (input, p, training) from the call's arguments:
_DROPOUTS = {
    F.dropout: lambda input, p=0.5, training=True, inplace=False: (input, p, training),
    torch.dropout: lambda input, p, train: (input, p, train),
}


def _dropout_draws(arguments):
    def draws(*args, **kwargs) -> bool:
        x, p, training = arguments(*args, **kwargs)
        return bool(training) and 0 < p < 1 and x.numel() > 0  # aten's dropout returns x or x * 0 otherwise

    return draws


def _dropout_same(sym, arguments):
    def rule(batch: Batch, args: tuple, kwargs: dict):
        x, p, _ = arguments(*args, **kwargs)
        if not batch.batched(x):
            return NotImplemented
        example = prims.select(x, 0, 0)
        # one example's dropout of ones is its scaled mask, kept / (1 - p): x times it, as eager's x * noise
        mask = sym(prims.full(tuple(example.shape), 1, dtype=x.dtype, device=x.device), p, True)
        return prims.mul(x, batch.materialize(mask))

    return rule


for _fn, _arguments in _DROPOUTS.items():
    register(RuleKind.DRAWS, _fn, _dropout_draws(_arguments))
    register(RuleKind.BATCH_SAME_RANDOMNESS, _fn, _dropout_same(lookup(_fn).symbol, _arguments))


# The feature and alpha dropouts (nn.Dropout1d/2d/3d, nn.AlphaDropout, nn.FeatureAlphaDropout) are eager's composites
# (aten's _dropout_impl) of one draw and arithmetic: they decompose into eager's very draw (dropout_noise) and its
# ops, which give their grads and JVPs. Out of training, at p 0 or of an empty input they draw nothing and are left
# to eager (the identity).
dropout_noise = impl_symbol(impls.dropout_noise, tags=Tag.RANDOM | Tag.NO_GRAD)
register(RuleKind.JVP, dropout_noise, constant(dropout_noise))
_SELU_ALPHA = 1.7580993408473766  # aten's alpha in alpha_dropout: SELU's negative saturation over its scale


def _noised(x: Any, noise: Any, p: float, alpha: bool) -> Any:
    """`x` with the dropout's `noise` (its bernoulli draws) applied, as aten computes it, op for op."""
    mul, add = lookup(torch.mul).symbol, lookup(torch.add).symbol
    if not alpha:
        return mul(x, lookup(torch.div).symbol(noise, 1 - p))
    a = 1.0 / math.sqrt((_SELU_ALPHA * _SELU_ALPHA * p + 1) * (1 - p))
    b = add(mul(add(noise, -1), _SELU_ALPHA * a), _SELU_ALPHA * a * p)
    return add(mul(x, mul(noise, a)), b)


def _noise_dropout(feature: bool, alpha: bool) -> Callable[..., Any]:
    def decomposition(input: Any, p: float, train: bool) -> Any:  # noqa: A002 - torch's names
        if not train or p == 0 or input.numel() == 0:
            return NotImplemented
        if p == 1:  # aten multiplies by a zero (NaN stays NaN), alpha dropout too
            return lookup(torch.mul).symbol(input, prims.full((), 0, dtype=input.dtype, device=input.device))
        return _noised(input, dropout_noise(input, p, feature), p, alpha)

    return decomposition


def _noise_same(feature: bool, alpha: bool) -> Callable[..., Any]:
    """randomness='same' under vmap: one example's draw, applied to every example."""

    def rule(batch: Batch, args: tuple, kwargs: dict):
        x, p, _ = _DROPOUTS[torch.dropout](*args, **kwargs)
        if not batch.batched(x):
            return NotImplemented
        return _noised(x, batch.materialize(dropout_noise(prims.select(x, 0, 0), p, feature)), p, alpha)

    return rule


def _identity_grad(sym) -> Callable[..., Any]:
    """Where the dropout draws nothing and zeroes nothing, eager returns its input: the grad passes through."""

    def rule(input: Any, p: float, train: bool) -> Any:  # noqa: A002 - torch's names
        if train and p != 0 and input.numel() != 0:
            return NotImplemented  # its decomposition's parts' grads
        y = sym(input, p, train)
        put_grad(input, get_grad(y))
        return y

    return rule


for _fn, _feature, _alpha in ((torch.feature_dropout, True, False), (torch.alpha_dropout, False, True),
                              (torch.feature_alpha_dropout, True, True)):
    _sym = torch_symbol(_fn, decomposition=_noise_dropout(_feature, _alpha), tags=Tag.RANDOM)
    register(RuleKind.GRAD, _sym, _identity_grad(_sym))
    register(RuleKind.DRAWS, _sym, _dropout_draws(_DROPOUTS[torch.dropout]))
    register(RuleKind.BATCH_SAME_RANDOMNESS, _sym, _noise_same(_feature, _alpha))
    register(RuleKind.BATCH, _sym, elementwise(_sym))  # where it draws nothing (p 1: zeros)


# derivatives.yaml gives the filled tensor (and a tensor p) zeros
_draw_fill_meta = _draw_meta(impls.random_fill, differentiable=True)


def _fill_meta(builder: TraceBuilder, x: Any, method_name: str, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("generator") is not None:
        raise UnsupportedOpError(
            f"Tensor.{method_name}(generator=...): fulmen draws from the default generator only; seed it with "
            "torch.manual_seed instead, or draw outside the jitted function and pass the tensor in", builder.source)
    numbers = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if numbers and method_name != "bernoulli_":  # bernoulli_ takes a tensor of probabilities; the others numbers
        raise DataDependentError(
            f"fulmen cannot trace Tensor.{method_name} with tensor arguments (shape "
            f"{tuple(numbers[0].shape)}): eager reads their values as Python numbers, which are unknown while "
            "tracing; compute them from Python numbers (math.sqrt instead of torch.sqrt), or draw outside the "
            "jitted function", builder.source)
    if not x.meta.is_contiguous():
        # eager's kernels place their draws by the layout (CPU normal_ draws in batches of 16 into a contiguous
        # float tensor, one by one into any other): the trace, which fills a fresh contiguous tensor, would differ
        raise UnsupportedOpError(
            f"fulmen cannot trace Tensor.{method_name} on a non-contiguous tensor: where eager's kernel puts its "
            "draws depends on the layout; fill a contiguous tensor and copy it in (`x.copy_(torch.empty_like(x, "
            f"memory_format=torch.contiguous_format).{method_name}(...))`)", builder.source)
    return _draw_fill_meta(builder, x, method_name, *args, **kwargs)


# `x.exponential_()` and the other in-place fills record the values `x` holds afterwards (drawn into a fresh tensor)
# and rebind `x`, as other in-place updates do (acquire/interpreter.py): one symbol, the method's name its second
# argument.
RANDOM_FILL = impl_symbol(impls.random_fill, tags=Tag.RANDOM, meta=_fill_meta)


def _fill_arguments(method_name: str) -> Callable[..., tuple[tuple, dict[str, Any]]]:
    def normalize(x: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict[str, Any]]:
        return (x, method_name, *args), kwargs

    return normalize


for _name in ("uniform_", "normal_", "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_", "random_"):
    bind(method(_name), TorchBinding(RANDOM_FILL, inplace=True, normalize=_fill_arguments(_name)))


# the in-place fills (`x.exponential_()`...) give `x` (and a tensor `p`) zeros, as eager does
@register(RuleKind.GRAD, RANDOM_FILL)
def random_fill_grad(x, method_name, *args, **kwargs):
    out = RANDOM_FILL(x, method_name, *args, **kwargs)
    _zero_grads(out, (x, *args), kwargs)
    return out
