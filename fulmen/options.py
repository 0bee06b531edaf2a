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
        cuda_graphs: capture the final forward and backward traces in CUDA graphs and replay them
            (fulmen.transforms.cudagraphs; torch.compile's "reduce-overhead"): for steps that launch many small
            kernels. Programs that cannot be captured run without graphs, with a warning that says why.
    """

    decompose: bool = True
    cse: bool = True
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        for name in ("decompose", "cse", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"JitOptions.{name} must be a bool, got {getattr(self, name)!r}")
