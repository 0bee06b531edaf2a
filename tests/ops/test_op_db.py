"""Forward parity with eager on PyTorch's own OpInfo samples, for every op fulmen supports, its composites run as
their decompositions (what fusion executors compile)."""

from __future__ import annotations

import pytest

from tests.ops.opdb import cases, run_case, supported_opinfos
from tests.ops.outcomes import Outcomes, param

CASES = list(cases())
_run = Outcomes(run_case)  # pass / error text, shared by the samples and the summary


@pytest.mark.parametrize("case", [param(c, c.xfail_reason) for c in CASES])
def test_op_db_sample(case):
    outcome = _run(case)
    assert outcome == "pass", outcome


def test_op_db_summary(summary):
    counts = {"pass": 0, "fail": 0, "xfail": 0}
    unexpected = []
    for case in CASES:
        outcome = _run(case)
        if outcome == "pass":
            counts["pass"] += 1
        elif case.xfail_reason:
            counts["xfail"] += 1
        else:
            counts["fail"] += 1
            unexpected.append(f"{case.id}: {outcome}")
    total = sum(counts.values())
    summary(f"op_db: {len(supported_opinfos())} OpInfos, {total} samples: {counts['pass']} pass, "
            f"{counts['fail']} fail, {counts['xfail']} xfail")
    assert not unexpected, "\n".join(unexpected[:20])
    assert counts["pass"] >= 0.95 * total
