"""Forward-over-reverse: fulmen.jvp(fulmen.grad(f)), the Hessian-vector product, against torch.func's in float64,
on programs people write and on PyTorch's OpInfo samples (tests/ops/opdb.py) of the ops fulmen differentiates."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.core.errors import TraceError
from tests.ops.opdb import (
    NoOracle,
    NotDifferentiable,
    differentiated_by,
    jvp_of_grad_cases,
    run_jvp_of_grad_case,
    vjp_xfail_reason,
)
from tests.ops.outcomes import Outcomes, param


def _both(f, primals: tuple, tangents: tuple, argnums=0):
    expected = torch.func.jvp(torch.func.grad(f, argnums), primals, tangents)
    actual = fulmen.jit(lambda p, t: fulmen.jvp(fulmen.grad(f, argnums), p, t))(primals, tangents)
    return actual, expected


def _assert_equal(actual, expected) -> None:
    got, want = torch.utils._pytree.tree_leaves(actual), torch.utils._pytree.tree_leaves(expected)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def _layer_norm_inputs():
    generator = torch.Generator().manual_seed(0)
    x, w, v = (torch.randn(shape, dtype=torch.float64, generator=generator) for shape in ((3, 4), (4, 5), (4, 5)))
    return x, w, v


def test_through_layer_norm():
    """The grad rule's backward reads layer_norm's mean and rstd, which native_layer_norm's JVP (as eager's) leaves
    without a tangent: their tangents come from the input's (they differed by 14)."""
    x, w, v = _layer_norm_inputs()
    actual, expected = _both(lambda w: torch.tanh(F.layer_norm(x @ w, (5,))).sum(), (w,), (v,))
    _assert_equal(actual, expected)


def test_cross_entropy_after_layer_norm():
    x, w, v = _layer_norm_inputs()
    target = torch.tensor([0, 3, 4])
    actual, expected = _both(lambda w: F.cross_entropy(F.layer_norm(x @ w, (5,)), target), (w,), (v,))
    _assert_equal(actual, expected)


@pytest.mark.parametrize("affine", [False, True])
def test_layer_norm_weight_and_bias(affine):
    """Every grad of layer_norm (input, weight, bias) and its tangent, with tangents for all three."""
    generator = torch.Generator().manual_seed(1)
    x, weight, bias, c = (torch.randn(shape, dtype=torch.float64, generator=generator)
                          for shape in ((2, 3, 6), (3, 6), (3, 6), (2, 3, 6)))
    primals = (x, weight, bias) if affine else (x,)
    tangents = tuple(torch.randn(p.shape, dtype=p.dtype, generator=generator) for p in primals)

    def f(x, weight=None, bias=None):
        return (c * F.layer_norm(x, (3, 6), weight, bias, eps=0.3) ** 2).sum()

    actual, expected = _both(f, primals, tangents, argnums=tuple(range(len(primals))))
    _assert_equal(actual, expected)


def test_through_eagers_backward():
    """An op fulmen differentiates by eager's own backward (torch_vjp): its leaves were detached, which dropped
    their tangents, so the grads' tangents missed the op's second derivative (torch.dot's grad is g * other)."""
    generator = torch.Generator().manual_seed(2)
    a, b, ta, tb = (torch.randn(5, dtype=torch.float64, generator=generator) for _ in range(4))
    actual, expected = _both(lambda a, b: torch.dot(a, b) ** 2, (a, b), (ta, tb), argnums=(0, 1))
    _assert_equal(actual, expected)


def test_update_of_a_captured_tensor_is_refused():
    """batch_norm in training mode updates the running statistics it captures: fulmen's transforms write the
    function's trace under other names, and the update's write-back read a value never computed (UnboundLocalError
    when the trace ran). Refused, naming the line; the statistics are left as they were."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, dtype=torch.float64, generator=generator)
    running_mean, running_var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)

    def f(x):
        return (F.batch_norm(x, running_mean, running_var, training=True) ** 2).sum()

    for transformed in (lambda x: fulmen.grad(f)(x), lambda x: fulmen.jvp(fulmen.grad(f), (x,), (x,))):
        with pytest.raises(TraceError, match=r"(?s)updates in place a tensor from outside it.*test_jvp_of_grad.py:\d+ "
                                             r"in f") as error:
            fulmen.jit(transformed)(x)
        assert "running_mean=None" in str(error.value)
        torch.testing.assert_close(running_mean, torch.zeros(3, dtype=torch.float64), rtol=0, atol=0)
    # without running statistics nothing is updated: the same function differentiates as torch.func's
    actual, expected = _both(lambda x: (F.batch_norm(x, None, None, training=True) ** 2).sum(), (x,), (x,))
    _assert_equal(actual, expected)


# --- op_db: one sample of each OpInfo fulmen differentiates (opdb.JVP_OF_GRAD_STRIDES picks them) ---------------
CASES = jvp_of_grad_cases()
# fulmen refuses these with a clear error (never a wrong result), by OpInfo name: (what the error says, why)
REFUSED: dict[str, tuple[str, str]] = {
    "nn.functional.batch_norm": ("updates in place a tensor from outside it",
                                 "batch_norm in training mode updates the running statistics the function captures"),
}


_run = Outcomes(run_jvp_of_grad_case, ((NotDifferentiable, lambda error: "skip"),
                                       (NoOracle, lambda error: f"no oracle: {error}")))


def _refused(case, outcome: str) -> bool:
    expected = REFUSED.get(case.op_name)
    return (expected is not None and case.sample.kwargs.get("training", False) and outcome.startswith("TraceError")
            and expected[0] in outcome)


@pytest.mark.parametrize("case", [param(c, vjp_xfail_reason(c)) for c in CASES])
def test_jvp_of_grad_sample(case):
    outcome = _run(case)
    if outcome == "skip":
        pytest.skip("no floating output depends on an input that requires grad")
    if outcome.startswith("no oracle"):
        pytest.skip(f"torch.func cannot do it: {outcome}")
    if _refused(case, outcome):
        return
    assert outcome == "pass", outcome


def _kind(case, outcome: str) -> str | None:
    """How the summary counts a case's outcome (None: no floating output to differentiate)."""
    if outcome.startswith("no oracle"):
        return "no oracle"
    if outcome in ("skip", "pass"):
        return None if outcome == "skip" else "pass"
    return "refused" if _refused(case, outcome) else "xfail" if vjp_xfail_reason(case) else "fail"


def test_jvp_of_grad_summary(summary):
    counts, unexpected = _run.tally(CASES, _kind)
    kinds = collections.Counter(differentiated_by(c.opinfo) for c in CASES)
    summary(f"op_db jvp(grad) against torch.func (float64): {len(CASES)} OpInfos ({kinds['rules']} with fulmen's "
            f"rules, {kinds['decomposition']} through their decomposition, {kinds['eager']} by eager's "
            f"backward), {sum(counts.values())} samples: {counts['pass']} pass, {counts['refused']} refused, "
            f"{counts['no oracle']} without torch.func's answer, {counts['fail']} fail, {counts['xfail']} xfail")
    assert not unexpected, "\n".join(unexpected[:20])
