"""Each op_db case run once, its outcome shared by the case's own test and its sweep's summary."""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import pytest


class Outcomes:
    """`outcomes(case)`: "pass", a label of an expected kind of error (`labels`: an exception type and how to say
    it, e.g. "skip"), or the error's text; the case runs on the first ask only."""

    def __init__(self, run: Callable[[Any], None],
                 labels: tuple[tuple[type[BaseException], Callable[[BaseException], str]], ...] = ()) -> None:
        self._run, self._labels, self._seen = run, labels, {}

    def __call__(self, case: Any) -> str:
        if case.id not in self._seen:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self._run(case)
                self._seen[case.id] = "pass"
            except Exception as error:  # noqa: BLE001 - recorded, then raised again by the sample's own test
                self._seen[case.id] = next((label(error) for kind, label in self._labels if isinstance(error, kind)),
                                           f"{type(error).__name__}: {error}")
        return self._seen[case.id]

    def tally(self, cases: Iterable[Any], kind: Callable[[Any, str], str | None]) -> tuple[collections.Counter, list]:
        """Each case's outcome counted under `kind(case, outcome)` (None: not counted; "fail": unexpected, listed with
        its outcome)."""
        counts: collections.Counter = collections.Counter()
        unexpected = []
        for case in cases:
            outcome = self(case)
            counted = kind(case, outcome)
            if counted is not None:
                counts[counted] += 1
            if counted == "fail":
                unexpected.append(f"{case.id}: {outcome}")
        return counts, unexpected


def param(case: Any, xfail_reason: str | None) -> Any:
    """`case` as a pytest parameter named by its id, expected to fail (not strictly) where a reason says why."""
    marks = [pytest.mark.xfail(reason=xfail_reason, strict=False)] if xfail_reason else []
    return pytest.param(case, id=case.id, marks=marks)
