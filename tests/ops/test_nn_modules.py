"""torch.nn layers beyond the transformer's, jitted whole, against eager.

They reach fulmen three ways: torch's own Python (`F.multi_head_attention_forward`, `F.interpolate`, boolean
dispatchers like `F.max_pool2d`) runs inline so its torch calls are traced one by one
(fulmen/acquisition/torch_python.py);
the ops it reaches without a rule of fulmen's (pooling, upsampling, recurrent layers, less common losses) are
differentiated by eager's own backward (fulmen/ops/rules/eager.py); and what would change state or draw again when
recomputed is refused naming the user's line.

Oracle: eager on the same inputs in float64 (outputs, grads of inputs and parameters, which grads are None,
buffers after the call), over two calls (the second one a cache hit).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fulmen
from fulmen.core.errors import UnsupportedOpError

G = torch.Generator().manual_seed(0)
X1 = torch.randn(2, 4, 10, dtype=torch.float64, generator=G)
X2 = torch.randn(2, 4, 8, 8, dtype=torch.float64, generator=G)
X3 = torch.randn(2, 4, 4, 4, 4, dtype=torch.float64, generator=G)
SEQ = torch.randn(3, 7, 8, dtype=torch.float64, generator=G)
V = torch.randn(3, 4, dtype=torch.float64, generator=G)
PAD = torch.tensor([[False] * 7, [False] * 5 + [True] * 2, [False] * 3 + [True] * 4])


class Pair(nn.Module):
    """A two-argument function of (a, b) as a module."""

    def __init__(self, fn: Callable[..., torch.Tensor], layer: nn.Module | None = None) -> None:
        super().__init__()
        self.fn, self.layer = fn, layer

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.fn(self.layer, a, b) if self.layer is not None else self.fn(a, b)


class First(nn.Module):
    """The first output of a layer that returns several (attention weights, hidden states, indices)."""

    def __init__(self, layer: nn.Module, **kwargs: object) -> None:
        super().__init__()
        self.layer, self.kwargs = layer, kwargs

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.layer(*args, **self.kwargs)
        return out[0] if isinstance(out, tuple) else out


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[torch.Tensor, ...]]] = {
    # torch's Python, inline
    "MultiheadAttention": (lambda: First(nn.MultiheadAttention(8, 2, batch_first=True)), (SEQ, SEQ, SEQ)),
    "MultiheadAttention padding mask": (lambda: First(nn.MultiheadAttention(8, 2, batch_first=True),
                                                      key_padding_mask=PAD), (SEQ, SEQ, SEQ)),
    "TransformerEncoderLayer": (lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), (SEQ,)),
    "TransformerDecoderLayer": (lambda: nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
                                (SEQ, SEQ.flip(1))),
    "MaxPool2d return_indices": (lambda: First(nn.MaxPool2d(2, return_indices=True)), (X2,)),
    # vision
    "Conv3d": (lambda: nn.Conv3d(4, 2, 3), (X3,)),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(4, 2, 3), (X1,)),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(4, 2, 3, stride=2, output_padding=1), (X2,)),
    "ConvTranspose3d": (lambda: nn.ConvTranspose3d(4, 2, 2), (X3,)),
    "MaxPool1d": (lambda: nn.MaxPool1d(3, stride=2), (X1,)),
    "MaxPool3d": (lambda: nn.MaxPool3d(2), (X3,)),
    "AvgPool2d": (lambda: nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False), (X2,)),
    "AvgPool3d": (lambda: nn.AvgPool3d(2), (X3,)),
    "AdaptiveAvgPool2d": (lambda: nn.AdaptiveAvgPool2d((3, 5)), (X2,)),
    "AdaptiveMaxPool2d": (lambda: nn.AdaptiveMaxPool2d(3), (X2,)),
    "LPPool2d": (lambda: nn.LPPool2d(2, 2), (X2,)),
    "Upsample nearest": (lambda: nn.Upsample(scale_factor=2), (X2,)),
    "Upsample bilinear": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), (X2,)),
    "Upsample bicubic": (lambda: nn.Upsample(size=(5, 7), mode="bicubic", align_corners=True), (X2,)),
    "Upsample trilinear": (lambda: nn.Upsample(scale_factor=2, mode="trilinear"), (X3,)),
    "PixelShuffle": (lambda: nn.Sequential(nn.PixelShuffle(2), nn.PixelUnshuffle(2)), (X2,)),
    "InstanceNorm2d": (lambda: nn.InstanceNorm2d(4, affine=True), (X2,)),
    "LocalResponseNorm": (lambda: nn.LocalResponseNorm(2), (X2,)),
    "CNN": (lambda: nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)), (X2,)),
    # recurrent
    "LSTM": (lambda: First(nn.LSTM(8, 16, num_layers=2, batch_first=True)), (SEQ,)),
    "LSTM projections": (lambda: First(nn.LSTM(8, 6, proj_size=3, bidirectional=True)), (SEQ,)),
    "GRU bidirectional": (lambda: First(nn.GRU(8, 16, batch_first=True, bidirectional=True)), (SEQ,)),
    "RNN relu": (lambda: First(nn.RNN(8, 6, nonlinearity="relu")), (SEQ,)),
    "LSTM dropout in eval": (lambda: First(nn.LSTM(8, 6, num_layers=2, dropout=0.5)).eval(), (SEQ,)),
    "LSTMCell": (lambda: First(nn.LSTMCell(4, 5)), (V,)),
    "GRUCell": (lambda: nn.GRUCell(4, 5), (V,)),
    # activations, distances, losses
    "PReLU": (lambda: nn.PReLU(4), (X2,)),
    "Hardshrink/Softshrink": (lambda: nn.Sequential(nn.Hardshrink(0.3), nn.Softshrink(0.1)), (X2,)),
    "RReLU in eval": (lambda: nn.RReLU().eval(), (X2,)),
    "Dropout2d in eval": (lambda: nn.Dropout2d(0.5).eval(), (X2,)),
    "Bilinear": (lambda: nn.Bilinear(4, 4, 3), (V, V.flip(0))),
    "cosine similarity": (lambda: Pair(F.cosine_similarity), (V, V.flip(0))),
    "pairwise distance": (lambda: Pair(F.pairwise_distance), (V, V.flip(0))),
    "cdist": (lambda: Pair(torch.cdist), (V, V.flip(0))),
    "huber": (lambda: Pair(F.huber_loss), (V, V.flip(0))),
    "triplet margin": (lambda: Pair(lambda a, b: F.triplet_margin_loss(a, b, a.flip(1))), (V, V.flip(0))),
    "hinge embedding": (lambda: Pair(lambda a, b: F.hinge_embedding_loss(a, b.sign())), (V, V.flip(0))),
    "cosine embedding": (lambda: Pair(lambda a, b: F.cosine_embedding_loss(a, b, torch.tensor([1, -1, 1]))),
                         (V, V.flip(0))),
    "margin ranking": (lambda: Pair(lambda a, b: F.margin_ranking_loss(a, b, torch.ones_like(a))), (V, V.flip(0))),
    "multi margin": (lambda: Pair(lambda a, b: F.multi_margin_loss(a + b, torch.tensor([0, 3, 1]))), (V, V.flip(0))),
    "poisson nll": (lambda: Pair(lambda a, b: F.poisson_nll_loss(a, b.abs())), (V, V.flip(0))),
}


def _grads(module: nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return [t.grad for t in inputs] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("name", CASES)
def test_a_layer_gives_eagers_outputs_grads_and_buffers(name):
    make, inputs = CASES[name]
    torch.manual_seed(0)
    eager = make().double()
    ours = copy.deepcopy(eager)
    jitted = fulmen.jit(ours)
    for _ in range(2):
        want_in = [t.clone().requires_grad_() for t in inputs]
        got_in = [t.clone().requires_grad_() for t in inputs]
        want, got = eager(*want_in), jitted(*got_in)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        want.sum().backward()
        got.sum().backward()
        for g, w in zip(_grads(ours, got_in), _grads(eager, want_in)):
            assert (g is None) == (w is None)  # None stays None (an optimizer skips it), as in eager
            if w is not None:
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
        for b, w in zip(ours.buffers(), eager.buffers()):
            torch.testing.assert_close(b, w, rtol=0, atol=0)
    assert fulmen.cache_misses(jitted) == 1


@pytest.mark.parametrize(
    ("make", "x", "message"),
    [(lambda: First(nn.LSTM(8, 6, num_layers=2, dropout=0.5)), SEQ, r"torch\.lstm with dropout=0\.5 in training"),
     (lambda: nn.InstanceNorm2d(4, track_running_stats=True), X2, "instance_norm updating running statistics"),
     (lambda: nn.RReLU(), X2, r"torch\.rrelu in training")],
    ids=["LSTM dropout", "InstanceNorm running stats", "RReLU"],
)
def test_a_layer_that_would_draw_or_update_again_in_its_backward_is_refused_naming_the_line(make, x, message):
    module = make().double()
    module(x)  # eager runs it
    with pytest.raises(UnsupportedOpError, match=rf"(?s){message}.*test_nn_modules\.py"):
        fulmen.jit(module)(x)


def test_an_unused_input_of_an_op_with_eagers_grad_gets_none_as_in_eager():
    fn = lambda a, b: F.hinge_embedding_loss(a, b.sign())  # noqa: E731  (b reaches only a comparison)
    a, b = V.clone().requires_grad_(), V.flip(0).clone().requires_grad_()
    fulmen.jit(fn)(a, b).backward()
    assert a.grad is not None and b.grad is None


def test_a_layer_with_eagers_grads_is_refused_under_autocast():
    layer = nn.Bilinear(4, 4, 3)  # eager's autocast converts inside F.bilinear (its _trilinear): the trace would not
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(V.float(), V.float())
        with pytest.raises(UnsupportedOpError, match=r"(?s)bilinear under torch\.autocast.*test_nn_modules\.py"):
            fulmen.jit(layer)(V.float(), V.float())


class Flattening(nn.Module):
    """Older code calls `flatten_parameters` in its forward (after DataParallel replicas, or to silence its warning)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(8, 16, num_layers=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rnn.flatten_parameters()
        return self.rnn(x)[0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuDNN's recurrent kernels)")
@pytest.mark.parametrize("name", ["LSTM", "LSTM projections", "GRU bidirectional", "RNN relu", "flatten in forward"])
def test_a_recurrent_layer_on_cuda_gives_eager_cudnns_outputs_and_grads(name):
    # torch's flatten_parameters reads where the weights live (data_ptr): inside a trace it is skipped (lookasides.py)
    make = Flattening if name == "flatten in forward" else CASES[name][0]
    torch.manual_seed(0)
    eager = make().cuda()
    ours = copy.deepcopy(eager)
    ours.apply(lambda m: m.flatten_parameters() if isinstance(m, nn.RNNBase) else None)  # as `.cuda()` leaves it
    jitted = fulmen.jit(ours)
    for _ in range(2):
        x = SEQ.float().cuda()
        want_in, got_in = x.clone().requires_grad_(), x.clone().requires_grad_()
        want, got = eager(want_in), jitted(got_in)
        torch.testing.assert_close(got, want)
        want.square().sum().backward()
        got.square().sum().backward()
        for g, w in zip(_grads(ours, [got_in]), _grads(eager, [want_in])):
            torch.testing.assert_close(g, w)
    assert fulmen.cache_misses(jitted) == 1
