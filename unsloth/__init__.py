"""fulmen's own Triton kernels for cross-entropy, SwiGLU and RoPE, as the operator executor "unsloth".

    import fulmen
    model = fulmen.jit(model, executors=["unsloth", "sdpa", "torchcompile", "torch"])

Importing this package registers the executor (naming "unsloth" in an executor list imports it). It needs no GPU
or Triton to import; its kernels run on CUDA tensors when Triton is installed, and torch runs the rest.
"""

from fulmen.unsloth.executor import UNSLOTH_SYMBOLS, unsloth_ex

__all__ = ["UNSLOTH_SYMBOLS", "unsloth_ex"]
