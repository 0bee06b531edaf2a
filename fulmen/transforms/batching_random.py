"""fulmen.vmap's rules for random ops, as torch.func.vmap runs them: which calls draw at all (dropout outside
training, or with p 0 or 1, draws nothing and runs under randomness='error'), and randomness='same' over batched
arguments: one draw of one example's shape, shared by every example (torch.func draws from the first example's
metadata). Ops that read their batched arguments' values in the draw (bernoulli, normal, multinomial) have no
such rule: torch.func refuses them too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fulmen.core.symbol import iter_proxies
from fulmen.ops import lookup, prims
from fulmen.ops.rules.batch import Batch
from fulmen.ops.rules.tables import RuleKind, register


def _like_same(sym):
    def rule(batch: Batch, args: tuple, kwargs: dict):
        x, *rest = args
        if any(batch.batched(p) for p in iter_proxies((rest, kwargs))):
            return NotImplemented
        return batch.materialize(sym(prims.select(x, 0, 0), *rest, **kwargs))

    return rule


for _fn in (torch.rand_like, torch.randn_like, torch.randint_like):
    register(RuleKind.BATCH_SAME_RANDOMNESS, _fn, _like_same(lookup(_fn).symbol))


# dropout spelling -> its (input, p, training) from the call's arguments
_DROPOUTS = {
    F.dropout: lambda input, p=0.5, training=True, inplace=False: (input, p, training),
    torch.dropout: lambda input, p, train: (input, p, train),
}


def _dropout_draws(arguments):
    def draws(*args, **kwargs) -> bool:
        x, p, training = arguments(*args, **kwargs)
        return bool(training) and 0 < p < 1 and x.numel() > 0  # aten's dropout returns x or x * 0 otherwise

    return draws


def _dropout_same(sym, arguments):
    def rule(batch: Batch, args: tuple, kwargs: dict):
        x, p, _ = arguments(*args, **kwargs)
        if not batch.batched(x):
            return NotImplemented
        example = prims.select(x, 0, 0)
        # one example's dropout of ones is its scaled mask, kept / (1 - p): x times it, as eager's x * noise
        mask = sym(prims.full(tuple(example.shape), 1, dtype=x.dtype, device=x.device), p, True)
        return prims.mul(x, batch.materialize(mask))

    return rule


for _fn, _arguments in _DROPOUTS.items():
    register(RuleKind.DRAWS, _fn, _dropout_draws(_arguments))
    register(RuleKind.BATCH_SAME_RANDOMNESS, _fn, _dropout_same(lookup(_fn).symbol, _arguments))
