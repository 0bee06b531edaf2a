"""Tensor factories: full, zeros, ones, arange, *_like, new_*, random draws (and in-place random fills) and
`torch.tensor` constants."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fulmen.core.errors import DataDependentError, UnsupportedOpError
from fulmen.core.source import user_location
from fulmen.core.symbol import Tag, iter_proxies, map_proxies
from fulmen.core.trace import TraceBuilder, infer_device
from fulmen.ops import impls, prims
from fulmen.ops.registry import TorchBinding, bind, impl_symbol, lookup, method, torch_symbol
from fulmen.ops.rules.batch import elementwise
from fulmen.ops.rules.grad import differentiated_by_eager, not_differentiable
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
torch_symbol(torch.nn.functional.dropout, tags=Tag.RANDOM)
torch_symbol(torch.dropout, tags=Tag.RANDOM)


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
# and rebind `x`, as other in-place updates do (acquire.py): one symbol, the method's name its second argument.
RANDOM_FILL = impl_symbol(impls.random_fill, tags=Tag.RANDOM, meta=_fill_meta)


def _fill_arguments(method_name: str) -> Callable[..., tuple[tuple, dict[str, Any]]]:
    def normalize(x: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict[str, Any]]:
        return (x, method_name, *args), kwargs

    return normalize


for _name in ("uniform_", "normal_", "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_", "random_"):
    bind(method(_name), TorchBinding(RANDOM_FILL, inplace=True, normalize=_fill_arguments(_name)))
