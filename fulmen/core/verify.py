"""Checks of a trace's well-formedness (every value is defined once, before it is read) and of the first run of each
executor call against what the trace was built for."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fulmen.core import pytree
from fulmen.core.dtypes import short_name
from fulmen.core.errors import ExecutorContractError
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Tag, iter_proxies
from fulmen.core.symbolic import has_symbolic_sizes, known_true
from fulmen.core.trace import Trace


def trace_problems(trace: Trace) -> list[str]:
    """What is wrong with `trace` (empty when nothing): reads of undefined values, values defined twice."""
    problems: list[str] = []
    defined = {p.pname for p in trace.inputs}
    if len(defined) != len(trace.inputs):
        problems.append("two inputs have the same name")
    for position, bsym in enumerate(trace.bound_symbols):
        if bsym.sym.name == "del":  # frees its arguments (fulmen.transforms.common.DEL): no read
            continue
        for name in bsym.arg_names():
            if name not in defined:
                problems.append(f"line {position} ({bsym.sym.printed}) reads {name}, which is not defined before it")
        for name in bsym.output_names():
            if name in defined:
                problems.append(f"line {position} ({bsym.sym.printed}) defines {name} a second time")
            defined.add(name)
    for proxy in iter_proxies(trace.output):
        if proxy.pname not in defined:
            problems.append(f"the trace returns {proxy.pname}, which it never defines")
    return problems


# --- first runs of executor calls -----------------------------------------------------------------------------------
# A trace is built from what each executor symbol declares of its outputs (an operator's like=/meta=), and everything
# after the call relies on it: a conversion to the declared dtype is dropped as a no-op, a shape is baked into later
# calls, `.contiguous()` of a declared-contiguous value is dropped. A kernel that returns something else makes the
# trace silently wrong, and a kernel that writes into its arguments corrupts what the backward saved. A trace's shapes
# are fixed (its guards), so checking each call once, on the trace's first run, finds any such disagreement at a cost
# paid once per trace; later runs call the kernels directly.


@dataclass(frozen=True, slots=True)
class _Site:
    """One executor call of a trace, and which of its tensor arguments (in call order) the trace still needs after
    it: read by a later call, returned, held by the caller, or sharing memory with such a value (a view)."""

    bsym: BoundSymbol
    kept: tuple[bool, ...]


class _FirstRunCheck:
    """Stands in for an executor's callable in a compiled trace's globals until each of its calls has run once."""

    __slots__ = ("impl", "name", "namespace", "pending")

    def __init__(self, impl: Callable[..., Any], name: str, namespace: dict[str, Any],
                 pending: dict[int, _Site]) -> None:
        self.impl, self.name, self.namespace, self.pending = impl, name, namespace, pending

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The trace's calls are one per line: the caller's line says which call this is.
        site = self.pending.get(sys._getframe(1).f_lineno)
        if site is None:
            return self.impl(*args, **kwargs)
        bsym = site.bsym
        kernel = Tag.KERNEL in bsym.sym.tags
        arguments = list(pytree.leaves((args, kwargs), _is_tensor)) if kernel else []
        versions = [_version(t) for t in arguments]
        owner = bsym.sym.executor.name if bsym.sym.executor is not None else None
        try:
            result = self.impl(*args, **kwargs)
        except Exception as error:
            # the traceback ends in the kernel, called from a line of generated code: name the program's call (on
            # first runs only, where the check costs nothing more; a later run's failure goes without)
            if hasattr(error, "add_note"):  # Python 3.11
                where = f" at {bsym.source.describe()}" if bsym.source is not None else ""
                error.add_note(f"fulmen: raised by {bsym.sym.printed} (executor {owner!r}), run for the program's "
                               f"call{where}")
            raise
        # A layout the operator declares (like=/meta=) is its promise; one learnt by running fn on meta tensors
        # follows the arguments' layouts, which a fusion region before it may have chosen otherwise: not its fault.
        declared = kernel and bsym.sym.meta is not None
        problem = _output_problem(bsym.output, result, declared, "")
        if problem is None and kernel:
            problem = _argument_problem(arguments, versions, site.kept, result)
        if problem is not None:
            raise ExecutorContractError(f"{bsym.sym.printed} (executor {owner!r}) {problem}", bsym.source)
        for line in [line for line, other in self.pending.items() if other.bsym is bsym]:
            self.pending.pop(line, None)
        if not self.pending:
            self.namespace[self.name] = self.impl
        return result


def check_first_runs(trace: Trace, line_map: dict[int, BoundSymbol], namespace: dict[str, Any]) -> None:
    """Puts a `_FirstRunCheck` in `namespace` (a compiled trace's globals) for each executor callable `trace` calls."""
    lines = {id(bsym): line for line, bsym in line_map.items()}
    root: dict[str, str] = {}  # a view's name -> the value whose memory it shares
    last: dict[str, float] = {}  # a root -> the position of the last call reading it or a view of it
    for position, bsym in enumerate(trace.bound_symbols):
        if bsym.sym.name == "del":  # frees its arguments (fulmen.transforms.common.DEL): no read
            continue
        for name in bsym.arg_names():
            base = root.get(name, name)
            last[base] = max(last.get(base, -1), position)
        if bsym.sym.tags & Tag.VIEW and bsym.args and isinstance(bsym.args[0], TensorProxy):
            for name in bsym.output_names():
                root[name] = root.get(bsym.args[0].pname, bsym.args[0].pname)
    # a trace taking its inputs in groups (a backward) is handed them to free; otherwise the caller keeps them
    held = [*iter_proxies(trace.output), *([] if trace.input_groups else trace.inputs)]
    for proxy in held:
        last[root.get(proxy.pname, proxy.pname)] = math.inf
    sites: dict[str, dict[int, _Site]] = {}
    for position, bsym in enumerate(trace.bound_symbols):
        line = lines.get(id(bsym))
        if line is None or bsym.sym.executor is None or bsym.sym.printed not in namespace:
            continue
        kept = tuple(last.get(root.get(p.pname, p.pname), -1) > position
                     for p in pytree.leaves((bsym.args, bsym.kwargs), _is_tensor))
        sites.setdefault(bsym.sym.printed, {})[line] = _Site(bsym, kept)
    for name, pending in sites.items():
        namespace[name] = _FirstRunCheck(namespace[name], name, namespace, pending)


def _is_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor)


def _version(tensor: torch.Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version


def _storage(tensor: torch.Tensor) -> int:
    """The address of the memory a tensor lives in (0 for none: an empty tensor cannot alias anything)."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return 0
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage of its own
        return 0


def _output_problem(expected: Any, got: Any, declared: bool, where: str) -> str | None:
    """How the value a call returned differs from the output its trace was built for, or None."""
    if isinstance(expected, TensorProxy):
        at = f" as output{where}" if where else ""
        if not isinstance(got, torch.Tensor):
            return f"returned {_describe(got)}{at}, but the trace was built for a tensor {expected.type_string()}"
        want, have = _layout(expected), _layout(got)
        if has_symbolic_sizes(expected.meta):  # its symbolic sizes and strides stand for any value: not compared
            have = _as_wanted(want, have)
        # a 0-dim CPU tensor mixes with tensors of any device in torch's ops (sdpa's philox seed and offset are such
        # where the trace's device rule says the query's device)
        scalar = got.ndim == 0 and got.device.type == "cpu"
        if want[:2] != have[:2] or (want[2] != have[2] and not scalar):
            return (f"returned {_type_string(got)}{at}, but the trace was built for {expected.type_string()} "
                    "(its like=/meta= function, or its fn run on meta tensors, says so)")
        if declared and want[3] != have[3]:
            return (f"returned{at or ' its output'} with strides {tuple(got.stride())}, but the trace was built "
                    f"for strides {tuple(expected.stride())} (later calls rely on the layout: a .contiguous() of a "
                    "contiguous value is dropped); return a tensor of that layout (e.g. out.contiguous()), or declare "
                    "the layout in like= (a meta tensor), or register without like=/meta= so that fulmen runs fn on "
                    "meta tensors to learn it")
        return None
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            count = sum(1 for _ in iter_proxies(expected))
            return (f"returned {_describe(got)}{' as output' + where if where else ''}, but the trace was built for "
                    f"a {type(expected).__name__} of {len(expected)} ({count} tensors)")
        for index, (want, have) in enumerate(zip(expected, got)):
            problem = _output_problem(want, have, declared, f"{where}[{index}]")
            if problem is not None:
                return problem
    return None


def _argument_problem(arguments: list[torch.Tensor], versions: list[int | None], kept: tuple[bool, ...],
                      result: Any) -> str | None:
    """Whether a kernel wrote into a tensor argument the trace still needs, or returned memory of one; None if not.
    (A kernel may reuse an argument nothing reads after it, as Liger's cross-entropy backward scales its saved
    gradient in place.)"""
    for position, (tensor, before, needed) in enumerate(zip(arguments, versions, kept)):
        if needed and before is not None and tensor._version != before:
            return (f"modified its tensor argument {position} ({_type_string(tensor)}) in place, but the trace still "
                    "needs that value after the call (a later call reads it, it is saved for the backward, or the "
                    "caller holds it); an operator must be functional: compute into a new tensor (e.g. x.clone())")
    storages = {_storage(t): position for position, (t, needed) in enumerate(zip(arguments, kept)) if needed}
    storages.pop(0, None)
    for index, out in enumerate(pytree.leaves(result, _is_tensor)):
        position = storages.get(_storage(out))
        if position is not None:
            return (f"returned output {index} in the memory of its tensor argument {position}, which the trace "
                    "still needs after the call; an operator's outputs must be new tensors: fulmen treats them as "
                    "independent of the arguments, so an in-place op on either would change the other. Return a "
                    "copy (e.g. x.clone())")
    return None


def _layout(value: torch.Tensor) -> tuple:
    device = value.device
    # a dimension of size 1 can have any stride (eager's own kernels disagree there)
    # (a symbolic size is never 1, nor a symbolic tensor known to be empty: no guard is asked)
    strides = tuple(stride for size, stride in zip(value.shape, value.stride()) if type(size) is not int or size != 1)
    empty = value.numel() == 0 if type(value) is not TensorProxy else known_true(value.numel() == 0)
    return tuple(value.shape), value.dtype, (device.type, device.index or 0), strides if not empty else ()


def _as_wanted(want: tuple, have: tuple) -> tuple:
    """`have` (a real output's layout) with the sizes and strides that are symbolic in `want` taken from `want`, and
    `want`'s symbolic values as None: a comparison checks the static ones only."""
    def merge(wanted: tuple, had: tuple) -> tuple:
        if len(wanted) != len(had):
            return had
        return tuple(w if isinstance(w, torch.SymInt) else h for w, h in zip(wanted, had))

    return (merge(want[0], have[0]), have[1], have[2], merge(want[3], have[3]) if have[3] else have[3])


def _type_string(tensor: torch.Tensor) -> str:
    return f"{tensor.device} {short_name(tensor.dtype)}[{', '.join(str(s) for s in tensor.shape)}]"


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, torch.Tensor):
        return f"a tensor {_type_string(value)}"
    return f"{type(value).__name__} {value!r}"[:80]
