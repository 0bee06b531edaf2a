"""Typed options for `fulmen.jit`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class JitOptions:
    """Options of one jitted callable.

    Attributes:
        decompose: record each torch-level symbol's decomposition into prims as its subsymbols (the multi-level IR).
            Off makes acquisition faster when no transform needs the prim level.
        cse: merge identical calls in the final trace.
        fuse_linear_cross_entropy: compute a cross-entropy of a linear's output (a language model's head and loss)
            chunk by chunk of rows, so the full logits and their gradient never exist (fulmen.transforms.fused_loss).
        cross_entropy_chunk_rows: rows (tokens) per chunk of the fused loss; None chooses from memory (each chunk's
            logits at most 1/8 of the full logits and 256 MiB, but at least 1024 rows).
    """

    decompose: bool = True
    cse: bool = True
    fuse_linear_cross_entropy: bool = True
    cross_entropy_chunk_rows: int | None = None

    def __post_init__(self) -> None:
        for name in ("decompose", "cse", "fuse_linear_cross_entropy"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"JitOptions.{name} must be a bool, got {getattr(self, name)!r}")
        rows = self.cross_entropy_chunk_rows
        if rows is not None and (type(rows) is not int or rows < 1):
            raise ValueError(f"JitOptions.cross_entropy_chunk_rows must be a positive int or None, got {rows!r}")
