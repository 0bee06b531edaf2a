"""Tensors built from others by placing their elements (diag, diag_embed, rot90, block_diag, vander, cartesian_prod,
combinations) and index factories (triu_indices, tril_indices), with eager's kernels and eager's grads.

`torch.block_diag` and `torch.cartesian_prod` are torch's Python (run inline): their builtins are what is bound.
"""

from __future__ import annotations

import math

import torch

from fulmen.ops.eager_grads import eager_op
from fulmen.ops.registry import methods, torch_symbol
from fulmen.ops.rules.grad import differentiated_by_eager, not_differentiable

_VF = torch._C._VariableFunctions

for _name in ("diag", "diag_embed", "diagflat", "rot90", "vander"):
    torch_symbol(getattr(torch, _name), aliases=methods(_name))
torch_symbol(torch.linalg.vander)
torch_symbol(torch.triu_indices)
torch_symbol(torch.tril_indices)
torch_symbol(_VF.block_diag, printed="torch._C._VariableFunctions.block_diag")
torch_symbol(_VF.cartesian_prod, printed="torch._C._VariableFunctions.cartesian_prod")
differentiated_by_eager(torch.diag, torch.diag_embed, torch.diagflat, torch.rot90, torch.vander, torch.linalg.vander,
                        _VF.block_diag, _VF.cartesian_prod)
not_differentiable(torch.triu_indices, torch.tril_indices)  # factories of indices


def _combinations_like(x: torch.Tensor, r: int = 2, with_replacement: bool = False) -> torch.Tensor:
    """torch's kernel selects the combinations with a mask (no meta kernel); their number follows from len(x)."""
    if x.dim() != 1:
        raise RuntimeError(f"Expect a 1D vector, but got shape {list(x.shape)}")
    if r < 0:
        raise RuntimeError(f"Expect a non-negative number, but got {r}")
    if r == 0:
        return x.new_empty((0,))
    n = x.shape[0]
    return x.new_empty((math.comb(n + r - 1, r) if with_replacement else math.comb(n, r), r))


eager_op(torch.combinations, like=_combinations_like)
