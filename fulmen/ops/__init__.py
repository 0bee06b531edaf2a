"""Torch-level symbols and the prims they decompose into.

Importing this package registers every supported torch callable (see `registry.TORCH_BINDINGS`).
"""

from fulmen.ops import (  # noqa: F401  (registration side effects)
    activations,
    backward_kernels,
    builders,
    checks,
    elementwise,
    factories,
    fft,
    fused_loss,
    linalg,
    nn,
    recurrent,
    reductions,
    shape,
    statistics,
    vision,
)
from fulmen.ops.registry import TORCH_BINDINGS, TorchBinding, lookup

__all__ = ["TORCH_BINDINGS", "TorchBinding", "lookup"]
