"""The program fuzz's generator (tests/jit/test_program_fuzz.py): seeded random programs that eager runs.

A program is Python source over 2-4 input tensors (float32 or float64; contiguous, transposed, sliced with a step or
expanded; requiring no grad, a leaf that requires grad, or a value with an autograd history), 5-15 statements drawn
from elementwise ops with broadcasting, reductions, matmul, views, in-place updates of inputs, views and
intermediates, where, cat/stack, detach and clone, and 1-5 outputs. Each statement is drawn for the values the
program holds at that point (eager's, run as it is built) and kept only when eager runs it without an error or a
deprecation warning.
"""

from __future__ import annotations

import linecache
import random
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

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
            # a leaf of its own with the layout's strides, not a view: a view of a tensor that does not require grad
            # made a leaf by requires_grad_() gets no grad in eager once its base is updated (autograd regenerates
            # its views' history from that base), a corner no program meets
            if t._is_view():  # an expanded one (elements sharing memory) becomes contiguous
                overlapping = any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))
                t = t.clone() if overlapping else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t)
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

    def unseen(self) -> str | None:
        """An update autograd does not see: under no_grad, through `.data`, or into an `out=` tensor."""
        choice = self.rng.random()
        if choice < 0.5:
            statement = self.inplace()
            return f"with torch.no_grad(): {statement}" if statement is not None else None
        x = self.name()
        if choice < 0.75:
            return f"{x}.data.{self.rng.choice(['mul_(2)', 'zero_()', 'clamp_(-0.5, 0.5)'])}"
        y = self.name(lambda v: v.shape == self.env[x].shape)
        return f"torch.mul({y}, 2, out={x})"

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
                                       ("chunk", 1), ("inplace", 5), ("augmented", 1), ("join", 1), ("copy", 2),
                                       ("unseen", 1))


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
