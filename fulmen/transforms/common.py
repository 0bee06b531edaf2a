"""Dead-code elimination, common-subexpression elimination and `del` after last use, and the Transforms that run
them in fulmen.jit's pipeline (fulmen.jit.pipeline)."""

from __future__ import annotations

from typing import Any

from fulmen.core.codegen import register_printer, render
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Symbol, Tag, iter_proxies, map_proxies
from fulmen.core.trace import Trace
from fulmen.transforms.transform import CleanupPass, GradTraces, TraceKind, Transform


def _keeps(bsym: BoundSymbol) -> bool:
    return bool(bsym.sym.tags & (Tag.IMPURE | Tag.RANDOM))


def dce(trace: Trace) -> Trace:
    """Drops bound symbols whose outputs nothing uses (side effects and RNG draws stay)."""
    needed = {p.pname for p in iter_proxies(trace.output)}
    kept: list[BoundSymbol] = []
    for bsym in reversed(trace.bound_symbols):
        if _keeps(bsym) or any(name in needed for name in bsym.output_names()):
            kept.append(bsym)
            needed.update(bsym.arg_names())
    kept.reverse()
    return trace.from_trace("Dead Code Elimination", bound_symbols=kept)


def _key(bsym: BoundSymbol, differentiated: bool) -> str | None:
    # A call whose outputs require grad stays: merged, the two values' grads would be summed before its backward
    # runs (in its output's dtype: a bfloat16 cast of a float32 value sums them in bfloat16) where eager runs the
    # backward of each call and sums at the input, so grads would round differently. (autocast's cache, eager's one
    # shared conversion, is modelled when acquiring: fulmen.transforms.autocast.CastCache.)
    if differentiated and any(p.requires_grad for p in bsym.proxy_outputs()):
        return None
    try:
        return f"{bsym.sym.printed}|{render(bsym.args)}|{render(bsym.kwargs)}"
    except TypeError:
        return None


def cse(trace: Trace, differentiated: bool = True) -> Trace:
    """Reuses the outputs of an identical earlier call (same symbol, same arguments) whose outputs do not require
    grad, or of any identical earlier call where the trace is not `differentiated`: a backward, whose values carry
    the forward's requires_grad but which nothing differentiates (fulmen refuses double backward)."""
    seen: dict[str, BoundSymbol] = {}
    renames: dict[str, TensorProxy] = {}
    roots = _memory_roots(trace)
    returned = {roots.get(p.pname) for p in iter_proxies(trace.output)}

    def rename(proxy: TensorProxy) -> TensorProxy:
        return renames.get(proxy.pname, proxy)

    kept: list[BoundSymbol] = []
    for bsym in trace.bound_symbols:
        if renames:
            bsym = bsym.with_args_mapped(rename)
        key = None if _keeps(bsym) else _key(bsym, differentiated)
        earlier = seen.get(key) if key is not None else None
        if earlier is not None and not _merges_returned_memory(bsym, earlier, roots, returned):
            for mine, theirs in zip(bsym.proxy_outputs(), earlier.proxy_outputs()):
                renames[mine.pname] = theirs
            continue
        if key is not None:
            seen[key] = bsym
        kept.append(bsym)
    output = map_proxies(trace.output, rename)
    return trace.from_trace("Common Subexpression Elimination", bound_symbols=kept, output=output)


# Symbols whose output shares its argument's memory though its meta tensor is no view of the argument's.
_ALIASING = frozenset({"detach", "alias"})


def _memory_roots(trace: Trace) -> dict[str, str]:
    """For each tensor, the tensor whose memory it is (itself, or what a view or detach of it was taken from)."""
    roots = {p.pname: p.pname for p in trace.inputs if type(p) is TensorProxy}
    for bsym in trace.bound_symbols:
        args = bsym.proxy_args()
        for out in bsym.proxy_outputs():
            aliases = args and type(out) is TensorProxy and (out.meta._is_view() or bsym.sym.name in _ALIASING)
            roots[out.pname] = roots.get(args[0].pname, args[0].pname) if aliases else out.pname
    return roots


def _merges_returned_memory(bsym: BoundSymbol, earlier: BoundSymbol, roots: dict[str, str], returned: set) -> bool:
    """Whether reusing `earlier`'s outputs for `bsym`'s would make two returned tensors share memory that eager
    allocates twice (`a.clone().reshape(-1)` and `a.clone().detach()` both returned were one storage)."""
    return any(roots.get(mine.pname) in returned and roots.get(theirs.pname) in returned
               and roots.get(mine.pname) != roots.get(theirs.pname)
               for mine, theirs in zip(bsym.proxy_outputs(), earlier.proxy_outputs()))


def _del_impl(*args: Any) -> None:  # pragma: no cover - printed as a `del` statement, never called
    raise AssertionError("del is printed, not called")


DEL = Symbol(name="del", printed="del", impl=_del_impl, tags=Tag.IMPURE)
register_printer(DEL, lambda bsym: "del " + ", ".join(p.pname for p in bsym.args))


def delete_last_used(trace: Trace) -> Trace:
    """Inserts `del` right after each value's last use, so the generated code frees memory as early as eager."""
    outputs = {p.pname for p in iter_proxies(trace.output)}
    seen: set[str] = set(outputs)
    result: list[BoundSymbol] = []
    for bsym in reversed(trace.bound_symbols):
        dead = []
        for proxy in bsym.proxy_args() + bsym.proxy_outputs():
            if proxy.pname not in seen:
                seen.add(proxy.pname)
                dead.append(proxy)
        if dead:
            result.append(BoundSymbol(DEL, tuple(dead), {}, None))
        result.append(bsym)
    unused_inputs = [p for p in trace.inputs if p.pname not in seen]
    result.reverse()
    if unused_inputs:
        result.insert(0, BoundSymbol(DEL, tuple(unused_inputs), {}, None))
    return trace.from_trace("Delete Last Used", bound_symbols=result)


# --- as pipeline passes -------------------------------------------------------------------------------------------
class DeadCodeElimination(CleanupPass):
    """`dce` of the acquired program (stage ACQUIRED) and of each backward autodiff builds (stage GRAD)."""

    title = "Dead Code Elimination"

    def run(self, trace: Trace) -> Trace:
        return dce(trace)


class CommonSubexpressionElimination(CleanupPass):
    """`cse` of the acquired program (stage ACQUIRED, with JitOptions.cse) and of each backward (stage GRAD)."""

    title = "Common Subexpression Elimination"

    def run(self, trace: Trace) -> Trace:
        return cse(trace)

    def transform_backward(self, traces: GradTraces) -> Trace:
        return cse(traces.backward, differentiated=False)


class DeleteLastUsed(Transform):
    """`delete_last_used` of each trace that runs (stage CODEGEN)."""

    @property
    def name(self) -> str:
        return "Delete Last Used"

    def transform_codegen(self, trace: Trace, kind: TraceKind, returned: int) -> Trace:
        return delete_last_used(trace)
