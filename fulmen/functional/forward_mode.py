"""Forward-mode autodiff on a trace: the transform that runs the JVP rules (fulmen.jvp).

The rules are the JVP table of fulmen.ops.rules.tables, written with fulmen.ops.rules.jvp (which says what a rule
gets and returns). A call none of whose inputs has a tangent is copied as it is; a symbol without a rule is
differentiated through its decomposition; a leaf without either runs torch's own forward-mode AD on its callable
(`impls.torch_jvp`), which also gives its outputs, so a random draw happens once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fulmen.core import pytree
from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Tag, iter_proxies, map_proxies
from fulmen.core.trace import TraceBuilder
from fulmen.ops.complex import complex_rule, complex_values, through_parts
from fulmen.ops.kernels import impls
from fulmen.ops.registry import impl_symbol
from fulmen.ops.rules.grad import differentiated_by_eager
from fulmen.ops.rules.jvp import differentiable
from fulmen.ops.rules.tables import RuleKind, rule
from fulmen.transforms.inline import Emitter
from fulmen.transforms.recording import run_recorded

TORCH_JVP = impl_symbol(impls.torch_jvp)
# a grad of a transformed program differentiates this call with eager's backward of the op it runs
differentiated_by_eager(TORCH_JVP)


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
        on_complex = bsym.sym.executor is None and complex_values(bsym, differentiable)
        # on complex values only rules that hold for them, else eager's forward-mode AD (fulmen.ops.complex)
        jvp = complex_rule(bsym, RuleKind.COMPLEX_JVP) if on_complex else rule(RuleKind.JVP, bsym.sym)
        if jvp is not None and self._apply(bsym, lambda: jvp(self.dot, args, kwargs)):
            return
        if through_parts(bsym, RuleKind.COMPLEX_JVP, differentiable) if on_complex else (
                bsym.subsymbols and not bsym.draws_random()):
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
