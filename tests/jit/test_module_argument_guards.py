"""A module passed to a jitted function (not jitted itself): `nn.Module.__getattr__` reads its `__dict__` to find a
parameter, buffer or submodule. The trace is guarded on that lookup, not on the module's whole content: a cache hit
checked every module's whole state before (199 of the 1,444 guards of a 16-layer Hugging Face Llama, most of the
check's time). Every change the lookup could see still misses the cache, and eager's answer comes back."""

from __future__ import annotations

import torch
from torch import nn

import fulmen


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _run(block: Block, x: torch.Tensor) -> torch.Tensor:
    return block(x)


def _whole_state_guards(jitted) -> list[str]:
    return [g.what for entry in jitted._cache.entries for g in entry.guards if "read whole" in g.what]


def test_a_module_argument_is_guarded_on_its_lookups_not_its_whole_state():
    torch.manual_seed(0)
    block, x = Block(), torch.randn(2, 4)
    jitted = fulmen.jit(_run)
    torch.testing.assert_close(jitted(block, x), block(x), rtol=0, atol=0)
    assert not _whole_state_guards(jitted)
    torch.testing.assert_close(jitted(block, x), block(x), rtol=0, atol=0)
    assert len(jitted._cache.entries) == 1  # a hit


def test_every_change_the_lookup_sees_misses():
    torch.manual_seed(0)
    block, x = Block(), torch.randn(2, 4)
    jitted = fulmen.jit(_run)
    jitted(block, x)

    block.lin.weight = nn.Parameter(torch.randn(4, 4))  # another parameter of the same name
    torch.testing.assert_close(jitted(block, x), block(x), rtol=0, atol=0)

    block.scale = torch.full((4,), 3.0)  # another buffer
    torch.testing.assert_close(jitted(block, x), block(x), rtol=0, atol=0)

    block.lin = nn.Linear(4, 4)  # another submodule
    torch.testing.assert_close(jitted(block, x), block(x), rtol=0, atol=0)

    # the name put in the module's own dict, where the normal lookup finds it before `__getattr__` runs
    block.__dict__["scale"] = torch.full((4,), 5.0)
    torch.testing.assert_close(jitted(block, x), block(x), rtol=0, atol=0)

    del block.__dict__["scale"]
    del block._buffers["scale"]
    block.scale = 7.0  # now a plain attribute: the buffer is gone
    torch.testing.assert_close(jitted(block, x), block(x), rtol=0, atol=0)
    assert len(jitted._cache.entries) == 6


def test_a_missing_member_stays_missing():
    """`hasattr(block, "extra")` runs `__getattr__` and finds nothing; a member added later is seen."""

    def run(block: Block, x: torch.Tensor) -> torch.Tensor:
        y = block(x)
        return y + 1 if hasattr(block, "extra") else y

    block, x = Block(), torch.randn(2, 4)
    jitted = fulmen.jit(run)
    torch.testing.assert_close(jitted(block, x), run(block, x), rtol=0, atol=0)
    block.register_buffer("extra", torch.zeros(()))
    torch.testing.assert_close(jitted(block, x), run(block, x), rtol=0, atol=0)
    assert len(jitted._cache.entries) == 2
