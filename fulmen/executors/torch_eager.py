"""The torch executor: runs every symbol fulmen defines with the torch callable it was acquired from.

It is always last in the executor list, so every torch-level symbol and prim has an implementation. Symbols print
as their torch callable (`torch.nn.functional.linear`), so what it runs is plain PyTorch.
"""

from __future__ import annotations

from fulmen.core.symbol import BoundSymbol, Tag
from fulmen.executors.base import DIRECT, Executor, Implementation


class TorchExecutor(Executor):
    def claims(self, bsym: BoundSymbol) -> Implementation | None:
        return DIRECT if bsym.sym.executor is None and not bsym.sym.tags & Tag.REGION else None


torch_executor = TorchExecutor("torch")
