"""Random ops under the `fulmen.dynamo` backend: each program runs forward and backward from the same seed, eagerly
and compiled; values, grads and the RNG state after the backward must be eager's (a checkpointed dropout's mask in
the backward included)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint

import fulmen


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(fn, x):
    x = x.detach().requires_grad_()
    torch.manual_seed(0)
    out = fn(x)
    out.sum().backward()
    return out, x.grad, torch.get_rng_state()


def _assert_as_eager(fn, backend):
    x = torch.randn(64, dtype=torch.float64)
    compiled = torch.compile(fn, backend=backend)
    for want, got in zip(_run(fn, x), _run(compiled, x)):
        assert torch.equal(got, want)


def checkpointed_dropout(x):
    # eager replays the forward's RNG state when the backward recomputes the body: the grad has the forward's mask
    return checkpoint.checkpoint(lambda a: F.dropout(a, 0.5) * 2, x.sin(), use_reentrant=False)


def test_a_checkpointed_dropout_runs_through_fulmen_with_the_forwards_mask():
    # Run as Dynamo captured it (its checkpoint op with preserve_rng_state=False), the backward drew a new mask
    backend = fulmen.dynamo.backend(fallback="eager")
    _assert_as_eager(checkpointed_dropout, backend)
    assert all(piece.by_fulmen for piece in backend.pieces)


def checkpointed_dropout_and_cond(x):
    def body(a):
        a = F.dropout(a, 0.5)
        return torch.cond(a.sum() > 0, lambda t: t * 2, lambda t: t - 1, (a,))

    return checkpoint.checkpoint(body, x, use_reentrant=False).sin() + F.dropout(x, 0.3)


@pytest.mark.parametrize("fallback", ["eager", "inductor"])
def test_random_ops_in_a_piece_fulmen_refuses_draw_as_eager(fallback):
    # the checkpoint holds a cond, which fulmen refuses: the fallback runs it (Inductor drew its own numbers)
    backend = fulmen.dynamo.backend(fallback=fallback)
    _assert_as_eager(checkpointed_dropout_and_cond, backend)
    refused = [piece for piece in backend.pieces if not piece.by_fulmen]
    assert len(refused) == 1 and "checkpoint" in refused[0].reasons[0]


def checkpointed_without_rng_state(x):
    return checkpoint.checkpoint(lambda a: F.dropout(a, 0.5) * 2, x, use_reentrant=False,
                                 preserve_rng_state=False).sin()


def test_a_checkpoint_that_does_not_preserve_rng_state_runs_eagerly():
    # eager recomputes with a new mask in the backward, which fulmen's replay cannot give: the node is refused
    backend = fulmen.dynamo.backend(fallback="eager")
    _assert_as_eager(checkpointed_without_rng_state, backend)
    assert "preserve_rng_state=False" in backend.report()
