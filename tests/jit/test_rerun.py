"""A program fulmen acquires twice on its first call (eager's path reads a tensor value, so it is acquired again as
a tracer is seen) changes Python state once, as eager does: the hooks and the globals its abandoned run set are
undone before the second run."""

from __future__ import annotations

import torch

import fulmen

COUNT = 0


def _reads_a_value_unless_compiling(x: torch.Tensor) -> None:
    if not torch.compiler.is_compiling():
        bool((x > 0).all())  # a tensor-value read: fulmen acquires the program again, as if compiling


def _counting(x: torch.Tensor) -> torch.Tensor:
    global COUNT
    COUNT += 1
    _reads_a_value_unless_compiling(x)
    return x * 2


class _LazyHook(torch.nn.Module):
    """Registers a forward hook on its child on the first call, as transformers' output capturing does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "hooked", False):  # an attribute, as transformers marks it
            self.lin.register_forward_hook(lambda module, args, out: out + 1)
            self.hooked = True
        _reads_a_value_unless_compiling(x)
        return self.lin(x)


def test_a_global_the_abandoned_run_stored_is_stored_once():
    global COUNT
    x = torch.ones(3)
    COUNT = 0
    _counting(x)
    want = COUNT
    COUNT = 0
    torch.testing.assert_close(fulmen.jit(_counting)(x), x * 2)
    assert COUNT == want == 1


def test_a_hook_the_abandoned_run_registered_is_registered_once():
    torch.manual_seed(0)
    eager = _LazyHook()
    model = _LazyHook()
    model.load_state_dict(eager.state_dict())
    jitted = fulmen.jit(model)
    x = torch.ones(2, 3)
    for _ in range(2):
        torch.testing.assert_close(jitted(x), eager(x))
    assert len(model.lin._forward_hooks) == len(eager.lin._forward_hooks) == 1


def test_a_hook_registered_on_an_argument_module_is_registered_once():
    eager = _LazyHook()
    model = _LazyHook()
    model.load_state_dict(eager.state_dict())
    jitted = fulmen.jit(lambda module, x: module(x))
    x = torch.ones(2, 3)
    torch.testing.assert_close(jitted(model, x), eager(x))
    assert len(model.lin._forward_hooks) == 1
