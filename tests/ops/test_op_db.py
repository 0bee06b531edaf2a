"""Forward parity with eager on PyTorch's own OpInfo samples, for every op fulmen supports."""

from __future__ import annotations

import warnings

import pytest

from tests.ops.opdb import cases, run_case, supported_opinfos

CASES = list(cases())


def _param(case):
    reason = case.xfail_reason
    marks = [pytest.mark.xfail(reason=reason, strict=False)] if reason else []
    return pytest.param(case, id=case.id, marks=marks)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_op_db_sample(case):
    run_case(case)


def test_op_db_summary(summary):
    counts = {"pass": 0, "fail": 0, "xfail": 0}
    unexpected = []
    for case in CASES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run_case(case)
            counts["pass"] += 1
        except Exception as error:  # noqa: BLE001 - a tally of outcomes, each failure is reported below
            if case.xfail_reason:
                counts["xfail"] += 1
            else:
                counts["fail"] += 1
                unexpected.append(f"{case.id}: {type(error).__name__}: {error}")
    total = sum(counts.values())
    summary(f"op_db: {len(supported_opinfos())} OpInfos, {total} samples: {counts['pass']} pass, "
            f"{counts['fail']} fail, {counts['xfail']} xfail")
    assert not unexpected, "\n".join(unexpected[:20])
    assert counts["pass"] >= 0.95 * total
