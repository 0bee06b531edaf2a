"""Liger-Kernel's Triton kernels as the operator executor "liger" (the optional extra `fulmen[liger]`).

    import fulmen
    model = fulmen.jit(model, executors=["liger", "sdpa", "torchcompile", "torch"])

Importing this package registers the executor (naming "liger" in an executor list imports it). It imports without
liger-kernel, Triton or a GPU; its kernels run on CUDA tensors when liger-kernel is installed, and torch runs the rest.
"""

from fulmen.liger.executor import LIGER_SYMBOLS, decline_reason, liger_ex

__all__ = ["LIGER_SYMBOLS", "decline_reason", "liger_ex"]
