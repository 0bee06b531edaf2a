"""A function or module torch.compile made, called inside a fulmen.jit program (made outside it, or inside, as a
decorator): traced as the function it wraps, as a nested fulmen.jit is. Dynamo compiles nothing while fulmen traces,
and the compiled function called outside fulmen is still compiled."""

from __future__ import annotations

import torch
from torch import nn

import fulmen


class Recording:
    """A Dynamo backend that runs the graph as captured and counts the graphs it is given."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return gm.forward


def _grads(out: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out.sum(), tensors))


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) * 2


def test_a_compiled_function_is_traced_as_the_function_it_wraps():
    backend = Recording()
    compiled = torch.compile(_block, backend=backend)

    def program(x, w):
        return compiled(x, w).sin() + 1

    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    jitted = fulmen.jit(program)
    got = jitted(x, w)
    want = (_block(x, w)).sin() + 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, e in zip(_grads(got, x, w), _grads(want, x, w)):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    torch.testing.assert_close(jitted(x, w), want, rtol=0, atol=0)
    assert backend.graphs == 0 and fulmen.cache_misses(jitted) == 1
    assert "torch.tanh" in str(fulmen.last_traces(jitted)[0])
    torch.testing.assert_close(compiled(x, w), _block(x, w))  # outside fulmen, Dynamo compiles it
    assert backend.graphs == 1


def test_a_compiled_module_is_traced_as_the_module_it_wraps():
    torch.manual_seed(0)
    layer = nn.Linear(3, 5)
    backend = Recording()
    compiled = torch.compile(layer, backend=backend)
    calls = []
    layer.register_forward_hook(lambda module, args, out: calls.append(out.shape))

    def program(x):
        return torch.relu(compiled(x)).sum(-1)

    x = torch.randn(2, 3, requires_grad=True)
    jitted = fulmen.jit(program)
    got = jitted(x)
    want = torch.relu(layer(x)).sum(-1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, e in zip(_grads(got, x, layer.weight, layer.bias), _grads(want, x, layer.weight, layer.bias)):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert backend.graphs == 0 and len(calls) == 2  # the module's hook ran in the trace and in eager


def test_torch_compile_called_inside_the_program_is_traced():
    backend = Recording()

    def program(x, w):
        once = torch.compile(_block, backend=backend)(x, w)

        @torch.compile  # the default backend (Inductor), made while fulmen traces
        def scaled(y):
            return y.cos() * 3

        return scaled(once) - x.mean()

    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    jitted = fulmen.jit(program)
    got = jitted(x, w)
    want = _block(x, w).cos() * 3 - x.mean()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, e in zip(_grads(got, x, w), _grads(want, x, w)):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert backend.graphs == 0
    trace = str(fulmen.last_traces(jitted)[0])
    assert "torch.tanh" in trace and "torch.cos" in trace
