"""Optimizers over distributed parameters: which ones update a parameter shard as they would the whole parameter, and
the state some make at construction (before the parameters are sharded).

Under `fsdp` each rank's optimizer steps only its own rows of every parameter. That is the whole parameter's update
only when the update is elementwise (SGD, Adam, AdamW, Adagrad, RMSprop, ...). Some of torch's optimizers read
whole parameters or the whole model, and on a shard they would silently step by other amounts than on one process.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim import Optimizer

from fulmen.distributed.specs import local_shard, spec_of

# why each is not exact on dim-0 shards; subclasses inherit the reason
NOT_ELEMENTWISE: dict[type[Optimizer], str] = {
    torch.optim.LBFGS: "its directions and line search take dot products over all parameters",
    torch.optim.Adafactor: "its factored second moments average over a matrix's rows and columns, and its step size "
                           "is the parameter's RMS",
    torch.optim.Muon: "it orthogonalizes each whole matrix",
}


def _reason(optimizer: Optimizer) -> str | None:
    return next((why for kind, why in NOT_ELEMENTWISE.items() if isinstance(optimizer, kind)), None)


def refuse_unexact_on_shards(optimizer: Optimizer, sharded: Iterable[tuple[str, torch.Tensor]], strategy: str) -> None:
    """Raises when `optimizer` holds one of the `sharded` (name, parameter) pairs and its update is not elementwise."""
    why = _reason(optimizer)
    if why is None:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    name = next((name for name, param in sharded if id(param) in held), None)
    if name is not None:
        kind = type(optimizer).__name__
        raise ValueError(f"{kind} cannot step parameter shards: {why}, so on {strategy}'s shard of {name!r} it would "
                         f"step by other amounts than on the whole parameter. Use an elementwise optimizer (AdamW, "
                         f"Adam, SGD, ...) or ThunderDDPStrategy, whose ranks hold whole parameters")


def has_stepped(optimizer: Optimizer) -> bool:
    """Whether the optimizer has state a step made: a nonzero step count, or state without one (SGD's momentum).
    Adagrad makes its state (step 0 and its sums) at construction."""
    for state in optimizer.state.values():
        step = state.get("step")
        if step is None or (step.item() if isinstance(step, torch.Tensor) else step) != 0:
            return True
    return False


def shard_optimizer_state(optimizer: Optimizer) -> None:
    """State the optimizer made for a parameter before `fsdp` sharded it (Adagrad's sums, whole-shaped) becomes this
    rank's rows, as the parameter did; it is elementwise, so the rows are the whole state's."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            spec = spec_of(param)
            if spec is None or not spec.sharded or param not in optimizer.state:
                continue
            state = optimizer.state[param]
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == spec.full_shape != param.shape:
                    state[key] = local_shard(value, spec.state.rank, spec.state.world).to(param.device)
