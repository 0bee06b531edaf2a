"""Typed options for `fulmen.jit`."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from fulmen.ops.float8 import RECIPES
from fulmen.transforms.transform import Transform


@dataclass(frozen=True, slots=True)
class OffloadOptions:
    """CPU offloading of the tensors the forward saves for the backward (`fulmen.transforms.offload`).

    A saved tensor on a CUDA device is copied to pinned host memory on a side stream right after the forward
    computes it, its device memory is freed after its last forward use, and it is copied back on the side stream
    ahead of its first use in the backward. Results are unchanged; device memory at any point is at most what it
    is without offloading. Tensors on the CPU are never offloaded (they are on the host already).

    Attributes:
        fraction: the share of the eligible saved bytes to offload, in (0, 1]. The tensors that stay saved the
            longest (farthest apart last forward use and first backward use) go first.
        min_bytes: saved tensors smaller than this stay on the device (the copies cost more than they free).
        min_distance: saved tensors whose last forward use and first backward use are fewer than this many
            trace operations apart stay on the device (their copies could not overlap with compute).
        prefetch: how many offloaded tensors are being copied back ahead of their first use in the backward, at
            most (each reload starts after the first backward use of the one `prefetch` places before it).
    """

    fraction: float = 1.0
    min_bytes: int = 1 << 20
    min_distance: int = 16
    prefetch: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, int | float) or not (
                0 < self.fraction <= 1):
            raise ValueError(f"OffloadOptions.fraction must be a number in (0, 1], got {self.fraction!r}")
        for name in ("min_bytes", "min_distance", "prefetch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"OffloadOptions.{name} must be a non-negative int, got {value!r}")


@dataclass(frozen=True, slots=True)
class Float8Options:
    """Float8 matmuls (`fulmen.transforms.float8`; the numerics are README.md's "Float8 training").

    Each linear and matmul whose dimensions suit float8 computes with torch._scaled_mm: inputs and weights cast to
    float8_e4m3fn with dynamic scales, the output gradient to float8 in the backward, outputs and gradients in their
    original dtypes. Parameters, optimizer state and every other op are unchanged.

    Attributes:
        recipe: torchao's recipe names and scaling rules (fulmen.ops.float8.RECIPES): "tensorwise" (one scale per
            tensor; the output gradient in e5m2), "rowwise" (one scale per row along the contracted dimension,
            powers of two; everything e4m3), "rowwise_with_gw_hp" (rowwise, but the weight gradient's matmul in high
            precision).
        skip: matmuls to leave in high precision, by their weight: qualified names of parameters or modules, or
            prefixes of them (`("transformer.h.0", "mlp.proj.weight")`), or a predicate of the parameter's name.
        lm_head: convert the model's head too (its weight is an `lm_head`'s, or its output feeds a cross-entropy).
        all_gather: under fulmen's FSDP, all-gather the weights each matmul casts already in float8 (half the bytes
            of bfloat16), scaled by the amax over all ranks; tensorwise only.
    """

    recipe: str = "tensorwise"
    skip: tuple[str, ...] | Callable[[str], bool] = ()
    lm_head: bool = False
    all_gather: bool = False

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"Float8Options.recipe must be one of {', '.join(map(repr, RECIPES))}, got "
                             f"{self.recipe!r}")
        skip = self.skip
        if isinstance(skip, str) or not (callable(skip) or isinstance(skip, tuple | list)) or (
                not callable(skip) and not all(isinstance(name, str) for name in skip)):
            raise TypeError("Float8Options.skip must be a list of qualified names (e.g. ['lm_head', "
                            f"'transformer.h.0.mlp']) or a predicate of a parameter's name, got {skip!r}")
        if not callable(skip):
            object.__setattr__(self, "skip", tuple(skip))
        for name in ("lm_head", "all_gather"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Float8Options.{name} must be a bool, got {getattr(self, name)!r}")
        if self.all_gather and self.recipe != "tensorwise":
            raise ValueError("Float8Options.all_gather needs recipe='tensorwise': a weight gathered in float8 has one "
                             f"scale, and {self.recipe!r} scales each row of it")


class CacheLimitAction(str, enum.Enum):
    """What a call does when it misses the cache and the cache already holds `JitOptions.cache_limit` traces."""

    EAGER = "eager"  # run the function eagerly, uncompiled (a warning says why the calls keep missing, once)
    ERROR = "error"  # raise fulmen.CacheLimitError, saying why


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
            logits at most half the full logits and 512 MiB, but at least 1024 rows).
        grouped_query_attention: call scaled_dot_product_attention with the shared key/value heads
            (`enable_gqa=True`) where a model repeats them for each query head, when torch runs the grouped call with
            the same fused kernel (fulmen.transforms.grouped_attention): no head copies in the forward, no head sums
            in the backward. Values equal eager's up to the order in which the key and value gradients are summed.
        activation_memory_budget: the bytes the forward saves for the backward, as a share of what it saves by
            default (0 to 1, torch.compile's option of the same name). Below 1, the backward also recomputes matmuls
            and reductions (a linear's output from its input), the fewest flops first, until the saved bytes fit:
            less memory for more compute. Values are unchanged. Where even recomputing all of them cannot reach the
            share, as few bytes as that leaves are saved; fewer are recomputed where the step's estimated peak would
            otherwise rise above the default's.
        transforms: `fulmen.Transform`s run at the pipeline's stages, in this order (see fulmen.jit.pipeline).
        offload: CPU offloading of the tensors saved for the backward (None: off).
        float8: float8 matmuls (fulmen.transforms.float8; None: off, every matmul computes as eager's).
        cuda_graphs: capture the final forward and backward traces in CUDA graphs and replay them
            (fulmen.transforms.cudagraphs; torch.compile's "reduce-overhead"): for steps that launch many small
            kernels. Programs that cannot be captured run without graphs, with a warning that says why.
        optimizer_bucket_cap_mb: in a whole training step (`loss.backward()` and `optimizer.step()` in the jitted
            program), the parameters' updates run in buckets: eager's kernel called once over several parameters of a
            group (one launch per foreach op for the bucket), each update waiting, its gradient held, until the
            bucket's gradients reach this many MiB (DDP's `bucket_cap_mb`) or a later call reads what it updates.
            0: each parameter alone, right after its gradient. Values are eager's either way.
        cache_limit: how many traces one jitted callable keeps (torch.compile's default recompile limit is 8 too);
            each holds its compiled code and, for a training step, its saved-for-backward plan.
        cache_limit_action: what a call that needs one more trace does then: "eager" (run uncompiled, with a warning
            naming what keeps changing) or "error" (raise fulmen.CacheLimitError).
        dynamic: symbolic sizes for the tensor arguments (fulmen.jit.dynamic_shapes). None (automatic, torch.compile's
            rule): the first trace is static, and a dimension whose size differs at a later trace becomes a symbol,
            so one trace serves every size its guards admit; True: every dimension is a symbol from the first trace;
            False: static shapes only, one trace per shape. Sizes 0 and 1 stay static; `fulmen.mark_dynamic(tensor,
            dim)` marks a dimension ahead. Parameters and buffers stay static.
    """

    decompose: bool = True
    cse: bool = True
    fuse_linear_cross_entropy: bool = True
    cross_entropy_chunk_rows: int | None = None
    grouped_query_attention: bool = True
    activation_memory_budget: float = 1.0
    transforms: tuple[Transform, ...] = field(default=())
    offload: OffloadOptions | None = None
    float8: Float8Options | None = None
    cuda_graphs: bool = False
    optimizer_bucket_cap_mb: float = 32.0
    cache_limit: int = 8
    cache_limit_action: CacheLimitAction | str = CacheLimitAction.EAGER
    dynamic: bool | None = None

    def __post_init__(self) -> None:
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise TypeError(f"JitOptions.dynamic must be None, True or False, got {self.dynamic!r}")
        for name in ("decompose", "cse", "fuse_linear_cross_entropy", "grouped_query_attention", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"JitOptions.{name} must be a bool, got {getattr(self, name)!r}")
        cap = self.optimizer_bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 0:
            raise ValueError(f"JitOptions.optimizer_bucket_cap_mb must be a number >= 0, got {cap!r}")
        rows = self.cross_entropy_chunk_rows
        if rows is not None and (type(rows) is not int or rows < 1):
            raise ValueError(f"JitOptions.cross_entropy_chunk_rows must be a positive int or None, got {rows!r}")
        budget = self.activation_memory_budget
        if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 <= budget <= 1:
            raise ValueError(f"JitOptions.activation_memory_budget must be a number in [0, 1], got {budget!r}")
        if not isinstance(self.transforms, tuple | list):
            raise TypeError(f"JitOptions.transforms must be a list of fulmen.Transform, got {self.transforms!r}")
        for transform in self.transforms:
            if not isinstance(transform, Transform):
                raise TypeError(f"JitOptions.transforms holds {transform!r}, which is not a fulmen.Transform "
                                "(subclass it and override the hooks of the stages you need)")
        object.__setattr__(self, "transforms", tuple(self.transforms))
        if self.offload is not None and not isinstance(self.offload, OffloadOptions):
            raise TypeError(f"JitOptions.offload must be an OffloadOptions or None, got {self.offload!r}")
        if self.float8 is not None and not isinstance(self.float8, Float8Options):
            raise TypeError(f"JitOptions.float8 must be a Float8Options or None, got {self.float8!r}")
        if type(self.cache_limit) is not int or self.cache_limit < 1:
            raise ValueError(f"JitOptions.cache_limit must be a positive int, got {self.cache_limit!r}")
        try:
            action = CacheLimitAction(self.cache_limit_action)
        except ValueError:
            choices = ", ".join(repr(a.value) for a in CacheLimitAction)
            raise ValueError(f"JitOptions.cache_limit_action must be one of {choices}, got "
                             f"{self.cache_limit_action!r}") from None
        object.__setattr__(self, "cache_limit_action", action)
