"""`fulmen.examine(fn, *args)`: which torch ops a program uses, which fulmen supports, and whether it traces."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from fulmen.acquisition.acquire import DATA_DEPENDENT, METADATA, Interpreter
from fulmen.core.errors import TraceError
from fulmen.core.trace import TraceBuilder
from fulmen.jit.jitted import JittedFunction
from fulmen.jit.jitted_module import JittedModule, core
from fulmen.ops import lookup
from fulmen.transforms.float8 import notes_of as float8_notes
from fulmen.transforms.fused_loss import PROVENANCE as FUSED_LOSS
from fulmen.transforms.remat import nbytes


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[Callable[..., Any]] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in METADATA:
            self.calls[func] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class ExamineReport:
    ops: dict[str, tuple[int, bool]] = field(default_factory=dict)  # torch op -> (calls, supported)
    error: str | None = None  # why acquisition failed, if it did
    # What the forward saves for the backward: (name, type, bytes), when inputs required grad.
    saved: list[tuple[str, str, int]] = field(default_factory=list)
    # Each cross-entropy: fused with the linear before it (fulmen.transforms.fused_loss) or why not.
    fused_losses: list[str] = field(default_factory=list)
    # With JitOptions.float8 (examine a jitted callable): each matmul, converted to float8 or kept, and why.
    float8: list[str] = field(default_factory=list)

    @property
    def saved_bytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self.saved)

    @property
    def unsupported(self) -> list[str]:
        return sorted(name for name, (_, ok) in self.ops.items() if not ok)

    def __str__(self) -> str:
        lines = [f"{'calls':>6}  {'supported':<9}  op"]
        for name, (count, ok) in sorted(self.ops.items()):
            lines.append(f"{count:>6}  {'yes' if ok else 'NO':<9}  {name}")
        lines.append(f"{len(self.ops)} ops, {len(self.unsupported)} unsupported")
        lines.append(f"acquisition: {'ok' if self.error is None else self.error}")
        lines.extend(f"linear + cross-entropy {note}" for note in self.fused_losses)
        lines.extend(f"float8: {note}" for note in self.float8)
        if self.saved:
            lines.append(f"saved for backward: {len(self.saved)} tensors, {self.saved_bytes} bytes")
            lines.extend(f"  {name}: {kind} ({nbytes} bytes)" for name, kind, nbytes in self.saved)
        return "\n".join(lines)


def _torch_name(func: Callable[..., Any]) -> str | None:
    """`torch.<name>` for a function of torch's namespace that torch.overrides does not name (`torch._is_all_true`)."""
    name = getattr(func, "__name__", None)
    return f"torch.{name}" if name is not None and getattr(torch, name, None) is func else None


def _supported(func: Callable[..., Any]) -> bool:
    if func in DATA_DEPENDENT:
        return False
    if lookup(func) is not None:
        return True
    return func in _SPECIAL_FUNCS


# The callables acquisition handles itself (conversions, setitem, copy_, ...), read off the interpreter.
_SPECIAL_FUNCS = frozenset(Interpreter(TraceBuilder()).special)


def examine(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> ExamineReport:
    """Runs `fn` eagerly, listing the torch ops it calls and whether fulmen supports them; then tries to jit it. `fn`
    may be the result of `fulmen.jit` (with its options, e.g. JitOptions.float8): its own function runs eagerly."""
    from fulmen import jit  # the public entry point sits above this module

    jitted = isinstance(fn, JittedFunction | JittedModule)
    eager = (fn.wrapped_module if isinstance(fn, JittedModule) else fn.__wrapped__) if jitted else fn
    recorder = _Recorder()
    with recorder:
        eager(*args, **kwargs)
    report = ExamineReport()
    for func, count in recorder.calls.items():
        name = resolve_name(func) or _torch_name(func) or repr(func)
        report.ops[name] = (count, _supported(func))
    compiled = fn if jitted else jit(fn)
    try:
        compiled(*args, **kwargs)
    except TraceError as error:
        report.error = str(error)
        return report
    entry = core(compiled).last_entry
    report.float8 = float8_notes(entry.traces)
    for trace in entry.traces:
        if trace.provenance.startswith(f"{FUSED_LOSS}: "):
            report.fused_losses = trace.provenance.removeprefix(f"{FUSED_LOSS}: ").split("; ")
    program = entry.program
    if program is not None:
        report.saved = [(p.pname, p.type_string(), nbytes(p)) for p in program.plan.saved]
    return report
