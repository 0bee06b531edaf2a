"""Guard fuzz: small programs, each called with one property changed at a time, compared with eager on every call.

Each family is a jitted program and its eager twin (the same function, or a deep copy of the same module) plus a
list of changes: properties of the tensor inputs (shape, dtype, requires_grad, layout, aliasing), the calling
context (no_grad, inference_mode, autocast), Python scalars (-0.0, nan, inf, int, bool), and the Python state the
program reads (globals, closure cells, object and class attributes, module attributes, submodules, hooks,
ModuleLists). For every change: apply it, call twice, undo it, call again. Every call compares the outputs, every
input after the call (in-place updates), the module states and, when something requires grad, the grads of the
inputs and parameters. A change must retrace once and the repeated call must hit; undoing it must hit the trace made
before it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

import fulmen
from fulmen.jit.jitted_module import core as jitted_core

OPTIONS = fulmen.JitOptions(cache_limit=64)  # the fuzz checks every retrace, not the limit


@dataclass
class Change:
    name: str
    args: Callable[[], tuple] | None = None  # other inputs for this call
    context: Callable[[], Any] = contextlib.nullcontext
    apply: Callable[[], None] | None = None  # changes Python state both programs read
    undo: Callable[[], None] | None = None


@dataclass
class Family:
    name: str
    jitted: Callable[..., Any]
    eager: Callable[..., Any]
    args: Callable[[], tuple]
    changes: list[Change]
    modules: tuple[nn.Module, nn.Module] | None = None  # (the jitted one's, the eager one's)
    jit: Any = None  # what fulmen.jit returned, when `jitted` wraps it


@dataclass
class Tally:
    calls: int = 0
    mismatches: list[str] = field(default_factory=list)


def _leaves(obj: Any) -> list[Any]:
    return tree_flatten(obj)[0]


def _compare(what: str, got: Any, want: Any, problems: list[str]) -> None:
    got_leaves, want_leaves = _leaves(got), _leaves(want)
    if len(got_leaves) != len(want_leaves):
        problems.append(f"{what}: {len(got_leaves)} leaves, eager {len(want_leaves)}")
        return
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
                problems.append(f"{what}[{i}]: {type(g).__name__} {getattr(g, 'shape', '')}, eager {w.shape} {w.dtype}")
            elif not torch.allclose(g.detach().double(), w.detach().double(), rtol=1e-5, atol=1e-5, equal_nan=True):
                problems.append(f"{what}[{i}]: values differ from eager")
        elif g != w and not (g != g and w != w):
            problems.append(f"{what}[{i}]: {g!r}, eager {w!r}")


def _grad_leaves(args: tuple, module: nn.Module | None) -> list[torch.Tensor]:
    leaves = [t for t in _leaves(args) if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad]
    return leaves + (list(module.parameters()) if module is not None else [])


def _call(family: Family, change: Change, tally: Tally, label: str) -> bool:
    """One call of both programs on equal, independent inputs; records every difference from eager. True when the
    call ran (an error eager raises as well is the expected result too, but there is no trace to reuse then)."""
    make = change.args or family.args
    args_j, args_e = make(), make()
    module_j, module_e = family.modules or (None, None)
    results = []
    for fn, args in ((family.jitted, args_j), (family.eager, args_e)):
        with change.context():
            try:
                results.append((fn(*args), None))
            except Exception as error:  # noqa: BLE001 - an error eager raises too is the expected result
                results.append((None, error))
    tally.calls += 1
    (out_j, err_j), (out_e, err_e) = results
    problems: list[str] = []
    if (err_j is None) != (err_e is None):
        problems.append(f"jitted raised {err_j!r}" if err_j is not None else f"eager raised {err_e!r}, jitted did not")
    elif err_j is None:
        _compare("output", out_j, out_e, problems)
        _compare("inputs after the call", args_j, args_e, problems)
        if module_j is not None:
            _compare("module state", list(module_j.state_dict().values()), list(module_e.state_dict().values()),
                     problems)
        differentiable = [o for o in _leaves(out_e) if isinstance(o, torch.Tensor) and o.requires_grad]
        if differentiable:
            for out in (out_j, out_e):
                outs = [o for o in _leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
                sum((o.float() * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in outs).backward()
            grads_j = [t.grad for t in _grad_leaves(args_j, module_j)]
            grads_e = [t.grad for t in _grad_leaves(args_e, module_e)]
            _compare("grads", grads_j, grads_e, problems)
            for module in (module_j, module_e):
                if module is not None:
                    module.zero_grad(set_to_none=True)
    tally.mismatches.extend(f"{family.name} / {label}: {p}" for p in problems)
    return err_j is None


def _run(family: Family, tally: Tally) -> None:
    base = Change("base")
    _call(family, base, tally, "base")
    _call(family, base, tally, "base again")
    core = jitted_core(family.jit or family.jitted)
    if core.stats.misses != 1:
        tally.mismatches.append(f"{family.name}: an identical call retraced ({core.last_miss_reasons})")
    for change in family.changes:
        if change.apply is not None:
            change.apply()
        ran = _call(family, change, tally, change.name)
        misses = core.stats.misses
        _call(family, change, tally, change.name + " (again)")
        if ran and core.stats.misses != misses:
            tally.mismatches.append(f"{family.name} / {change.name}: the repeated call retraced "
                                    f"({core.last_miss_reasons})")
        if change.undo is not None:
            change.undo()
        misses = core.stats.misses
        _call(family, base, tally, f"base after {change.name}")
        if core.stats.misses != misses:
            tally.mismatches.append(f"{family.name} / {change.name}: undoing it retraced ({core.last_miss_reasons})")


# --- input and context changes ---------------------------------------------------------------------------------------
def _tensor(*shape: int, dtype: torch.dtype = torch.float32, requires_grad: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(shape) * 7 + len(shape))
    t = torch.randn(*shape, generator=generator).to(dtype)
    return t.requires_grad_() if requires_grad else t


def input_changes(shape: tuple[int, ...], *, grad: bool = True, autocast: bool = True) -> list[Change]:
    """The tensor property changes for a program of one tensor `x` of `shape` (2-D or 4-D)."""
    transposed = (lambda: (_tensor(*shape[::-1]).t(),)) if len(shape) == 2 else \
        (lambda: (_tensor(*shape).transpose(2, 3).contiguous().transpose(2, 3),))
    changes = [
        Change("shape", lambda: (_tensor(*(s + 1 for s in shape)),)),
        Change("dtype float64", lambda: (_tensor(*shape, dtype=torch.float64),)),
        Change("transposed (strides)", transposed),
        Change("sliced (storage offset, strides)", lambda: (_tensor(*(s * 2 for s in shape))[tuple(
            slice(1, s + 1) for s in shape)],)),
        Change("expanded (zero stride)", lambda: (_tensor(*shape[:-1], 1).expand(shape),)),
        Change("no_grad", context=torch.no_grad),
        Change("inference_mode", context=torch.inference_mode),
    ]
    if len(shape) == 4:
        changes.append(Change("channels_last", lambda: (_tensor(*shape).to(memory_format=torch.channels_last),)))
    if grad:
        changes.append(Change("requires_grad", lambda: (_tensor(*shape, requires_grad=True),)))
    if autocast:
        changes.append(Change("autocast bf16", context=lambda: torch.autocast("cpu", dtype=torch.bfloat16)))
    return changes


def function_family(name: str, fn: Callable[..., Any], args: Callable[[], tuple], changes: list[Change]) -> Family:
    return Family(name, fulmen.jit(fn, options=OPTIONS), fn, args, changes)


def module_family(name: str, module: nn.Module, args: Callable[[], tuple],
                  changes: Callable[[nn.Module, nn.Module], list[Change]]) -> Family:
    twin = copy.deepcopy(module)
    return Family(name, fulmen.jit(module, options=OPTIONS), twin, args, changes(module, twin), (module, twin))


# --- the families --------------------------------------------------------------------------------------------------
def x2() -> tuple:
    return (_tensor(3, 4),)


def reads_layout(x):
    y = x * x.stride(0) + x.storage_offset()
    return y * 2 if x.is_contiguous() else y * 3


def reshape_then_update(x):
    y = x.reshape(-1)
    y.add_(1)  # a view of x when x is contiguous, a copy otherwise
    return x.sum() + y.sum()


def contiguous_then_update(x):
    y = x.contiguous()
    y.mul_(0)  # x itself when contiguous
    return y + 1


def flatten_then_view(x):
    return x.flatten(1).view(x.shape[0], -1).sum(1)


SCALE = 1.0
OFFSET = torch.ones(4)
ACTIVATIONS = {"act": torch.tanh}


def reads_globals(x):
    return ACTIVATIONS["act"](x * SCALE + OFFSET)


def set_global(name: str, value: Any) -> Callable[[], None]:
    return lambda: globals().__setitem__(name, value)


def divide(x, a):
    return x / a, x * a


def scalar_changes() -> list[Change]:
    return [Change(name, lambda v=v: (_tensor(3, 4), v)) for name, v in
            [("-0.0", -0.0), ("0.0", 0.0), ("nan", float("nan")), ("inf", float("inf")), ("int 2", 2),
             ("bool", True), ("2.5", 2.5)]]


def closure_family() -> Family:
    factor = 2.0
    weights = [1.0, 3.0]
    table = {"shift": 0.5}

    def program(x):
        for w in weights:
            x = x * w
        return x * factor + table["shift"]

    def set_factor(value: float) -> Callable[[], None]:
        def apply() -> None:
            nonlocal factor
            factor = value
        return apply

    changes = [
        Change("nonlocal rebound", apply=set_factor(-1.0), undo=set_factor(2.0)),
        Change("closure list appended", apply=lambda: weights.append(5.0), undo=weights.pop),
        Change("closure list item", apply=lambda: weights.__setitem__(0, 4.0),
               undo=lambda: weights.__setitem__(0, 1.0)),
        Change("closure dict value", apply=lambda: table.__setitem__("shift", -0.0),
               undo=lambda: table.__setitem__("shift", 0.5)),
    ]
    return function_family("closure", program, x2, changes)


class Inner:
    def __init__(self) -> None:
        self.t = 1.0


class Config:
    bias = 0.0  # class attributes, read through an instance and through the class
    offset = 0.0

    def __init__(self) -> None:
        self.s = 2.0
        self.inner = Inner()
        self.mode = "mul"

    @property
    def doubled(self) -> float:
        return self.s * 2


class Slotted:
    __slots__ = ("k",)

    def __init__(self) -> None:
        self.k = 3.0


CONFIG, SLOTTED = Config(), Slotted()


def reads_objects(x, cfg):
    y = x * cfg.s + cfg.inner.t + cfg.bias + cfg.doubled + getattr(cfg, "extra", 0.0) + SLOTTED.k + Config.offset
    return y * 2 if cfg.mode == "mul" else y + 2


def set_attr(obj: Any, name: str, value: Any) -> Callable[[], None]:
    return lambda: setattr(obj, name, value)


def object_changes() -> list[Change]:
    def attr(name: str, obj: Any, attribute: str, value: Any) -> Change:
        old = getattr(obj, attribute)
        return Change(name, apply=set_attr(obj, attribute, value), undo=set_attr(obj, attribute, old))

    return [
        attr("argument attribute", CONFIG, "s", 5.0),
        attr("nested attribute", CONFIG.inner, "t", -2.0),
        attr("class attribute", Config, "bias", 1.5),
        attr("class attribute read on the class", Config, "offset", -1.0),
        attr("string attribute", CONFIG, "mode", "add"),
        attr("slot", SLOTTED, "k", -3.0),
        Change("attribute getattr finds", apply=set_attr(CONFIG, "extra", 7.0),
               undo=lambda: delattr(CONFIG, "extra")),
        Change("instance attribute shadows the class's", apply=set_attr(CONFIG, "bias", 9.0),
               undo=lambda: delattr(CONFIG, "bias")),
    ]


class Parts:
    def __init__(self) -> None:
        self.items = [Inner(), Inner()]

    @property
    def first(self) -> Inner:
        return self.items[0]

    def last(self) -> Inner:
        return self.items[-1]


PARTS, INNER = Parts(), Inner()


def current_inner() -> Inner:
    return INNER


def reads_unnamed(x):  # reads off values no variable names: results of calls and getters, items at variable keys
    y = x * PARTS.first.t + PARTS.last().t + current_inner().t
    for i in range(2):
        y = y + PARTS.items[i].t * (i + 1)
    return y


def unnamed_changes() -> list[Change]:
    first, last, replacement = PARTS.items[0], PARTS.items[1], Inner()
    replacement.t = -4.0
    return [
        Change("a property's result", apply=set_attr(first, "t", 4.0), undo=set_attr(first, "t", 1.0)),
        Change("a method's result and a variable index's item", apply=set_attr(last, "t", -1.0),
               undo=set_attr(last, "t", 1.0)),
        Change("a function's result", apply=set_attr(INNER, "t", 6.0), undo=set_attr(INNER, "t", 1.0)),
        Change("the item at a variable index replaced", apply=lambda: PARTS.items.__setitem__(1, replacement),
               undo=lambda: PARTS.items.__setitem__(1, last)),
    ]


def updates_first(x, y):
    x.add_(1)
    return y * 2


def alias_changes() -> list[Change]:
    def same() -> tuple:
        a = _tensor(4)
        return (a, a)

    def overlapping() -> tuple:
        base = _tensor(6)
        return (base[0:4], base[1:5])

    def disjoint() -> tuple:
        base = _tensor(8)
        return (base[0:4], base[4:8])

    def strided() -> tuple:
        base = _tensor(8)
        return (base[0::2], base[1::2])

    return [Change("same tensor twice", same), Change("overlapping views", overlapping),
            Change("disjoint views of one storage", disjoint), Change("interleaved views", strided)]


class Net(nn.Module):
    def __init__(self, buffers_updated: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.norm = nn.BatchNorm1d(4) if buffers_updated else nn.LayerNorm(4)
        self.buffers_updated = buffers_updated
        self.blocks = nn.ModuleList([nn.Linear(4, 4)])
        self.register_buffer("calls", torch.zeros(()))
        self.scale_out = True
        self.dims = (1,)
        self.out_dtype = torch.float32
        self.coeffs = {"a": 1.0}

    def forward(self, x):
        if self.buffers_updated:
            self.calls.add_(1)
        y = self.norm(self.act(self.fc(x)))
        for block in self.blocks:
            y = y + block(y)
        y = y * self.coeffs["a"]
        if self.scale_out:
            y = y * 2
        return y.sum(self.dims).to(self.out_dtype)


def module_changes(a: nn.Module, b: nn.Module) -> list[Change]:
    def on_both(name: str, apply: Callable[[nn.Module], Any], undo: Callable[[nn.Module, Any], None]) -> Change:
        saved: list[Any] = []
        return Change(name, apply=lambda: saved.extend([apply(a), apply(b)]),
                      undo=lambda: (undo(a, saved[0]), undo(b, saved[1]), saved.clear()))

    def setting(name: str, attribute: str, value: Any) -> Change:
        return on_both(name, lambda m: (getattr(m, attribute), setattr(m, attribute, value))[0],
                       lambda m, old: setattr(m, attribute, old))

    extra = nn.Linear(4, 4)
    return [
        on_both("eval()", lambda m: m.eval(), lambda m, _: m.train()),
        setting("plain attribute", "scale_out", False),
        setting("tuple attribute", "dims", (0,)),
        setting("dtype attribute", "out_dtype", torch.float64),
        setting("submodule swapped", "act", nn.Tanh()),
        on_both("dict attribute value", lambda m: m.coeffs.__setitem__("a", 3.0),
                lambda m, _: m.coeffs.__setitem__("a", 1.0)),
        on_both("forward hook", lambda m: m.register_forward_hook(lambda mod, inp, out: out * 10),
                lambda m, handle: handle.remove()),
        on_both("forward pre-hook on a submodule", lambda m: m.fc.register_forward_pre_hook(
            lambda mod, inp: (inp[0] + 1,)), lambda m, handle: handle.remove()),
        on_both("ModuleList.append", lambda m: m.blocks.append(copy.deepcopy(extra)), lambda m, _: m.blocks.pop(-1)),
        on_both("del ModuleList[0]", lambda m: (m.blocks[0], m.blocks.__delitem__(0))[0],
                lambda m, old: m.blocks.insert(0, old)),
        on_both("parameter frozen", lambda m: m.fc.weight.requires_grad_(False),
                lambda m, _: m.fc.weight.requires_grad_(True)),
        Change("input shape", lambda: (_tensor(5, 4),)),
        Change("input requires grad", lambda: (_tensor(3, 4, requires_grad=True),)),
        Change("no_grad", context=torch.no_grad),
    ]


def called_module_family() -> Family:
    """A module the jitted function receives as an argument: no shadow, its state read through the frames (its
    tensors are captured, so the program updates none in place: fulmen refuses that for captured tensors)."""
    module = Net(buffers_updated=False)
    twin = copy.deepcopy(module)

    def call(m, x):
        return m(x) * 2

    jitted = fulmen.jit(call, options=OPTIONS)
    return Family("module as an argument", lambda x: jitted(module, x), lambda x: call(twin, x), x2,
                  module_changes(module, twin), (module, twin), jitted)


def families() -> list[Family]:
    globals().update(SCALE=1.0, OFFSET=torch.ones(4), ACTIVATIONS={"act": torch.tanh})
    torch.manual_seed(0)
    global_changes = [
        Change("global scalar", apply=set_global("SCALE", 2.0), undo=set_global("SCALE", 1.0)),
        Change("global -0.0", apply=set_global("SCALE", -0.0), undo=set_global("SCALE", 1.0)),
        Change("global int", apply=set_global("SCALE", 1), undo=set_global("SCALE", 1.0)),
        Change("global tensor rebound", apply=set_global("OFFSET", torch.full((4,), 3.0)),
               undo=set_global("OFFSET", OFFSET)),
        Change("global dict value", apply=lambda: ACTIVATIONS.__setitem__("act", torch.sigmoid),
               undo=lambda: ACTIVATIONS.__setitem__("act", torch.tanh)),
    ]
    return [
        function_family("layout reads", reads_layout, x2, input_changes((3, 4))),
        function_family("reshape then update", reshape_then_update, x2, input_changes((3, 4), grad=False)),
        function_family("contiguous then update", contiguous_then_update, x2, input_changes((3, 4), grad=False)),
        function_family("flatten then view", flatten_then_view, lambda: (_tensor(2, 3, 4, 5),),
                        input_changes((2, 3, 4, 5))),
        function_family("globals", reads_globals, x2, global_changes + input_changes((3, 4))),
        function_family("scalars", divide, lambda: (_tensor(3, 4), 1.0), scalar_changes()),
        closure_family(),
        function_family("objects", reads_objects, lambda: (_tensor(3, 4), CONFIG), object_changes()),
        function_family("unnamed reads", reads_unnamed, x2, unnamed_changes()),
        function_family("aliased inputs", updates_first, lambda: (_tensor(4), _tensor(4) + 1), alias_changes()),
        module_family("module state", Net(), x2, module_changes),
        called_module_family(),
    ]


def test_guard_fuzz(summary):
    tally = Tally()
    for family in families():
        _run(family, tally)
    summary(f"guard fuzz: {tally.calls} calls compared with eager, {len(tally.mismatches)} mismatches")
    assert not tally.mismatches, "\n".join(tally.mismatches)
