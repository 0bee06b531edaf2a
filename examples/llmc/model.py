"""GPT-2 as llm.c's PyTorch reference writes it, randomly initialised (no checkpoint loading).

The program is left exactly as a user would bring it; the llm.c executor (executor.py) swaps in CUDA kernels
without editing it. For that, the pieces it replaces are plain module-level functions or methods that it can
name: `_permute` (fused qkv -> per-head q, k, v), `_unpermute` (heads -> side by side), `NewGELU.forward`, and
`torch.nn.functional.layer_norm` as nn.LayerNorm calls it. The softmax of the attention and the cross-entropy of
the loss are the torch functions themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


def _permute(qkv: torch.Tensor, n_embd: int, n_head: int, B: int, T: int, C: int):
    """(B, T, 3C) fused projections -> q, k, v, each (B, n_head, T, C // n_head)."""
    q, k, v = qkv.split(n_embd, dim=2)
    q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
    k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
    v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
    return q, k, v


def _unpermute(y: torch.Tensor, B: int, T: int, C: int) -> torch.Tensor:
    """(B, n_head, T, head_size) -> (B, T, C): the heads' outputs side by side."""
    return y.transpose(1, 2).contiguous().view(B, T, C)


def _manual_attention(qkv, bias, n_embd, n_head, B, T, C):
    """Causal self-attention spelled out: scores, the causal mask, softmax, the weighted sum of values."""
    q, k, v = _permute(qkv, n_embd, n_head, B, T, C)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(bias[:, :, :T, :T] == 0, float("-inf"))
    att = F.softmax(att, dim=-1)
    y = att @ v  # (B, nh, T, T) @ (B, nh, T, hs) -> (B, nh, T, hs)
    return _unpermute(y, B, T, C)


class NewGELU(nn.Module):
    """GELU with the tanh approximation, the variant GPT-2 was trained with."""

    def forward(self, input):
        return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k and v of all heads in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        # A mask despite the name (the name follows OpenAI's and Hugging Face's checkpoints).
        mask = torch.tril(torch.ones(config.block_size, config.block_size))
        self.register_buffer("bias", mask.view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        qkv = self.c_attn(x)
        y = _manual_attention(qkv, self.bias, self.n_embd, self.n_head, B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = NewGELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # the token embedding and the output layer share weights

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.config.block_size, f"sequence of length {t} exceeds the block size {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            # Generation needs only the last position; the list index keeps the time dim.
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss
