"""Built-in replacements of module methods and functions during acquisition (user classes are never patched).

A lookaside swaps a method for a traceable equivalent only inside fulmen's shadow modules. LitGPT's mixture of
experts routes tokens with `torch.where(mask)`, whose output shape depends on the routing (data-dependent); the
replacement runs every expert on every token and weights the outputs by the routing probabilities (zero for the
experts a token was not routed to), which is the same sum in the same expert order.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

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
    y = torch.zeros_like(x)
    for expert_index, expert in enumerate(self.experts):
        y = y + weights[:, expert_index, None] * expert(x)
    y = y.view(batch, time, channels)
    if self.config.n_shared_expert:
        y = y + self.shared_experts(residual_x)
    return y


# "module.Class" -> {method name: replacement}
METHOD_LOOKASIDES: dict[str, dict[str, Callable[..., Any]]] = {
    "litgpt.model.LLaMAMoE": {"forward": litgpt_moe_forward},
}


def method_lookasides(cls: type) -> dict[str, Callable[..., Any]]:
    return METHOD_LOOKASIDES.get(f"{cls.__module__}.{cls.__qualname__}", {})


def checkpoint_lookaside(builder: TraceBuilder) -> Callable[..., Any]:
    def checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: bool | None = None,
                   context_fn: Any = None, determinism_check: str = "default", debug: bool = False,
                   preserve_rng_state: bool = True, **kwargs: Any) -> Any:
        """Traces `function` inline, marking its ops to be recomputed in the backward instead of saved."""
        outer = builder.checkpoint_region
        builder.checkpoint_regions += 1
        builder.checkpoint_region = builder.checkpoint_regions
        try:
            return function(*args, **kwargs)
        finally:
            builder.checkpoint_region = outer

    return checkpoint


def _fabric_backward_hook_lookaside(builder: TraceBuilder) -> Callable[..., Any]:
    def register_backward_hook(self, tensor: torch.Tensor) -> torch.Tensor:
        """Fabric hooks a set-up module's outputs only to check that `fabric.backward` is used. A hook has no place
        in a trace, so inside one (a jitted `forward_and_loss(fabric_model, ...)`) the check is skipped."""
        return tensor

    return register_backward_hook


# ("module", "attribute path") -> factory of the replacement, given the trace builder. Swapped only while
# acquiring, so `torch.utils.checkpoint.checkpoint(...)` calls are seen (a name imported before is not). A module
# not imported yet is left alone: nothing can call into it from the program.
FUNCTION_LOOKASIDES: dict[tuple[str, str], Callable[[TraceBuilder], Callable[..., Any]]] = {
    ("torch.utils.checkpoint", "checkpoint"): checkpoint_lookaside,
    ("lightning.fabric.wrappers", "_FabricModule._register_backward_hook"): _fabric_backward_hook_lookaside,
}


def resolve_attribute(module_name: str, path: str) -> tuple[Any, str] | None:
    owner = sys.modules.get(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent, None)
    return (owner, name) if owner is not None and hasattr(owner, name) else None


@contextlib.contextmanager
def function_lookasides(builder: TraceBuilder) -> Iterator[list[tuple[Any, str, Any]]]:
    """Swaps the lookasides in while acquiring; gives the (owner, name, original) it swapped."""
    targets = [(target, factory) for key, factory in FUNCTION_LOOKASIDES.items() if (target := resolve_attribute(*key))]
    originals = [(owner, name, getattr(owner, name)) for (owner, name), _ in targets]
    try:
        for (owner, name), factory in targets:
            setattr(owner, name, factory(builder))
        yield originals
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
