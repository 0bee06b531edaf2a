"""Forward-mode autodiff on a trace: JVP rules, one table, and the transform that runs them (fulmen.jvp).

A JVP rule gets `dot` (a tensor's tangent, None when it is zero), then the call's arguments and keyword arguments,
and returns the call's outputs and their tangents (same structure, None for zero):

    @register_jvp(prims.mul)
    def _mul(dot, args, kwargs):
        a, b = args
        y = prims.mul(a, b)
        return y, add_tangents(dot(a) * b if dot(a) is not None else None, ...)

Rules record with symbols and torch calls on the proxies, as grad rules do. A call none of whose inputs has a
tangent is copied as it is; a symbol without a rule is differentiated through its decomposition; a leaf without
either runs torch's own forward-mode AD on its callable (`impls.torch_jvp`), which also gives its outputs, so a
random draw happens once. Most rules come from the grad rules' formulas: an elementwise op's Jacobian is diagonal,
so its JVP applies the VJP formula to the tangent; a linear op's JVP is the op applied to the tangents.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fulmen.core import pytree
from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Symbol, Tag, iter_proxies, map_proxies
from fulmen.core.trace import TraceBuilder
from fulmen.ops import impls, prims
from fulmen.ops.registry import impl_symbol, rule_registrar
from fulmen.transforms.inline import Emitter
from fulmen.transforms.recording import run_recorded

Dot = Callable[[Any], TensorProxy | None]
JvpRule = Callable[[Dot, tuple, dict], tuple[Any, Any]]

# symbol -> rule (fulmen.transforms.jvp_rules fills it).
JVP_RULES: dict[Symbol, JvpRule] = {}

TORCH_JVP = impl_symbol(impls.torch_jvp)


# @register_jvp(target): the decorated function is the JVP rule of `target` (a symbol or a torch callable).
register_jvp = rule_registrar(JVP_RULES, "a JVP rule")


def differentiable(x: Any) -> bool:
    return type(x) is TensorProxy and (x.dtype.is_floating_point or x.dtype.is_complex)


def zeros_like(x: TensorProxy) -> TensorProxy:
    return prims.full(tuple(x.shape), 0, dtype=x.dtype, device=x.device)


def add_tangents(*tangents: TensorProxy | None) -> TensorProxy | None:
    """The sum of the nonzero tangents (None when all are zero)."""
    present = [t for t in tangents if t is not None]
    if not present:
        return None
    total = present[0]
    for t in present[1:]:
        total = total + t
    return total


class JvpTransform:
    """Writes the JVP of source calls into `builder`: their primal outputs and, where nonzero, their tangents.

    `env` maps the source's names to the target's values; `tangents` maps target values' names to their tangents.
    """

    def __init__(self, builder: TraceBuilder, interpreter: Any, env: dict[str, Any],
                 tangents: dict[str, TensorProxy]) -> None:
        self.builder = builder
        self.interpreter = interpreter
        self.emitter = Emitter(builder, env)
        self.tangents = dict(tangents)
        self.fallbacks: list[str] = []  # the symbols that went through torch's forward-mode AD

    def dot(self, x: Any) -> TensorProxy | None:
        return self.tangents.get(x.pname) if type(x) is TensorProxy else None

    def run(self, bsyms: list[BoundSymbol]) -> None:
        for bsym in bsyms:
            self.call(bsym)

    def call(self, bsym: BoundSymbol) -> None:
        args, kwargs = self.emitter.read(bsym.args), self.emitter.read(bsym.kwargs)
        with_tangent = [p for p in iter_proxies((args, kwargs)) if p.pname in self.tangents]
        # a NO_GRAD symbol (detach) gives no tangent: forward-mode AD does not pass through it either
        if not with_tangent or bsym.sym.tags & Tag.NO_GRAD or not any(differentiable(o) for o in bsym.proxy_outputs()):
            self.emitter.emit(bsym)
            return
        if bsym.sym.tags & Tag.IMPURE:
            raise TraceError(f"fulmen.jvp cannot differentiate {bsym.sym.printed}: it writes into a tensor",
                             bsym.source)
        rule = JVP_RULES.get(bsym.sym)
        if rule is not None and self._apply(bsym, lambda: rule(self.dot, args, kwargs)):
            return
        if bsym.subsymbols and not bsym.draws_random():
            self.run(bsym.subsymbols)
        else:
            self.fallbacks.append(bsym.sym.printed)
            self._apply(bsym, lambda: self._torch_jvp(bsym, args, kwargs))

    def _apply(self, bsym: BoundSymbol, run: Callable[[], Any]) -> bool:
        """Runs a rule for `bsym` and maps its outputs and tangents; False when the rule declines."""
        result = run_recorded(run, self.builder, self.interpreter, bsym.source)
        if result is NotImplemented:
            return False
        out, out_tangents = result
        sources, outputs = bsym.proxy_outputs(), list(iter_proxies(out))
        flat_tangents = _flat_tangents(out, out_tangents)
        if len(outputs) != len(sources):
            raise TraceError(f"the JVP rule of {bsym.sym.printed} returned {len(outputs)} tensors, the symbol gives "
                             f"{len(sources)}", bsym.source)
        for source, value, tangent in zip(sources, outputs, flat_tangents):
            if (tuple(value.shape), value.dtype) != (tuple(source.shape), source.dtype):
                raise TraceError(f"the JVP rule of {bsym.sym.printed} computed {value.type_string()} where the "
                                 f"symbol gives {source.type_string()}", bsym.source)
            self.emitter.env[source.pname] = value
            if tangent is None or not differentiable(value):
                continue
            if (tuple(tangent.shape), tangent.dtype) != (tuple(value.shape), value.dtype):
                raise TraceError(f"the JVP rule of {bsym.sym.printed} gave a tangent of {tangent.type_string()} for "
                                 f"an output of {value.type_string()}", bsym.source)
            self.tangents[value.pname] = tangent
        return True

    def _torch_jvp(self, bsym: BoundSymbol, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        tangents = tuple(self.dot(p) for p in iter_proxies((args, kwargs)))
        out = map_proxies(bsym.output, lambda p: self.builder.make_proxy(p.meta, p.device))
        floating = [p for p in iter_proxies(out) if differentiable(p)]
        tangent_outs = tuple(self.builder.make_proxy(p.meta, p.device) for p in floating)
        self.builder.scopes[-1].append(BoundSymbol(TORCH_JVP, (bsym.sym, args, kwargs, tangents), {},
                                                   (out, tangent_outs), [], bsym.source))
        by_name = {p.pname: t for p, t in zip(floating, tangent_outs)}
        return out, map_proxies(out, lambda p: by_name.get(p.pname))


def _flat_tangents(out: Any, tangents: Any) -> list[TensorProxy | None]:
    """The tangents in the order of `out`'s proxies (`tangents` has `out`'s structure, None for zero tangents)."""
    by_path = dict(pytree.leaves_with_paths(tangents, _is_proxy))
    return [by_path.get(path) for path, _ in pytree.leaves_with_paths(out, _is_proxy)]


def _is_proxy(obj: Any) -> bool:
    return type(obj) is TensorProxy
