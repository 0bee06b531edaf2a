"""A program's own names never shadow what its trace imports: an argument named `dist` (the collectives' module in
fsdp/ddp traces) or after a builtin gets another name in the trace, and the program runs as eager."""

from __future__ import annotations

import pytest
import torch

import fulmen
import fulmen.distributed as fd
from fulmen.core.symbol import IMPORTS
from fulmen.core.trace import Namespace
from tests.distributed.launch import run_ranks, values


@pytest.mark.parametrize("name", [*sorted(IMPORTS), "float", "len"])
def test_a_namespace_never_hands_out_an_imported_or_builtin_name(name):
    assert Namespace().create(name) != name


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, dist: torch.Tensor, float: torch.Tensor) -> torch.Tensor:  # noqa: A002 - the point of it
        return (self.lin(dist) * float).sum()


def _named_like_imports(rank: int, world: int, kind: str) -> dict:
    dist, scale = torch.randn(2, 4), torch.randn(2, 3)
    model = (fd.fsdp if kind == "fsdp" else fd.ddp)(_Net())
    jitted = fulmen.jit(model)
    jitted(dist, scale).backward()
    return {"grads": {n: p.grad for n, p in model.named_parameters()}, "inputs": (dist, scale),
            "traces": str(fulmen.last_traces(jitted)[-1]) + str(fulmen.last_backward_traces(jitted)[-1])}


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_an_argument_named_dist_runs_under_ddp_and_fsdp(kind):
    (result,) = values(run_ranks(_named_like_imports, 1, kind))
    eager = _Net()
    eager(*result["inputs"]).backward()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(result["grads"][name], p.grad, rtol=0, atol=0, msg=name)
    assert "= dist." in result["traces"]  # the collectives' module, called by its name beside the argument
