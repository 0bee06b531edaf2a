"""Forward parity with eager on PyTorch's own OpInfo samples, for every op fulmen supports, its composites run as
their decompositions (what fusion executors compile)."""

from __future__ import annotations

import pytest

from tests.ops.opdb import cases, run_case, supported_opinfos
from tests.ops.outcomes import Outcomes, param
from tests.sweeps import share

# Every other sample of each OpInfo, its first included (FULMEN_FULL_SWEEPS=1: all; tests/sweeps.py): the grads sweep
# (test_op_db_grads.py) compares the outputs of the first eight of every differentiable OpInfo too, decomposed as here
CASES = share(cases(), 0, 2)
_run = Outcomes(run_case)  # pass / error text, shared by the samples and the summary


@pytest.mark.parametrize("case", [param(c, c.xfail_reason) for c in CASES])
def test_op_db_sample(case):
    outcome = _run(case)
    assert outcome == "pass", outcome


def test_op_db_summary(summary):
    counts, unexpected = _run.tally(CASES, lambda case, outcome: "pass" if outcome == "pass"
                                    else "xfail" if case.xfail_reason else "fail")
    total = sum(counts.values())
    summary(f"op_db: {len(supported_opinfos())} OpInfos, {total} samples: {counts['pass']} pass, "
            f"{counts['fail']} fail, {counts['xfail']} xfail")
    assert not unexpected, "\n".join(unexpected[:20])
    assert counts["pass"] >= 0.95 * total
