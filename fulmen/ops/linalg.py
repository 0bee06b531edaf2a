"""Linear algebra: products (mv, dot, tensordot, kron, ...), factorizations and solvers (`torch.linalg`), matrix
norms, and the norms weight/spectral parametrizations call (`torch._weight_norm`, `torch.renorm`).

`mv` and `dot` decompose into `prims.matmul`, which runs the very kernel eager's `mv` and `dot` run (torch.matmul
dispatches a matrix-vector and a vector-vector product to them), so fusion executors and autocast see through
them. The rest are leaves with eager's own kernels: their meta comes from torch's meta kernels and their grads from
eager's backward (autodiff's fallback), which is exact as these ops are deterministic. An SVD- or eigen-based
op recomputed for the backward gives the same factors as its forward (LAPACK on the same input), so the gauge of
singular and eigenvectors eager's backward assumes is the forward's.
"""

from __future__ import annotations

from typing import Any

import torch

from fulmen.core.errors import UnsupportedOpError
from fulmen.core.symbol import iter_proxies
from fulmen.core.trace import TraceBuilder, infer_device
from fulmen.ops import prims
from fulmen.ops.registry import bind, lookup, method, methods, torch_symbol
from fulmen.ops.rules.eager import eager_op
from fulmen.ops.rules.grad import differentiated_by_eager, not_differentiable

_VF = torch._C._VariableFunctions


def _same_dtype(name: str, a: Any, b: Any) -> None:
    # torch's meta kernel of mv accepts mixed dtypes; eager's kernel (and prims.matmul's) refuses them
    if a.dtype != b.dtype:
        raise RuntimeError(f"{name}: expected both operands to have the same dtype, but got {a.dtype} and {b.dtype}")


def _mv_decomposition(a: Any, vec: Any) -> Any:
    _same_dtype("mv", a, vec)
    return prims.matmul(a, vec)


def _dot_decomposition(a: Any, b: Any) -> Any:
    _same_dtype("dot", a, b)
    return prims.matmul(a, b)


torch_symbol(torch.mv, decomposition=_mv_decomposition, aliases=(method("mv"),))
torch_symbol(torch.dot, decomposition=_dot_decomposition, aliases=(method("dot"),))
bind(torch.linalg.matmul, lookup(torch.matmul))



def _conj_transpose_decomposition(x: Any) -> Any:
    # a complex tensor's .H is conjugated too: left to torch
    if x.dtype.is_complex or x.dim() != 2:
        return NotImplemented
    return prims.permute(x, (1, 0))


torch_symbol(torch.Tensor.H.__get__, decomposition=_conj_transpose_decomposition)
torch_symbol(torch.vdot, aliases=(method("vdot"),))
torch_symbol(torch.inner, aliases=(method("inner"),))
torch_symbol(torch.addmv, aliases=(method("addmv"),), inplace=(method("addmv_"),))
torch_symbol(torch.addr, aliases=(method("addr"),), inplace=(method("addr_"),))
torch_symbol(torch.kron, aliases=(method("kron"),))
torch_symbol(torch.trace, aliases=(method("trace"),))
torch_symbol(torch.linalg.multi_dot)
torch_symbol(torch.linalg.vecdot)
torch_symbol(torch.linalg.cross)
torch_symbol(torch.cross, aliases=(method("cross"),))
torch_symbol(torch.linalg.diagonal)
# torch.chain_matmul and torch.tensordot are torch's Python (run inline); these are the builtins they call
torch_symbol(_VF.chain_matmul, printed="torch._C._VariableFunctions.chain_matmul")
torch_symbol(_VF.tensordot, printed="torch._C._VariableFunctions.tensordot")
differentiated_by_eager(torch.vdot, torch.inner, torch.addmv, torch.addr, torch.kron, torch.trace,
                        torch.linalg.multi_dot, torch.linalg.vecdot, torch.linalg.cross, torch.cross,
                        torch.linalg.diagonal, _VF.chain_matmul, _VF.tensordot)

# Matrix functions, factorizations, solvers; the legacy `torch.*` spellings are separate ATen ops, with their own
# backward, so they keep symbols of their own.
for _fn in (torch.linalg.matrix_exp, torch.linalg.matrix_power, torch.linalg.det, torch.linalg.slogdet,
            torch.linalg.inv, torch.linalg.inv_ex, torch.linalg.solve, torch.linalg.solve_ex,
            torch.linalg.solve_triangular, torch.linalg.qr, torch.linalg.svd, torch.linalg.svdvals,
            torch.linalg.cholesky, torch.linalg.cholesky_ex, torch.linalg.eigh, torch.linalg.eigvalsh,
            torch.linalg.eig, torch.linalg.eigvals, torch.linalg.lu_factor,
            torch.linalg.lu_factor_ex, torch.linalg.lu_solve, torch.linalg.householder_product,
            torch.linalg.tensorinv, torch.linalg.tensorsolve, torch.linalg.cond,
            torch.linalg.ldl_factor, torch.linalg.ldl_factor_ex, torch.linalg.ldl_solve, torch.linalg.norm,
            torch.linalg.matrix_norm):
    torch_symbol(_fn)
    differentiated_by_eager(_fn)
torch_symbol(torch.linalg.matrix_rank)
not_differentiable(torch.linalg.matrix_rank)  # an integer
# Under CPU autocast eager's pinv multiplies in lower precision inside the op, while on the fake tensors autocast's
# probe runs on it does not (the probe would state no conversion): an eager op, refused under autocast.
eager_op(torch.linalg.pinv)
# (P, L, U): eager's autograd leaves the permutation matrix out
for _fn in (torch.linalg.lu, torch.lu_unpack):
    torch_symbol(_fn, differentiable_outputs=(False, True, True))
    differentiated_by_eager(_fn)
for _name in ("matrix_exp", "matrix_power", "det", "logdet", "slogdet", "inverse", "svd", "qr", "cholesky",
              "cholesky_solve", "cholesky_inverse", "pinverse", "triangular_solve", "ormqr"):
    torch_symbol(getattr(torch, _name), aliases=methods(_name))
    differentiated_by_eager(getattr(torch, _name))


def _lstsq_meta(builder: TraceBuilder, a: Any, b: Any, rcond: float | None = None, *,
                driver: str | None = None) -> Any:
    """torch has no meta kernel for lstsq: its outputs as eager's kernel shapes them. The residuals of the gelsd and
    gelss drivers for a tall A are computed only where every matrix of A has full rank, a value: refused."""
    driver = driver or ("gelsy" if a.device.type == "cpu" else "gels")
    if a.dim() < 2 or b.dim() < 1 or a.dim() < b.dim():
        raise RuntimeError("torch.linalg.lstsq: input must have at least 2 dimensions, and at least as many as other")
    if a.dtype != b.dtype:
        raise RuntimeError(f"torch.linalg.lstsq: expected input and other to have the same dtype, but got "
                           f"{a.dtype} and {b.dtype}")
    m, n = a.shape[-2:]
    if m > n and driver in ("gelsd", "gelss"):
        raise UnsupportedOpError(
            f"fulmen cannot trace torch.linalg.lstsq with driver={driver!r} for a tall input ({m} x {n}): eager "
            "returns residuals only where every matrix has full rank, so their shape depends on the values; use "
            "driver='gels' or 'gelsy', or compute the residuals from the solution", builder.source)
    vector = b.dim() == a.dim() - 1  # other of shape (*, m)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-1] if vector else b.shape[:-2])
    k = 1 if vector else b.shape[-1]
    real = a.dtype.to_real()

    def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    solution = empty((*batch, n) if vector else (*batch, n, k), a.dtype)
    residuals = empty((*batch, k) if m > n and driver != "gelsy" else (0,), real)
    rank = empty((0,) if driver == "gels" else tuple(a.shape[:-2]), torch.int64)
    values = empty((*a.shape[:-2], min(m, n)) if driver in ("gelsd", "gelss") else (0,), real)
    requires_grad = torch.is_grad_enabled() and any(p.requires_grad for p in iter_proxies((a, b)))
    # eager's autograd differentiates the solution and the residuals, not the singular values
    return builder.wrap_outputs(torch.return_types.linalg_lstsq((solution, residuals, rank, values)),
                                infer_device((a, b), {}), requires_grad, differentiable=(True, True, True, False))


torch_symbol(torch.linalg.lstsq, meta=_lstsq_meta)

# Norms the weight-norm and spectral-norm parametrizations use.
torch_symbol(torch._weight_norm, printed="torch._weight_norm")
torch_symbol(torch.norm_except_dim)
torch_symbol(torch.renorm, aliases=(method("renorm"),), inplace=(method("renorm_"),))
differentiated_by_eager(torch.linalg.lstsq, torch._weight_norm, torch.norm_except_dim, torch.renorm)
