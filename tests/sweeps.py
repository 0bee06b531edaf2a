"""What the sweeps run on CI, and FULMEN_FULL_SWEEPS=1 to run them whole (before a release, or after changing a rule,
a decomposition, a promotion or how fulmen takes a module's parameters):
- the op_db sweeps a deterministic share of their samples, with every OpInfo in every share (below): the grads' value
  sets, autocast's input dtypes and jvp / vmap share them out, test_op_db.py and test_op_db_vjp.py take every other;
- tests/transforms/test_jvp_of_grad.py a stride of the OpInfos by how fulmen differentiates them (tests/ops/opdb.py);
- tests/models/test_hf.py the unpadded batch on every fourth family, the function form on every sixth and the Dynamo
  backend on five;
- tests/ops/test_promotion.py's test_binary, of the cases eager refuses with the same dtypes, every other one.

A sweep with several variants (the grads' value sets, autocast's input dtypes, jvp and vmap) gives each variant its own
share, so that together they still run every sample: variant `part` of `parts` takes, of each OpInfo's samples, every
`parts`-th one from its `part`-th (its first where it has fewer), so each variant checks every OpInfo and every sample
is checked by one variant. Sharing by OpInfo keeps every op, and so every op family, in each variant."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TypeVar

FULL_SWEEPS = os.environ.get("FULMEN_FULL_SWEEPS") == "1"

C = TypeVar("C")  # an opdb.Case: anything with op_name


def share(cases: Iterable[C], part: int, parts: int) -> list[C]:
    """Variant `part` (0 <= part < parts) of the samples in `cases` (in their order), or all of them with
    FULMEN_FULL_SWEEPS=1."""
    if not 0 <= part < parts:
        raise ValueError(f"share: part {part} of {parts} does not exist")
    cases = list(cases)
    if FULL_SWEEPS:
        return cases
    by_op: dict[str, list[int]] = {}
    for position, case in enumerate(cases):
        by_op.setdefault(case.op_name, []).append(position)
    kept = set()
    for positions in by_op.values():
        kept.update(positions[part::parts] or positions[:1])
    return [case for position, case in enumerate(cases) if position in kept]
