"""The offline default data: a small English corpus shipped with fulmen, as a LitGPT `DataModule`.

Without a tokenizer the text is read as bytes (token ids 0..255, so a model with `padded_vocab_size=256` needs
no tokenizer files); with one (`tokenizer_dir`), it is tokenized once. The last `val_fraction` of the tokens is
held out for validation. Training samples are windows of `max_seq_length + 1` tokens starting at random offsets
drawn from a generator seeded with `seed` and the sample's index, so sample `i` is the same in every run and a
resumed run sees exactly the samples the uninterrupted one would have.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from litgpt.data import DataModule
from litgpt.tokenizer import Tokenizer
from torch.utils.data import DataLoader, Dataset

CORPUS = Path(__file__).with_name("corpus.txt")


class Windows(Dataset):
    """`length` windows of `size` tokens from `tokens`, window `i` at a random offset seeded by (`seed`, `i`)."""

    def __init__(self, tokens: torch.Tensor, size: int, length: int, seed: int) -> None:
        if tokens.numel() <= size:
            raise ValueError(f"the corpus has {tokens.numel()} tokens, too few for samples of {size} tokens: lower "
                             "train.max_seq_length or use a larger corpus")
        self.tokens, self.size, self.length, self.seed = tokens, size, length, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(0, self.tokens.numel() - self.size, (1,), generator=generator))
        return self.tokens[start : start + self.size]


@dataclass
class ShippedCorpus(DataModule):
    """The text corpus shipped with fulmen (or any text file): bytes, or tokens of a connected tokenizer."""

    path: Path = CORPUS
    """A UTF-8 text file."""
    val_fraction: float = 0.1
    """The share of the tokens held out for validation (the end of the text)."""
    seed: int = 42
    """Seeds where the training windows start."""
    num_samples: int = 1_000_000
    """Training samples per epoch (windows may overlap)."""

    tokenizer: Tokenizer | None = field(default=None, init=False, repr=False)
    batch_size: int = field(default=1, init=False, repr=False)
    max_seq_length: int = field(default=-1, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__init__()
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"data.val_fraction must be between 0 and 1, got {self.val_fraction}")
        if self.num_samples < 1:
            raise ValueError(f"data.num_samples must be a positive integer, got {self.num_samples}")

    def connect(self, tokenizer: Tokenizer | None = None, batch_size: int = 1,
                max_seq_length: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_seq_length = -1 if max_seq_length is None else max_seq_length

    def _tokens(self) -> torch.Tensor:
        path = Path(self.path)
        if not path.is_file():
            raise FileNotFoundError(f"data.path: no text file at {path}")
        text = path.read_text(encoding="utf-8")
        if self.tokenizer is None:
            return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        return self.tokenizer.encode(text, bos=False, eos=False).long()

    def setup(self, stage: str = "") -> None:
        if self.max_seq_length < 1:
            raise RuntimeError("ShippedCorpus.connect(..., max_seq_length=) must be called before setup")
        tokens = self._tokens()
        split = int(tokens.numel() * (1 - self.val_fraction))
        size = self.max_seq_length + 1
        self.train = Windows(tokens[:split], size, self.num_samples, self.seed)
        val = tokens[split:]
        self.val = [val[i : i + size] for i in range(0, val.numel() - size + 1, size)]
        if not self.val:
            raise ValueError(f"the validation part of {self.path} has {val.numel()} tokens, too few for one sample "
                             f"of {size}: raise data.val_fraction or lower train.max_seq_length")

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size, shuffle=False)
