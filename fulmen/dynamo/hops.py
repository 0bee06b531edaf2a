"""Dynamo's higher-order ops and context nodes given back as the torch calls they stand for.

Dynamo captures `torch.utils.checkpoint.checkpoint(fn, ...)` as `tag_activation_checkpoint(body, ...)`, a
higher-order op made for AOT autograd and Inductor: run as it is (what an eager fallback does), it calls
checkpoint with `preserve_rng_state=False` whatever the user asked, so the backward recomputes a dropout with a new
mask and the RNG state after backward moves on; eager's own checkpoint replays the forward's RNG state. Called as
`checkpoint` again, the node computes what eager computes, and fulmen acquires it as a checkpointed region.

Dynamo captures `with torch.autocast(...)` as `_enter_autocast` / `_exit_autocast` nodes, which hand themselves to
the active torch-function mode (fulmen's acquisition, which has no symbol for them). `split_module` knows them and
repeats them in each piece of a region, so only the graphs fulmen acquires have them replaced by the context
manager's own `__enter__` / `__exit__`, whose global-state calls fulmen records as `with torch.autocast` blocks.
"""

from __future__ import annotations

import copy
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


def enter_autocast(*args: Any) -> torch.autocast:
    """`torch.amp._enter_autocast`, as `with torch.autocast(*args):` enters."""
    mode = torch.autocast(*args)
    mode.__enter__()
    return mode


def exit_autocast(mode: torch.autocast) -> None:
    mode.__exit__(None, None, None)


# Dynamo's context nodes -> the torch calls fulmen acquires in their place
CONTEXT_CALLS = {torch.amp._enter_autocast: enter_autocast, torch.amp._exit_autocast: exit_autocast}


def with_context_calls(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `module` (sharing its submodules) whose context nodes call `CONTEXT_CALLS`; `module` as it is when
    it has none."""
    if not any(node.op == "call_function" and node.target in CONTEXT_CALLS for node in module.graph.nodes):
        return module
    copied = torch.fx.GraphModule(module, copy.deepcopy(module.graph), module.__class__.__name__)
    for node in copied.graph.nodes:
        if node.op == "call_function" and node.target in CONTEXT_CALLS:
            node.target = CONTEXT_CALLS[node.target]
    copied.recompile()
    return copied


def checkpoint_reason(node: torch.fx.Node) -> str | None:
    """Why fulmen refuses a checkpoint node, or None: with `preserve_rng_state=False` eager recomputes the body in
    the backward from the RNG state current then (a dropout draws a new mask), where fulmen replays the forward's
    draws; the fallback runs eager's checkpoint."""
    if node.op == "call_function" and node.target is checkpoint and node.kwargs.get("preserve_rng_state") is False:
        return "checkpoint(preserve_rng_state=False) draws anew in the backward; fulmen replays the forward's draws"
    return None


def _is_hop(node: torch.fx.Node, name: str) -> bool:
    return (node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)
            and node.target.name() == name)


def as_torch_calls(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`module` with its `tag_activation_checkpoint` nodes calling `torch.utils.checkpoint.checkpoint` (in place)."""
    nodes = [node for node in module.graph.nodes if _is_hop(node, "tag_activation_checkpoint")]
    for node in nodes:
        node.target = checkpoint
    if nodes:
        module.recompile()
    return module
