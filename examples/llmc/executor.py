"""The "llm.c" operator executor: the GPT-2 reference model (model.py) on llm.c-style CUDA kernels.

Two layers of operators are registered:

- kernel operators (`llmc_permute`, `llmc_gelu_backward`, ...): one kernel wrapper of kernels.py each. These are
  what the final forward and backward traces call (LLMC_SYMBOLS).
- composite operators that replace pieces of the user's program while this executor is active: the model's
  `_permute` and `_unpermute`, `NewGELU.forward`, and `torch.nn.functional.layer_norm`. Their implementations say
  how to run them with the kernel operators (execution_transform) and how to differentiate them with the kernel
  operators (grad_transform).

torch's own softmax and cross_entropy symbols get implementations too. Every checker accepts fp32 CUDA tensors
only: anything else (CPU tensors, half precision, unusual arguments) is declined and runs through torch as if
this executor were absent.

Use: `fulmen.jit(model, executors=[llmc_executor])`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import fulmen
from examples.llmc import kernels
from examples.llmc import model as reference
from fulmen import TensorProxy, get_grad, put_grad, put_grads
from fulmen.extend import OperatorExecutor, register_executor

__all__ = ["LLMC_SYMBOLS", "llmc_executor"]

llmc_executor = OperatorExecutor("llm.c")
register_executor(llmc_executor)


def _on_cuda(*tensors: Any) -> bool:
    return all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors)


def _cuda_fp32(*tensors: Any) -> bool:
    return _on_cuda(*tensors) and all(t.dtype == torch.float32 for t in tensors)


def _ints(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


# ---- kernel operators ------------------------------------------------------------------------------------------


def _permute_like(qkv):
    B, T, _, NH, d = qkv.shape
    return tuple(TensorProxy(like=qkv, shape=(B, NH, T, d)) for _ in range(3))


def _permute_backward_like(dq, dk, dv):
    B, NH, T, d = dq.shape
    return TensorProxy(like=dq, shape=(B, T, 3, NH, d))


def _unpermute_like(heads):
    B, NH, T, d = heads.shape
    return TensorProxy(like=heads, shape=(B, T, NH, d))


def _unpermute_backward_like(dmerged):
    B, T, NH, d = dmerged.shape
    return TensorProxy(like=dmerged, shape=(B, NH, T, d))


def _layernorm_like(x, weight, bias, eps=1e-5):
    stats_shape = tuple(x.shape[:-1])
    return TensorProxy(like=x), TensorProxy(like=x, shape=stats_shape), TensorProxy(like=x, shape=stats_shape)


register = llmc_executor.register_operator
llmc_permute = register("llmc_permute", like=_permute_like, fn=kernels.permute_split)
llmc_permute_backward = register("llmc_permute_backward", like=_permute_backward_like,
                                 fn=kernels.permute_split_backward)
llmc_unpermute = register("llmc_unpermute", like=_unpermute_like, fn=kernels.unpermute_forward)
llmc_unpermute_backward = register("llmc_unpermute_backward", like=_unpermute_backward_like,
                                   fn=kernels.unpermute_backward)
llmc_softmax = register("llmc_softmax", like=lambda x: TensorProxy(like=x), fn=kernels.softmax_forward)
llmc_crossentropy = register("llmc_crossentropy", like=lambda probs, targets: TensorProxy(like=targets,
                             dtype=probs.dtype), fn=kernels.crossentropy_forward)
llmc_crossentropy_softmax_backward = register(
    "llmc_crossentropy_softmax_backward",
    like=lambda dlosses, probs, targets: TensorProxy(like=probs),
    fn=kernels.crossentropy_softmax_backward,
)
llmc_gelu = register("llmc_gelu", like=lambda x: TensorProxy(like=x), fn=kernels.gelu_forward)
llmc_gelu_backward = register("llmc_gelu_backward", like=lambda x, grad: TensorProxy(like=x),
                              fn=kernels.gelu_backward)
llmc_layernorm = register("llmc_layernorm", like=_layernorm_like, fn=kernels.layernorm_forward)
llmc_layernorm_backward = register(
    "llmc_layernorm_backward",
    like=lambda grad, x, weight, mean, rstd: (TensorProxy(like=x), TensorProxy(like=weight), TensorProxy(like=weight)),
    fn=kernels.layernorm_backward,
)

#: The kernel operators (every operator registered so far): a forward plus backward of the reference GPT-2 calls
#: them all when every replacement applies.
LLMC_SYMBOLS = frozenset(llmc_executor.operators)


# ---- the model's _permute: fused qkv -> q, k, v -----------------------------------------------------------------

llmc_permute_util = register(
    "llmc_permute_util",
    like=lambda qkv, n_embd, n_head, B, T, C: tuple(
        TensorProxy(like=qkv, shape=(B, n_head, T, C // n_head)) for _ in range(3)
    ),
    fn=reference._permute,
    replaces=reference._permute,
)


def _permute_checker(qkv, n_embd, n_head, B, T, C) -> bool:
    return (
        _cuda_fp32(qkv)
        and _ints(n_embd, n_head, B, T, C)
        and n_head > 0
        and n_embd == C  # split(n_embd) must cut exactly the q, k and v blocks the kernel expects
        and C % n_head == 0
        and tuple(qkv.shape) == (B, T, 3 * C)
    )


def _fused_qkv(qkv, n_head, B, T, C):
    return qkv.reshape(B, T, 3, n_head, C // n_head)


def _permute_execution(qkv, n_embd, n_head, B, T, C):
    return llmc_permute(_fused_qkv(qkv, n_head, B, T, C))


def _permute_grad(qkv, n_embd, n_head, B, T, C):
    q, k, v = llmc_permute(_fused_qkv(qkv, n_head, B, T, C))
    dqkv = llmc_permute_backward(get_grad(q), get_grad(k), get_grad(v))
    put_grad(qkv, dqkv.reshape(qkv.shape))
    return q, k, v


llmc_executor.register_implementation(
    llmc_permute_util, checker=_permute_checker, execution_transform=_permute_execution,
    grad_transform=_permute_grad,
)


# ---- the model's _unpermute: heads -> side by side ---------------------------------------------------------------

llmc_unpermute_util = register(
    "llmc_unpermute_util",
    like=lambda y, B, T, C: TensorProxy(like=y, shape=(B, T, C)),
    fn=reference._unpermute,
    replaces=reference._unpermute,
)


def _unpermute_checker(y, B, T, C) -> bool:
    if not (_cuda_fp32(y) and _ints(B, T, C) and y.ndim == 4):
        return False
    b, n_head, t, head_size = y.shape
    return (b, t, n_head * head_size) == (B, T, C)


def _unpermute_execution(y, B, T, C):
    return llmc_unpermute(y).view(B, T, C)


def _unpermute_grad(y, B, T, C):
    merged = llmc_unpermute(y)
    out = merged.view(B, T, C)
    put_grad(y, llmc_unpermute_backward(get_grad(out).reshape(merged.shape)))
    return out


llmc_executor.register_implementation(
    llmc_unpermute_util, checker=_unpermute_checker, execution_transform=_unpermute_execution,
    grad_transform=_unpermute_grad,
)


# ---- NewGELU.forward ---------------------------------------------------------------------------------------------

llmc_module_gelu = register(
    "llmc_module_gelu",
    like=lambda self, x: TensorProxy(like=x),
    fn=reference.NewGELU.forward,
    replaces=reference.NewGELU.forward,
)


def _gelu_grad(self, x):
    y = llmc_gelu(x)
    put_grad(x, llmc_gelu_backward(x, get_grad(y)))
    return y


llmc_executor.register_implementation(
    llmc_module_gelu,
    checker=lambda self, x: _cuda_fp32(x),
    execution_transform=lambda self, x: llmc_gelu(x),
    grad_transform=_gelu_grad,
)


# ---- torch.nn.functional.layer_norm --------------------------------------------------------------------------------

llmc_layer_norm = register(
    "llmc_layer_norm",
    like=lambda x, normalized_shape, weight=None, bias=None, eps=1e-5: TensorProxy(like=x),
    fn=F.layer_norm,
    replaces=F.layer_norm,
)


def _layer_norm_checker(x, normalized_shape, weight=None, bias=None, eps=1e-5) -> bool:
    # The kernels normalise over the last dim only and need both affine parameters.
    if weight is None or bias is None or not _cuda_fp32(x, weight, bias) or x.ndim < 1:
        return False
    C = x.shape[-1]
    return (
        tuple(normalized_shape) == (C,)
        and tuple(weight.shape) == (C,)
        and tuple(bias.shape) == (C,)
        and isinstance(eps, float | int)
    )


def _layer_norm_execution(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    out, _, _ = llmc_layernorm(x, weight, bias, eps)
    return out


def _layer_norm_grad(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    out, mean, rstd = llmc_layernorm(x, weight, bias, eps)
    dx, dweight, dbias = llmc_layernorm_backward(get_grad(out), x, weight, mean, rstd)
    put_grads((x, weight, bias), (dx, dweight, dbias))
    return out


llmc_executor.register_implementation(
    llmc_layer_norm, checker=_layer_norm_checker, execution_transform=_layer_norm_execution,
    grad_transform=_layer_norm_grad,
)


# ---- torch.softmax (the attention's) -----------------------------------------------------------------------------


def _softmax_checker(x, dim, dtype=None) -> bool:
    return (
        _cuda_fp32(x)
        and x.ndim >= 1
        and isinstance(dim, int)
        and dim in (-1, x.ndim - 1)
        and dtype in (None, torch.float32)
    )


def _softmax_execution(x, dim, dtype=None):
    return llmc_softmax(x)


def _softmax_grad(x, dim, dtype=None):
    # llm.c has no standalone softmax backward kernel (its attention backward is fused), so the backward is
    # the usual y * (g - sum(g * y)) in torch ops.
    y = llmc_softmax(x)
    g = get_grad(y)
    put_grad(x, y * (g - (g * y).sum(dim=-1, keepdim=True)))
    return y


llmc_executor.register_implementation(
    fulmen.torch.softmax, checker=_softmax_checker, execution_transform=_softmax_execution,
    grad_transform=_softmax_grad,
)


# ---- torch.nn.functional.cross_entropy (the loss) --------------------------------------------------------------------
# The kernels treat negative targets as ignored (loss 0, gradient 0), which is torch's behaviour for any
# ignore_index < 0: a negative target other than ignore_index is an error in torch. The mean is taken over the
# positions that are not ignored, as torch's reduction="mean" does; counting them is a tensor op, so it needs no
# data-dependent read.


def _cross_entropy_checker(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                           reduction="mean", label_smoothing=0.0) -> bool:
    return (
        _cuda_fp32(input)
        and input.ndim == 2
        and _on_cuda(target)
        and target.dtype in (torch.int64, torch.int32)
        and tuple(target.shape) == (input.shape[0],)
        and weight is None
        and size_average is None
        and reduce is None
        and isinstance(ignore_index, int)
        and ignore_index < 0
        and reduction == "mean"
        and label_smoothing == 0.0
    )


def _valid_positions(losses, target):
    return (target >= 0).sum().to(losses.dtype)


def _cross_entropy_execution(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                             reduction="mean", label_smoothing=0.0):
    losses = llmc_crossentropy(llmc_softmax(input), target)
    return losses.sum() / _valid_positions(losses, target)


def _cross_entropy_grad(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                        reduction="mean", label_smoothing=0.0):
    probs = llmc_softmax(input)
    losses = llmc_crossentropy(probs, target)
    n_valid = _valid_positions(losses, target)
    loss = losses.sum() / n_valid
    # d loss / d losses_r = 1 / n_valid for every position; ignored ones get no gradient in the kernel anyway.
    dlosses = fulmen.torch.ones_like(losses) * (get_grad(loss) / n_valid)
    put_grad(input, llmc_crossentropy_softmax_backward(dlosses, probs, target))
    return loss


llmc_executor.register_implementation(
    fulmen.torch.cross_entropy, checker=_cross_entropy_checker, execution_transform=_cross_entropy_execution,
    grad_transform=_cross_entropy_grad,
)
