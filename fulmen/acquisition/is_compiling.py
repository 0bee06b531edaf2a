"""The program seeing `torch.compiler.is_compiling()` as True while fulmen acquires it, as under Dynamo.

Libraries branch on it to keep tensor-value reads out of traced code: Hugging Face transformers' masking skips
`if padding_mask.all(): drop the mask` (a data-dependent branch) when it knows it is being traced, and keeps the
mask, which gives the same attention. fulmen.jit acquires a program as eager runs it, and again under this flag
only when eager's path reads a tensor value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def _session_flag() -> Iterator[None]:
    """torch's own flag behind `is_compiling()`, set and restored as torch.export does (torch before 2.12 has no
    context manager for it)."""
    previous = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = previous


# The context manager Dynamo holds for a compile session (torch 2.12+), else the flag itself.
seen_as_compiling = getattr(torch.compiler, "_compile_session_context", _session_flag)
