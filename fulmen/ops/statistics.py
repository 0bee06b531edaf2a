"""Covariance and correlation, binning into sorted boundaries (bucketize, searchsorted) and the trapezoidal rule,
with eager's kernels and eager's grads."""

from __future__ import annotations

from typing import Any

import torch

from fulmen.ops.eager_grads import eager_op
from fulmen.ops.registry import TorchBinding, bind, method, torch_symbol
from fulmen.ops.rules.grad import differentiated_by_eager, not_differentiable

for _fn in (torch.bucketize, torch.searchsorted, torch.trapezoid, torch.trapz, torch.cumulative_trapezoid):
    torch_symbol(_fn)
differentiated_by_eager(torch.trapezoid, torch.trapz, torch.cumulative_trapezoid)
not_differentiable(torch.bucketize, torch.searchsorted)  # indices


def _moment_like(fn: Any) -> Any:
    """cov and corrcoef have no meta kernel (they compare weights on the host). Their shape is set by the number of
    variables alone; their dtype, which the weights promote, by eager's kernel on one observation of each."""

    def like(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if x.dim() > 2:
            raise RuntimeError(f"{fn.__name__}(): expected input to have two or fewer dimensions but got an input "
                               f"with {x.dim()} dimensions")
        variables = x.shape[0] if x.dim() == 2 else 1
        small = torch.zeros((min(variables, 2), 1) if x.dim() == 2 else (1,), dtype=x.dtype)
        weights = {name: torch.ones(1, dtype=w.dtype) for name, w in kwargs.items()
                   if name in ("fweights", "aweights") and w is not None}
        with torch.device("cpu"):
            dtype = fn(small, *args, **{**kwargs, **weights}).dtype
        shape = (variables, variables) if x.dim() == 2 and variables != 1 else ()
        return torch.empty(shape, dtype=dtype, device="meta")

    return like


for _fn in (torch.cov, torch.corrcoef):
    bind(method(_fn.__name__), TorchBinding(eager_op(_fn, like=_moment_like(_fn))))
