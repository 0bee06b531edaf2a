"""Copying the calls of one trace into another under construction, the shared step of the functional transforms.

A functional transform (fulmen.grad, vjp, jvp, vmap) acquires the function it transforms into a trace of its own
and writes the transformed calls into the trace being built around it. `Emitter` copies calls across: it reads
each argument through an environment (the source trace's names -> values of the target) and gives every value a
call defines, its decomposition's values included, a fresh name, so a trace may be copied in more than once.
"""

from __future__ import annotations

from typing import Any

import torch

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Tag, iter_proxies, map_proxies
from fulmen.core.trace import TraceBuilder


def _differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


class Emitter:
    """Copies calls into `builder`'s current scope; `env` maps the source's names to the target's values."""

    def __init__(self, builder: TraceBuilder, env: dict[str, Any] | None = None) -> None:
        self.builder = builder
        self.env: dict[str, Any] = dict(env or {})

    def read(self, obj: Any) -> Any:
        """`obj` (a structure of the source's values) in the target's values."""
        return map_proxies(obj, lambda p: self.env.get(p.pname, p))

    def emit(self, bsym: BoundSymbol) -> BoundSymbol:
        copy = self._copy(bsym, self.env, {})
        self.builder.scopes[-1].append(copy)
        return copy

    def fresh(self, proxy: TensorProxy, requires_grad: bool) -> TensorProxy:
        new = self.builder.make_proxy(proxy.meta, proxy.device, requires_grad and _differentiable(proxy.dtype))
        self.env[proxy.pname] = new
        return new

    def _copy(self, bsym: BoundSymbol, env: dict[str, Any], adopted: dict[str, TensorProxy]) -> BoundSymbol:
        """`bsym` reading `env`; its outputs named `adopted` (a composite's outputs, for its parts) keep those."""
        args = map_proxies(bsym.args, lambda p: env.get(p.pname, p))
        kwargs = map_proxies(bsym.kwargs, lambda p: env.get(p.pname, p))
        # A value requires grad where it did in the source and something it reads does in the target.
        reads_grad = torch.is_grad_enabled() and not bsym.sym.tags & Tag.NO_GRAD and any(
            p.requires_grad for p in iter_proxies((args, kwargs)))

        def fresh(proxy: TensorProxy) -> TensorProxy:
            new = adopted.get(proxy.pname)
            if new is None:
                new = self.builder.make_proxy(proxy.meta, proxy.device,
                                              reads_grad and proxy.requires_grad and _differentiable(proxy.dtype))
            env[proxy.pname] = new
            return new

        output = map_proxies(bsym.output, fresh)
        outputs = {p.pname: env[p.pname] for p in iter_proxies(bsym.output)}
        inner = dict(env)
        subsymbols = [self._copy(sub, inner, outputs) for sub in bsym.subsymbols]
        return bsym.from_bsym(args=args, kwargs=kwargs, output=output, subsymbols=subsymbols)
