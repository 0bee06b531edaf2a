"""Program fuzz: small random programs, jitted and eager, compared on every observable.

A seeded generator writes programs of 5-15 statements over 2-4 input tensors (float32 and float64; contiguous,
transposed, sliced with a step, expanded; some requiring grad as leaves, some carrying an autograd history): unary
and binary elementwise ops with broadcasting, reductions, matmul, views of every kind, in-place updates of inputs,
of views of inputs and of intermediates, where, cat/stack, detach, clone, and several outputs (views of inputs, the
same tensor twice). Every statement is kept only when eager runs it, and a program only when eager also runs its
backward, so each program is a valid eager program. Each is then called twice (a trace, then a cache hit on new
values) under fulmen.jit and eagerly on equal, independent inputs, and compared: output values, dtypes, shapes,
strides, requires_grad, which outputs are an input or share an input's memory or each other's, the inputs after the
call (in-place updates), and the grads of the inputs (the outputs times seeded cotangents, backward). A FulmenError
is a refusal, counted by kind; anything else that differs is a mismatch, reported with the seed and the program's
source (replay one: `python tests/jit/test_program_fuzz.py SEED [torchcompile]`).
"""

from __future__ import annotations

import dataclasses
import linecache
import random
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import fulmen
from fulmen.core.errors import FulmenError

LAYOUTS = ("contiguous", "contiguous", "transposed", "sliced", "expanded")
GRADS = ("none", "none", "leaf", "history")  # no grad; a leaf that requires grad; a value with an autograd history
SHAPES = ((3, 4), (4,), (3, 1), (1, 4), (2, 3, 4), (4, 3), (3, 4), (4, 4), ())


@dataclass(frozen=True, slots=True)
class InputSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str
    grad: str


@dataclass(frozen=True, slots=True)
class Program:
    seed: int
    inputs: tuple[InputSpec, ...]
    body: tuple[str, ...]
    outputs: tuple[str, ...]

    def source(self) -> str:
        lines = [f"def program({', '.join(s.name for s in self.inputs)}):"]
        lines += [f"    {line}" for line in self.body]
        lines.append(f"    return ({', '.join(self.outputs)},)")
        return "\n".join(lines) + "\n"

    def describe(self) -> str:
        specs = ", ".join(f"{s.name}: {s.shape} {str(s.dtype)[6:]} {s.layout} grad={s.grad}" for s in self.inputs)
        return f"seed {self.seed} ({specs})\n{self.source()}"

    def function(self) -> Callable[..., tuple]:
        # A file name linecache knows, so fulmen's errors can quote the program's lines.
        filename = f"<program fuzz {self.seed}>"
        text = self.source()
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        namespace: dict[str, Any] = {"torch": torch}
        exec(compile(text, filename, "exec"), namespace)
        return namespace["program"]


# --- inputs --------------------------------------------------------------------------------------------------------
def _layout(base: Callable[[tuple[int, ...]], torch.Tensor], spec: InputSpec) -> torch.Tensor:
    shape = spec.shape
    if spec.layout == "transposed" and len(shape) >= 2:
        return base((*shape[:-2], shape[-1], shape[-2])).transpose(-1, -2)
    if spec.layout == "sliced" and shape:
        big = base((2 * shape[0] + 1, *(s + 1 for s in shape[1:])))
        return big[(slice(1, None, 2), *(slice(1, None) for _ in shape[1:]))]
    if spec.layout == "expanded" and shape and shape[0] > 1:
        return base((1, *shape[1:])).expand(shape)
    return base(shape)


def make_inputs(specs: Sequence[InputSpec], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The inputs of `specs` with values drawn from `seed`, and the leaves whose grads the program computes."""
    generator = torch.Generator().manual_seed(seed)
    args, leaves = [], []
    for spec in specs:
        def base(shape: tuple[int, ...], spec: InputSpec = spec) -> torch.Tensor:
            t = torch.randn(shape, generator=generator, dtype=spec.dtype)
            if spec.grad == "history":  # a leaf behind an op: updates in place are valid on the views of `t * 1`
                leaves.append(t.requires_grad_())
                return t * 1
            return t
        t = _layout(base, spec)
        if spec.grad == "leaf":
            leaves.append(t.requires_grad_())
        args.append(t)
    return args, leaves


# --- the generator -------------------------------------------------------------------------------------------------
def _broadcasts(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        return False
    return True


def _fits(value: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether `value` broadcasts to `target`'s shape (what an in-place op with it needs)."""
    return _broadcasts(value, target) and torch.broadcast_shapes(value.shape, target.shape) == target.shape


class Draw:
    """Candidate statements for the values a program holds so far (`env`: eager's values, by name)."""

    def __init__(self, rng: random.Random, env: dict[str, torch.Tensor], new: str):
        self.rng, self.env, self.new = rng, env, new

    def name(self, where: Callable[[torch.Tensor], bool] = lambda t: True) -> str | None:
        names = [n for n, t in self.env.items() if where(t)]
        return self.rng.choice(names) if names else None

    def dim(self, t: torch.Tensor) -> int:
        return self.rng.randrange(t.dim()) if t.dim() else 0

    def unary(self) -> str:
        x = self.name()
        op = self.rng.choice(["torch.exp({})", "torch.tanh({})", "torch.sin({})", "torch.neg({})", "{}.abs()",
                              "torch.sigmoid({})", "torch.relu({})", "torch.nn.functional.gelu({})", "{} * 1.5",
                              "{} + 2", "2 - {}", "{} ** 2", "{}.cos()"])
        return f"{self.new} = {op.format(x)}"

    def binary(self) -> str | None:
        x = self.name()
        y = self.name(lambda t: _broadcasts(t, self.env[x]))
        op = self.rng.choice(["{} + {}", "{} - {}", "{} * {}", "torch.maximum({}, {})", "{} / ({}.abs() + 1)",
                              "torch.where({0} > 0, {0}, {1})", "torch.where({1} > {0}, 0.5, {0})"])
        return f"{self.new} = {op.format(x, y)}"

    def reduction(self) -> str:
        x = self.name()
        t = self.env[x]
        op = self.rng.choice(["sum", "mean", "amax"])
        if t.dim() == 0 or self.rng.random() < 0.2:
            return f"{self.new} = {x}.{op}()"
        dims = self.rng.choice([str(self.dim(t)), f"({self.dim(t)}, -1)", "-1"])
        return f"{self.new} = {x}.{op}({dims}, keepdim={self.rng.random() < 0.5})"

    def matmul(self) -> str | None:
        x = self.name(lambda t: t.dim() >= 1)
        if x is None:
            return None
        k = self.env[x].shape[-1]
        y = self.name(lambda t: t.dim() >= 1 and (t.shape[0] if t.dim() == 1 else t.shape[-2]) == k)
        if y is not None:
            return f"{self.new} = {x} @ {y}"
        y = self.name(lambda t: t.dim() >= 2 and t.shape[-1] == k)
        return f"{self.new} = {x} @ {y}.transpose(-1, -2)" if y is not None else None

    def view_of(self, t: torch.Tensor) -> str:
        """A view (or reshape) of `t`, written as the suffix of an expression."""
        rng, d = self.rng, self.dim(t)
        options = [".view(-1)", ".reshape(-1)", ".unsqueeze(0)", f".unsqueeze({t.dim()})", "[None]"]
        if t.dim() >= 1:
            n = t.shape[d]
            options += [f".select({d}, {rng.randrange(n)})", f"[{rng.randrange(n)}]", "[1:]", "[::2]",
                        f".narrow({d}, {n // 2}, {max(1, n - n // 2)})", f".split({max(1, n // 2)}, {d})[0]",
                        f".chunk(2, {d})[-1]", f".expand(2, *{tuple(t.shape)})", ".flatten()"]
            if n % 2 == 0:
                options.append(f".view({tuple(t.shape[:d])} + (2, {n // 2}) + {tuple(t.shape[d + 1:])})")
        if t.dim() >= 2:
            perm = list(range(t.dim()))
            rng.shuffle(perm)
            options += [".t()" if t.dim() == 2 else ".transpose(0, 1)", f".permute{tuple(perm)}", "[:, 1::2]",
                        ".transpose(-1, -2)", "torch.diagonal({})", f".diagonal(0, {d}, -1)", ".mT"]
        ones = [i for i, s in enumerate(t.shape) if s == 1]
        if ones:
            sizes = ", ".join("3" if s == 1 else "-1" for s in t.shape)
            options += [f".squeeze({rng.choice(ones)})", f".expand({sizes})"]
        return rng.choice(options)

    def view(self) -> str:
        x = self.name()
        suffix = self.view_of(self.env[x])
        return f"{self.new} = {suffix.format(x) if '{}' in suffix else x + suffix}"

    def chunk(self) -> str | None:
        x = self.name(lambda t: t.dim() >= 1 and max(t.shape) >= 2)
        if x is None:
            return None
        t = self.env[x]
        d = self.rng.choice([i for i, s in enumerate(t.shape) if s >= 2])
        call = self.rng.choice([f"chunk(2, {d})", f"split([1, {t.shape[d] - 1}], {d})", f"unbind({d})[:2]"])
        return f"{self.new}, {self.new}_b = {x}.{call}"

    def target(self) -> str:
        """An existing value or a view of one, to update in place."""
        x = self.name()
        if self.rng.random() < 0.4:
            suffix = self.view_of(self.env[x])
            return suffix.format(x) if "{}" in suffix else x + suffix
        return x

    def inplace(self) -> str | None:
        target = self.target()
        try:
            t = eval(target, {"torch": torch}, dict(self.env))  # noqa: S307 - the generator's own expression
        except (RuntimeError, IndexError):
            return None
        y = self.name(lambda v: _fits(v, t))
        options = ["{}.mul_(2)", "{}.clamp_(-0.5, 0.5)", "{}.zero_()", "{}.masked_fill_({} > 0, 0.25)",
                   "{}.div_(4)", "{}.sub_(0.5)"]
        if y is not None:
            options += ["{}.add_({y})", "{}.copy_({y})", "{}.mul_({y})", "{}.masked_fill_({y} < 0, -1.0)",
                        "{}.addcmul_({y}, {y}, value=0.5)"]
        if t.dim() >= 1:
            i = self.rng.randrange(t.shape[0])
            options += [f"{{}}[{i}] = 1.5", f"{{}}.index_put_((torch.tensor([{i}, 0]),), torch.tensor(3.0))",
                        f"{{}}[{i}] += 1"]
        statement = self.rng.choice(options)
        if statement.startswith("{}[") or "+=" in statement:
            if not target.isidentifier():
                return None
            return statement.format(target)
        return statement.format(f"({target})" if not target.isidentifier() else target, target, y=y)

    def augmented(self) -> str | None:
        x = self.name()
        y = self.name(lambda v: _fits(v, self.env[x]))
        return f"{x} {self.rng.choice(['+=', '*=', '-='])} {y}" if y is not None else None

    def join(self) -> str | None:
        x = self.name(lambda t: t.dim() >= 1)
        if x is None:
            return None
        t = self.env[x]
        if self.rng.random() < 0.5:
            y = self.name(lambda v: v.shape == t.shape)
            return f"{self.new} = torch.stack([{x}, {y}], {self.rng.randrange(t.dim() + 1)})"
        d = self.dim(t)
        y = self.name(lambda v: v.dim() == t.dim() and all(a == b for i, (a, b) in enumerate(zip(v.shape, t.shape))
                                                          if i != d))
        return f"{self.new} = torch.cat([{x}, {y}, {x} * 2], {d})"

    def copy(self) -> str:
        x = self.name()
        op = self.rng.choice([".detach()", ".clone()", ".contiguous()", ".detach().clone()", ".to(torch.float64)",
                              ".float()", ".clone().detach()"])
        return f"{self.new} = {x}{op}"


KINDS: tuple[tuple[str, int], ...] = (("unary", 3), ("binary", 3), ("reduction", 2), ("matmul", 1), ("view", 4),
                                       ("chunk", 1), ("inplace", 5), ("augmented", 1), ("join", 1), ("copy", 2))


def _run_body(specs: Sequence[InputSpec], body: Sequence[str], seed: int) -> dict[str, torch.Tensor]:
    args, _ = make_inputs(specs, seed)
    env: dict[str, Any] = {s.name: t for s, t in zip(specs, args)}
    env["torch"] = torch
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # eager's deprecations (an update of an expanded tensor): not drawn
        exec("\n".join(body), env)  # noqa: S102 - the generator's own statements
    del env["torch"], env["__builtins__"]
    return env


def _accepts(env: dict[str, Any]) -> bool:
    return all(isinstance(t, torch.Tensor) and t.numel() > 0 for t in env.values())


def _statement(rng: random.Random, specs: Sequence[InputSpec], body: list[str], seed: int) -> str | None:
    """One more statement that eager runs after `body`, or None when a few draws found none."""
    env = _run_body(specs, body, seed)
    names, weights = zip(*KINDS)
    for _ in range(8):
        draw = Draw(rng, env, f"t{len(body)}")
        try:
            statement = getattr(draw, rng.choices(names, weights)[0])()
            if statement is not None and _accepts(_run_body(specs, [*body, statement], seed)):
                return statement
        except (RuntimeError, IndexError, ValueError, TypeError, UserWarning):  # eager rejects it: draw another
            continue
    return None


def generate(seed: int) -> Program:
    rng = random.Random(seed)
    specs = tuple(InputSpec(name, rng.choice(SHAPES), rng.choice((torch.float32, torch.float64)),
                            rng.choice(LAYOUTS), rng.choice(GRADS)) for name in "abcd"[:rng.randint(2, 4)])
    body: list[str] = []
    for _ in range(rng.randint(5, 15)):
        statement = _statement(rng, specs, body, seed)
        if statement is not None:
            body.append(statement)
    names = list(_run_body(specs, body, seed))
    outputs = [rng.choice(names) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.3:
        outputs.append(outputs[0])  # the same tensor twice
    return Program(seed, specs, tuple(body), tuple(outputs))


# --- the comparison ------------------------------------------------------------------------------------------------
@dataclass
class Observed:
    outputs: list[torch.Tensor]
    relations: list[tuple]
    inputs: list[torch.Tensor]
    grads: list[torch.Tensor | None]


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _relations(outs: Sequence[torch.Tensor], args: Sequence[torch.Tensor]) -> list[tuple]:
    """Which output is which input or shares its memory, and which outputs are or share each other."""
    found = []
    for i, out in enumerate(outs):
        for k, arg in enumerate(args):
            found.append(("output", i, "input", k, out is arg, _same_memory(out, arg)))
        for j in range(i):
            found.append(("output", i, "output", j, out is outs[j], _same_memory(out, outs[j])))
    return found


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides that matter: a dimension of size 1 is never stepped along (eager's kernels pick any)."""
    return tuple(st if size > 1 else 0 for size, st in zip(t.shape, t.stride()))


def observe(fn: Callable[..., tuple], specs: Sequence[InputSpec], seed: int) -> Observed:
    args, leaves = make_inputs(specs, seed)
    outs = list(fn(*args))
    relations = _relations(outs, args)
    layouts = [(tuple(o.shape), _strides(o), o.storage_offset() if any(_same_memory(o, a) for a in args) else None,
                o.dtype, o.requires_grad) for o in outs]
    values = [o.detach().clone() for o in outs]
    generator = torch.Generator().manual_seed(seed + 7)
    differentiable = [o for o in outs if o.requires_grad]
    if differentiable:
        sum((o * torch.randn(o.shape, generator=generator, dtype=o.dtype)).sum() for o in differentiable).backward()
    observed = Observed(values, relations, [a.detach().clone() for a in args], [t.grad for t in leaves])
    observed.relations.extend(("layout", i, *layout) for i, layout in enumerate(layouts))
    return observed


def _close(got: torch.Tensor, want: torch.Tensor, mixed: bool) -> bool:
    """Equal up to rounding: float64 values of a program with float32 inputs may have taken a float32 path in one
    and not the other (`b += a` with b float32: fulmen's grad of the float64 `a` skips eager's float32 rounding)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    tolerance = 1e-4 if want.dtype == torch.float32 else 1e-5 if mixed else 1e-9
    return torch.allclose(got, want, rtol=tolerance, atol=tolerance, equal_nan=True)


def _kind(t: torch.Tensor | None) -> str:
    return "None" if t is None else "a tensor"


def differences(got: Observed, want: Observed) -> list[str]:
    mixed = any(t.dtype == torch.float32 for t in want.inputs)
    found = []
    for what, gs, ws in (("output", got.outputs, want.outputs), ("input after the call", got.inputs, want.inputs),
                         ("grad of input leaf", got.grads, want.grads)):
        for i, (g, w) in enumerate(zip(gs, ws)):
            if (g is None) != (w is None):
                found.append(f"{what} {i}: {_kind(g)}, eager {_kind(w)}")
            elif g is not None and not _close(g, w, mixed):
                found.append(f"{what} {i}: {g.dtype} {tuple(g.shape)} {g.flatten()[:6].tolist()}, eager "
                             f"{w.dtype} {tuple(w.shape)} {w.flatten()[:6].tolist()}")
    for g, w in zip(got.relations, want.relations):
        if g != w and w[0] == "layout":
            found.append(f"output {w[1]}: shape, strides, storage offset, dtype, requires_grad {g[2:]}, eager {w[2:]}")
        elif g != w:
            found.append(f"{w[0]} {w[1]} vs {w[2]} {w[3]} (is it, shares its memory): {g[4:]}, eager {w[4:]}")
    return found


@dataclass
class Tally:
    programs: int = 0
    refused: Counter = field(default_factory=Counter)
    mismatches: list[str] = field(default_factory=list)


def _refusal_kind(error: FulmenError) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:90]}"


def check(program: Program, executors: Sequence[str] | None, tally: Tally) -> None:
    fn = program.function()
    jitted = fulmen.jit(fn, executors=executors)
    for call in range(2):  # the trace's first call, then a cache hit on new values
        seed = program.seed * 10 + call
        want = observe(fn, program.inputs, seed)
        try:
            got = observe(jitted, program.inputs, seed)
        except FulmenError as error:
            tally.refused[_refusal_kind(error)] += 1
            return
        except Exception as error:  # noqa: BLE001 - every other exception is a finding, reported with the program
            tally.mismatches.append(f"{program.describe()}call {call}: raised {type(error).__name__}: {error}")
            return
        found = differences(got, want)
        if found:
            tally.mismatches.append(f"{program.describe()}call {call}:\n  " + "\n  ".join(found))
            return
    tally.programs += 1


def _eager_runs(program: Program) -> bool:
    """Whether eager runs the program, its backward and its second call (not: an update of a value the backward
    needs)."""
    fn = program.function()
    try:
        for call in range(2):
            observe(fn, program.inputs, program.seed * 10 + call)
    except (RuntimeError, NameError, IndexError):  # NameError, IndexError: a shrunk program's
        return False
    return True


def valid_program(seed: int) -> Program | None:
    """The program of `seed` when eager runs it; None when it does not."""
    program = generate(seed)
    return program if _eager_runs(program) else None


def shrink(program: Program, executors: Sequence[str] | None = None) -> Program:
    """A smaller program that still differs from eager: statements and outputs dropped, inputs made plain, one at a
    time while it does (for reading a finding; the replay prints it)."""
    def fails(candidate: Program) -> bool:
        tally = Tally()
        return _eager_runs(candidate) and (check(candidate, executors, tally) or bool(tally.mismatches))

    changed = True
    while changed:
        changed = False
        candidates = [dataclasses.replace(program, body=program.body[:i] + program.body[i + 1:])
                      for i in range(len(program.body))]
        candidates += [dataclasses.replace(program, outputs=program.outputs[:i] + program.outputs[i + 1:])
                       for i in range(len(program.outputs)) if len(program.outputs) > 1]
        for i, spec in enumerate(program.inputs):
            for plain in (dataclasses.replace(spec, layout="contiguous"), dataclasses.replace(spec, grad="none")):
                if plain != spec:
                    candidates.append(dataclasses.replace(
                        program, inputs=program.inputs[:i] + (plain,) + program.inputs[i + 1:]))
        for candidate in candidates:
            if fails(candidate):
                program, changed = candidate, True
                break
    return program


def fuzz_one(program: Program, executors: Sequence[str] | None = None) -> Tally:
    tally = Tally()
    check(program, executors, tally)
    return tally


def fuzz(seeds: Sequence[int], executors: Sequence[str] | None = None) -> Tally:
    tally = Tally()
    for seed in seeds:
        program = valid_program(seed)
        if program is not None:
            check(program, executors, tally)
    return tally


def report(tally: Tally, label: str) -> str:
    refused = ", ".join(f"{kind} x{n}" for kind, n in tally.refused.most_common())
    return (f"program fuzz ({label}): {tally.programs} programs compared with eager, "
            f"{sum(tally.refused.values())} refused, {len(tally.mismatches)} mismatches" +
            (f"; refusals: {refused}" if refused else ""))


CI_SEEDS = range(40)


def _spec(name: str, shape: tuple[int, ...], layout: str = "contiguous", grad: str = "none",
          dtype: torch.dtype = torch.float32) -> InputSpec:
    return InputSpec(name, shape, dtype, layout, grad)


# Findings of the fuzz, shrunk: each differed from eager before its fix.
FINDINGS = {
    # a view returned twice came back as two objects (each remade from the input), where eager gives one
    "a view returned twice is one object": Program(
        1, (_spec("a", (3, 4)),), ("t = a[1:]",), ("t", "a", "t")),
    # flatten() of a 1-D tensor is the tensor itself in eager: the update through it was lost
    "flatten of a 1-D tensor is the tensor": Program(
        2, (_spec("a", (4,)),), ("t = a.flatten()", "t.mul_(2)"), ("a", "t")),
    # the value an update left was contiguous where eager's tensor keeps its strides: a later flatten() viewed it
    # (and an update through it reached the input) where eager's copies
    "an updated tensor keeps its strides (not dense)": Program(
        3, (_spec("a", (4, 4), "sliced"),), ("torch.diagonal(a).zero_()", "a.flatten().mul_(2)"), ("a",)),
    "an updated tensor keeps its strides (transposed)": Program(
        4, (_spec("a", (3, 4), "transposed"),), ("a.masked_fill_(a > 0, 0.25)", "t = torch.sigmoid(a)"), ("t",)),
    "an updated view of an intermediate keeps its strides": Program(
        5, (_spec("a", (2, 3, 4)),), ("t = a @ a.transpose(-1, -2)", "d = t.diagonal(0, 1, -1)", "d.mul_(2)"),
        ("d",)),
    # a view of a view read the value from before its root's update
    "a view of a view sees its root's update": Program(
        6, (_spec("d", (3, 2)),), ("t0 = d.transpose(-1, -2)", "t1 = t0.permute(1, 0)", "d.add_(1)",
                                   "t1.t().add_(t0)"), ("d",)),
    # clamp's mask reads b[None], which the forward saved as a view of b and then overwrote with the write-back:
    # the backward failed a version check naming a tensor eager never saved
    "a saved view of an input updated in place": Program(
        8, (_spec("b", (3,), grad="history"),), ("b[None].clamp_(-0.5, 0.5)", "m = b.mean()"), ("m",)),
    # cat promotes float32 and float64 to float64: its grad rule put a float64 grad for the float32 input, which
    # the grad transform refused ("the grad rule of torch.cat put a grad of cpu f64[2, 3] for a: cpu f32[2, 3]")
    "cat of float32 and float64": Program(
        10, (_spec("a", (2, 3), grad="leaf"), _spec("b", (2, 3), grad="leaf", dtype=torch.float64)),
        ("t = torch.cat([a, b], 0)",), ("t",)),
    # the grad rule of the copy into a's diagonal read c's value, so the backward kept c and failed its version
    # check after c's update (eager's copy_ never saves its source)
    "a copied value updated afterwards": Program(
        11, (_spec("a", (3, 1), grad="history", dtype=torch.float64), _spec("c", (), dtype=torch.float64)),
        ("torch.diagonal(a).copy_(c)", "c.add_(c)"), ("a",)),
    # the updated view was the value written into it, no longer a view of t: u, v and t shared no memory
    "views of one intermediate share memory after an update": Program(
        12, (_spec("a", (3, 4)),), ("t = a * 2", "u, v = t.chunk(2, 1)", "v.mul_(3)"), ("u", "v", "t")),
    # an update through a detached alias of a view of a leaf that requires grad gave the leaf the update's history
    # above the alias, and the call was refused as an update of that leaf
    "an update through a detached view of a leaf": Program(
        13, (_spec("a", (4, 4), grad="leaf"),), ("t = a[None].detach()", "t.select(0, 0).sub_(0.5)"),
        ("t", "a")),
}


# Findings fulmen cannot match: refused, naming the line.
REFUSED = {
    # eager's alias shares b's memory and carries the update's history; fulmen returned it without one (its grads
    # were lost)
    "a detached alias of an input given a history": (Program(
        7, (_spec("b", (4,), grad="history"),), ("t = b.detach()", "t *= b * 2"), ("t",)), "t *= b * 2"),
    # the write into the expanded view's base ran an in-place copy into the expanded tensor: a raw RuntimeError
    "an update through an expanded view": (Program(
        9, (_spec("b", (1, 4)),), ("t = b.expand(3, -1)", "t[1] += 1"), ("b",)), "t[1] += 1"),
    # eager's loop reads column 1 after writing it to zero, fulmen's functional update the old column: b[:, 2]
    # differed
    "an update reading what it writes elsewhere": (Program(
        14, (_spec("b", (4, 3)),), ("t = b[:, 1:2]", "b -= t"), ("b",)), "b -= t"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_refused_finding(name):
    program, line = REFUSED[name]
    args, _ = make_inputs(program.inputs, 0)
    with pytest.raises(fulmen.TraceError) as error:
        fulmen.jit(program.function())(*args)
    assert error.value.location.line == line


@pytest.mark.parametrize("name", FINDINGS)
def test_finding(name):
    tally = fuzz_one(FINDINGS[name])
    assert not tally.mismatches and not tally.refused, "\n".join(tally.mismatches) or str(tally.refused)


def test_program_fuzz(summary):
    tally = fuzz(CI_SEEDS)
    summary(report(tally, "default executors"))
    assert not tally.mismatches, "\n\n".join(tally.mismatches)


if __name__ == "__main__":  # replay: python tests/jit/test_program_fuzz.py SEED [executor ...]
    seed_arg, executor_args = int(sys.argv[1]), sys.argv[2:] or None
    replayed = valid_program(seed_arg)
    print("eager rejects this program" if replayed is None else replayed.describe())
    if replayed is not None:
        result = fuzz([seed_arg], executor_args)
        print(report(result, "replay"), *result.mismatches, sep="\n")
        if result.mismatches:
            shrunk = fuzz_one(shrink(replayed, executor_args), executor_args)
            print("shrunk:", *shrunk.mismatches, sep="\n")
