"""The "unsloth" operator executor: fulmen's Triton kernels for cross-entropy, SwiGLU and RoPE.

Kernel operators (what final traces call; UNSLOTH_SYMBOLS): `unsloth_cross_entropy` / `_backward`,
`unsloth_swiglu` / `_backward`, `unsloth_apply_rope` / `_backward`. They take effect only while "unsloth" is in the
executor list:

- cross-entropy: an implementation of torch's `cross_entropy` symbol (2-D logits, int64 targets, reductions
  mean/sum/none, any ignore_index; no class weights or label smoothing).
- RoPE: `litgpt_apply_rope` replaces LitGPT's `apply_rope` (x of 3 or 4 dims, any strides and heads, cos/sin of
  batch 1 or B, an even number of rotated dims: partial rotary slices included).
- SwiGLU: LitGPT's `LLaMAMLP.forward` is traced through a lookaside that states the product as `swiglu(e, g)`, which
  `litgpt_swiglu` replaces.

Each checker accepts CUDA tensors of float dtypes when Triton is installed (and CPU tensors under Triton's
interpreter, TRITON_INTERPRET=1); anything else is declined and runs as the executor were absent. Triton and the
kernels are imported at the first kernel call, so this module imports without a GPU or Triton.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from types import ModuleType
from typing import Any

import litgpt.model
import torch
import torch.nn.functional as F

from fulmen import TensorProxy, get_grad, put_grad, put_grads
from fulmen.extend import OperatorExecutor, register_executor

__all__ = ["UNSLOTH_SYMBOLS", "swiglu", "unsloth_ex"]

unsloth_ex = OperatorExecutor("unsloth")
register_executor(unsloth_ex)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _kernels(name: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.{name}")


@functools.cache
def _triton_missing() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError as error:
        warnings.warn(f"the unsloth executor needs Triton ({error}; pip install triton): its kernels are skipped "
                      "and torch runs those operations", stacklevel=2)
        return True
    return False


def _runnable(*tensors: Any) -> bool:
    """The kernels can run on these tensors: CUDA ones (CPU ones under Triton's interpreter), float dtypes."""
    devices = {"cuda", "cpu"} if os.environ.get("TRITON_INTERPRET") == "1" else {"cuda"}
    if not all(isinstance(t, torch.Tensor) and t.device.type in devices for t in tensors):
        return False
    return len({t.device for t in tensors}) == 1 and not _triton_missing()


def _floats(*tensors: TensorProxy) -> bool:
    return all(t.dtype in FLOAT_DTYPES for t in tensors)


# ---- kernel operators ----------------------------------------------------------------------------------------------


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int):
    return _kernels("cross_entropy").forward(logits, target, ignore_index)


def _cross_entropy_backward(dloss, logits, target, lse, ignore_index: int):
    return _kernels("cross_entropy").backward(dloss, logits, target, lse, ignore_index)


def _swiglu(e: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return _kernels("swiglu").forward(e, g)


def _swiglu_backward(dh: torch.Tensor, e: torch.Tensor, g: torch.Tensor):
    return _kernels("swiglu").backward(dh, e, g)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _kernels("rope").forward(x, cos, sin)


def _apply_rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _kernels("rope").backward(grad, cos, sin)


def _row_stats(logits: TensorProxy, target: TensorProxy, ignore_index: int):
    rows = (logits.shape[0],)
    return TensorProxy(like=logits, shape=rows, dtype=torch.float32), TensorProxy(like=logits, shape=rows,
                                                                                 dtype=torch.float32)


register = unsloth_ex.register_operator
unsloth_cross_entropy = register("unsloth_cross_entropy", like=_row_stats, fn=_cross_entropy)
unsloth_cross_entropy_backward = register(
    "unsloth_cross_entropy_backward", like=lambda dloss, logits, target, lse, ignore_index: TensorProxy(like=logits),
    fn=_cross_entropy_backward,
)
# Rerunning SwiGLU in the backward (where proj's weight gradient reads it) costs less than saving its output.
unsloth_swiglu = register("unsloth_swiglu", like=lambda e, g: TensorProxy(like=e), fn=_swiglu, recomputable=True)
unsloth_swiglu_backward = register(
    "unsloth_swiglu_backward", like=lambda dh, e, g: (TensorProxy(like=e), TensorProxy(like=g)), fn=_swiglu_backward,
)
unsloth_apply_rope = register("unsloth_apply_rope", like=lambda x, cos, sin: TensorProxy(like=x), fn=_apply_rope)
unsloth_apply_rope_backward = register(
    "unsloth_apply_rope_backward", like=lambda grad, cos, sin: TensorProxy(like=grad), fn=_apply_rope_backward,
)

#: The kernel operators: a LitGPT Llama-family training step on CUDA calls them all.
UNSLOTH_SYMBOLS = frozenset(unsloth_ex.operators)


# ---- torch.nn.functional.cross_entropy -----------------------------------------------------------------------------


def _cross_entropy_checker(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                           reduction="mean", label_smoothing=0.0) -> bool:
    return (
        _runnable(input, target)
        and input.ndim == 2
        and input.shape[0] > 0
        and _floats(input)
        and target.dtype == torch.int64
        and tuple(target.shape) == (input.shape[0],)
        and weight is None
        and size_average is None
        and reduce is None
        and type(ignore_index) is int
        and reduction in ("mean", "sum", "none")
        and label_smoothing == 0.0
    )


def _reduce(losses: TensorProxy, target: TensorProxy, ignore_index: int, reduction: str, dtype: torch.dtype):
    """The reduced loss in the logits' dtype, and for the mean the number of targets it divides by."""
    if reduction == "none":
        return losses.to(dtype), None
    if reduction == "sum":
        return losses.sum().to(dtype), None
    # torch's mean is over the targets that are not ignored (NaN when all are)
    n_valid = (target != ignore_index).sum()
    return (losses.sum() / n_valid).to(dtype), n_valid


def _cross_entropy_execution(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                             reduction="mean", label_smoothing=0.0):
    losses, _ = unsloth_cross_entropy(input, target, ignore_index)
    return _reduce(losses, target, ignore_index, reduction, input.dtype)[0]


def _cross_entropy_grad(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                        reduction="mean", label_smoothing=0.0):
    losses, lse = unsloth_cross_entropy(input, target, ignore_index)
    loss, n_valid = _reduce(losses, target, ignore_index, reduction, input.dtype)
    dloss = get_grad(loss)  # one per row (none), or one for all rows (sum, mean)
    if n_valid is not None:
        dloss = dloss.to(torch.float32) / n_valid
    put_grad(input, unsloth_cross_entropy_backward(dloss, input, target, lse, ignore_index))
    return loss


unsloth_ex.register_implementation(
    F.cross_entropy, checker=_cross_entropy_checker, execution_transform=_cross_entropy_execution,
    grad_transform=_cross_entropy_grad,
)


# ---- LitGPT's apply_rope -------------------------------------------------------------------------------------------

litgpt_apply_rope = register(
    "litgpt_apply_rope", like=lambda x, cos, sin: TensorProxy(like=x), fn=litgpt.model.apply_rope,
    replaces=litgpt.model.apply_rope,
)


def _apply_rope_checker(x, cos, sin) -> bool:
    if not (_runnable(x, cos, sin) and _floats(x, cos, sin) and x.ndim in (3, 4) and cos.ndim == 3):
        return False
    n = x.shape[-1]
    return (
        tuple(cos.shape) == tuple(sin.shape)
        and cos.shape[0] in (1, x.shape[0])
        and cos.shape[1] == x.shape[-2]
        and cos.shape[2] == n  # LitGPT broadcasts a cos of width 1 for n_elem == 1
        and n % 2 == 0
        and n > 0
        and not (cos.requires_grad or sin.requires_grad)  # the kernels differentiate x only
    )


def _apply_rope_grad(x, cos, sin):
    out = unsloth_apply_rope(x, cos, sin)
    put_grad(x, unsloth_apply_rope_backward(get_grad(out), cos, sin))
    return out


unsloth_ex.register_implementation(
    litgpt_apply_rope, checker=_apply_rope_checker, execution_transform=unsloth_apply_rope,
    grad_transform=_apply_rope_grad,
)


# ---- SwiGLU in LitGPT's LLaMAMLP -----------------------------------------------------------------------------------


def swiglu(e: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """silu(e) * g: the call boundary `litgpt_swiglu` replaces."""
    return F.silu(e) * g


def llama_mlp_forward(self: litgpt.model.LLaMAMLP, x: torch.Tensor) -> torch.Tensor:
    """LitGPT's `LLaMAMLP.forward`, with its SwiGLU as a call of `swiglu`."""
    return self.proj(swiglu(self.fc_1(x), self.fc_2(x)))


litgpt_swiglu = register("litgpt_swiglu", like=lambda e, g: TensorProxy(like=e), fn=swiglu, replaces=swiglu)


def _swiglu_checker(e, g) -> bool:
    return _runnable(e, g) and _floats(e) and e.dtype == g.dtype and tuple(e.shape) == tuple(g.shape)


def _swiglu_grad(e, g):
    h = unsloth_swiglu(e, g)
    put_grads((e, g), unsloth_swiglu_backward(get_grad(h), e, g))
    return h


unsloth_ex.register_implementation(
    litgpt_swiglu, checker=_swiglu_checker, execution_transform=unsloth_swiglu, grad_transform=_swiglu_grad,
)
unsloth_ex.register_lookaside(litgpt.model.LLaMAMLP.forward, llama_mlp_forward)
