"""The torch.func transforms in a Dynamo graph (vmap, grad, vjp, jvp, jacrev, ... and flex_attention's block masks,
which vmap their mask function): regions fulmen leaves to the fallback.

Dynamo inlines a transform: it enters a functorch level (`_vmap_increment_nesting`, `_grad_increment_nesting`, ...),
wraps tensors for it (`_add_batch_dim`, `_wrap_for_grad`), runs the function's torch calls on the wrapped tensors,
unwraps the results and leaves the level. fulmen cannot trace batched or grad-wrapped tensors, and the level is
global state of the whole process: every node from a level's entry to its exit is refused, so the region is one
piece the fallback runs with its entry and exit. Split node by node, a batched tensor crossed into a fulmen piece
(NotImplementedError: Cannot access storage of BatchedTensorImpl) and the probe ran `torch.func.grad`'s own
autograd call on its stand-ins. A wrapped tensor used after its level has ended (the function `torch.func.vjp`
returns, called later) makes the graph fall back whole: no piece boundary may carry it.
"""

from __future__ import annotations

import torch
import torch._functorch.predispatch as predispatch
import torch.fx

# a level's entry -> what the user wrote, for the refusal. Dynamo records torch._functorch.predispatch's wrappers or
# the C functions they call, by torch release; a release without one of them records the other.
_ENTRY_NAMES = {
    "_vmap_increment_nesting": "torch.vmap",
    "_grad_increment_nesting": "torch.func.grad / vjp / jacrev",
    "_jvp_increment_nesting": "torch.func.jvp / jacfwd",
    "_enter_dual_level": "a forward-mode AD dual level",
}
_EXIT_NAMES = ("_vmap_decrement_nesting", "_grad_decrement_nesting", "_jvp_decrement_nesting", "_exit_dual_level")


def _found(name: str) -> list[object]:
    """The functions of that name in predispatch and in torch._C._functorch (those this torch has)."""
    return [function for module in (predispatch, torch._C._functorch)
            if (function := getattr(module, name, None)) is not None]


_ENTRIES = {function: user for name, user in _ENTRY_NAMES.items() for function in _found(name)}
_ENTRIES[torch._C._autograd._saved_tensors_hooks_disable] = "torch.func.grad / vjp / jacrev"
_EXITS = frozenset({*(function for name in _EXIT_NAMES for function in _found(name)),
                    torch._C._autograd._saved_tensors_hooks_enable})
# what gives a level's result back as a tensor of the level outside it
_UNWRAPS = frozenset(function for name in ("_remove_batch_dim", "_unwrap_for_grad") for function in _found(name))


def _target(node: torch.fx.Node) -> object:
    return node.target if node.op == "call_function" else None


def _regions(module: torch.fx.GraphModule) -> list[tuple[str, list[torch.fx.Node]]]:
    """Each outermost functorch level as the transform's name and its nodes, entry to exit."""
    regions: list[tuple[str, list[torch.fx.Node]]] = []
    depth = 0
    for node in module.graph.nodes:
        target = _target(node)
        if target in _ENTRIES:
            if depth == 0:
                regions.append((_ENTRIES[target], []))
            depth += 1
        if depth:
            regions[-1][1].append(node)
        if target in _EXITS:
            depth = max(depth - 1, 0)
    return regions


def func_regions(module: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """Every node of a functorch level's region, with the reason fulmen refuses it."""
    return {node: (f"inside {name} (a torch.func transform): fulmen cannot trace its batched or wrapped tensors, "
                   f"the fallback runs the region")
            for name, nodes in _regions(module) for node in nodes}


def escaping_value_reason(module: torch.fx.GraphModule) -> str | None:
    """Why the graph falls back whole, or None: a value a region made for its level is used after the region."""
    for name, nodes in _regions(module):
        inside = set(nodes)
        for node in nodes:
            if _target(node) not in _UNWRAPS and any(user not in inside for user in node.users):
                return (f"{node.name}, made inside {name} (a torch.func transform), is used after the transform: "
                        f"the fallback runs the graph")
    return None
