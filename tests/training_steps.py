"""Training loops and eager comparisons shared by the training, transform and CUDA tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


def train(loss_fn: Callable[..., torch.Tensor], model: nn.Module, batches: Sequence[tuple[torch.Tensor, ...]],
          lr: float) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Adam steps of `loss_fn(model, *batch)`: each step's loss and gradients, as float32 copies."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses, grads = [], []
    for batch in batches:
        loss = loss_fn(model, *batch)
        loss.backward()
        losses.append(loss.detach().float().clone())
        grads.append([p.grad.float().clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads


def grads_of(model: nn.Module, *losses: torch.Tensor) -> list[list[torch.Tensor]]:
    """The gradients each loss's backward gives the parameters, run in the order given, each from none (float32
    copies)."""
    grads = []
    for loss in losses:
        model.zero_grad(set_to_none=True)
        loss.backward()
        grads.append([p.grad.float().clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return grads


def assert_backward_matches_eager(model: nn.Module, loss: torch.Tensor, eager_loss: torch.Tensor,
                                  dtype: torch.dtype | None = None, rtol: float = 1.6e-2, atol: float = 2e-3) -> None:
    """Backward of the jitted `loss`, then of `eager_loss`, on the same parameters: gradients of one dtype (`dtype`
    where given), and close (the defaults allow for bf16 autocast)."""
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    eager_loss.backward()
    for g, p in zip(got, model.parameters()):
        assert g.dtype == p.grad.dtype and dtype in (None, g.dtype)
        torch.testing.assert_close(g, p.grad, rtol=rtol, atol=atol)
