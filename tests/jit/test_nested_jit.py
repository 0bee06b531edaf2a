"""A jitted function or module called by a program another fulmen.jit acquires (a submodule jitted on its own, a
helper jitted where it is defined, `fulmen.vmap(fulmen.jit(f))`) is traced as part of that program: values, grads
and hooks as eager's, its parameters as the outer trace's module inputs, and its own cache left alone."""

from __future__ import annotations

import torch
from torch import nn

import fulmen


def _grads(out: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out.sum(), tensors))


def test_a_jitted_helper_is_traced_inline():
    helper = fulmen.jit(lambda x, w: torch.tanh(x @ w))

    def program(x, w):
        return helper(x, w) * 2 + 1

    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    jitted = fulmen.jit(program)
    got = jitted(x, w)
    want = torch.tanh(x @ w) * 2 + 1
    torch.testing.assert_close(got, want)
    for g, e in zip(_grads(got, x, w), _grads(want, x, w)):
        torch.testing.assert_close(g, e)
    assert fulmen.cache_misses(helper) == 0  # traced by the outer program only
    assert "torch.tanh" in str(fulmen.last_traces(jitted)[0])
    torch.testing.assert_close(helper(x, w), torch.tanh(x @ w))  # called on its own, it still runs its trace
    assert fulmen.cache_misses(helper) == 1


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def test_a_jitted_submodule_is_traced_with_its_parameters_as_module_inputs():
    eager, model = _model(), _model()
    model[0] = fulmen.jit(model[0])
    calls = []
    for m in (eager[0], model[0]):
        m.register_forward_hook(lambda module, args, out: (calls.append(type(module).__name__), out * 2)[1])
    jitted = fulmen.jit(model)
    x = torch.randn(5, 3)
    got, want = jitted(x), eager(x)
    torch.testing.assert_close(got, want)
    assert sorted(calls) == ["JittedModule", "Linear"]  # each hook ran once
    for g, e in zip(_grads(got, *model.parameters()), _grads(want, *eager.parameters())):
        torch.testing.assert_close(g, e)
    trace = fulmen.last_traces(jitted)[0]
    assert [p.pname for p in trace.inputs][1:] == ["t_0__model_weight", "t_0__model_bias", "t_2_weight", "t_2_bias"]
    assert fulmen.cache_misses(model[0]) == 0


def test_vmap_of_a_jitted_function_equals_torch_vmap():
    def f(x):
        return torch.sin(x).sum(0) * x

    x = torch.randn(3, 4, 5)
    torch.testing.assert_close(fulmen.vmap(fulmen.jit(f))(x), torch.vmap(f)(x))
