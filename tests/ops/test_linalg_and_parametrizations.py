"""Training through torch.nn.utils.parametrizations (weight_norm, spectral_norm, orthogonal) and the old
torch.nn.utils.weight_norm under fulmen.jit follows eager step by step: losses, every grad, and spectral_norm's
power-iteration buffers (updated in place under no_grad in train mode). Also the linear-algebra ops those
parametrizations and their users reach, where the op_db samples do not look: lstsq's output shapes, refusals
naming the user's line, out= writes, and mv/dot as the prims fusion executors see."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

import fulmen
from tests.ops.opdb import DECOMPOSED

STEPS = 3
TIGHT = {"rtol": 1e-12, "atol": 1e-12}


def _mlp(parametrize: Callable[[nn.Sequential], None], seed: int = 0) -> nn.Sequential:
    """The same network for the same seed: eager's and fulmen's copies are built apart, as the old weight_norm's
    hook (and orthogonal's cached base) cannot be deep-copied."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    parametrize(net)
    return net


def _weight_norm(net: nn.Sequential) -> None:
    parametrizations.weight_norm(net[0])
    parametrizations.weight_norm(net[2], dim=1)


def _spectral_norm(net: nn.Sequential) -> None:
    parametrizations.spectral_norm(net[0])
    parametrizations.spectral_norm(net[2], n_power_iterations=2)


def _orthogonal(orthogonal_map: str | None) -> Callable[[nn.Sequential], None]:
    def parametrize(net: nn.Sequential) -> None:
        # net[0]'s weight is 8 x 6: the default map for a tall matrix is householder, for a square one matrix_exp
        parametrizations.orthogonal(net[0], orthogonal_map=orthogonal_map)
        parametrizations.orthogonal(net[2], orthogonal_map=orthogonal_map)

    return parametrize


def _old_weight_norm(net: nn.Sequential) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of parametrizations.weight_norm
        nn.utils.weight_norm(net[0])
        nn.utils.weight_norm(net[2], dim=None)


def _train_both(parametrize: Callable[[nn.Sequential], None], train: bool = True) -> tuple[nn.Module, nn.Module]:
    eager, model = _mlp(parametrize), _mlp(parametrize)
    eager.train(train)
    model.train(train)
    jitted = fulmen.jit(model)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(5, 6, dtype=torch.float64, generator=generator)
        y = torch.randn(5, 3, dtype=torch.float64, generator=generator)
        expected = nn.functional.mse_loss(eager(x), y)
        actual = nn.functional.mse_loss(jitted(x), y)
        torch.testing.assert_close(actual, expected, **TIGHT, msg=lambda m, s=step: f"loss at step {s}: {m}")
        eager_opt.zero_grad()
        opt.zero_grad()
        expected.backward()
        actual.backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert p.grad is not None and q.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, **TIGHT,
                                       msg=lambda m, n=name, s=step: f"{n}.grad, step {s}: {m}")
        for (name, b), c in zip(model.named_buffers(), eager.buffers()):
            torch.testing.assert_close(b, c, **TIGHT, msg=lambda m, n=name, s=step: f"buffer {n}, step {s}: {m}")
        eager_opt.step()
        opt.step()
    assert fulmen.cache_misses(jitted) == 1
    return eager, model


@pytest.mark.parametrize("parametrize", [
    pytest.param(_weight_norm, id="weight_norm"),
    pytest.param(_orthogonal(None), id="orthogonal-default"),
    pytest.param(_orthogonal("cayley"), id="orthogonal-cayley"),
    pytest.param(_old_weight_norm, id="old-weight_norm"),
])
def test_parametrized_training_matches_eager(parametrize):
    _train_both(parametrize)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_spectral_norm_training_and_buffers_match_eager(train):
    eager, model = _train_both(_spectral_norm, train)
    buffers = dict(model.named_buffers())
    assert {name.rsplit(".", 1)[-1] for name in buffers} == {"_u", "_v"}
    if train:  # the power iteration moved u and v from their initial values, in place, as eager's did
        initial = dict(_mlp(_spectral_norm).named_buffers())
        assert all(not torch.equal(buffers[name], initial[name]) for name in buffers)


def test_lstsq_shapes_match_eagers():
    """lstsq has no meta kernel: fulmen's shapes for its four outputs are its own, checked against eager's over
    drivers, vector and matrix right-hand sides, tall and wide inputs and broadcast batches."""
    shapes = [((5, 3), (5,)), ((2, 5, 3), (2, 5)), ((3, 5), (3,)), ((5, 3), (5, 2)), ((2, 5, 3), (1, 5, 2)),
              ((1, 5, 3), (4, 5, 2)), ((3, 5), (3, 2)), ((3, 3), (3, 4))]
    generator = torch.Generator().manual_seed(0)
    for a_shape, b_shape in shapes:
        a = torch.randn(a_shape, dtype=torch.float64, generator=generator)
        b = torch.randn(b_shape, dtype=torch.float64, generator=generator)
        for driver in ("gels", "gelsy", "gelsd", "gelss"):
            if driver in ("gelsd", "gelss") and a_shape[-2] > a_shape[-1]:
                continue  # refused: test_lstsq_value_dependent_residuals_refused

            def solve(a, b, driver=driver):
                return torch.linalg.lstsq(a, b, driver=driver)

            expected, actual = solve(a, b), fulmen.jit(solve)(a, b)
            for got, want in zip(actual, expected):
                assert (got.shape, got.dtype) == (want.shape, want.dtype), (a_shape, b_shape, driver)
            torch.testing.assert_close(actual.solution, expected.solution)


def test_lstsq_value_dependent_residuals_refused():
    def solve(a, b):
        return torch.linalg.lstsq(a, b, driver="gelsd").residuals

    with pytest.raises(fulmen.UnsupportedOpError, match="full rank") as caught:
        fulmen.jit(solve)(torch.randn(5, 3), torch.randn(5, 2))
    assert f":{inspect.getsourcelines(solve)[1] + 1} in solve" in str(caught.value)  # the user's line


def test_out_argument_writes_like_eager():
    """`op(..., out=t)` writes the result into t, as spectral_norm's F.normalize(..., out=self._u) does; an out of
    another shape (which eager would resize) or under autograd (which eager refuses) is refused."""

    def normalize_into(x, u):
        with torch.no_grad():
            nn.functional.normalize(x, dim=0, out=u)
        return u * 2

    x, u = torch.randn(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    u_eager = u.clone()
    expected = normalize_into(x, u_eager)
    actual = fulmen.jit(normalize_into)(x, u)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    torch.testing.assert_close(u, u_eager, rtol=0, atol=0)
    with pytest.raises(fulmen.UnsupportedOpError, match="resize"):
        fulmen.jit(lambda x, out: torch.add(x, 1, out=out))(x, torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mv_dot_decompose_to_matmul_bit_exact(dtype):
    """mv and dot are prims.matmul when a fusion executor takes their decomposition, with eager's bits."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(33, 65, dtype=dtype, generator=generator, requires_grad=True)
    v = torch.randn(65, dtype=dtype, generator=generator, requires_grad=True)
    w = torch.randn(33, dtype=dtype, generator=generator, requires_grad=True)

    def program(a, v, w):
        return torch.dot(torch.mv(a, v), w) + a.mv(v).dot(w)

    expected = program(a, v, w)
    want = torch.autograd.grad(expected, (a, v, w))
    jitted = fulmen.jit(program, executors=[DECOMPOSED])
    actual = jitted(a, v, w)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    for got, ref in zip(torch.autograd.grad(actual, (a, v, w)), want):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="same dtype"):
        fulmen.jit(torch.dot)(v, v.detach().float() if dtype == torch.float64 else v.detach().double())


def test_complex_transforms_differentiate_as_eager():
    """fft and stft values are eager's, and so are the grads through their complex outputs (eager's backward)."""
    generator = torch.Generator().manual_seed(0)
    signal = torch.randn(2, 64, dtype=torch.float64, generator=generator)
    window = torch.hann_window(16, dtype=torch.float64)

    def spectrum(x):
        return torch.fft.rfft(x).abs() + torch.stft(x, 16, window=window, return_complex=True).abs().sum(-1)[..., :1]

    torch.testing.assert_close(fulmen.jit(spectrum)(signal), spectrum(signal), rtol=0, atol=0)
    mine, theirs = signal.clone().requires_grad_(), signal.clone().requires_grad_()
    fulmen.jit(spectrum)(mine).sum().backward()
    spectrum(theirs).sum().backward()
    assert torch.equal(mine.grad, theirs.grad)


@pytest.mark.parametrize("transpose", [lambda x: x.mH, torch.adjoint, lambda x: x.H], ids=["mH", "adjoint", "H"])
def test_conjugate_transposes_conjugate_as_decompositions(transpose):
    """A complex tensor's .mH/.H/adjoint are conjugated: run as decompositions (what fusion executors take) they
    were plain permutations before, the imaginary parts' signs flipped against eager's."""
    x = torch.randn(2, 3, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))

    def program(x):
        return transpose(x) * 1

    torch.testing.assert_close(fulmen.jit(program, executors=[DECOMPOSED])(x), program(x), rtol=0, atol=0)
