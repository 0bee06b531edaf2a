"""The "liger" operator executor: Liger-Kernel's Triton kernels (the optional extra `fulmen[liger]`).

Operators (what final traces call; LIGER_SYMBOLS), in effect only while "liger" is in the executor list:

- fused linear + cross-entropy: `liger_fused_linear_cross_entropy` runs fulmen's fused loss
  (`fused_loss.linear_cross_entropy[_forward]`, fulmen.transforms.fused_loss): Liger's chunked kernel computes the
  loss and the gradients for h, W and the bias in the forward, as fulmen's own does.
- cross-entropy: `liger_cross_entropy` / `_backward`, an implementation of torch's `cross_entropy` (2-D logits, class
  indices, no class weights) where it is not fused with a linear.
- RMSNorm: LitGPT's `RMSNorm.forward` is traced through a lookaside that states it as `rms_norm(x, weight, ...)`,
  which `litgpt_rms_norm` replaces: `liger_rms_norm` / `_backward`.
- RoPE: `liger_litgpt_apply_rope` replaces LitGPT's `apply_rope`: `liger_apply_rope` / `_backward`.
- SwiGLU: LitGPT's `LLaMAMLP.forward` is traced through fulmen.unsloth's restatement with a `swiglu(e, g)` call, which
  `liger_litgpt_swiglu` replaces: `liger_swiglu` / `_backward`.

Each checker accepts CUDA tensors when liger-kernel (and so Triton) is installed; anything else is declined with a
warning that gives the reason, and runs as if the executor were absent. Under Triton's interpreter (TRITON_INTERPRET=1)
the kernels that run there (cross-entropies and RoPE) also take CPU tensors. liger_kernel is imported at the first
check that needs it, so this module imports without it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import warnings
from collections.abc import Callable
from typing import Any

import litgpt.model
import torch
import torch.nn.functional as F

from fulmen import TensorProxy, get_grad, put_grad, put_grads
from fulmen.extend import OperatorExecutor, fused_loss, register_executor
from fulmen.unsloth.executor import KNOWN_LLAMA_MLP_FORWARDS, forward_fingerprint, llama_mlp_forward, swiglu

__all__ = ["LIGER_SYMBOLS", "decline_reason", "liger_ex"]

liger_ex = OperatorExecutor("liger")
register_executor(liger_ex)

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# Liger 0.8's RMSNorm and SwiGLU kernels do not run under Triton's interpreter (they call .to on Python floats).
INTERPRETABLE = frozenset({"fused linear + cross-entropy", "cross-entropy", "RoPE"})


@functools.cache
def _kernels() -> Any:
    """fulmen.liger.kernels (liger_kernel and Triton), or the reason it cannot be imported."""
    try:
        return importlib.import_module(f"{__package__}.kernels")
    except ImportError as error:
        return f"liger-kernel is not importable ({error}; pip install 'fulmen[liger]')"


def decline_reason(kernel: str, *tensors: Any) -> str | None:
    """Why the Liger kernel named `kernel` cannot run on these tensors (None: it can)."""
    devices = {t.device for t in tensors if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        return f"its tensors are on several devices ({sorted(map(str, devices))})"
    on_cuda = all(d.type == "cuda" for d in devices)
    interpreted = (all(d.type == "cpu" for d in devices) and kernel in INTERPRETABLE
                   and os.environ.get("TRITON_INTERPRET") == "1")
    if on_cuda or interpreted:
        kernels = _kernels()
        if isinstance(kernels, str):
            return kernels
        if on_cuda or kernels.interpreted():  # Triton decided when it was imported, maybe before TRITON_INTERPRET
            return None
    return f"Liger's kernels run on CUDA tensors, these are on {sorted({d.type for d in devices})}"


def _accepts(kernel: str, reason: str | None) -> bool:
    """A checker's answer: True without a reason to decline; with one, False and a warning that gives it."""
    if reason is not None:
        warnings.warn(f"the liger executor does not run {kernel}: {reason}; torch runs it instead", stacklevel=2)
    return reason is None


def _kernel(function: str) -> Callable[..., Any]:
    """Runs `fulmen.liger.kernels.<function>`."""

    def run(*args: Any, **kwargs: Any) -> Any:
        return getattr(_kernels(), function)(*args, **kwargs)

    run.__name__ = run.__qualname__ = function
    return run


def _wants(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


register = liger_ex.register_operator


# ---- fused linear + cross-entropy (fulmen's fused loss) -------------------------------------------------------------
def _flce_like(h, weight, bias, target, *, reduction, dtype, wants, **spec):
    loss = TensorProxy(like=h, shape=tuple(target.shape) if reduction == "none" else (), dtype=dtype)
    grads = [TensorProxy(like=t) for t, wanted in zip((h, weight, bias), wants) if wanted]
    return (loss, *grads)


liger_fused_linear_cross_entropy = register("liger_fused_linear_cross_entropy", like=_flce_like,
                                            fn=_kernel("fused_linear_cross_entropy"))


def _flce_checker(h, weight, bias, target, *, ignore_index, reduction, label_smoothing, dtype, chunk_rows,
                  wants=(False, False, False), compiled=False) -> bool:
    if not (h.dtype == weight.dtype in FLOATS and dtype in (h.dtype, torch.float32) and target.dtype == torch.int64
            and (bias is None or bias.dtype == h.dtype)):
        return _accepts("fused linear + cross-entropy", "it takes h and the weight in one float dtype, int64 targets "
                        f"and the loss in that dtype or float32 (got {h.dtype}, {weight.dtype} -> {dtype})")
    return _accepts("fused linear + cross-entropy", decline_reason("fused linear + cross-entropy", h, weight,
                                                                         bias, target))


def _flce(h, weight, bias, target, *, ignore_index, reduction, label_smoothing, dtype, wants, **unused):
    return liger_fused_linear_cross_entropy(h, weight, bias, target, ignore_index=ignore_index, reduction=reduction,
                                            label_smoothing=label_smoothing, dtype=dtype, wants=wants)


liger_ex.register_implementation(fused_loss.LINEAR_CROSS_ENTROPY_FORWARD, checker=_flce_checker,
                                 execution_transform=_flce)
liger_ex.register_implementation(
    fused_loss.LINEAR_CROSS_ENTROPY, checker=_flce_checker,
    execution_transform=lambda *args, **kwargs: _flce(*args, **kwargs, wants=(False, False, False))[0])


# ---- torch.nn.functional.cross_entropy -----------------------------------------------------------------------------
_CROSS_ENTROPY = inspect.signature(F.cross_entropy)


def _ce_arguments(*args: Any, **kwargs: Any) -> dict[str, Any]:
    bound = _CROSS_ENTROPY.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _ce_like(logits, target, *, reduction, want_grad, **spec):
    loss = TensorProxy(like=logits, shape=tuple(target.shape) if reduction == "none" else ())
    return (loss, TensorProxy(like=logits)) if want_grad else (loss,)


liger_cross_entropy = register("liger_cross_entropy", like=_ce_like, fn=_kernel("cross_entropy"))
liger_cross_entropy_backward = register("liger_cross_entropy_backward", like=lambda g, grad: TensorProxy(like=grad),
                                        fn=_kernel("cross_entropy_backward"))


def _ce_checker(*args: Any, **kwargs: Any) -> bool:
    a = _ce_arguments(*args, **kwargs)
    logits, target = a["input"], a["target"]
    if not (logits.ndim == 2 and logits.shape[0] > 0 and logits.dtype in FLOATS and target.dtype == torch.int64
            and tuple(target.shape) == (logits.shape[0],) and a["weight"] is None and a["size_average"] is None
            and a["reduce"] is None and type(a["ignore_index"]) is int and a["reduction"] in ("mean", "sum", "none")):
        return _accepts("cross-entropy", "it takes 2-D logits, class indices and no class weights")
    return _accepts("cross-entropy", decline_reason("cross-entropy", logits, target))


def _ce(a: dict[str, Any], want_grad: bool) -> tuple[TensorProxy, ...]:
    return liger_cross_entropy(a["input"], a["target"], ignore_index=a["ignore_index"], reduction=a["reduction"],
                               label_smoothing=float(a["label_smoothing"]), want_grad=want_grad)


def _ce_grad(*args: Any, **kwargs: Any) -> TensorProxy:
    a = _ce_arguments(*args, **kwargs)
    loss, grad = _ce(a, want_grad=True)
    put_grad(a["input"], liger_cross_entropy_backward(get_grad(loss), grad))
    return loss


liger_ex.register_implementation(
    F.cross_entropy, checker=_ce_checker, grad_transform=_ce_grad,
    execution_transform=lambda *args, **kwargs: _ce(_ce_arguments(*args, **kwargs), want_grad=False)[0])


# ---- LitGPT's RMSNorm ----------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, dim: int, eps: float, add_unit_offset: bool) -> torch.Tensor:
    """LitGPT's RMSNorm.forward as a function of tensors: the call boundary `litgpt_rms_norm` replaces."""
    dtype = x.dtype
    x = x.float()
    norm_x = torch.mean(x * x, dim=dim, keepdim=True)
    x_normed = x * torch.rsqrt(norm_x + eps)
    weight = (1 + weight) if add_unit_offset else weight
    return (x_normed * weight.float()).to(dtype=dtype)


def rms_norm_forward(self: litgpt.model.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """LitGPT's `RMSNorm.forward`, as a call of `rms_norm`."""
    return rms_norm(x, self.weight, self.dim, self.eps, self.add_unit_offset)


# The forwards `rms_norm_forward` restates (forward_fingerprint: sha256 of the body, comments and layout aside).
KNOWN_RMS_NORM_FORWARDS = frozenset({
    "f30e670f14422dda",  # LitGPT 0.5.13: dtype; x.float(); mean(x * x); rsqrt; (1 + weight) if offset; .to(dtype)
})

litgpt_rms_norm = register("litgpt_rms_norm", fn=rms_norm, replaces=rms_norm)
liger_rms_norm = register("liger_rms_norm", fn=_kernel("rms_norm"), like=lambda x, weight, eps, offset: (
    TensorProxy(like=x), TensorProxy(like=x, shape=(x.numel() // x.shape[-1],), dtype=torch.float32)))
liger_rms_norm_backward = register(
    "liger_rms_norm_backward", fn=_kernel("rms_norm_backward"),
    like=lambda grad, x, weight, rstd, offset, want_weight: (TensorProxy(like=x), TensorProxy(like=weight))[
        : 2 if want_weight else 1])


def _rms_norm_checker(x, weight, dim, eps, add_unit_offset) -> bool:
    if not (x.dtype in FLOATS and isinstance(weight, torch.Tensor) and weight.dtype in FLOATS and x.ndim >= 1
            and dim in (-1, x.ndim - 1) and tuple(weight.shape) == (x.shape[-1],) and x.numel() > 0):
        return _accepts("RMSNorm", "it normalises the last dim with a weight of that size")
    return _accepts("RMSNorm", decline_reason("RMSNorm", x, weight))


def _rms_norm_grad(x, weight, dim, eps, add_unit_offset):
    offset = 1.0 if add_unit_offset else 0.0
    y, rstd = liger_rms_norm(x, weight, eps, offset)
    grads = liger_rms_norm_backward(get_grad(y), x, weight, rstd, offset, _wants(weight))
    put_grads((x, weight)[: len(grads)], grads)
    return y


liger_ex.register_implementation(
    litgpt_rms_norm, checker=_rms_norm_checker, grad_transform=_rms_norm_grad,
    execution_transform=lambda x, weight, dim, eps, add_unit_offset: liger_rms_norm(
        x, weight, eps, 1.0 if add_unit_offset else 0.0)[0])


# ---- LitGPT's apply_rope -------------------------------------------------------------------------------------------
liger_litgpt_apply_rope = register("liger_litgpt_apply_rope", fn=litgpt.model.apply_rope,
                                   replaces=litgpt.model.apply_rope)


def _heads_last(x: TensorProxy, cos: TensorProxy, sin: TensorProxy) -> torch.Tensor:
    """Liger rotates a (B, T, heads, dim) copy in place and returns it as the (B, heads, T, dim) view."""
    batch, heads, time, dim = x.shape
    return torch.empty(batch, time, heads, dim, dtype=x.dtype, device="meta").transpose(1, 2)


liger_apply_rope = register("liger_apply_rope", like=_heads_last, fn=_kernel("apply_rope"))
liger_apply_rope_backward = register("liger_apply_rope_backward", like=_heads_last, fn=_kernel("apply_rope_backward"))


def _apply_rope_checker(x, cos, sin) -> bool:
    if not (x.ndim == 4 and cos.ndim == 3 and x.dtype in FLOATS and cos.dtype == sin.dtype
            and cos.dtype in (x.dtype, torch.float32) and tuple(cos.shape) == tuple(sin.shape)
            and cos.shape[0] in (1, x.shape[0]) and tuple(cos.shape[1:]) == tuple(x.shape[2:])
            and x.shape[-1] % 2 == 0 and not (cos.requires_grad or sin.requires_grad)):
        return _accepts("RoPE", "it takes x (B, heads, T, dim) and cos, sin (1 or B, T, dim) that need no grad")
    return _accepts("RoPE", decline_reason("RoPE", x, cos, sin))


def _apply_rope_grad(x, cos, sin):
    out = liger_apply_rope(x, cos, sin)
    put_grad(x, liger_apply_rope_backward(get_grad(out), cos, sin))
    return out


liger_ex.register_implementation(liger_litgpt_apply_rope, checker=_apply_rope_checker,
                                 execution_transform=liger_apply_rope, grad_transform=_apply_rope_grad)


# ---- SwiGLU in LitGPT's LLaMAMLP -----------------------------------------------------------------------------------
liger_litgpt_swiglu = register("liger_litgpt_swiglu", fn=swiglu, replaces=swiglu)
# Rerunning SwiGLU in the backward (where proj's weight gradient reads it) costs less than saving its output.
liger_swiglu = register("liger_swiglu", like=lambda e, g: TensorProxy(like=e), fn=_kernel("swiglu"),
                        recomputable=True)
liger_swiglu_backward = register("liger_swiglu_backward", like=lambda grad, e, g: (TensorProxy(like=e),
                                                                                   TensorProxy(like=g)),
                                 fn=_kernel("swiglu_backward"))


def _swiglu_checker(e, g) -> bool:
    if not (e.dtype in FLOATS and e.dtype == g.dtype and tuple(e.shape) == tuple(g.shape) and e.numel() > 0):
        return _accepts("SwiGLU", "it takes two tensors of one shape and float dtype")
    return _accepts("SwiGLU", decline_reason("SwiGLU", e, g))


def _swiglu_grad(e, g):
    h = liger_swiglu(e, g)
    put_grads((e, g), liger_swiglu_backward(get_grad(h), e, g))
    return h


liger_ex.register_implementation(liger_litgpt_swiglu, checker=_swiglu_checker, execution_transform=liger_swiglu,
                                 grad_transform=_swiglu_grad)

for _original, _forward, _known, _what in (
        (litgpt.model.RMSNorm.forward, rms_norm_forward, KNOWN_RMS_NORM_FORWARDS, "RMSNorm"),
        (litgpt.model.LLaMAMLP.forward, llama_mlp_forward, KNOWN_LLAMA_MLP_FORWARDS, "SwiGLU")):
    if forward_fingerprint(_original) in _known:
        liger_ex.register_lookaside(_original, _forward)
    else:  # restating a forward that changed could compute something else: better no kernel than a wrong one
        warnings.warn(f"the liger executor does not know this LitGPT's {_original.__qualname__}: its {_what} kernel "
                      "is not used", stacklevel=1)

#: The kernel operators: a LitGPT Llama-family training step on CUDA calls them all (the cross-entropy ones when its
#: loss is not fused with the lm_head).
LIGER_SYMBOLS = frozenset(sym.name for sym in (
    liger_fused_linear_cross_entropy, liger_cross_entropy, liger_cross_entropy_backward, liger_rms_norm,
    liger_rms_norm_backward, liger_apply_rope, liger_apply_rope_backward, liger_swiglu, liger_swiglu_backward,
))
