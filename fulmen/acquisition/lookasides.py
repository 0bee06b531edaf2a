"""Built-in lookasides of the acquisition (nothing is patched: see replacements.py).

A method lookaside answers a method for a traceable equivalent only inside fulmen's shadow modules. LitGPT's mixture of
experts routes tokens with `torch.where(mask)`, whose output shape depends on the routing (data-dependent); the
replacement runs every expert on every token and adds each output where the token was routed to the expert, weighted
by its routing probability: the same sum in the same expert order. A token an expert was not routed to reaches it as
zeros and its output is dropped by selection, not multiplied by a zero weight: eager never runs the expert on that
token, so an output that overflows there (inf, nan) must not reach the result or the grads as 0 * inf = nan.
An expert that draws random numbers (LoRA dropout in training mode) is refused: eager draws its mask for the routed
tokens only, a number known only from the routing's values, so no trace can draw eager's mask. BatchNorm with a
cumulative average (momentum=None) keeps its factor, 1 / num_batches_tracked, a tensor instead of a Python number.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fulmen.core.errors import UnsupportedOpError
from fulmen.core.source import user_location
from fulmen.core.symbol import BoundSymbol, Tag, current_builder
from fulmen.core.trace import TraceBuilder


def litgpt_moe_forward(self, x: torch.Tensor) -> torch.Tensor:
    batch, time, channels = x.size()
    residual_x = x
    x = x.view(-1, channels)
    if not self.config.n_expert_groups:
        router = self.gate(x)
        probs, indices = torch.topk(router, self.config.n_expert_per_token)
        probs = probs.softmax(dim=1, dtype=torch.float).to(dtype=x.dtype)
    else:
        probs, indices = self.gate(x)
    if self.config.routed_scaling_factor != 1.0:
        probs = probs * self.config.routed_scaling_factor
    routed = indices.unsqueeze(-1) == torch.arange(self.config.n_expert, device=x.device)  # (B*T, k, n_expert)
    weights = (probs.unsqueeze(-1) * routed).sum(dim=1)  # (B*T, n_expert): zero where not routed
    chosen = routed.any(dim=1)  # (B*T, n_expert)
    y = torch.zeros_like(x)
    builder = current_builder()
    scope = builder.scopes[-1] if isinstance(builder, TraceBuilder) else []
    start = len(scope)
    for expert_index, expert in enumerate(self.experts):
        rows = chosen[:, expert_index, None]
        out = expert(torch.where(rows, x, 0))
        y = y + torch.where(rows, weights[:, expert_index, None] * out, 0)
    _refuse_random_experts(type(self).__qualname__, scope[start:])
    y = y.view(batch, time, channels)
    if self.config.n_shared_expert:
        y = y + self.shared_experts(residual_x)
    return y


def _draws(bsym: BoundSymbol) -> bool:
    """Whether the call draws random numbers when it runs: a dropout in eval mode (`training=False`) does not,
    though its symbol is tagged as drawing; a call whose arguments cannot be read is taken to draw."""
    if bsym.subsymbols:
        return any(_draws(sub) for sub in bsym.subsymbols)
    if not bsym.sym.tags & Tag.RANDOM:
        return False
    try:
        bound = inspect.signature(bsym.sym.impl).bind(*bsym.args, **bsym.kwargs)
    except (TypeError, ValueError):  # a builtin without a signature, or arguments fulmen normalised otherwise
        return True
    bound.apply_defaults()
    return bool(bound.arguments.get("training", bound.arguments.get("train", True)))


def _refuse_random_experts(kind: str, recorded: list[BoundSymbol]) -> None:
    draw = next((bsym for bsym in recorded if _draws(bsym)), None)
    if draw is None:
        return
    where = f" ({draw.source.short()})" if draw.source is not None else ""
    raise UnsupportedOpError(
        f"fulmen cannot compile LitGPT's {kind} when an expert draws random numbers: {draw.sym.printed}{where}. "
        "fulmen runs every expert on every token (which tokens are routed to an expert depends on the routing's "
        "values), so it would draw another mask than eager, which draws one for the routed tokens only. Give the "
        "experts no dropout (lora_dropout=0.0, or lora_mlp=False) or call model.eval()", draw.source)


def rnn_flatten_parameters(self) -> None:
    """Nothing, inside a trace. Eager calls it when the weights changed, which the trace's proxies always look like:
    it reads where the weights live (`data_ptr`) to copy them into one cuDNN buffer. The real module's weights were
    flattened by `.cuda()`, and cuDNN copies weights that are not, so the values are eager's either way."""


def batch_norm_forward(self, input: torch.Tensor) -> torch.Tensor:
    """`_BatchNorm.forward`; with momentum=None in training (a cumulative average: torch.optim.swa_utils.update_bn
    sets it) eager reads the count as a number, `1.0 / float(num_batches_tracked)`, which a trace cannot. Here the
    factor stays a float64 tensor of that value, read when the update runs (impls.batch_norm_update)."""
    counted = self.training and self.track_running_stats and self.num_batches_tracked is not None
    if self.momentum is not None or not counted:
        return nn.modules.batchnorm._BatchNorm.forward(self, input)
    self._check_input_dim(input)
    self.num_batches_tracked.add_(1)
    factor = torch.reciprocal(self.num_batches_tracked.double())
    return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, True, factor, self.eps)


# --- the fast paths of nn.TransformerEncoder, nn.TransformerEncoderLayer and nn.MultiheadAttention -----------------
# In eval, where no grad is to be computed, eager runs fused kernels (torch._transformer_encoder_layer_fwd,
# torch._native_multi_head_attention) and, for an encoder given a padding mask, nested tensors, whose outputs are
# zeros at the padded positions. Each forward decides with `torch.overrides.has_torch_function(tensor_args)`, which
# any active torch-function mode answers yes, so inside a trace torch's own forward would take the composite path.
# These lookasides are torch's forwards reading a `torch` that answers as eager does for the plain tensors the
# proxies stand for: fulmen then takes eager's path, runs its fused kernels, and refuses the nested one.
class _Answering:
    """`target`, with some of its attributes answered otherwise."""

    def __init__(self, target: Any, **answers: Any) -> None:
        self._target = target
        self.__dict__.update(answers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def _left_aligned(src: torch.Tensor, kept: torch.Tensor) -> bool:
    """Eager's check before its nested path: whether every row keeps its first positions only, a read of the mask's
    values (a float mask by then: never known while tracing). Yes: only the nested path reads the answer, and fulmen
    refuses it (below); where the encoder takes its composite path anyway (a grad to compute) the answer is unused."""
    return True


def _refuse_nested(src: torch.Tensor, kept: torch.Tensor, mask_check: bool = True) -> Any:
    raise UnsupportedOpError(
        "fulmen cannot trace nn.TransformerEncoder's nested-tensor fast path: in eval with src_key_padding_mask and "
        "no grad to compute, eager takes it (with mask_check, where the padding mask is left-aligned: every row's "
        "padding at its end, which fulmen cannot know while tracing), and its outputs are zeros at the padded "
        "positions, computed on nested tensors, which fulmen does not trace. Construct the encoder with "
        "enable_nested_tensor=False (its layers then run eager's fused kernels, as fulmen does), or call "
        "torch.backends.mha.set_fastpath_enabled(False)", user_location())


_EAGER_TORCH = _Answering(torch, overrides=_Answering(torch.overrides, has_torch_function=lambda args: False),
                          _nested_tensor_from_mask_left_aligned=_left_aligned,
                          _nested_tensor_from_mask=_refuse_nested)


def _as_eager_decides(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of torch's `forward` reading `_EAGER_TORCH` for `torch` (torch's module is left as it is)."""
    scope = {**forward.__globals__, "torch": _EAGER_TORCH}
    copy = types.FunctionType(forward.__code__, scope, forward.__name__, forward.__defaults__, forward.__closure__)
    copy.__kwdefaults__ = forward.__kwdefaults__
    copy.__qualname__ = forward.__qualname__
    return copy


# "module.Class" -> {method name: replacement}, for the class and its subclasses that keep its method
METHOD_LOOKASIDES: dict[str, dict[str, Callable[..., Any]]] = {
    "litgpt.model.LLaMAMoE": {"forward": litgpt_moe_forward},
    "torch.nn.modules.batchnorm._BatchNorm": {"forward": batch_norm_forward},
    "torch.nn.modules.rnn.RNNBase": {"flatten_parameters": rnn_flatten_parameters},
    **{f"{cls.__module__}.{cls.__qualname__}": {"forward": _as_eager_decides(cls.forward)}
       for cls in (nn.TransformerEncoder, nn.TransformerEncoderLayer, nn.MultiheadAttention)},
}


def method_lookasides(cls: type) -> dict[str, Callable[..., Any]]:
    found: dict[str, Callable[..., Any]] = {}
    for base in cls.__mro__:
        for name, replacement in METHOD_LOOKASIDES.get(f"{base.__module__}.{base.__qualname__}", {}).items():
            # a subclass's own method is the user's, not the one the lookaside stands for
            if name not in found and getattr(cls, name, None) is base.__dict__.get(name):
                found[name] = replacement
    return found


@contextlib.contextmanager
def checkpoint_region(builder: TraceBuilder) -> Iterator[None]:
    """The ops recorded inside are marked to be recomputed in the backward instead of saved (a checkpointed
    function: `torch.utils.checkpoint.checkpoint`, either way it runs)."""
    outer = builder.checkpoint_region
    builder.checkpoint_regions += 1
    builder.checkpoint_region = builder.checkpoint_regions
    try:
        yield
    finally:
        builder.checkpoint_region = outer


def is_fabric_backward_check(hook: Any) -> bool:
    """Fabric hooks a set-up module's outputs only to check that `fabric.backward` is used (a partial of
    `lightning.fabric.wrappers._backward_hook`). A hook has no place in a trace, so inside one (a jitted
    `forward_and_loss(fabric_model, ...)`) the check is skipped; any other hook is refused."""
    function = getattr(hook, "func", None)
    return (getattr(function, "__module__", None) == "lightning.fabric.wrappers"
            and getattr(function, "__qualname__", None) == "_backward_hook")
