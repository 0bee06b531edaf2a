"""Random draws consume the global RNG exactly as eager does, on the call that traces as on every later one."""

from __future__ import annotations

import pytest
import torch

import fulmen

DRAWS = {
    "rand": lambda x: x + torch.rand(3),
    "randn": lambda x: x + torch.randn(3),
    "randint": lambda x: x + torch.randint(0, 100, (3,)),
    "randperm": lambda x: x + torch.randperm(3),
    "normal": lambda x: x + torch.normal(0.0, 1.0, (3,)),
    "randn_like": lambda x: x + torch.randn_like(x),
    "bernoulli": lambda x: x + torch.bernoulli(torch.full_like(x, 0.5)),
}


@pytest.mark.parametrize("name", sorted(DRAWS))
def test_draws_and_the_rng_state_after_them_are_eagers_from_the_first_call(name):
    program = DRAWS[name]
    jitted = fulmen.jit(program)
    x = torch.zeros(3)
    for _ in range(2):  # the first call traces, the second runs the cached trace
        torch.manual_seed(5)
        got, got_next = jitted(x), torch.rand(4)
        torch.manual_seed(5)
        want, want_next = program(x), torch.rand(4)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(got_next, want_next, rtol=0, atol=0)


@pytest.mark.parametrize("draw", [
    lambda g: torch.randn(3, generator=g),
    lambda g: torch.randint(0, 9, (3,), generator=g),
    lambda g: torch.bernoulli(torch.full((3,), 0.5), generator=g),
], ids=["randn", "randint", "bernoulli"])
def test_a_draw_from_the_users_generator_is_refused_before_it_draws(draw):
    """A trace draws from the default generator; replaying one that named the user's generator would draw from the
    wrong stream, so it is refused, naming the call's line, and the generator is left as it was."""
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    with pytest.raises(fulmen.UnsupportedOpError, match=r"generator=.*default generator only") as error:
        fulmen.jit(lambda x: x + draw(generator))(torch.ones(3))
    assert "test_random.py" in str(error.value)
    assert torch.equal(generator.get_state(), state)


def _requires_grad_and_grads(program, inputs: list[torch.Tensor]) -> tuple[bool, torch.Tensor, list]:
    """Whether the output requires grad, the output, and the inputs' grads for a weighted sum of it (seeded)."""
    torch.manual_seed(7)
    out = program(*inputs)
    if not out.requires_grad:
        return False, out, []
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    return True, out, list(torch.autograd.grad((out * weights).sum(), inputs, allow_unused=True))


# Draws from tensors that require grad: eager records only bernoulli(p) and normal (zero grads to what they read,
# no reparameterisation); the others' outputs do not require grad.
DRAWS_FROM_GRAD_TENSORS = {
    "rand_like": (lambda x: torch.rand_like(x), 1),
    "randn_like": (lambda x: torch.randn_like(x), 1),
    "randint_like": (lambda x: torch.randint_like(x, 9), 1),
    "randn_like_times_x": (lambda x: torch.randn_like(x) * x, 1),
    "multinomial": (lambda p: torch.multinomial(p, 2), 1),
    "bernoulli": (lambda p: torch.bernoulli(p), 1),
    "bernoulli_method": (lambda p: p.bernoulli(), 1),
    "bernoulli_mask": (lambda p: p * torch.bernoulli(p), 1),
    "normal": (lambda mean, std: torch.normal(mean, std), 2),
    "normal_mean": (lambda mean: torch.normal(mean, 0.5), 1),
    "normal_std": (lambda std: torch.normal(2.0, std), 1),
    "normal_reparameterised": (lambda mean, std: mean + std * torch.normal(torch.zeros_like(mean), 1.0), 2),
}


@pytest.mark.parametrize("name", sorted(DRAWS_FROM_GRAD_TENSORS))
def test_draws_from_tensors_that_require_grad_are_differentiated_as_eager_does(name):
    program, count = DRAWS_FROM_GRAD_TENSORS[name]
    inputs = [(torch.rand(2, 5) * 0.8 + 0.1).requires_grad_() for _ in range(count)]
    eager = _requires_grad_and_grads(program, inputs)
    ours = _requires_grad_and_grads(fulmen.jit(program), inputs)
    assert ours[0] == eager[0], f"requires_grad: fulmen {ours[0]}, eager {eager[0]}"
    assert torch.equal(ours[1], eager[1])
    for got, want in zip(ours[2], eager[2], strict=True):
        assert torch.equal(got, want)


def test_bernoulli_with_a_float_p_of_a_tensor_that_requires_grad():
    """Eager records it without a derivative: the forward runs, the output requires grad, and the backward raises."""
    x = torch.rand(3, requires_grad=True)
    jitted = fulmen.jit(lambda x: torch.bernoulli(x, 0.5) * x)
    torch.manual_seed(0)
    out = jitted(x)
    torch.manual_seed(0)
    want = torch.bernoulli(x, 0.5) * x
    assert out.requires_grad and torch.equal(out, want)
    with pytest.raises(RuntimeError, match="derivative for aten::bernoulli is not implemented"):
        want.sum().backward()
    with pytest.raises(RuntimeError, match=r"derivative for aten::bernoulli is not implemented.*test_random.py"):
        out.sum().backward()
