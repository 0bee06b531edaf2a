"""Grad rules (and the backwards of autograd Functions, traced as grad rules) that update tensors in place: what they
return, put and ask the grad of is the updated value, as in eager.

Before, the object a rule updated in place still named its first value there: transformers' PhiMoE router
(`PhimoeMultiplier.backward` builds its grad with `scatter_add_`) trained with grads that lacked the scattered part.
"""

from __future__ import annotations

import itertools

import torch
from transformers.models.phimoe.modeling_phimoe import sparsemixer

import fulmen
from fulmen import get_grad, put_grad
from fulmen.core.proxies import TensorProxy
from fulmen.extend import OperatorExecutor

_COUNTER = itertools.count()


class ScatteredGrad(torch.autograd.Function):
    """A router's grad as PhiMoE's: `gates * -g`, plus g scattered to the selected columns, in place."""

    @staticmethod
    def forward(ctx, scores, gates, selected):
        ctx.save_for_backward(gates, selected)
        return gates.gather(-1, selected) * 2

    @staticmethod
    def backward(ctx, grad):
        gates, selected = ctx.saved_tensors
        out = gates * grad.mul(-1)
        out.scatter_add_(dim=-1, index=selected, src=grad)
        return out, None, None


def routed(scores: torch.Tensor) -> torch.Tensor:
    gates = torch.softmax(scores, -1).detach()
    return ScatteredGrad.apply(scores, gates, gates.argmax(-1, keepdim=True))


def _scores() -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()


def test_a_function_backward_that_scatters_in_place_gives_eagers_grad():
    scores, weights = _scores(), torch.arange(6.0).unsqueeze(1)
    want = torch.autograd.grad((routed(scores) * weights).sum(), scores)[0]
    got = torch.autograd.grad((fulmen.jit(routed)(scores) * weights).sum(), scores)[0]
    torch.testing.assert_close(got, want)


def test_phimoe_sparsemixer_in_training_gives_eagers_grads():
    """transformers' own router, in training (random Gumbel draws, Heun's method, PhimoeMultiplier)."""
    scores, weights = _scores(), torch.arange(12.0).reshape(6, 2)

    def route(scores):
        multiplier, selected = sparsemixer(scores, jitter_eps=0.01, training=True, top_k=2)
        return (multiplier * weights).sum(), selected

    jitted = fulmen.jit(route)
    for seed in range(2):
        torch.manual_seed(seed)
        want, want_selected = route(scores)
        torch.manual_seed(seed)
        got, got_selected = jitted(scores)
        assert torch.equal(got_selected, want_selected)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got, scores)[0], torch.autograd.grad(want, scores)[0])


def scale_plus_one(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_a_grad_transform_that_updates_its_output_and_grad_in_place():
    executor = OperatorExecutor(f"inplace_rule{next(_COUNTER)}")
    op = executor.register_operator(f"scale_plus_one{next(_COUNTER)}", like=lambda x: TensorProxy(like=x),
                                    fn=scale_plus_one, replaces=scale_plus_one)

    def rule(x):
        y = x * 2
        y.add_(1)  # the output the rule returns, get_grad asks for: 2x + 1
        grad = get_grad(y) * 1
        grad.mul_(2)  # the grad it puts: 2g
        put_grad(x, grad)
        return y

    executor.register_implementation(op, grad_transform=rule)
    x = torch.randn(5, requires_grad=True)
    out = fulmen.jit(lambda x: scale_plus_one(x).sin(), executors=[executor])(x)
    torch.testing.assert_close(out, (x * 2 + 1).sin())
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], 2 * (x * 2 + 1).cos())
