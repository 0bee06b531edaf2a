"""The GPT-2 of seed 002 (llm.c's PyTorch reference) for tests: the model `examples/llmc` ships, at a tiny size.

The program our users bring: fused qkv projection split into heads, attention written by hand (a causal mask
buffer sliced and compared, masked_fill with -inf, softmax), the tanh GELU spelled with torch.pow, LayerNorm,
tied token embedding and lm_head, and cross-entropy with ignore_index=-1.
"""

from __future__ import annotations

from examples.llmc.model import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "tiny_config"]


def tiny_config() -> GPTConfig:
    return GPTConfig(block_size=32, vocab_size=96, n_layer=2, n_head=4, n_embd=32)
