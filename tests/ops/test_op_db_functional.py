"""torch.func as the oracle: fulmen.jvp against torch.func.jvp and fulmen.vmap against torch.func.vmap on PyTorch's
OpInfo samples (float64), for every op fulmen supports."""

from __future__ import annotations

import warnings

import pytest

from tests.ops.opdb import (
    NoOracle,
    NotDifferentiable,
    functional_cases,
    run_jvp_case,
    run_vmap_case,
    supported_opinfos,
)
from tests.sweeps import share

RUNNERS = {"jvp": run_jvp_case, "vmap": run_vmap_case}
# Each transform its share of every OpInfo's samples: together they transform every sample (tests/sweeps.py)
CASES = list(functional_cases())
CASES_BY_KIND = {kind: share(CASES, part, len(RUNNERS)) for part, kind in enumerate(RUNNERS)}
OUTCOMES: dict[tuple[str, str], str] = {}  # (transform, case id) -> rules / fallback / loop / skip / error text

# fulmen refuses these with a clear error (never a wrong result), by transform and OpInfo name
IN_PLACE_STATS = ("batch_norm in training mode updates running_mean/running_var in place, and fulmen.jvp and "
                  "fulmen.vmap refuse in-place updates of the function's inputs")
XFAIL_OPS: dict[str, dict[str, str]] = {
    "jvp": {"nn.functional.batch_norm": IN_PLACE_STATS},
    "vmap": {
        "nn.functional.batch_norm": IN_PLACE_STATS,
        "as_strided": "fulmen.vmap refuses as_strided: it addresses storage, which traces do not model",
        "as_strided.partial_views": "fulmen.vmap refuses as_strided: it addresses storage, which traces do not model",
    },
}


def xfail_reason(kind: str, case) -> str | None:
    reason = XFAIL_OPS[kind].get(case.op_name)
    if reason is IN_PLACE_STATS and not case.sample.kwargs.get("training"):
        reason = None  # in eval mode the running stats are only read
    return reason or case.xfail_reason


def _run(kind: str, case) -> str:
    key = (kind, case.id)
    if key not in OUTCOMES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                OUTCOMES[key] = RUNNERS[kind](case)
        except (NotDifferentiable, NoOracle):
            OUTCOMES[key] = "skip"
        except Exception as error:  # noqa: BLE001 - recorded, then re-raised by the sample's own test
            OUTCOMES[key] = f"{type(error).__name__}: {error}"
    return OUTCOMES[key]


def _params(kind: str):
    for case in CASES_BY_KIND[kind]:
        reason = xfail_reason(kind, case)
        marks = [pytest.mark.xfail(reason=reason, strict=False)] if reason else []
        yield pytest.param(kind, case, id=f"{kind}-{case.id}", marks=marks)


@pytest.mark.parametrize(("kind", "case"), [*_params("jvp"), *_params("vmap")])
def test_functional_sample(kind, case):
    outcome = _run(kind, case)
    if outcome == "skip":
        pytest.skip("torch.func has no result to compare with (or nothing to transform)")
    assert outcome in ("rules", "fallback", "loop"), outcome


@pytest.mark.parametrize("kind", ["jvp", "vmap"])
def test_functional_summary(kind, summary):
    counts = {"pass": 0, "fail": 0, "xfail": 0}
    how = {"rules": 0, "fallback": 0, "loop": 0}
    unexpected = []
    for case in CASES_BY_KIND[kind]:
        outcome = _run(kind, case)
        if outcome == "skip":
            continue
        if outcome in how:
            counts["pass"] += 1
            how[outcome] += 1
        elif xfail_reason(kind, case):
            counts["xfail"] += 1
        else:
            counts["fail"] += 1
            unexpected.append(f"{case.id}: {outcome}")
    total = sum(counts.values())
    other = ("through torch's forward-mode AD for an op without a JVP rule" if kind == "jvp"
             else "with an op run once per example (no batching rule)")
    ops = len({c.op_name for c in CASES_BY_KIND[kind]})
    summary(f"op_db {kind} against torch.func.{kind} (float64): {ops} OpInfos of "
            f"{len(supported_opinfos())} supported, {total} samples: {counts['pass']} pass ({how['rules']} by "
            f"fulmen's rules alone, {how['fallback'] + how['loop']} {other}), {counts['fail']} fail, "
            f"{counts['xfail']} xfail")
    assert not unexpected, "\n".join(unexpected[:20])
    assert counts["pass"] >= 0.95 * total
