"""Batching a trace: the transform that runs the batching rules (fulmen.vmap).

Every batched value carries its batch dimension first. The rules are the batching tables of
fulmen.ops.rules.tables, written with fulmen.ops.rules.batch (which says what a rule gets and returns). A rule runs
only when some tensor argument is batched (other calls are copied as they are) and may return NotImplemented to
decline. A symbol without a rule is batched through its decomposition; a leaf without either runs once per example
(`impls.batch_loop`), as torch.func does for ops it has no rule for. A random op's draw follows `Randomness`: the
DRAWS table says whether a call draws at all, BATCH_SAME_RANDOMNESS holds the rules that share one draw.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch

from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Tag, iter_proxies, map_proxies
from fulmen.core.trace import TraceBuilder
from fulmen.ops import prims
from fulmen.ops.kernels import impls
from fulmen.ops.registry import impl_symbol
from fulmen.ops.rules.batch import Batch
from fulmen.ops.rules.grad import differentiated_by_eager
from fulmen.ops.rules.tables import RuleKind, rule
from fulmen.transforms.autodiff import STORAGE_OPS
from fulmen.transforms.inline import Emitter
from fulmen.transforms.recording import run_recorded


class Randomness(enum.Enum):
    """torch.func.vmap's `randomness`: what a random op inside the function does."""

    ERROR = "error"  # refuse random ops
    SAME = "same"  # one draw shared by every example (ops whose arguments are not batched)
    DIFFERENT = "different"  # an independent draw per example


BATCH_LOOP = impl_symbol(impls.batch_loop)
# a grad of a transformed program differentiates this call with eager's backward of the op it runs
differentiated_by_eager(BATCH_LOOP)


def draws_random(bsyms: list[BoundSymbol]) -> bool:
    return any(bsym.draws_random() for bsym in bsyms)


class BatchTransform:
    """Writes the batched form of source calls into `builder`.

    `env` maps the source's names to the target's values; `batched` names the target values that carry the batch
    dimension (first).
    """

    def __init__(self, builder: TraceBuilder, interpreter: Any, env: dict[str, Any], batched: set[str], size: int,
                 randomness: Randomness) -> None:
        self.builder = builder
        self.interpreter = interpreter
        self.emitter = Emitter(builder, env)
        self.batch = Batch(size, set(batched))
        self.randomness = randomness
        self.loops: list[str] = []  # the symbols that ran once per example

    def run(self, bsyms: list[BoundSymbol]) -> None:
        for bsym in bsyms:
            self.call(bsym)

    def call(self, bsym: BoundSymbol) -> None:
        args, kwargs = self.emitter.read(bsym.args), self.emitter.read(bsym.kwargs)
        batched = [self.batch.batched(p) for p in iter_proxies((args, kwargs))]
        draws = rule(RuleKind.DRAWS, bsym.sym)
        random = bool(bsym.sym.tags & Tag.RANDOM) and (draws is None or draws(*args, **kwargs))
        if random and self.randomness is Randomness.ERROR:
            raise TraceError(f"fulmen.vmap: {bsym.sym.printed} draws random numbers; pass randomness='same' or "
                             "'different' to say what each example gets (as torch.func.vmap)", bsym.source)
        if random and self.randomness is Randomness.SAME and any(batched):
            same = rule(RuleKind.BATCH_SAME_RANDOMNESS, bsym.sym)
            if same is None or not self._apply(bsym, lambda: same(self.batch, args, kwargs)):
                raise TraceError(f"fulmen.vmap(randomness='same') cannot batch {bsym.sym.printed} over batched "
                                 "arguments: each example would need its own values with shared randomness "
                                 "(torch.func.vmap refuses it too); use randomness='different'", bsym.source)
            return
        if not any(batched) and not (random and self.randomness is Randomness.DIFFERENT):
            self.emitter.emit(bsym)
            return
        if bsym.sym.tags & Tag.IMPURE or bsym.sym.printed in STORAGE_OPS:
            raise TraceError(f"fulmen.vmap cannot batch {bsym.sym.printed}: it writes into a tensor or addresses "
                             "storage, which traces do not model", bsym.source)
        batching = None if random else rule(RuleKind.BATCH, bsym.sym)
        if batching is not None and self._apply(bsym, lambda: batching(self.batch, args, kwargs)):
            return
        if bsym.subsymbols and not random:
            self.run(bsym.subsymbols)
            return
        self.loops.append(bsym.sym.printed)
        self._apply(bsym, lambda: self._loop(bsym, args, kwargs, tuple(batched)))

    def _apply(self, bsym: BoundSymbol, run: Callable[[], Any]) -> bool:
        """Runs a rule for `bsym` and maps its outputs (all batched); False when the rule declines."""
        out = run_recorded(run, self.builder, self.interpreter, bsym.source)
        if out is NotImplemented:
            return False
        sources, outputs = bsym.proxy_outputs(), list(iter_proxies(out))
        if len(outputs) != len(sources):
            raise TraceError(f"the batching rule of {bsym.sym.printed} returned {len(outputs)} tensors, the symbol "
                             f"gives {len(sources)}", bsym.source)
        for source, value in zip(sources, outputs):
            if (tuple(value.shape), value.dtype) != ((self.batch.size, *source.shape), source.dtype):
                raise TraceError(f"the batching rule of {bsym.sym.printed} computed {value.type_string()} where a "
                                 f"batch of {self.batch.size} of {source.type_string()} was expected", bsym.source)
            self.emitter.env[source.pname] = value
            self.batch.names.add(value.pname)
        return True

    def _loop(self, bsym: BoundSymbol, args: tuple, kwargs: dict, batched: tuple[bool, ...]) -> Any:
        size = self.batch.size
        if size == 0:  # no example to run: the outputs are empty, of the shapes the trace knows
            return map_proxies(bsym.output, lambda p: prims.full((0, *p.shape), 0, dtype=p.dtype, device=p.device))

        def batched_proxy(p: TensorProxy) -> TensorProxy:
            with torch._C.DisableTorchFunction():  # a meta tensor, not a call of the program
                meta = torch.empty((size, *p.shape), dtype=p.dtype, device="meta")
            return self.builder.make_proxy(meta, p.device)

        out = map_proxies(bsym.output, batched_proxy)
        self.builder.scopes[-1].append(BoundSymbol(BATCH_LOOP, (bsym.sym, args, kwargs, batched, size), {}, out, [],
                                                   bsym.source))
        return out
