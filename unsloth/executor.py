"""The "unsloth" operator executor: fulmen's Triton kernels for cross-entropy, SwiGLU and RoPE.

Kernel operators (what final traces call; UNSLOTH_SYMBOLS): `unsloth_cross_entropy` / `_backward`,
`unsloth_swiglu` / `_backward`, `unsloth_apply_rope` / `_backward`. They take effect only while "unsloth" is in the
executor list:

- cross-entropy: an implementation of torch's `cross_entropy` symbol (2-D logits, int64 targets, reductions
  mean/sum/none, any ignore_index; no class weights or label smoothing).
- RoPE: `litgpt_apply_rope` replaces LitGPT's `apply_rope` (x of 3 or 4 dims, any strides and heads, cos/sin of
  batch 1 or B, an even number of rotated dims: partial rotary slices included).
- SwiGLU: LitGPT's `LLaMAMLP.forward` is traced through a lookaside that states the product as `swiglu(e, g)`, which
  `litgpt_swiglu` replaces (for the LitGPT forwards the lookaside is known to restate: KNOWN_LLAMA_MLP_FORWARDS).

Each checker accepts CUDA tensors of float dtypes when Triton is installed (and CPU tensors under Triton's
interpreter, TRITON_INTERPRET=1); anything else is declined and runs as if the executor were absent. Triton and the
kernels are imported at the first kernel call, so this module imports without a GPU or Triton.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import os
import sys
import textwrap
import warnings
from collections.abc import Callable
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
KERNEL_MODULES = ("cross_entropy", "swiglu", "rope")


@functools.cache
def _triton_missing() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError as error:
        warnings.warn(f"the unsloth executor needs Triton ({error}; pip install triton): its kernels are skipped "
                      "and torch runs those operations", stacklevel=1)
        return True
    return False


def _interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels (on CPU tensors). Triton decides when a kernel is decorated,
    that is when the kernel modules are imported: before that, TRITON_INTERPRET=1 says they will be."""
    rope = sys.modules.get(f"{__package__}.rope")
    if rope is not None:
        return type(rope._rope_kernel).__name__ == "InterpretedFunction"
    return os.environ.get("TRITON_INTERPRET") == "1"


def _runnable(*tensors: Any) -> bool:
    """The kernels can run on these tensors: all on one CUDA device (or the CPU under Triton's interpreter)."""
    devices = {"cuda", "cpu"} if _interpreted() else {"cuda"}
    if not all(isinstance(t, torch.Tensor) and t.device.type in devices for t in tensors):
        return False
    return len({t.device for t in tensors}) == 1 and not _triton_missing()


def _floats(*tensors: TensorProxy) -> bool:
    return all(t.dtype in FLOAT_DTYPES for t in tensors)


# ---- kernel operators ----------------------------------------------------------------------------------------------


@functools.cache
def _kernel_modules() -> dict[str, Any]:
    """The kernel modules (and Triton), imported together at the first kernel call: all interpreted or all
    compiled."""
    return {name: importlib.import_module(f"{__package__}.{name}") for name in KERNEL_MODULES}


def _kernel(module: str, function: str) -> Callable[..., Any]:
    """Runs `fulmen.unsloth.<module>.<function>`."""

    def run(*args: Any) -> Any:
        return getattr(_kernel_modules()[module], function)(*args)

    run.__name__ = run.__qualname__ = f"{module}_{function}"
    return run


def _like_first(first: TensorProxy, *rest: Any) -> TensorProxy:
    return TensorProxy(like=first)


def _row_stats(logits: TensorProxy, target: TensorProxy, ignore_index: int) -> tuple[TensorProxy, TensorProxy]:
    """Per row: the loss and the log-sum-exp, fp32."""
    return tuple(TensorProxy(like=logits, shape=(logits.shape[0],), dtype=torch.float32) for _ in range(2))


register = unsloth_ex.register_operator
unsloth_cross_entropy = register("unsloth_cross_entropy", like=_row_stats, fn=_kernel("cross_entropy", "forward"))
unsloth_cross_entropy_backward = register(
    "unsloth_cross_entropy_backward", like=lambda dloss, logits, *rest: TensorProxy(like=logits),
    fn=_kernel("cross_entropy", "backward"),
)
# Rerunning SwiGLU in the backward (where proj's weight gradient reads it) costs less than saving its output.
unsloth_swiglu = register("unsloth_swiglu", like=_like_first, fn=_kernel("swiglu", "forward"), recomputable=True)
unsloth_swiglu_backward = register(
    "unsloth_swiglu_backward", like=lambda dh, e, g: (TensorProxy(like=e), TensorProxy(like=g)),
    fn=_kernel("swiglu", "backward"),
)
unsloth_apply_rope = register("unsloth_apply_rope", like=_like_first, fn=_kernel("rope", "forward"))
unsloth_apply_rope_backward = register("unsloth_apply_rope_backward", like=_like_first,
                                       fn=_kernel("rope", "backward"))

#: The kernel operators: a LitGPT Llama-family training step on CUDA calls them all.
UNSLOTH_SYMBOLS = frozenset(sym.name for sym in (
    unsloth_cross_entropy, unsloth_cross_entropy_backward, unsloth_swiglu, unsloth_swiglu_backward,
    unsloth_apply_rope, unsloth_apply_rope_backward,
))


# ---- torch.nn.functional.cross_entropy -----------------------------------------------------------------------------

_CROSS_ENTROPY = inspect.signature(F.cross_entropy)


def _cross_entropy_arguments(*args: Any, **kwargs: Any) -> dict[str, Any]:
    bound = _CROSS_ENTROPY.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _cross_entropy_checker(*args: Any, **kwargs: Any) -> bool:
    a = _cross_entropy_arguments(*args, **kwargs)
    logits, target = a["input"], a["target"]
    return (
        _runnable(logits, target)
        and logits.ndim == 2
        and logits.shape[0] > 0
        and logits.shape[1] > 0
        and _floats(logits)
        and target.dtype == torch.int64
        and tuple(target.shape) == (logits.shape[0],)
        and a["weight"] is None
        and a["size_average"] is None
        and a["reduce"] is None
        and type(a["ignore_index"]) is int
        and a["reduction"] in ("mean", "sum", "none")
        and a["label_smoothing"] == 0.0
    )


def _cross_entropy(a: dict[str, Any]) -> tuple[TensorProxy, TensorProxy, TensorProxy | None]:
    """The kernel's call on F.cross_entropy's arguments `a`, reduced: (the loss in the logits' dtype, the per-row
    log-sum-exp, for a mean the number of targets it counts)."""
    logits, target, ignore_index, reduction = a["input"], a["target"], a["ignore_index"], a["reduction"]
    losses, lse = unsloth_cross_entropy(logits, target, ignore_index)
    if reduction == "none":
        return losses.to(logits.dtype), lse, None
    if reduction == "sum":
        return losses.sum().to(logits.dtype), lse, None
    n_valid = (target != ignore_index).sum()  # torch's mean counts the targets not ignored (NaN when none is)
    return (losses.sum() / n_valid).to(logits.dtype), lse, n_valid


def _cross_entropy_grad(*args: Any, **kwargs: Any) -> TensorProxy:
    a = _cross_entropy_arguments(*args, **kwargs)
    loss, lse, n_valid = _cross_entropy(a)
    dloss = get_grad(loss)  # one per row (none), or one for all rows (sum, mean)
    if n_valid is not None:
        dloss = dloss.to(torch.float32) / n_valid
    dlogits = unsloth_cross_entropy_backward(dloss, a["input"], a["target"], lse, a["ignore_index"])
    put_grad(a["input"], dlogits)
    return loss


unsloth_ex.register_implementation(
    F.cross_entropy, checker=_cross_entropy_checker,
    execution_transform=lambda *args, **kwargs: _cross_entropy(_cross_entropy_arguments(*args, **kwargs))[0],
    grad_transform=_cross_entropy_grad,
)


# ---- LitGPT's apply_rope -------------------------------------------------------------------------------------------

# Without like=, the output is what apply_rope itself returns (it broadcasts x against a larger cos batch, which
# the checker then declines).
litgpt_apply_rope = register("litgpt_apply_rope", fn=litgpt.model.apply_rope, replaces=litgpt.model.apply_rope)


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


# The forwards `llama_mlp_forward` restates: sha256 of the body `ast.unparse` prints (comments and layout aside).
KNOWN_LLAMA_MLP_FORWARDS = frozenset({
    "5297c46a632cd72a",  # LitGPT 0.5.13: x_fc_1 = self.fc_1(x); x_fc_2 = self.fc_2(x); F.silu(x_fc_1) * x_fc_2; proj
})


def forward_fingerprint(function: Callable[..., Any]) -> str | None:
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    body = ast.unparse(ast.Module(ast.parse(source).body[0].body, []))
    return hashlib.sha256(body.encode()).hexdigest()[:16]


litgpt_swiglu = register("litgpt_swiglu", fn=swiglu, replaces=swiglu)


def _swiglu_checker(e, g) -> bool:
    return _runnable(e, g) and _floats(e) and e.dtype == g.dtype and tuple(e.shape) == tuple(g.shape)


def _swiglu_grad(e, g):
    h = unsloth_swiglu(e, g)
    put_grads((e, g), unsloth_swiglu_backward(get_grad(h), e, g))
    return h


unsloth_ex.register_implementation(
    litgpt_swiglu, checker=_swiglu_checker, execution_transform=unsloth_swiglu, grad_transform=_swiglu_grad,
)
if forward_fingerprint(litgpt.model.LLaMAMLP.forward) in KNOWN_LLAMA_MLP_FORWARDS:
    unsloth_ex.register_lookaside(litgpt.model.LLaMAMLP.forward, llama_mlp_forward)
else:  # restating a forward that changed could compute something else: better no kernel than a wrong one
    warnings.warn("the unsloth executor does not know this LitGPT's LLaMAMLP.forward: its SwiGLU kernel is not used "
                  "(cross-entropy and RoPE are)", stacklevel=1)
