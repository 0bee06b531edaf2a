"""fulmen's own Triton kernels (cross-entropy, SwiGLU, RoPE) as an executor: see the unsloth issue."""
