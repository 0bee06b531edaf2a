"""polygamma, special.zeta, special.ndtri, frexp, ldexp, take and torch.rms_norm in every spelling a program uses
(functions, methods, in-place methods, torch.special), against eager: values, which outputs require grad, grads
(float64, also against finite differences), eager's errors; torch.rms_norm under fulmen.dynamo (nn.RMSNorm). The
op_db sweeps (test_op_db*.py) run PyTorch's own samples of each."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fulmen

POSITIVE = torch.rand(3, 4, dtype=torch.float64) + 0.5
PROBABILITIES = torch.rand(3, 4, dtype=torch.float64) * 0.9 + 0.05
INDEX = torch.tensor([[0, 11, -1], [5, -12, 3]])

CALLS = {
    "polygamma": (lambda x: torch.polygamma(2, x), POSITIVE),
    "polygamma_keywords": (lambda x: torch.polygamma(n=1, input=x), POSITIVE),
    "special_polygamma": (lambda x: torch.special.polygamma(3, x), POSITIVE),
    "polygamma_method": (lambda x: x.polygamma(1), POSITIVE),
    "polygamma_n0": (lambda x: x.polygamma(0), POSITIVE),
    "polygamma_in_place": (lambda x: (x * 2).polygamma_(1), POSITIVE),
    "ndtri": (lambda x: torch.special.ndtri(x), PROBABILITIES),
    "zeta_of_q": (lambda q: torch.special.zeta(torch.full_like(q, 3.0), q), POSITIVE),
    "zeta_number_x": (lambda q: torch.special.zeta(2.5, q), POSITIVE),
    "zeta_broadcast": (lambda q: torch.special.zeta(torch.full((3, 4), 3.0, dtype=q.dtype), q[:1] + q[1:2]), POSITIVE),
    "frexp": (lambda x: torch.frexp(x * 1e3)[0], POSITIVE),
    "frexp_method": (lambda x: x.frexp().mantissa * x, POSITIVE),
    "ldexp": (lambda x: torch.ldexp(x, torch.tensor([1, -2, 3, 0])), POSITIVE),
    "ldexp_by_floats": (lambda x: torch.ldexp(x, x.flip(0)), POSITIVE),
    "ldexp_broadcast": (lambda x: torch.ldexp(x[:, :1], x[0] * 2) + torch.ldexp(x.sum(), x), POSITIVE),
    "ldexp_method": (lambda x: x.ldexp(torch.tensor([2])), POSITIVE),
    "ldexp_in_place": (lambda x: (x + 1).ldexp_(torch.tensor([1, 2, 3, 4])), POSITIVE),
    "take": (lambda x: torch.take(x, INDEX), POSITIVE),
    "take_method_transposed": (lambda x: x.t().take(INDEX), POSITIVE),
    "take_repeated": (lambda x: x.take(torch.tensor([1, 1, 1, -1])), POSITIVE),
    "rms_norm": (lambda x: torch.rms_norm(x, [4], torch.linspace(0.5, 2, 4, dtype=x.dtype), 1e-6), POSITIVE),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_values_and_grads_equal_eagers(name):
    fn, x = CALLS[name]
    want_in, got_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = fn(want_in), fulmen.jit(fn)(got_in)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got.requires_grad == want.requires_grad
    cotangent = torch.randn(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(0))
    (want_grad,) = torch.autograd.grad(want, want_in, cotangent)
    (got_grad,) = torch.autograd.grad(got, got_in, cotangent)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)


# Not "ldexp": eager's grad of x for an integer exponent is grad * 2 ** other in integers, 0 for a negative exponent
# (test_values_and_grads_equal_eagers checks fulmen gives eager's)
@pytest.mark.parametrize(
    "name",
    [
        "polygamma",
        "special_polygamma",
        "ndtri",
        "zeta_of_q",
        "zeta_broadcast",
        "frexp_method",
        "ldexp_by_floats",
        "ldexp_broadcast",
        "take",
        "take_repeated",
        "rms_norm",
    ],
)
def test_grads_equal_finite_differences(name):
    fn, x = CALLS[name]
    assert torch.autograd.gradcheck(fulmen.jit(fn), (x.clone().requires_grad_(),))


def test_frexp_gives_a_half_precision_input_its_own_dtypes_grad_and_an_int_exponent():
    x = torch.tensor([0.3, -7.5, 1000.0, 0.0], dtype=torch.float16)

    def fn(x):
        mantissa, exponent = torch.frexp(x)
        return mantissa * 3, exponent

    want_in, got_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    (want, want_exponent), (got, got_exponent) = fn(want_in), fulmen.jit(fn)(got_in)
    assert got_exponent.dtype == want_exponent.dtype == torch.int32 and not got_exponent.requires_grad
    assert torch.equal(got_exponent, want_exponent) and torch.equal(got, want)
    want.sum().backward()
    got.sum().backward()
    assert got_in.grad.dtype == torch.float16 and torch.equal(got_in.grad, want_in.grad)


def test_frexp_of_a_float64_past_float32s_range_has_eagers_zero_grad():
    # eager divides by exp2 of the int32 exponent, a float32: 2 ** 1000 is inf there, and so the grad is 0
    x = torch.tensor([1e300, 3.0], dtype=torch.float64)
    want_in, got_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.frexp(want_in)[0].sum().backward()
    fulmen.jit(lambda x: torch.frexp(x)[0])(got_in).sum().backward()
    assert torch.equal(got_in.grad, want_in.grad) and got_in.grad[0] == 0


def test_zeta_refuses_the_grad_of_x_as_eager_does():
    x, q = torch.tensor([2.5, 3.0], requires_grad=True), torch.tensor([1.5, 2.0])
    with pytest.raises(NotImplementedError, match="the derivative for 'zeta' is not implemented") as eager:
        torch.special.zeta(x, q).sum().backward()
    with pytest.raises(NotImplementedError) as ours:
        fulmen.jit(torch.special.zeta)(x, q).sum().backward()
    assert str(ours.value) == str(eager.value)


@pytest.mark.parametrize(
    ("fn", "args", "error"),
    [
        (lambda x: torch.polygamma(-1, x), (POSITIVE,), "does not support negative n"),
        (lambda x: torch.take(x, torch.tensor([0, 1], dtype=torch.int32)), (POSITIVE,), "Expected a long tensor"),
        (lambda x: torch.frexp(x), (torch.tensor([1, 2]),), "only supports floating-point dtypes"),
    ],
    ids=["polygamma_negative_n", "take_int32_index", "frexp_of_ints"],
)
def test_eagers_errors_are_raised_while_tracing(fn, args, error):
    with pytest.raises(RuntimeError, match=error):
        fn(*args)
    with pytest.raises(RuntimeError) as ours:
        fulmen.jit(fn)(*args)
    assert not isinstance(ours.value, fulmen.UnsupportedOpError)
    assert error in str(ours.value).splitlines()[0]


def test_in_place_forms_update_the_tensor_the_caller_passed():
    for update in (lambda x: x.polygamma_(1), lambda x: x.ldexp_(torch.tensor([3]))):
        want, got = POSITIVE.clone(), POSITIVE.clone()
        update(want)
        fulmen.jit(update)(got)
        assert torch.equal(got, want)


def test_rms_norm_under_the_dynamo_backend_runs_in_fulmen():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8), nn.Linear(8, 4))
    backend = fulmen.dynamo.backend(fallback="eager")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(3, 8)
    got = compiled(x)
    got.sum().backward()
    got_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want = model(x)
    want.sum().backward()
    torch._dynamo.reset()
    assert [piece.runs_by for piece in backend.pieces] == ["fulmen"], backend.report()
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(g, w)
