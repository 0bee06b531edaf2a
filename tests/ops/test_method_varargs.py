"""Tensor methods that take their sizes or dims as varargs as well as one sequence (`x.flip(0, 1)`,
`x.flip((0, 1))`), traced as eager runs them: values and grads equal to eager's."""

from __future__ import annotations

import pytest
import torch

import fulmen

CALLS = {
    "flip_int": lambda x: x.flip(0),
    "flip_ints": lambda x: x.flip(0, 2),
    "flip_negative": lambda x: x.flip(-1),
    "flip_list": lambda x: x.flip([0, 1]),
    "flip_size": lambda x: x.flip(torch.Size([1])),
    "flip_keyword": lambda x: x.flip(dims=(0,)),
    "tile_int": lambda x: x.tile(2),
    "tile_ints": lambda x: x.tile(2, 1, 1, 3),
    "tile_tuple": lambda x: x.tile((2, 1)),
    "tile_keyword": lambda x: x.tile(dims=(1, 2)),
    "permute_ints": lambda x: x.permute(2, 0, 1),
    "permute_tuple": lambda x: x.permute((2, 0, 1)),
    "repeat_ints": lambda x: x.repeat(2, 1, 1),
    "repeat_tuple": lambda x: x.repeat((1, 2, 1)),
    "view_ints": lambda x: x.view(6, 4),
    "view_tuple": lambda x: x.view((4, 6)),
    "reshape_ints": lambda x: x.reshape(-1, 4),
    "expand_ints": lambda x: x.expand(2, 2, 3, 4),
    "expand_tuple": lambda x: x.expand((2, -1, 3, 4)),
    "roll": lambda x: x.roll((1, 2), (0, 1)),
    "new_zeros_ints": lambda x: x.new_zeros(2, 3) + x.sum(),
    "torch_flip": lambda x: torch.flip(x, (0, 1)),
    "torch_tile": lambda x: torch.tile(x, (2,)),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_method_with_varargs_dims_matches_eager(name):
    call = CALLS[name]
    x = torch.randn(2, 3, 4, requires_grad=True)
    want = call(x)
    got = fulmen.jit(call)(x)
    assert got.shape == want.shape and torch.equal(got, want)
    cotangent = torch.randn(want.shape)
    assert torch.equal(torch.autograd.grad(got, x, cotangent)[0], torch.autograd.grad(want, x, cotangent)[0])


@pytest.mark.parametrize("name", ["flip_int", "flip_ints", "tile_int", "tile_ints"])
def test_method_with_varargs_dims_under_vmap(name):
    call = CALLS[name]
    x = torch.randn(5, 2, 3, 4)
    torch.testing.assert_close(fulmen.vmap(call)(x), torch.func.vmap(call)(x), rtol=0, atol=0)
