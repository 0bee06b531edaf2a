"""Autocast's conversions stated in the trace, equal to eager's bit for bit, or refused where they cannot be stated.
(op_db's samples under autocast: tests/ops/test_op_db_autocast.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.core.errors import UnsupportedOpError


def _under_autocast(fn, *args, device: str = "cpu", dtype: torch.dtype = torch.bfloat16):
    with torch.autocast(device, dtype=dtype):
        return fn(*args)


@pytest.mark.parametrize("equation", ["bij,bjk->bik", "ij,jk->ik", "ii,ij->j"])
def test_einsum_converts_what_eager_converts(equation):
    """On CPU, autocast converts inside einsum: the views and the diagonal it makes of its operands, at the bmm it
    calls. Those are conversions of the operands, so the trace states them in front of einsum: eager's bits, forward
    and backward. (Before, einsum ran in float32 and only its result was converted.)"""
    torch.manual_seed(0)
    a = torch.randn(2, 8, 8, requires_grad=True) if equation[0] == "b" else torch.randn(8, 8, requires_grad=True)
    b = torch.randn(2, 8, 5, requires_grad=True) if equation[0] == "b" else torch.randn(8, 5, requires_grad=True)

    def f(a, b):
        return torch.einsum(equation, a, b)

    jitted = fulmen.jit(f)
    ours, eager = _under_autocast(jitted, a, b), _under_autocast(f, a, b)
    assert ours.dtype == eager.dtype == torch.bfloat16
    assert torch.equal(ours, eager)
    g = torch.randn_like(eager)
    assert all(torch.equal(x, y) for x, y in zip(torch.autograd.grad(ours, (a, b), g),
                                                  torch.autograd.grad(eager, (a, b), g)))
    assert str(fulmen.last_traces(jitted)[0]).count("dtype=torch.bfloat16") == 2  # both operands, in front


def test_conversion_of_a_value_computed_inside_an_op_is_refused():
    """'ij,jk->k' sums i out of the first operand in float32, then autocast converts that sum for the bmm: no
    conversion of an input gives those bits, so fulmen refuses, naming the op and the line, rather than guess."""
    a, b = torch.randn(8, 8), torch.randn(8, 5)

    def f(a, b):
        return torch.einsum("ij,jk->k", a, b)

    with pytest.raises(UnsupportedOpError, match=r"einsum under torch.autocast: autocast converts inside it") as info:
        _under_autocast(fulmen.jit(f), a, b)
    assert 'torch.einsum("ij,jk->k", a, b)' in str(info.value)


def test_an_op_converting_its_result_only_under_autocast():
    """rms_norm's composite (what the probe's fake tensors run) computes a bfloat16 input in float32 and converts
    the result back only under autocast: a conversion that cannot be stated in front of the op, yet is not refused
    (the plan converts the output), and the result is eager's."""
    x, w = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)

    def f(x, w):
        return F.rms_norm(x, (16,), w)

    jitted = fulmen.jit(f)
    ours, eager = _under_autocast(jitted, x, w), _under_autocast(f, x, w)
    assert ours.dtype == eager.dtype == torch.bfloat16
    assert torch.equal(ours, eager)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_unbatched_conv1d_with_string_padding(device):
    """conv1d with padding="same" on an unbatched input converts the view it makes of the input (on CUDA the
    trace once converted only the weight, and the kernel raised on mixed dtypes)."""
    torch.manual_seed(0)
    x = torch.randn(4, 9, device=device)
    w, b = torch.randn(2, 4, 3, device=device, requires_grad=True), torch.randn(2, device=device, requires_grad=True)

    def f(x, w, b):
        return F.conv1d(x, w, b, padding="same")

    for dtype in (torch.bfloat16, torch.float16):
        ours = _under_autocast(fulmen.jit(f), x, w, b, device=device, dtype=dtype)
        eager = _under_autocast(f, x, w, b, device=device, dtype=dtype)
        assert ours.dtype == eager.dtype == dtype
        assert torch.equal(ours, eager)


@pytest.mark.cuda
@pytest.mark.parametrize("reduction", ["sum", "cumsum", "softmax", "norm"])
def test_cuda_autocast_gives_reductions_a_float32_dtype(reduction):
    """On CUDA, autocast runs sum, cumsum, softmax and the norms of half-precision tensors with dtype=float32 (the
    kernel accumulates and returns float32) rather than converting their input: the trace states that argument,
    so the result is eager's, not a half-precision result converted afterwards (off by 2**-9 relative: fused
    regions reduce in their own order, so equal to float32 precision, not bit for bit)."""
    torch.manual_seed(0)
    x = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    calls = {"sum": lambda x: x.sum(), "cumsum": lambda x: x.cumsum(1), "softmax": lambda x: x.softmax(1),
             "norm": lambda x: torch.linalg.vector_norm(x, dim=1)}
    f = calls[reduction]
    jitted = fulmen.jit(f)
    ours, eager = _under_autocast(jitted, x, device="cuda"), _under_autocast(f, x, device="cuda")
    assert ours.dtype == eager.dtype == torch.float32
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)
    assert "dtype=torch.float32" in str(fulmen.last_traces(jitted)[0])
    g = torch.randn_like(eager)
    torch.testing.assert_close(torch.autograd.grad(ours, x, g)[0], torch.autograd.grad(eager, x, g)[0])


@pytest.mark.cuda
def test_cuda_autocast_cross_entropy_of_half_precision_logits():
    """The common autocast loss: logits from a linear are bfloat16, and on CUDA autocast runs cross_entropy's
    nll_loss in float32, converting the log-probabilities computed inside it. No conversion of the logits states
    that, so the trace holds cross_entropy's parts as aten computes them: log_softmax in bfloat16, converted, then
    nll_loss in float32."""
    torch.manual_seed(0)
    h = torch.randn(64, 32, device="cuda", requires_grad=True)
    w = torch.randn(1000, 32, device="cuda", requires_grad=True)
    target = torch.randint(0, 1000, (64,), device="cuda")
    target[::7] = -100

    def loss(h, w, target):
        return F.cross_entropy(F.linear(h, w), target)

    jitted = fulmen.jit(loss)
    ours, eager = (_under_autocast(f, h, w, target, device="cuda") for f in (jitted, loss))
    assert ours.dtype == eager.dtype == torch.float32
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)
    forward = str(fulmen.last_traces(jitted)[0])
    assert "torch.log_softmax(" in forward and "nll_loss(" in forward
    assert "torch.nn.functional.cross_entropy(" not in forward
    # the grads pass through bfloat16 logits: equal to their precision, a unit or two apart (eager's log_softmax
    # backward is one kernel rounding once, fulmen's its formula)
    for got, want in zip(torch.autograd.grad(ours, (h, w)), torch.autograd.grad(eager, (h, w))):
        torch.testing.assert_close(got, want, rtol=0, atol=2**-6 * want.abs().max().item())


def _step_grads(fn, inputs, *, dtype=torch.bfloat16, cache_enabled=True):
    """The output and the grads of `inputs` (leaves made here) under CPU autocast, of a loss that weighs each
    output element differently."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    with torch.autocast("cpu", dtype=dtype, cache_enabled=cache_enabled):
        out = fn(*leaves)
    (out.float() * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return [out.detach(), *(x.grad for x in leaves)]


class _GatedMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.gate, self.up = torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(64, 128, bias=False)
        self.down = torch.nn.Linear(128, 64, bias=False)

    def forward(self, x):
        h = self.norm(x)  # float32 under CPU autocast, converted to bfloat16 by each linear that reads it
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def test_grads_of_a_value_autocast_converts_for_two_ops_are_summed_as_eager_sums_them():
    """Eager converts the normed activation once per linear, so the two bfloat16 grads are converted and summed in
    float32; the trace merged the two conversions into one and summed them in bfloat16 (the input's and the norm's
    grads were off by bfloat16 roundings)."""
    torch.manual_seed(0)
    model, x = _GatedMLP(), torch.randn(8, 64)
    results = []
    for net in (model, fulmen.jit(model)):
        model.zero_grad(set_to_none=True)
        results.append(_step_grads(net, [x]) + [p.grad for p in model.parameters()])
    for ours, eager in zip(results[1], results[0]):
        assert torch.equal(ours, eager)


def test_layer_norm_of_a_bfloat16_matmul_under_autocast():
    """CPU autocast leaves layer_norm in its input's dtype: a bfloat16 activation with float32 weight and bias,
    whose backward failed inside aten ("expected scalar type Float but found BFloat16")."""
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)), torch.randn(8, 64)
    results = []
    for net in (model, fulmen.jit(model)):
        model.zero_grad(set_to_none=True)
        results.append(_step_grads(net, [x]) + [p.grad for p in model.parameters()])
    assert results[0][0].dtype == torch.bfloat16
    for ours, eager in zip(results[1], results[0]):
        assert torch.equal(ours, eager)


def _two_uses_of_a_leaf(x, x2, w):
    return (x @ w) + (x2 @ w) + (x @ w.T)


def _two_uses_of_a_computed_weight(x, x2, w):
    w = w * 1.0
    return (x @ w) + (x2 @ w)


def _an_explicit_conversion_and_autocasts(x, x2, w):
    return (x @ w) + (x2.to(torch.bfloat16) @ w.to(torch.bfloat16))


@pytest.mark.parametrize("cache_enabled", [True, False])
@pytest.mark.parametrize("fn", [_two_uses_of_a_leaf, _two_uses_of_a_computed_weight,
                                _an_explicit_conversion_and_autocasts])
def test_autocast_cache_shares_a_conversion_where_eager_shares_it(fn, cache_enabled):
    """Eager's autocast cache converts a float32 leaf that requires grad once for every op that reads it (its grads
    summed in bfloat16), any other value once per op; cache_enabled=False converts every time. Grads bit for bit."""
    torch.manual_seed(0)
    inputs = [torch.randn(16, 64), torch.randn(16, 64), torch.randn(64, 64)]
    eager = _step_grads(fn, inputs, cache_enabled=cache_enabled)
    ours = _step_grads(fulmen.jit(fn), inputs, cache_enabled=cache_enabled)
    for got, want in zip(ours, eager):
        assert torch.equal(got, want)


def test_an_argument_that_is_not_a_leaf_is_converted_per_op_as_eager_converts_it():
    """Eager's cache holds leaves only: an argument `w * 1` (not a leaf) read by two ops is converted for each, its
    grads summed in float32; the trace took every input for a leaf and shared one conversion. The same jitted
    function then gets a leaf again: it shares the conversion, as eager does (a trace per answer)."""
    torch.manual_seed(0)
    x, x2, base = torch.randn(16, 64), torch.randn(16, 64), torch.randn(64, 64)
    jitted = fulmen.jit(_two_uses_of_a_leaf)
    for leaf in (False, True, False):
        grads = []
        for fn in (_two_uses_of_a_leaf, jitted):
            w = base.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = fn(x, x2, w if leaf else w * 1)
            (out.float() * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
            grads.append(w.grad)
        assert torch.equal(grads[1], grads[0]), f"leaf={leaf}"
    assert fulmen.cache_misses(jitted) == 2


def test_the_autocast_cache_setting_is_part_of_the_cache_key():
    torch.manual_seed(0)
    inputs = [torch.randn(16, 64), torch.randn(16, 64), torch.randn(64, 64)]
    jitted = fulmen.jit(_two_uses_of_a_leaf)
    for cache_enabled in (True, False, True):
        ours = _step_grads(jitted, inputs, cache_enabled=cache_enabled)
        eager = _step_grads(_two_uses_of_a_leaf, inputs, cache_enabled=cache_enabled)
        assert all(torch.equal(got, want) for got, want in zip(ours, eager))
    assert fulmen.cache_misses(jitted) == 2


def test_a_cached_conversion_asked_for_another_dtype_is_refused():
    """Eager's cache answers by tensor: under an inner float16 autocast, a weight the outer bfloat16 autocast
    converted stays bfloat16 (eager's matmul then raises on the mixed dtypes); fulmen names the line."""
    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)

    def f(x, w):
        y = x @ w
        with torch.autocast("cpu", dtype=torch.float16):
            return y @ w

    with pytest.raises(fulmen.TraceError, match="its cache holds the torch.bfloat16 conversion") as info:
        _under_autocast(fulmen.jit(f), x, w)
    assert "return y @ w" in str(info.value)
    with pytest.raises(RuntimeError, match="same dtype"):
        _under_autocast(f, x, w)
