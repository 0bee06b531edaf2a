"""An `if` on a comparison of a `torch.rand` draw with a number it never crosses (fulmen/acquisition/random_bounds.py),
against eager.

Eager takes the same branch whatever is drawn, so fulmen traces it, keeping the draw (the generator advances as
eager's does); a comparison whose answer depends on the draw is refused, naming the line. Hugging Face's LayerDrop
(`if torch.rand([]) < self.layerdrop`, 0.0 by default) is the case that matters (tests/models/test_hf_usage.py).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import pytest
import torch

import fulmen


def _branch(compare: Callable[[torch.Tensor, float], torch.Tensor], number: float,
            dtype: torch.dtype = torch.float32) -> Callable[[torch.Tensor], torch.Tensor]:
    def program(x: torch.Tensor) -> torch.Tensor:
        drawn = torch.rand([], dtype=dtype)
        if compare(drawn, number):
            return x * 2 + torch.rand(3)
        return x * 3 + torch.rand(3)

    return program


@pytest.mark.parametrize(("compare", "number"), [
    (operator.lt, 0.0), (operator.lt, 1.0), (operator.lt, -2), (operator.le, 1.0), (operator.le, -1e-9),
    (operator.gt, -1e-9), (operator.gt, 1.0), (operator.ge, 0.0), (operator.ge, 1.0), (operator.ge, 3),
], ids=lambda value: getattr(value, "__name__", str(value)))
def test_a_comparison_with_one_answer_takes_eagers_branch(compare, number):
    program = _branch(compare, number)
    jitted = fulmen.jit(program)
    x = torch.ones(3)
    for seed in range(2):
        torch.manual_seed(seed)
        want, want_state = program(x), torch.get_rng_state()
        torch.manual_seed(seed)
        got, got_state = jitted(x), torch.get_rng_state()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert torch.equal(got_state, want_state)
    assert fulmen.cache_hits(jitted) == 1


@pytest.mark.parametrize(("compare", "number", "dtype"), [
    (operator.lt, 0.5, torch.float32),
    (operator.gt, -1e-46, torch.float32),  # -0.0 in float32: a draw of 0 answers False
    (operator.lt, 1.0, torch.bfloat16),  # a draw in bfloat16 may round up to 1
], ids=["half-way", "rounds-to-zero", "bfloat16"])
def test_a_comparison_the_draw_decides_is_refused_naming_the_line(compare, number, dtype):
    with pytest.raises(fulmen.DataDependentError, match="reads tensor values") as error:
        fulmen.jit(_branch(compare, number, dtype))(torch.ones(3))
    assert error.value.location.line == "if compare(drawn, number):"


def test_a_draw_updated_in_place_is_not_bounded_any_more():
    def program(x):
        drawn = torch.rand([])
        drawn.mul_(2)
        return x * 2 if drawn < 1.0 else x

    with pytest.raises(fulmen.DataDependentError) as error:
        fulmen.jit(program)(torch.ones(3))
    assert error.value.location.line == "return x * 2 if drawn < 1.0 else x"
