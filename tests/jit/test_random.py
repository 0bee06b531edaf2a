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
