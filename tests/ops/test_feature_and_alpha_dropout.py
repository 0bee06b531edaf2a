"""nn.Dropout1d / 2d / 3d, nn.AlphaDropout and nn.FeatureAlphaDropout in training, against eager with the same seed:
the same draws (outputs bit for bit), grads, and the generator's state after the call, on the first call and on a
cached one; out of training, at p 0 and 1 as eager; and the in-place shape change of F.dropout1d(inplace=True) on an
unbatched input refused, naming the line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fulmen


class InPlace(nn.Module):
    """A dropout updating an intermediate in place (`inplace=True`), then both read."""

    def __init__(self, dropout: nn.Module) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        return self.dropout(h) + h


CASES = {
    "Dropout1d": (lambda: nn.Dropout1d(0.4), (2, 3, 5)),
    "Dropout1d_unbatched": (lambda: nn.Dropout1d(0.4), (3, 5)),
    "Dropout2d": (lambda: nn.Dropout2d(0.4), (2, 3, 5, 4)),
    "Dropout3d": (lambda: nn.Dropout3d(0.4), (2, 3, 2, 5, 4)),
    "AlphaDropout": (lambda: nn.AlphaDropout(0.3), (4, 7)),
    "FeatureAlphaDropout": (lambda: nn.FeatureAlphaDropout(0.3), (2, 3, 5)),
    "AlphaDropout_p1": (lambda: nn.AlphaDropout(1.0), (4, 7)),
    "Dropout2d_in_place": (lambda: InPlace(nn.Dropout2d(0.5, inplace=True)), (2, 3, 4, 4)),
    "AlphaDropout_in_place": (lambda: InPlace(nn.AlphaDropout(0.5, inplace=True)), (3, 5)),
}


def _run(module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    leaf = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out = module(leaf)
    (grad,) = torch.autograd.grad(out.square().sum(), leaf)
    return out, grad, torch.rand(2)  # the generator's state after the call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_training_draws_outputs_and_grads_are_eagers(name, dtype):
    make, shape = CASES[name]
    module = make().train()
    jitted = fulmen.jit(module)
    x = torch.randn(shape).to(dtype)
    for seed in (3, 4):  # the second call runs the cached trace
        want, got = _run(module, x, seed), _run(jitted, x, seed)
        for w, g in zip(want, got):
            assert g.dtype == w.dtype and torch.equal(g, w)
    assert fulmen.cache_misses(jitted) == 1


def test_a_transposed_inputs_alpha_dropout_draws_in_its_layout_as_eager():
    x = torch.randn(7, 4).t()  # eager draws into empty_like(x): where each draw lands follows the strides
    module = nn.AlphaDropout(0.3)
    for w, g in zip(_run(module, x, 5), _run(fulmen.jit(module), x, 5)):
        assert torch.equal(g, w)


@pytest.mark.parametrize(
    "make",
    [lambda: nn.Dropout2d(0.5), lambda: nn.AlphaDropout(0.5), lambda: nn.Dropout2d(0.0)],
    ids=["Dropout2d", "AlphaDropout", "p0"],
)
def test_out_of_training_or_at_p0_it_draws_nothing(make):
    module = make()
    if module.p > 0:
        module.eval()
    x = torch.randn(2, 3, 4, 4)
    torch.manual_seed(1)
    want = (module(x), torch.rand(2))
    torch.manual_seed(1)
    got = (fulmen.jit(module)(x), torch.rand(2))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_fulmen_vmap_shares_one_examples_feature_mask_under_randomness_same_as_torch_func():
    x = torch.randn(3, 2, 4, 5)
    fn = lambda x: torch.feature_dropout(x, 0.5, True)  # noqa: E731
    torch.manual_seed(2)
    want = torch.func.vmap(fn, randomness="same")(x)
    torch.manual_seed(2)
    got = fulmen.vmap(fn, randomness="same")(x)
    assert torch.equal(got, want)


def test_an_in_place_shape_change_is_refused_naming_the_line():
    module = InPlace(nn.Dropout1d(0.5, inplace=True))  # F.dropout1d calls input.unsqueeze_(0) on an unbatched input
    module(torch.randn(3, 5))
    with pytest.raises(
        fulmen.UnsupportedOpError,
        match=r"(?s)unsqueeze_: it changes a tensor's shape in place.*"
        r"inplace=False.*test_feature_and_alpha_dropout\.py",
    ):
        fulmen.jit(module)(torch.randn(3, 5))
