"""Printing traces as Python and compiling them.

The printed source is self-contained: it starts with the imports its callees need, so `exec` of
`trace.python()` in an empty namespace defines a function that computes what the trace computes.
"""

from __future__ import annotations

import itertools
import linecache
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import resolve_name

from fulmen.core import pytree, symbolic
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import IMPORTS, BoundSymbol, Symbol, iter_proxies
from fulmen.core.trace import CODEGEN, Trace, TracePrinter
from fulmen.core.verify import check_first_runs

# Custom printers: symbol -> (bsym, rendered outputs) -> the statement (without the type comment).
Printer = Callable[[BoundSymbol], str]
PRINTERS: dict[Symbol, Printer] = {}


def register_printer(sym: Symbol, printer: Printer) -> None:
    PRINTERS[sym] = printer


_MEMORY_FORMATS = {
    torch.contiguous_format: "torch.contiguous_format",
    torch.preserve_format: "torch.preserve_format",
    torch.channels_last: "torch.channels_last",
    torch.channels_last_3d: "torch.channels_last_3d",
}


def render(obj: Any) -> str:
    """Python source for a value appearing as an argument in a trace."""
    if type(obj) is TensorProxy:
        return obj.pname
    if isinstance(obj, symbolic.SYMBOLIC):  # a size the trace computes from its inputs' shapes (`4*s0`)
        return symbolic.python(obj)
    if obj is None or isinstance(obj, (bool, str)):
        return repr(obj)
    if isinstance(obj, int):
        return repr(int(obj))
    if isinstance(obj, float):
        if math.isfinite(obj):
            return repr(obj)
        return "float('nan')" if math.isnan(obj) else ("float('inf')" if obj > 0 else "-float('inf')")
    if isinstance(obj, complex):
        return f"complex({render(obj.real)}, {render(obj.imag)})"
    if isinstance(obj, torch.dtype):
        return str(obj)
    if isinstance(obj, torch.device):
        return f"torch.device({str(obj)!r})"
    if isinstance(obj, torch.memory_format):
        return _MEMORY_FORMATS[obj]
    if obj is Ellipsis:
        return "..."
    if isinstance(obj, slice):
        return f"slice({render(obj.start)}, {render(obj.stop)}, {render(obj.step)})"
    if isinstance(obj, torch.Size):
        obj = tuple(obj)
    if isinstance(obj, tuple):
        inner = ", ".join(render(item) for item in obj)
        return f"({inner},)" if len(obj) == 1 else f"({inner})"
    if isinstance(obj, list):
        return "[" + ", ".join(render(item) for item in obj) + "]"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{render(k)}: {render(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, torch.layout):
        return str(obj)
    if isinstance(obj, torch.nn.Module):
        # `self` of a replaced method (fulmen.extend): such calls are claimed or descend to their parts before a
        # trace runs, so the name only has to be readable and distinct per module (CSE must not merge modules).
        return f"module_{type(obj).__name__}_{id(obj):x}"
    if isinstance(obj, Symbol):  # a symbol passed as data (torch_vjp's function)
        return obj.printed
    if callable(obj) and resolve_name(obj) is not None:  # a torch callable passed as data (view_scatter's view)
        return resolve_name(obj)
    if callable(obj) and getattr(obj, "__module__", None) == "fulmen.ops.kernels.impls":  # one of fulmen's own views
        return f"impls.{obj.__name__}"
    raise TypeError(f"fulmen cannot print a value of type {type(obj).__name__} in a trace: {obj!r}")


def render_call(bsym: BoundSymbol) -> str:
    parts = [render(arg) for arg in bsym.args] + [f"{key}={render(value)}" for key, value in bsym.kwargs.items()]
    return f"{bsym.sym.printed}({', '.join(parts)})"


def _render_outputs(output: Any) -> str:
    if type(output) is TensorProxy:
        return output.pname
    if isinstance(output, (tuple, list)):
        inner = ", ".join(_render_outputs(item) for item in output)
        return f"({inner},)" if len(output) == 1 else f"({inner})"
    return "_"


def _type_comment(output: Any) -> str:
    proxies = list(iter_proxies(output))
    return "  # " + ", ".join(f'{p.pname}: "{p.type_string()}"' for p in proxies) if proxies else ""


def statement(bsym: BoundSymbol) -> str:
    printer = PRINTERS.get(bsym.sym)
    call = printer(bsym) if printer is not None else render_call(bsym)
    if printer is not None and call.startswith("del "):
        return call
    has_output = any(True for _ in iter_proxies(bsym.output))
    if not has_output:
        return call
    return f"{_render_outputs(bsym.output)} = {call}{_type_comment(bsym.output)}"


@dataclass(frozen=True, slots=True)
class PythonSource:
    source: str
    line_map: dict[int, BoundSymbol]  # source line number (1-based) -> the bound symbol printed there


def _imports(trace: Trace, print_depth: int) -> list[str]:
    roots: set[str] = {"torch"}

    def symbols_in(obj: Any) -> Iterator[Symbol]:
        return pytree.leaves(obj, lambda item: isinstance(item, Symbol))

    from_executors: dict[str, str] = {}

    def visit(bsyms: list[BoundSymbol], depth: int) -> None:
        for bsym in bsyms:
            if bsym.sym.executor is not None:
                from_executors[bsym.sym.printed] = bsym.sym.executor.name
            roots.add(bsym.sym.printed.split(".", 1)[0])
            roots.update(sym.printed.split(".", 1)[0] for sym in symbols_in(bsym.args))
            if depth > 0:
                visit(bsym.subsymbols, depth - 1)

    visit(trace.bound_symbols, print_depth)
    lines = sorted(IMPORTS[root] for root in roots if root in IMPORTS)
    return lines + [f"# {name}: from executor {owner!r}" for name, owner in sorted(from_executors.items())]


def trace_source(trace: Trace, print_depth: int = 0, include_sources: bool = True) -> PythonSource:
    lines = [f"# Constructed by {trace.provenance}", *_imports(trace, print_depth), ""]
    if trace.input_groups:
        lines.append(f"def {trace.name}({', '.join(name for name, _ in trace.input_groups)}):")
        position = 0
        for name, length in trace.input_groups:
            group = trace.inputs[position : position + length]
            position += length
            if group:
                lines.append(f"  {''.join(p.pname + ', ' for p in group)}= {name}")
            lines.append(f"  {name}.clear()")
    else:
        lines.append(f"def {trace.name}({', '.join(p.pname for p in trace.inputs)}):")
    for proxy in trace.inputs:
        lines.append(f'  # {proxy.pname}: "{proxy.type_string()}"')
    lines += [f"  {line}" for line in _size_bindings(trace)]
    line_map: dict[int, BoundSymbol] = {}
    last_source = None

    def emit(bsym: BoundSymbol, depth: int, indent: str, commented: bool) -> None:
        text = statement(bsym)
        lines.append(f"{indent}# {text}" if commented else f"{indent}{text}")
        if not commented:
            line_map[len(lines)] = bsym
        if depth > 0:
            for sub in bsym.subsymbols:
                emit(sub, depth - 1, indent + "  ", True)

    for bsym in trace.bound_symbols:
        if include_sources and bsym.source is not None and bsym.source != last_source:
            if last_source is None or (bsym.source.filename, bsym.source.lineno) != (
                last_source.filename,
                last_source.lineno,
            ):
                lines.append(f"  # {bsym.source.short()}: {bsym.source.line}")
            last_source = bsym.source
        emit(bsym, print_depth, "  ", False)
    lines.append(f"  return {render(tuple(trace.output))}")
    return PythonSource("\n".join(lines) + "\n", line_map)


def _size_bindings(trace: Trace) -> list[str]:
    """The statements binding the symbolic sizes the trace's statements use from its inputs' shapes (none for a
    trace of static shapes)."""
    if not any(symbolic.has_symbolic_sizes(p.meta) for p in trace.inputs):
        return []
    needed = symbolic.free_symbols([(b.args, b.kwargs) for b in trace.bound_symbols])
    needed |= symbolic.free_symbols(trace.output)
    return symbolic.size_bindings(trace.inputs, needed) if needed else []


_counter = itertools.count()


def compile_trace(trace: Trace) -> Callable[..., Any]:
    """Executes the printed trace and returns the function it defines."""
    printed = trace_source(trace, include_sources=False)
    source = printed.source
    filename = f"<fulmen trace {next(_counter)}: {trace.provenance}>"
    # Registered so tracebacks through the generated code show its lines.
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    # Executor symbols (custom operators, fusion regions) are not importable by name: they enter as globals.
    namespace: dict[str, Any] = {
        bsym.sym.printed: bsym.sym.impl for bsym in trace.bound_symbols if bsym.sym.executor is not None
    }
    check_first_runs(trace, printed.line_map, namespace)
    exec(compile(source, filename, "exec"), namespace)
    function = namespace[trace.name]
    # One entry per compiled trace: dropped with the function's code, which a traceback through it keeps alive as
    # long as the traceback needs its lines.
    weakref.finalize(function.__code__, linecache.cache.pop, filename, None)
    return function


def _source(trace: Trace, print_depth: int, include_sources: bool) -> str:
    return trace_source(trace, print_depth=print_depth, include_sources=include_sources).source


CODEGEN.register(TracePrinter(_source, compile_trace))
