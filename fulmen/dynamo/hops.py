"""Dynamo's higher-order ops given back as the torch calls they stand for, before a captured graph runs.

Dynamo captures `torch.utils.checkpoint.checkpoint(fn, ...)` as `tag_activation_checkpoint(body, ...)`, a
higher-order op made for AOT autograd and Inductor: run as it is (what an eager fallback does), it calls
checkpoint with `preserve_rng_state=False` whatever the user asked, so the backward recomputes a dropout with a new
mask and the RNG state after backward moves on; eager's own checkpoint replays the forward's RNG state. Called as
`checkpoint` again, the node computes what eager computes, and fulmen acquires it as a checkpointed region.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.utils.checkpoint


def checkpoint(body: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`torch.utils.checkpoint.checkpoint` of a body Dynamo captured, with the user's options (and selective
    checkpointing policy, which Dynamo keeps in the body's meta)."""
    kwargs["use_reentrant"] = False  # the form Dynamo traces; both compute the same
    if "_checkpoint_context_fn" in body.meta:
        kwargs["context_fn"] = body.meta["_checkpoint_context_fn"]
    return torch.utils.checkpoint.checkpoint(body, *args, **kwargs)


def checkpoint_reason(node: torch.fx.Node) -> str | None:
    """Why fulmen refuses a checkpoint node, or None: with `preserve_rng_state=False` eager recomputes the body in
    the backward from the RNG state current then (a dropout draws a new mask), where fulmen replays the forward's
    draws (/tmp/dynamo_findings/checkpoint_preserve_rng_false.py); the fallback runs eager's checkpoint."""
    if node.op == "call_function" and node.target is checkpoint and node.kwargs.get("preserve_rng_state") is False:
        return "checkpoint(preserve_rng_state=False) draws anew in the backward; fulmen replays the forward's draws"
    return None


def _is_hop(node: torch.fx.Node, name: str) -> bool:
    return (node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)
            and node.target.name() == name)


def as_torch_calls(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`module` with its `tag_activation_checkpoint` nodes calling `torch.utils.checkpoint.checkpoint` (in place),
    its code and its nested graphs' compiled now."""
    nodes = [node for node in module.graph.nodes if _is_hop(node, "tag_activation_checkpoint")]
    for node in nodes:
        node.target = checkpoint
    if nodes:
        module.recompile()
    for graph in module.modules():
        # Reading `code` compiles a lazy GraphModule: compiled on its first call instead, inside fulmen's
        # acquisition, it would compile on fulmen's stand-in for the module and recurse without end
        # (/tmp/dynamo_findings/lazy_graphmodule_submodule.py).
        if isinstance(graph, torch.fx.GraphModule):
            graph.code  # noqa: B018
    return module
