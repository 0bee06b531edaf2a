"""A module attribute the program looks for and does not find (`hasattr`, `getattr` with a default) stays absent, or
the next call traces again: against eager, after the attribute is set between calls.

`nn.Module.__getattr__` looks in the parameters, buffers and submodules after the module's own dict and its class,
so all of them are guarded. Transformers' `PreTrainedModel.loss_function` is such a read: `hasattr(self,
"_loss_function")`, set by assigning `model.loss_function = ...` (tests/models/test_hf_usage.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import fulmen


class Scaled(nn.Module):
    """Doubles its input once it has `name` (found through any of the places a module attribute lives)."""

    def __init__(self, name: str, default: bool = False) -> None:
        super().__init__()
        self.name, self.default = name, default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.default:
            return x * (2 if getattr(self, self.name, None) is not None else 1)
        return x * 2 if hasattr(self, self.name) else x


class WithProperty(nn.Module):
    """transformers' `loss_function` pattern: a property that reads a private attribute only its setter stores."""

    @property
    def act(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self._act if hasattr(self, "_act") else torch.sin

    @act.setter
    def act(self, value: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._act = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x)


def _plain(module: nn.Module) -> None:
    module.extra = 1.0


def _submodule(module: nn.Module) -> None:
    module.extra = nn.Identity()


def _parameter(module: nn.Module) -> None:
    module.register_parameter("extra", nn.Parameter(torch.ones(1)))


def _buffer(module: nn.Module) -> None:
    module.register_buffer("extra", torch.ones(1))


def _property(module: nn.Module) -> None:
    module.act = torch.cos


CASES = {
    "attribute": (lambda: Scaled("extra"), _plain),
    "submodule": (lambda: Scaled("extra"), _submodule),
    "parameter": (lambda: Scaled("extra"), _parameter),
    "buffer": (lambda: Scaled("extra", default=True), _buffer),
    "property's attribute": (WithProperty, _property),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("form", ["module", "function"])
def test_an_attribute_set_after_a_call_that_missed_it_is_seen(case: str, form: str):
    make, set_it = CASES[case]
    model = make()
    jitted = fulmen.jit(model) if form == "module" else fulmen.jit(lambda module, x: module(x))
    call = (lambda x: jitted(x)) if form == "module" else (lambda x: jitted(model, x))
    x = torch.randn(3)
    torch.testing.assert_close(call(x), model(x))
    set_it(model)
    torch.testing.assert_close(call(x), model(x))  # eager's new value, not the cached one
    assert fulmen.cache_misses(jitted) == 2
    torch.testing.assert_close(call(x), model(x))
    assert fulmen.cache_hits(jitted) == 1
