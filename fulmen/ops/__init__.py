"""Torch-level symbols and the prims they decompose into, each op one stanza in its family's module: its symbol,
decomposition, and its grad, JVP and batching rules (fulmen.ops.rules).

Importing this package registers every supported torch callable (see `registry.TORCH_BINDINGS`) and every rule:
the families are imported here, and nowhere else for their side effects.
"""

from fulmen.ops import (  # noqa: F401  (registration side effects)
    activations,
    complex,
    effects,
    elementwise,
    factories,
    fft,
    float8,
    fused_loss,
    linalg,
    losses,
    nn,
    optim,
    recurrent,
    reductions,
    shape,
    special,
    vision,
)
from fulmen.ops.kernels import backward_kernels  # noqa: F401  (eager's backward kernels as symbols, their rules)

# The prims' rules, by prim kind (registration side effects). Aliased: fulmen.ops.elementwise, .factories and
# .reductions name the torch-level families.
from fulmen.ops.prims import elementwise as _prim_elementwise  # noqa: F401
from fulmen.ops.prims import factories as _prim_factories  # noqa: F401
from fulmen.ops.prims import indexing as _prim_indexing  # noqa: F401
from fulmen.ops.prims import reductions as _prim_reductions  # noqa: F401
from fulmen.ops.prims import shapes as _prim_shapes  # noqa: F401
from fulmen.ops.registry import TORCH_BINDINGS, TorchBinding, lookup

__all__ = ["TORCH_BINDINGS", "TorchBinding", "lookup"]
