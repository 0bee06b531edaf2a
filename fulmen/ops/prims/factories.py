"""The rules of the factories: prims that read no tensor.

prims.full's value is a Python number and iota's are its arguments, so neither output ever carries a grad, as in
eager.
"""

from __future__ import annotations

from fulmen.ops import prims
from fulmen.ops.rules.grad import not_differentiable

not_differentiable(prims.full, prims.iota)
