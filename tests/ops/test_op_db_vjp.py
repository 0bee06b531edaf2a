"""Float64 VJP checks on PyTorch's OpInfo samples: <J u, v> (finite differences) == <u, J^T v> (fulmen's backward)."""

from __future__ import annotations

import pytest

from tests.ops.opdb import NotDifferentiable, run_vjp_case, supported_opinfos, vjp_cases, vjp_xfail_reason
from tests.ops.outcomes import Outcomes, param
from tests.sweeps import share

# The second and fourth sample of each OpInfo (its first where it has one; FULMEN_FULL_SWEEPS=1: all four;
# tests/sweeps.py): test_op_db_grads.py checks fulmen's grads against eager's on all eight of its samples
CASES = share(vjp_cases(), 1, 2)
_run = Outcomes(run_vjp_case, ((NotDifferentiable, lambda error: "skip"),))  # pass / skip / error text


@pytest.mark.parametrize("case", [param(c, vjp_xfail_reason(c)) for c in CASES])
def test_vjp_sample(case):
    outcome = _run(case)
    if outcome == "skip":
        pytest.skip("no floating output depends on an input that requires grad")
    assert outcome == "pass", outcome


def test_vjp_summary(summary):
    counts, unexpected = _run.tally(CASES, lambda case, outcome: (
        None if outcome == "skip" else "pass" if outcome == "pass" else "xfail" if vjp_xfail_reason(case) else "fail"))
    total = sum(counts.values())
    ops = len({c.op_name for c in CASES})
    summary(f"op_db VJP (float64): {ops} differentiable OpInfos of {len(supported_opinfos())} supported, "
            f"{total} samples: {counts['pass']} pass, {counts['fail']} fail, {counts['xfail']} xfail")
    assert not unexpected, "\n".join(unexpected[:20])
    assert counts["pass"] >= 0.95 * total
