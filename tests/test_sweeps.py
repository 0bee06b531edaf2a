"""The CI shares of the op_db sweeps (tests/sweeps.py): each variant checks every OpInfo, and the variants
together check every sample."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests import sweeps


@dataclass(frozen=True)
class Sample:
    op_name: str
    index: int


# OpInfos with 8, 3, 2 and 1 samples, interleaved as no sweep lists them (a share goes by OpInfo, not by position)
CASES = [Sample(name, i) for i in range(8) for name, count in (("add", 8), ("cat", 3), ("mm", 2), ("erf", 1))
         if i < count]


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_the_shares_cover_every_sample_and_every_opinfo(monkeypatch, parts):
    monkeypatch.setattr(sweeps, "FULL_SWEEPS", False)
    shares = [sweeps.share(CASES, part, parts) for part in range(parts)]
    assert set().union(*shares) == set(CASES)
    for chosen in shares:
        assert {c.op_name for c in chosen} == {"add", "cat", "mm", "erf"}
        assert chosen == [c for c in CASES if c in chosen]  # in the sweep's order
    # an OpInfo with at least `parts` samples gives each of them to one variant only
    assert sum(len([c for c in chosen if c.op_name == "add"]) for chosen in shares) == 8
    assert sweeps.share(CASES, 1 % parts, parts) == sweeps.share(CASES, 1 % parts, parts)  # deterministic


def test_a_share_of_three_takes_every_third_sample_of_an_opinfo(monkeypatch):
    monkeypatch.setattr(sweeps, "FULL_SWEEPS", False)
    by_part = [[c.index for c in sweeps.share(CASES, part, 3) if c.op_name == "add"] for part in range(3)]
    assert by_part == [[0, 3, 6], [1, 4, 7], [2, 5]]
    # where an OpInfo has fewer samples than the part asks for, its first
    assert [c.index for c in sweeps.share(CASES, 2, 3) if c.op_name == "mm"] == [0]


def test_full_sweeps_run_everything(monkeypatch):
    monkeypatch.setattr(sweeps, "FULL_SWEEPS", True)
    assert sweeps.share(CASES, 1, 3) == CASES


def test_a_part_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="part 3 of 3"):
        sweeps.share(CASES, 3, 3)
