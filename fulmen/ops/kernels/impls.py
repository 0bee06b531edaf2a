"""fulmen's own callables, as traces print them (`impls.setitem(...)`).

Functional forms of in-place updates: acquisition turns every in-place update into one of these out-of-place calls
(or the op's own out-of-place symbol), so traces are pure until the final `prims.copy_` write-backs into the
program's inputs. Also: the fallbacks of the grad transform, and the copies of CPU offloading.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import forward_ad
from torch.utils._pytree import tree_leaves, tree_map_only


def _clone_with_layout(x: torch.Tensor) -> torch.Tensor:
    """A copy of `x` with its strides, also where `x` is not dense (a slice with a step; `clone` makes that one
    contiguous). The value an in-place update leaves keeps the updated tensor's layout, as eager's does: a later
    `reshape`/`flatten` views it or copies it by its strides, and the program may read them."""
    if x.is_contiguous():  # the same copy in one call
        return x.clone()
    return _empty_with_layout(x, x.device).copy_(x)


def setitem(x: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """`x` with `x[index] = value` applied, leaving `x` untouched."""
    out = x.clone() if x.is_contiguous() else _clone_with_layout(x)  # backward traces make thousands: slices' grads
    if out.is_meta and any(isinstance(item, torch.Tensor) and item.dtype in (torch.bool, torch.uint8)
                           for item in (index if isinstance(index, tuple) else (index,))):
        return out  # a mask's count of true elements is a value (the call checks it against `value`'s shape)
    out[index] = value
    return out


def select_at(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """`x[index]` along `dim` for a 0-dim integer tensor `index`, as eager does it: it reads the index's value and
    selects, so the result is a view of `x` (a write into it must reach `x`). Meta tensors select position 0, which
    gives the view's shape and strides. A compiler's fake tensors (a fusion region, which is pure: no write goes
    through it) gather instead, which reads no value on the host."""
    if index.is_meta:
        return x.select(dim, 0)
    if type(index) is not torch.Tensor:
        position = torch.where(index < 0, index + x.shape[dim], index)
        return x.index_select(dim, position.reshape(1)).squeeze(dim)
    return x.select(dim, int(index))


def copy(dst: torch.Tensor, src: Any) -> torch.Tensor:
    """The value `dst` holds after `dst.copy_(src)`."""
    out = _empty_with_layout(dst, dst.device)  # dst's layout, as eager's update keeps it
    return out.fill_(src) if not isinstance(src, torch.Tensor) else out.copy_(src)


def fill(x: torch.Tensor, value: Any) -> torch.Tensor:
    """The value `x` holds after `x.fill_(value)`."""
    return _empty_with_layout(x, x.device).fill_(value)  # x's layout, as eager's update keeps it


def random_fill(x: torch.Tensor, method: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The values `x` holds after the in-place random fill `x.<method>(*args, **kwargs)`: the same draws from the
    default generator as eager's fill. They are drawn into a fresh contiguous tensor, as the updated tensor is
    (factories.py refuses a fill of any other layout, whose draws eager's kernels would place otherwise)."""
    return getattr(torch.empty(x.shape, dtype=x.dtype, device=x.device), method)(*args, **kwargs)


def dropout_noise(x: torch.Tensor, p: float, feature: bool) -> torch.Tensor:
    """The noise eager's feature and alpha dropouts draw (aten's _dropout_impl): bernoulli(1 - p) draws into a tensor
    of x's dtype, of x's layout (empty_like: where each draw lands follows it), or for a feature dropout one per
    channel (N, C, 1, ...), contiguous."""
    noise = x.new_empty((*x.shape[:2], *(1,) * (x.dim() - 2))) if feature else torch.empty_like(x)
    return noise.bernoulli_(1 - p)


def check_all_true(valid: torch.Tensor, message: str) -> None:
    """Raises ValueError(`message`) unless every element of `valid` is true (`fulmen.ops.effects`)."""
    if not bool(valid.all()):
        raise ValueError(message)


def keep_history(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`new`, as the next value of a tensor that held `old` and whose autograd history the update leaves alone (an
    in-place update under `torch.no_grad()`, or through `.detach()` / `.data`): its grad goes to `old` only."""
    return new


def autograd_leaf(x: torch.Tensor) -> torch.Tensor:
    """`x` after `x.requires_grad_()` inside the program, where x is a value the program computed that requires no
    grad: eager makes it a leaf of autograd, so what is computed from it requires grad and its grad stops there."""
    return x


def batch_norm_update(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                      weight: torch.Tensor | None, bias: torch.Tensor | None, momentum: float | None,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`F.batch_norm(..., training=True)` as a pure function: its output and the running statistics it leaves. The
    update lands on copies, so recomputing it (a backward without a grad rule does) never updates the buffers again;
    acquisition writes the new statistics back once. A tensor `momentum` is a cumulative average's factor (BatchNorm
    with momentum=None: 1 / num_batches_tracked, float64), read as eager reads it, when the update runs."""
    if isinstance(momentum, torch.Tensor):
        momentum = 0.0 if momentum.is_meta else momentum.item()
    mean, var = running_mean.clone(), running_var.clone()
    out = torch.nn.functional.batch_norm(x, mean, var, weight, bias, True, momentum, eps)
    return out, mean, var


def embedding_backward(g: torch.Tensor, index: torch.Tensor, num_weights: int, padding_idx: int,
                       scale_grad_by_freq: bool) -> torch.Tensor:
    """The weight gradient of `F.embedding(index, weight, padding_idx, scale_grad_by_freq=...)` (padding_idx -1:
    none) for its output's cotangent `g`, by the kernel eager's backward runs: on CUDA it sums each row's
    contributions in float32 in a fixed order and rounds once, where an index_add in bfloat16 rounds at every atomic
    addition, in no fixed order."""
    return torch.ops.aten.embedding_dense_backward(g, index, num_weights, padding_idx, scale_grad_by_freq)


def attention_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                      dropout_p: float, is_causal: bool, scale: float | None,
                      enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`F.scaled_dot_product_attention` with dropout as eager's math kernel runs it (the same draw), and the
    attention probabilities after dropout, whose zeros hold the mask it drew."""
    return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, _additive(attn_mask, q.dtype), dropout_p,
                                                              is_causal, scale=scale, enable_gqa=enable_gqa)


def attention_dropped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                      kept: torch.Tensor, dropout_p: float, is_causal: bool, scale: float | None,
                      enable_gqa: bool) -> torch.Tensor:
    """`attention_dropout`'s output with the dropout mask it drew (`kept`) instead of a new draw, through the ops
    eager's math kernel differentiates (its dropout multiplies by the kept mask divided by 1 - p). The kernel computes
    half-precision attention in float32 and rounds the output once; so does this, or the grads round elsewhere."""
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    _, probs = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, _additive(attn_mask, dtype), 0.0, is_causal,
                                                                 scale=scale, enable_gqa=enable_gqa)
    if enable_gqa:
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    return torch.matmul(probs * kept.to(probs.dtype).div(1 - dropout_p), v).to(dtype)


def _additive(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as `F.scaled_dot_product_attention` hands it to its math kernel (which adds the mask it gets):
    0 where kept, -inf where masked."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.where(attn_mask.logical_not(), -torch.inf, torch.scalar_tensor(0.0, dtype=dtype,
                                                                                device=attn_mask.device))


def no_derivative(grad: torch.Tensor, shape: list[int], dtype: torch.dtype, message: str,
                  not_implemented: bool = False) -> torch.Tensor:
    """The grad (of `shape` and `dtype`) of a call eager records without a derivative: its output requires grad, and
    its backward raises when a grad reaches it, as this does (NotImplementedError where eager's formula is
    derivatives.yaml's not_implemented, RuntimeError otherwise)."""
    raise (NotImplementedError if not_implemented else RuntimeError)(message)


# Eager's fused backward kernels (symbols in fulmen.ops.kernels.backward_kernels): each computes in float32 for
# half-precision tensors and rounds once, where the same formula as separate torch calls rounds after every step.
def tanh_backward(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.tanh_backward(g, y)


def sigmoid_backward(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.sigmoid_backward(g, y)


def silu_backward(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.silu_backward(g, x)


def gelu_backward(g: torch.Tensor, x: torch.Tensor, approximate: str) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(g, x, approximate=approximate)


def hardswish_backward(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.hardswish_backward(g, x)


def hardsigmoid_backward(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.hardsigmoid_backward(g, x)


def hardtanh_backward(g: torch.Tensor, x: torch.Tensor, min_val: float, max_val: float) -> torch.Tensor:
    return torch.ops.aten.hardtanh_backward(g, x, min_val, max_val)


def leaky_relu_backward(g: torch.Tensor, x_or_y: torch.Tensor, negative_slope: float, is_result: bool
                        ) -> torch.Tensor:
    return torch.ops.aten.leaky_relu_backward(g, x_or_y, negative_slope, is_result)


def elu_backward(g: torch.Tensor, alpha: float, scale: float, input_scale: float, is_result: bool,
                 x_or_y: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.elu_backward(g, alpha, scale, input_scale, is_result, x_or_y)


# The values in-place activations write, computed out of place: symbols of their own (fulmen/ops/activations.py)
# because eager's grads of these updates read their result, not their input, and round otherwise.
def elu_update(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    return torch.nn.functional.elu(x, alpha)


def celu_update(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    return torch.celu(x, alpha)


def selu_update(x: torch.Tensor) -> torch.Tensor:
    return torch.selu(x)


def leaky_relu_update(x: torch.Tensor, negative_slope: float = 0.01) -> torch.Tensor:
    return torch.nn.functional.leaky_relu(x, negative_slope)


def softmax_backward(g: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.ops.aten._softmax_backward_data(g, y, dim, y.dtype)


def log_softmax_backward(g: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.ops.aten._log_softmax_backward_data(g, y, dim, y.dtype)


def layer_norm_backward(g: torch.Tensor, x: torch.Tensor, normalized_shape: list[int], mean: torch.Tensor,
                        rstd: torch.Tensor, weight: torch.Tensor | None, bias_dtype: torch.dtype | None,
                        output_mask: list[bool]) -> tuple[torch.Tensor | None, ...]:
    """The grads of `native_layer_norm`'s input, weight and bias (those `output_mask` asks for). `bias_dtype` is the
    bias's dtype (None without a bias): the kernel reads only the bias's metadata, and the bias itself is not kept
    for the backward. Eager's CPU kernel keeps a half-precision input's statistics in the input's dtype (its forward
    rounds them so), except in its mixed-dtype form, where the weight (or without one the bias) is float32, as
    under CPU autocast: then they stay float32, the kernel's float32 form reads them so, and a half-precision copy
    would select its other form, which refuses the float32 weight. A forward fused by an executor gives them in
    float32, the dtype the trace states."""
    param_dtype = weight.dtype if weight is not None else bias_dtype
    if x.device.type == "cpu" and param_dtype in (None, x.dtype):
        mean, rstd = mean.to(x.dtype), rstd.to(x.dtype)
    bias = None if bias_dtype is None else torch.empty(normalized_shape, dtype=bias_dtype, device=x.device)
    return tuple(torch.ops.aten.native_layer_norm_backward(g, x, normalized_shape, mean, rstd, weight, bias,
                                                           output_mask))


def view_scatter(
    base: torch.Tensor, value: torch.Tensor, view_fn: Callable[..., Any], args: tuple, kwargs: dict, index: int | None
) -> torch.Tensor:
    """`base` after writing `value` into the view `view_fn(base, *args, **kwargs)` (its `index`-th output)."""
    out = _clone_with_layout(base)
    if out.is_meta:  # the output's metadata is the base's; the view may need values only the run has (narrow's start)
        return out
    view = view_fn(out, *args, **kwargs)
    if index is not None:
        view = view[index]
    view.copy_(value)
    return out


def torch_vjp(fn: Callable[..., Any], args: tuple, kwargs: dict, wrt: tuple[int, ...], cotangents: tuple) -> tuple:
    """Grads of `fn(*args, **kwargs)` for its `wrt`-th tensor arguments, by torch autograd on `fn` itself.

    The backward of an op fulmen has no grad rule for: it recomputes the op under autograd and pulls the
    cotangents back through it.
    """
    position = itertools.count()
    leaves: list[torch.Tensor] = []

    def leaf(t: torch.Tensor) -> torch.Tensor:
        if next(position) in wrt:
            # detach() drops a forward-mode tangent too: under fulmen.jvp (torch_jvp of this backward) the op must
            # still see its inputs' tangents, or the grads' tangents lose the op's second derivative
            primal, tangent = forward_ad.unpack_dual(t)
            t = primal.detach().requires_grad_(True)
            leaves.append(t)
            if tangent is not None:
                t = forward_ad.make_dual(t, tangent)
        return t

    with torch.enable_grad():
        args, kwargs = tree_map_only(torch.Tensor, leaf, (args, kwargs))
        out = fn(*args, **kwargs)
    floating = [o for o in tree_leaves(out)
                if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex())]
    pairs = [(o, g) for o, g in zip(floating, cotangents) if o.requires_grad]
    # Differentiable itself when the caller records autograd (a backward differentiated again, fulmen.jvp of it).
    grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True,
                                create_graph=torch.is_grad_enabled())
    return tuple(torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads))


def _floating_leaves(out: Any) -> list[torch.Tensor]:
    return [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex())]


def torch_jvp(fn: Callable[..., Any], args: tuple, kwargs: dict, tangents: tuple) -> tuple[Any, tuple]:
    """`fn(*args, **kwargs)` and the tangents of its floating outputs, by torch's forward-mode AD on `fn` itself,
    given the tangents of its tensor arguments in order (None: zero). The JVP of an op fulmen has no JVP rule for;
    the outputs come from the same call, so an op that draws random numbers draws them once."""
    position = itertools.count()

    def dual(t: torch.Tensor) -> torch.Tensor:
        tangent = tangents[next(position)]
        return t if tangent is None else forward_ad.make_dual(t, tangent)

    # grad mode on: an op that is itself a backward (impls.torch_vjp) records what forward-mode AD goes through
    with forward_ad.dual_level(), torch.enable_grad():
        args, kwargs = tree_map_only(torch.Tensor, dual, (args, kwargs))
        out = fn(*args, **kwargs)
        floating = _floating_leaves(out)
        results = [forward_ad.unpack_dual(o).tangent for o in floating]
        out = tree_map_only(torch.Tensor, lambda o: forward_ad.unpack_dual(o).primal.detach(), out)
    return out, tuple(torch.zeros_like(o) if t is None else t.detach() for o, t in zip(_floating_leaves(out), results))


def batch_loop(fn: Callable[..., Any], args: tuple, kwargs: dict, batched: tuple[bool, ...], size: int) -> Any:
    """`fn` mapped over dim 0 of its `batched` tensor arguments (flags in argument order), `size` calls, results
    stacked along a new dim 0: the batching of an op fulmen has no batching rule for, one call per example."""
    results = []
    for index in range(size):
        flags = iter(batched)
        example = tree_map_only(torch.Tensor, lambda t, i=index, flags=flags: t[i] if next(flags) else t,
                                (args, kwargs))
        results.append(fn(*example[0], **example[1]))
    return torch.utils._pytree.tree_map(lambda *parts: torch.stack(parts), *results)


# --- CPU offloading of saved tensors (fulmen.transforms.offload) ----------------------------------------------------
# A device tensor's copy to pinned host memory and back runs on a side stream per device; events attached to the
# tensors order the streams. Tensors on the CPU are copied plainly (nothing is freed; tests run the rewrite so).


@functools.cache
def offload_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _empty_with_layout(x: torch.Tensor, device: torch.device, pin_memory: bool = False) -> torch.Tensor:
    """An empty tensor with `x`'s strides, also for a view that is not dense (`empty_like` would make that one
    contiguous): the backward's kernels pick their algorithm by layout, and must see the one eager saved."""
    if x.is_contiguous() or any(stride == 0 and size > 1 for stride, size in zip(x.stride(), x.shape)):
        return torch.empty_like(x, device=device, pin_memory=pin_memory)
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device, pin_memory=pin_memory)


def offload_to_host(x: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of `x`, started on the offload stream once `x` is computed. The caching allocator
    reuses `x`'s memory only after the copy is done, however early the program drops `x`."""
    if x.device.type != "cuda":
        return x.clone()
    stream = offload_stream(x.device)
    host = _empty_with_layout(x, torch.device("cpu"), pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream):
        host.copy_(x, non_blocking=True)
        host._fulmen_copied = stream.record_event()  # type: ignore[attr-defined]
    x.record_stream(stream)
    return host


def reload_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device copy of `host`, started on the offload stream; `wait_for_copy` makes it safe to read."""
    if device.type != "cuda":
        return host.clone()
    copied = getattr(host, "_fulmen_copied", None)
    if copied is not None:
        # The device memory the forward copied from must be free again before this one is allocated, so
        # offloading never raises the peak (when the copy out lags, the caller waits instead).
        copied.synchronize()
        host._fulmen_copied = None  # type: ignore[attr-defined]
    out = _empty_with_layout(host, device)
    stream = offload_stream(out.device)
    stream.wait_stream(torch.cuda.current_stream(out.device))  # the compute stream may still use out's memory
    with torch.cuda.stream(stream):
        out.copy_(host, non_blocking=True)
        out._fulmen_ready = stream.record_event()  # type: ignore[attr-defined]
    return out


def wait_for_copy(x: torch.Tensor) -> torch.Tensor:
    """`x` itself, once the copy `reload_to_device` started into it is done (the current stream waits)."""
    ready = getattr(x, "_fulmen_ready", None)
    if ready is not None:
        torch.cuda.current_stream(x.device).wait_event(ready)
        x._fulmen_ready = None  # type: ignore[attr-defined]
    return x


def set_switch(owner: str, name: str, value: Any) -> None:
    """`owner.name = value` for one of torch's backend switches (`torch.backends.cudnn.deterministic = True`),
    `owner` named by its dotted path from `torch` (fulmen.ops.effects)."""
    target: Any = torch
    for part in owner.split(".")[1:]:
        target = getattr(target, part)
    setattr(target, name, value)
