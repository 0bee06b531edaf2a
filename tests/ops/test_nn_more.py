"""More torch.nn ops against eager: embedding bags, sampling grids, CTC loss, unpooling, fractional max pooling,
in-place random fills and torch.distributions (whose argument validation the trace repeats when it runs).

Oracle: eager on the same inputs in float64 (outputs, grads of every floating input and parameter, which grads are
None), over two calls (the second one a cache hit), each call after the same `torch.manual_seed` in eager and in
fulmen, so ops that draw must draw eager's values.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributions as D
import torch.nn.functional as F
from torch import nn

import fulmen
from fulmen.core.errors import DataDependentError, UnsupportedOpError

G = torch.Generator().manual_seed(0)
X1 = torch.randn(2, 4, 10, dtype=torch.float64, generator=G)
X2 = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=G)
X3 = torch.randn(2, 3, 4, 6, 6, dtype=torch.float64, generator=G)
GRID2 = torch.rand(2, 5, 7, 2, dtype=torch.float64, generator=G) * 2.4 - 1.2  # some points outside [-1, 1]
GRID3 = torch.rand(2, 3, 4, 5, 3, dtype=torch.float64, generator=G) * 2.4 - 1.2
THETA2 = torch.eye(2, 3, dtype=torch.float64).expand(2, 2, 3) + 0.2 * torch.randn(2, 2, 3, dtype=torch.float64,
                                                                                   generator=G)
THETA3 = torch.eye(3, 4, dtype=torch.float64).expand(2, 3, 4) + 0.2 * torch.randn(2, 3, 4, dtype=torch.float64,
                                                                                   generator=G)
BAG_1D = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 0, 0])
BAG_OFFSETS = torch.tensor([0, 2, 2, 6])  # the second bag is empty
BAG_2D = torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9], [0, 1, 1, 7]])
BAG_WEIGHTS = torch.rand(10, dtype=torch.float64, generator=G)
LOG_PROBS = torch.randn(12, 3, 5, dtype=torch.float64, generator=G).log_softmax(2)  # (T, N, C)
TARGETS = torch.tensor([[1, 2, 2, 4], [3, 1, 0, 0], [4, 4, 4, 4]])  # padded (N, S)
TARGET_LENGTHS = torch.tensor([4, 2, 4])
INPUT_LENGTHS = torch.tensor([12, 9, 6])  # the third can't align its 4 repeated labels within 6 steps: infinite loss


class Fn(nn.Module):
    """A function of tensors (and a layer with parameters, when given) as a module."""

    def __init__(self, fn: Callable[..., torch.Tensor], layer: nn.Module | None = None) -> None:
        super().__init__()
        self.fn, self.layer = fn, layer

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(self.layer, *args) if self.layer is not None else self.fn(*args)


def _unpool(pool: Callable[..., tuple[torch.Tensor, torch.Tensor]], unpool: Callable[..., torch.Tensor],
            **kwargs: object) -> Fn:
    def fn(x: torch.Tensor) -> torch.Tensor:
        out, indices = pool(x, 2, return_indices=True)
        return unpool(out * 2, indices, 2, **kwargs)

    return Fn(fn)


def _ctc(reduction: str, zero_infinity: bool, lengths_as_lists: bool = False, batch: int = 3) -> Fn:
    input_lengths, target_lengths = INPUT_LENGTHS[:batch], TARGET_LENGTHS[:batch]
    if lengths_as_lists:
        input_lengths, target_lengths = input_lengths.tolist(), target_lengths.tolist()

    def fn(log_probs: torch.Tensor) -> torch.Tensor:
        return F.ctc_loss(log_probs[:, :batch], TARGETS[:batch], input_lengths, target_lengths, reduction=reduction,
                          zero_infinity=zero_infinity)

    return Fn(fn)


CONCATENATED_TARGETS = torch.cat([t[:n] for t, n in zip(TARGETS, TARGET_LENGTHS)])


def _concatenated_ctc(log_probs: torch.Tensor) -> torch.Tensor:
    loss = nn.CTCLoss(blank=0, reduction="sum", zero_infinity=True)
    return loss(log_probs, CONCATENATED_TARGETS, INPUT_LENGTHS, TARGET_LENGTHS)


SAMPLES = torch.rand(2, 3, 2, dtype=torch.float64, generator=G)
MU = torch.randn(4, dtype=torch.float64, generator=G)
SIGMA = torch.rand(4, dtype=torch.float64, generator=G) + 0.5
VALUE = torch.randn(4, dtype=torch.float64, generator=G)
LOGITS = torch.randn(4, 5, dtype=torch.float64, generator=G)
CLASSES = torch.tensor([0, 4, 2, 2])


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[torch.Tensor, ...]]] = {
    # embedding bags
    "EmbeddingBag sum 2-D": (lambda: nn.EmbeddingBag(10, 3, mode="sum"), (BAG_2D,)),
    "EmbeddingBag mean offsets": (lambda: Fn(lambda e, i: e(i, BAG_OFFSETS), nn.EmbeddingBag(10, 3)), (BAG_1D,)),
    "EmbeddingBag max last offset": (lambda: Fn(lambda e, i: e(i, torch.tensor([0, 2, 2, 6, 10])),
                                                nn.EmbeddingBag(10, 3, mode="max", include_last_offset=True)),
                                     (BAG_1D,)),
    "EmbeddingBag per-sample weights": (lambda: Fn(lambda e, i, w: e(i, BAG_OFFSETS, per_sample_weights=w),
                                                   nn.EmbeddingBag(10, 3, mode="sum")), (BAG_1D, BAG_WEIGHTS)),
    "EmbeddingBag padding_idx": (lambda: Fn(lambda e, i: e(i, BAG_OFFSETS), nn.EmbeddingBag(10, 3, padding_idx=4)),
                                 (BAG_1D,)),
    "EmbeddingBag scale_grad_by_freq": (lambda: nn.EmbeddingBag(10, 3, mode="sum", scale_grad_by_freq=True),
                                        (BAG_2D,)),
    "embedding_bag weight": (lambda: Fn(lambda w: F.embedding_bag(BAG_1D, w, BAG_OFFSETS, mode="max")),
                             (torch.randn(10, 3, dtype=torch.float64, generator=G),)),
    # sampling grids
    "grid_sample bilinear zeros": (lambda: Fn(lambda x, g: F.grid_sample(x, g, align_corners=False)), (X2, GRID2)),
    "grid_sample bilinear border corners": (
        lambda: Fn(lambda x, g: F.grid_sample(x, g, padding_mode="border", align_corners=True)), (X2, GRID2)),
    "grid_sample nearest reflection": (
        lambda: Fn(lambda x, g: F.grid_sample(x, g, mode="nearest", padding_mode="reflection", align_corners=False)),
        (X2, GRID2)),
    "grid_sample bicubic zeros corners": (
        lambda: Fn(lambda x, g: F.grid_sample(x, g, mode="bicubic", align_corners=True)), (X2, GRID2)),
    "grid_sample bicubic reflection": (
        lambda: Fn(lambda x, g: F.grid_sample(x, g, mode="bicubic", padding_mode="reflection", align_corners=False)),
        (X2, GRID2)),
    "grid_sample 3-D": (lambda: Fn(lambda x, g: F.grid_sample(x, g, padding_mode="border", align_corners=False)),
                        (X3, GRID3)),
    "affine_grid 2-D": (lambda: Fn(lambda t: F.affine_grid(t, [2, 3, 5, 7], align_corners=False)), (THETA2,)),
    "spatial transformer": (lambda: Fn(lambda x, t: F.grid_sample(
        x, F.affine_grid(t, list(x.shape), align_corners=True), align_corners=True)), (X2, THETA2)),
    "spatial transformer 3-D": (lambda: Fn(lambda x, t: F.grid_sample(
        x, F.affine_grid(t, [2, 3, 3, 4, 5], align_corners=False), mode="nearest", align_corners=False)),
        (X3, THETA3)),
    # CTC
    "ctc mean": (lambda: _ctc("mean", zero_infinity=True), (LOG_PROBS,)),
    "ctc sum": (lambda: _ctc("sum", zero_infinity=True), (LOG_PROBS,)),
    "ctc none lists": (lambda: _ctc("none", zero_infinity=True, lengths_as_lists=True), (LOG_PROBS,)),
    "ctc finite without zero_infinity": (lambda: _ctc("mean", zero_infinity=False, batch=2), (LOG_PROBS,)),
    "CTCLoss concatenated targets": (lambda: Fn(_concatenated_ctc), (LOG_PROBS,)),
    # unpooling (indices from max pooling with return_indices)
    "max_unpool1d": (lambda: _unpool(F.max_pool1d, F.max_unpool1d), (X1,)),
    "max_unpool2d": (lambda: _unpool(F.max_pool2d, F.max_unpool2d), (X2,)),
    "max_unpool2d output_size": (lambda: _unpool(F.max_pool2d, F.max_unpool2d, output_size=[7, 7]),
                                 (X2[..., :-1, :-1].contiguous(),)),
    "max_unpool3d": (lambda: _unpool(F.max_pool3d, F.max_unpool3d), (X3,)),
    "MaxUnpool2d indices as input": (lambda: Fn(lambda x, i: nn.MaxUnpool2d(2)(x, i)),
                                     F.max_pool2d(X2, 2, return_indices=True)),
    # fractional max pooling: its regions are drawn (unless given)
    "FractionalMaxPool2d output_size": (lambda: nn.FractionalMaxPool2d(3, output_size=5), (X2,)),
    "FractionalMaxPool2d output_ratio": (lambda: nn.FractionalMaxPool2d(2, output_ratio=0.5), (X2,)),
    "fractional_max_pool2d unbatched indices": (
        lambda: Fn(lambda x: F.fractional_max_pool2d(x, 2, output_size=4, return_indices=True)[0]), (X2[0],)),
    "fractional_max_pool2d given samples": (
        lambda: Fn(lambda x: F.fractional_max_pool2d(x, 2, output_size=4, _random_samples=SAMPLES)), (X2,)),
    "FractionalMaxPool3d": (lambda: nn.FractionalMaxPool3d(2, output_size=(2, 4, 4)), (X3,)),
    # in-place random fills: eager's draws, zero grads for the filled tensor (and a tensor p)
    "uniform_": (lambda: Fn(lambda x: (x * 2).uniform_(-1, 2) * x), (X2,)),
    "normal_": (lambda: Fn(lambda x: (x * 2).normal_(1.0, 0.5) * x), (X2,)),
    "bernoulli_ float p": (lambda: Fn(lambda x: (x * 2).bernoulli_(0.3) * x), (X2,)),
    "bernoulli_ tensor p": (lambda: Fn(lambda x, p: (x * 2).bernoulli_(p) * x), (X2, X2[0, 0].sigmoid())),
    "exponential_": (lambda: Fn(lambda x: (x * 2).exponential_(2.0) * x), (X2,)),
    "geometric_": (lambda: Fn(lambda x: (x * 2).geometric_(0.3) * x), (X2,)),
    "cauchy_": (lambda: Fn(lambda x: (x * 2).cauchy_(0.5, 2.0) * x), (X2,)),
    "log_normal_": (lambda: Fn(lambda x: (x * 2).log_normal_(0.5, 0.25) * x), (X2,)),
    "random_": (lambda: Fn(lambda x: (x * 2).random_(0, 10) * x), (X2,)),
    "fill of a new tensor": (lambda: Fn(lambda x: x * torch.empty(x.shape[-1], dtype=x.dtype).exponential_()), (X2,)),
    "gumbel_softmax": (lambda: Fn(lambda x: F.gumbel_softmax(x, tau=0.5)), (X2,)),
    "gumbel_softmax hard": (lambda: Fn(lambda x: F.gumbel_softmax(x, hard=True, dim=1)), (X2,)),
    # torch.distributions, validating its arguments and samples (validate_args, on by default)
    "Normal log_prob": (lambda: Fn(lambda m, s, v: D.Normal(m, s).log_prob(v)), (MU, SIGMA, VALUE)),
    "Normal rsample": (lambda: Fn(lambda m, s: D.Normal(m, s).rsample((3,))), (MU, SIGMA)),
    "Normal sample": (lambda: Fn(lambda m, s: D.Normal(m, s).sample() * m), (MU, SIGMA)),
    "Normal entropy and KL": (lambda: Fn(lambda m, s: D.Normal(m, s).entropy()
                                         + D.kl_divergence(D.Normal(m, s), D.Normal(m.flip(0), s.flip(0)))),
                              (MU, SIGMA)),
    "Categorical logits": (lambda: Fn(lambda logits: D.Categorical(logits=logits).log_prob(CLASSES)
                                      + D.Categorical(logits=logits).entropy()), (LOGITS,)),
    "Categorical probs": (lambda: Fn(lambda logits: D.Categorical(probs=logits.softmax(-1)).log_prob(CLASSES)),
                          (LOGITS,)),
    "Categorical sample": (lambda: Fn(lambda logits: logits.log_softmax(-1).gather(
        -1, D.Categorical(logits=logits).sample().unsqueeze(-1))), (LOGITS,)),
    "Bernoulli log_prob": (lambda: Fn(lambda m: D.Bernoulli(logits=m).log_prob((VALUE > 0).double())), (MU,)),
    "Laplace rsample": (lambda: Fn(lambda m, s: D.Laplace(m, s).rsample()), (MU, SIGMA)),
    "Exponential rsample": (lambda: Fn(lambda s: D.Exponential(s).rsample((2,))), (SIGMA,)),
    "Cauchy rsample": (lambda: Fn(lambda m, s: D.Cauchy(m, s).rsample()), (MU, SIGMA)),
    "Independent TanhTransform": (lambda: Fn(lambda m, s: D.Independent(D.TransformedDistribution(
        D.Normal(m, s), [D.transforms.TanhTransform()]), 1).log_prob(VALUE.tanh() * 0.5)), (MU, SIGMA)),
}


def _leaf(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    return t.requires_grad_() if t.is_floating_point() else t


def _grads(module: nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return [t.grad for t in inputs if t.is_floating_point()] + [p.grad for p in module.parameters()]


def _check_against_eager(make: Callable[[], nn.Module], inputs: tuple[torch.Tensor, ...], device: str = "cpu"
                         ) -> None:
    torch.manual_seed(0)
    eager = make().double().to(device)
    ours = copy.deepcopy(eager)
    jitted = fulmen.jit(ours)
    for call in range(2):
        want_in, got_in = [_leaf(t.to(device)) for t in inputs], [_leaf(t.to(device)) for t in inputs]
        torch.manual_seed(call)
        want = eager(*want_in)
        want_next = torch.rand((), device=device)
        torch.manual_seed(call)
        got = jitted(*got_in)
        assert torch.rand((), device=device) == want_next  # the program drew as much as in eager
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        cotangent = torch.randn(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(call)).to(device)
        (want * cotangent).sum().backward()
        (got * cotangent).sum().backward()
        for g, w in zip(_grads(ours, got_in), _grads(eager, want_in), strict=True):
            assert (g is None) == (w is None)  # None stays None, as in eager
            if w is not None:
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert fulmen.cache_misses(jitted) == 1


@pytest.mark.parametrize("name", CASES)
def test_an_op_gives_eagers_outputs_and_grads(name):
    _check_against_eager(*CASES[name])


# (the cases that make CPU tensors of their own are left out)
DRAWING = ["FractionalMaxPool2d output_size", "FractionalMaxPool3d", "uniform_", "normal_", "bernoulli_ float p",
           "bernoulli_ tensor p", "exponential_", "geometric_", "cauchy_", "log_normal_", "random_", "gumbel_softmax",
           "gumbel_softmax hard", "Normal rsample", "Normal sample", "Categorical sample", "Laplace rsample",
           "Exponential rsample", "Cauchy rsample", "Normal log_prob"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (its generator and kernels)")
@pytest.mark.parametrize("name", DRAWING)
def test_an_op_on_cuda_draws_and_validates_as_eager(name):
    _check_against_eager(*CASES[name], device="cuda")


def test_fractional_max_pooling_draws_eagers_regions_under_the_same_seed():
    # the regions differ from seed to seed: equal outputs under each seed are not a coincidence
    pool = fulmen.jit(nn.FractionalMaxPool2d(3, output_size=5))
    outs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        want = nn.FractionalMaxPool2d(3, output_size=5)(X2)
        want_next = torch.rand(())
        torch.manual_seed(seed)
        outs.append(pool(X2))
        torch.testing.assert_close(outs[-1], want, rtol=0, atol=0)
        assert torch.rand(()) == want_next  # the RNG moved on as far as in eager
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(
    ("fn", "bad", "message"),
    [(lambda m, s: D.Normal(m, s).log_prob(VALUE), (MU, -SIGMA),
      r"Expected parameter scale \(Tensor of shape \(4,\)\) of distribution Normal.* to satisfy the constraint "
      r"GreaterThan\(lower_bound=0\.0\), but found invalid values"),
     (lambda logits, classes: D.Categorical(logits=logits).log_prob(classes), (LOGITS, CLASSES + 1),
      r"Expected value argument \(Tensor of shape \(4,\)\) to be within the support \(IntegerInterval\(lower_bound=0, "
      r"upper_bound=4\)\) of the distribution Categorical.*, but found invalid values")],
    ids=["argument", "sample"],
)
def test_a_distributions_validation_raises_eagers_error_when_the_trace_runs_on_invalid_values(fn, bad, message):
    good = (MU, SIGMA) if bad[0] is MU else (LOGITS, CLASSES)
    with pytest.raises(ValueError, match=rf"(?s){message}"):
        fn(*bad)  # eager
    jitted = fulmen.jit(fn)
    torch.testing.assert_close(jitted(*good), fn(*good), rtol=0, atol=0)
    with pytest.raises(ValueError, match=rf"(?s){message}.*test_nn_more\.py"):  # the same trace, checking again
        jitted(*bad)
    assert fulmen.cache_misses(jitted) == 1


def test_reading_is_all_true_outside_a_distributions_validation_is_refused_naming_the_line():
    def fn(x):
        return x * 2 if torch._is_all_true(x > 0) else x

    with pytest.raises(DataDependentError, match=r"(?s)torch\._is_all_true: it reads tensor values.*test_nn_more\.py"):
        fulmen.jit(fn)(SIGMA)


@pytest.mark.parametrize("method", ["normal_", "uniform_", "exponential_", "bernoulli_"])
def test_a_fill_of_a_float32_tensor_draws_eagers_values(method):
    # CPU normal_ draws a contiguous float32 tensor of 16 elements or more in batches, others one by one
    fn = lambda x: getattr(x * 1, method)()  # noqa: E731
    x = torch.randn(5, 7)
    jitted = fulmen.jit(fn)
    for seed in (0, 1):
        torch.manual_seed(seed)
        want = fn(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(jitted(x), want, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("fn", "inputs", "message"),
    [(lambda w: F.embedding_bag(BAG_1D, w, BAG_OFFSETS, max_norm=1.0), (torch.randn(10, 3),),
      r"embedding_bag with max_norm"),
     (lambda w: F.embedding_bag(BAG_1D, w, BAG_OFFSETS, sparse=True), (torch.randn(10, 3),),
      r"embedding_bag with sparse=True"),
     (lambda x: (x * 1).t().normal_(), (torch.randn(5, 7),), r"Tensor\.normal_ on a non-contiguous tensor"),
     (lambda x: (x * 1).exponential_(generator=torch.Generator()), (torch.randn(5, 7),),
      r"Tensor\.exponential_\(generator=\.\.\.\): fulmen draws from the default generator only"),
     (lambda x: x.new([1.0, 2.0]) * 2, (torch.randn(5, 7),), r"Tensor\.new\(\*sizes\) only")],
    ids=["embedding_bag max_norm", "embedding_bag sparse", "normal_ non-contiguous", "exponential_ generator",
         "Tensor.new data"],
)
def test_a_call_fulmen_cannot_trace_exactly_is_refused_naming_the_line(fn, inputs, message):
    fn(*[t.clone() for t in inputs])  # eager runs it
    with pytest.raises(UnsupportedOpError, match=rf"(?s){message}.*test_nn_more\.py"):
        fulmen.jit(fn)(*inputs)


@pytest.mark.parametrize("sizes", [(), (torch.Size([]),), (torch.Size([2, 3]),), (2, 3), (0,)],
                         ids=["no sizes", "0-D Size", "Size", "ints", "zero"])
def test_tensor_new_gives_eagers_shape(sizes):
    fn = lambda x: x.new(*sizes).zero_() + x.sum()  # noqa: E731
    x = torch.randn(5, 7)
    torch.testing.assert_close(fulmen.jit(fn)(x), fn(x), rtol=0, atol=0)


def test_the_locals_a_distributions_validation_message_is_stated_from_are_torchs():
    # fulmen words eager's ValueError from these locals of torch's validating frames; were one renamed, the read of
    # torch._is_all_true would be refused as data-dependent instead (fulmen/acquisition/distribution_checks.py)
    assert {"self", "value", "param", "constraint"} <= set(D.Distribution.__init__.__code__.co_varnames)
    assert {"self", "value", "support"} <= set(D.Distribution._validate_sample.__code__.co_varnames)
