"""Peak CUDA memory of a training step, for tests comparing fulmen with eager."""

from __future__ import annotations

from collections.abc import Callable

import torch


def cuda_peak(step: Callable[[], torch.Tensor]) -> int:
    """Bytes above what was allocated before, at the peak of `step().backward()`, after one warm-up call (which
    compiles fulmen's traces and Inductor's regions)."""
    step().backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base
