"""Program fuzz: small random programs, jitted and eager, compared on every observable.

A seeded generator (program_generator.py) writes programs of 5-15 statements over 2-4 input tensors (float32 and
float64; contiguous, transposed, sliced with a step, expanded; some requiring grad as leaves, some carrying an
autograd history): unary and binary elementwise ops with broadcasting, reductions, matmul, views of every kind,
in-place updates of inputs, of views of inputs and of intermediates, where, cat/stack, detach, clone, and several
outputs (views of inputs, the same tensor twice). Every statement is kept only when eager runs it, and a program only
when eager also runs its backward and second call, so each program is a valid eager program. Each is then called
twice (a trace, then a cache hit on new values, which must not trace again) under fulmen.jit and eagerly on equal,
independent inputs, and compared: output values, dtypes, shapes, strides, requires_grad, which outputs are an input
or share an input's memory or each other's, the inputs after the call (in-place updates; requires_grad, is_leaf,
grad_fn's kind and version counter of each and of the tensor it is a view of), and the grads of the inputs (the
outputs, the inputs and their bases times seeded cotangents, backward: an update gives an input eager's history).
A FulmenError is a refusal, counted by kind; anything else that differs is a mismatch, reported with the seed and
the program's source. Replay one and shrink it with
`python -m tests.jit.test_program_fuzz SEED [torchcompile]`, run a range with
`python -m tests.jit.test_program_fuzz 0:1000 [torchcompile]`.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
import torch

import fulmen
from fulmen.core.errors import FulmenError
from fulmen.jit.jitted_module import core as jitted_core
from tests.jit.program_generator import InputSpec, Program, generate, make_inputs


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
    states = [_autograd_state(a) for a in args]
    generator = torch.Generator().manual_seed(seed + 7)
    # the outputs, then the inputs and the tensors they are views of: an update gives them the history eager's does
    held = [*outs, *(t for a in args for t in (a, a._base) if t is not None)]
    differentiable = [t for t in held if t.requires_grad]
    if differentiable:
        sum((t * torch.randn(t.shape, generator=generator, dtype=t.dtype)).sum() for t in differentiable).backward()
    observed = Observed(values, relations, [a.detach().clone() for a in args], [t.grad for t in leaves])
    observed.relations.extend(("layout", i, *layout) for i, layout in enumerate(layouts))
    observed.relations.extend(("input state", i, *state) for i, state in enumerate(states))
    return observed


def _grad_fn_kind(t: torch.Tensor) -> str:
    """The kind of `t`'s grad_fn where fulmen can be eager's: none, a leaf's or CopySlices (the base of an updated
    view), or another kind of node (eager's op, fulmen's one function)."""
    name = type(t.grad_fn).__name__
    return name if t.grad_fn is None or name == "CopySlices" else "an op's"


def _autograd_state(t: torch.Tensor) -> tuple:
    """What the call left on an input and on the tensor it is a view of: requires_grad, is_leaf, grad_fn's kind, and
    the version counter (which a view shares with its base)."""
    base = t._base
    return (t.requires_grad, t.is_leaf, _grad_fn_kind(t), t._version,
            None if base is None else (base.requires_grad, base.is_leaf, _grad_fn_kind(base)))


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
        elif g != w and w[0] == "input state":
            found.append(f"input {w[1]} after the call: requires_grad, is_leaf, grad_fn, version, its base's "
                         f"requires_grad, is_leaf, grad_fn {g[2:]}, eager {w[2:]}")
        elif g != w:
            found.append(f"{w[0]} {w[1]} vs {w[2]} {w[3]} (is it, shares its memory): {g[4:]}, eager {w[4:]}")
    return found


@dataclass
class Tally:
    programs: int = 0
    refused: Counter = field(default_factory=Counter)
    mismatches: list[str] = field(default_factory=list)


def _refusal_kind(error: FulmenError) -> str:
    """The error's kind: its first words, without the names and sizes that vary from program to program."""
    text = re.sub(r"\b(input|tensor) [a-z]\b", r"\1 X", str(error).splitlines()[0])
    words = re.split(r" \(|:", text)[0][:80]
    return f"{type(error).__name__}: {words}"


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
        except RuntimeError as error:
            if "then updated in place by it" not in str(error):
                tally.mismatches.append(f"{program.describe()}call {call}: raised RuntimeError: {error}")
                return
            # bridge._check_stale: fulmen's backward reads an input the program updated after reading it (where eager
            # may have saved a value computed from it instead): refused by design, with eager's version error
            tally.refused[f"RuntimeError (saved input updated in place): {str(error).splitlines()[0][:60]}"] += 1
            return
        except Exception as error:  # noqa: BLE001 - every other exception is a finding, reported with the program
            tally.mismatches.append(f"{program.describe()}call {call}: raised {type(error).__name__}: {error}")
            return
        found = differences(got, want)
        if found:
            tally.mismatches.append(f"{program.describe()}call {call}:\n  " + "\n  ".join(found))
            return
    if jitted_core(jitted).stats.misses != 1:
        tally.mismatches.append(f"{program.describe()}the second call, on new values, traced again: "
                                f"{jitted_core(jitted).last_miss_reasons}")
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


CI_SEEDS = range(400)  # about 7 s on one core


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
    # a view written under no_grad is read again from its base, and that read kept grad mode off: the output lost
    # its autograd history (no grads for b)
    "a view updated under no_grad keeps its history": Program(
        16, (_spec("a", (4, 3), dtype=torch.float64), _spec("b", (4, 3), grad="leaf")),
        ("t = torch.stack([a, b], 2).unsqueeze(3)", "with torch.no_grad(): t.view(-1).zero_()"), ("t",)),
    # CSE merged the two clones: the returned reshape of one and detach of the other shared one storage
    "two clones returned through a view and a detach": Program(
        18, (_spec("a", (4,)),), ("t = a.clone().reshape(-1)", "u = a.clone().detach()"), ("t", "u")),
    # the updated detached alias held the value written into it, no longer t's memory
    "a detached alias updated in place shares its base's memory": Program(
        20, (_spec("b", (3, 4)),), ("t = b.cos()", "u = t.detach()", "u.masked_fill_(t < 0, -1.0)"), ("u", "t")),
    # an input that is a view of another tensor, updated with a value that has a history, was refused: eager gives the
    # view and its base (CopySlices) that history, and later uses of either differentiate back to b
    "a view input given a history": Program(
        21, (_spec("a", (3, 4), "transposed"), _spec("b", (3, 4), grad="leaf")), ("a.mul_(b)",), ("a",)),
    "a view of an input with a history updated through a view": Program(
        22, (_spec("a", (2, 3, 4), "sliced", grad="history"), _spec("c", (), grad="leaf")),
        ("a[0].mul_(c)", "t = a.sum()"), ("t",)),
    # eager's grad_fn of an input updated through a view of it (`d[2] = v` copies into d[2]) is CopySlices, not the
    # jitted function's node; its version counter was bumped twice, by the write and by marking it dirty
    "an input updated through an index": Program(23, (_spec("d", (3, 4), grad="history"),), ("d[2] = 1.5",), ("d",)),
    # the version counter was bumped once for all the updates, where eager bumps it once for each
    "each update bumps the version counter": Program(
        24, (_spec("b", (2, 3, 4)),),
        ("b.copy_(b)", "b[1] = 1.5", "with torch.no_grad(): b.add_(b)", "b.masked_fill_(b > 0, 0.25)"), ("b",)),
    # the forward saved the detached alias t for the grad of `b * 2` and the write-back of b then changed it: b's grads
    # used t's new value, where eager's mul_ saves the old one
    "a detached alias of an input saved, then updated with a history": Program(
        25, (_spec("b", (3, 4), grad="history"),), ("t = b.detach()", "t *= b * 2", "u = t * 1"), ("u",)),
    # a returned .detach() alias of an input that an update gave a history was refused: eager's alias shares the
    # input's memory and carries that history (fulmen's, taken from the input after the call, is given it)
    "a detached alias of an input given a history": Program(
        7, (_spec("b", (4,), grad="history"),), ("t = b.detach()", "t *= b * 2"), ("t",)),
    # the same with a view of the alias also returned; the alias feeds the view and b, and the trace's value for b is
    # the alias's, which the call copied (distinct.py): the backward watched the copy's node, not the alias
    "a view of a detached alias of an input given a history": Program(
        27, (_spec("b", (3, 4), grad="history"), _spec("w", (4,), grad="leaf")),
        ("t = b.detach()", "t.mul_(w)", "u = t[0]"), ("u", "b", "t")),
}


# Findings fulmen cannot match: refused, naming the line.
REFUSED = {
    # eager's .data alias shares b's memory, carries the update's history and has a version counter of its own, which
    # counts the updates through it: fulmen's alias, taken after the call, would start a new one
    "a .data alias of an input given a history": (Program(
        26, (_spec("b", (4,), grad="history"), _spec("w", (4,), grad="leaf")), ("t = b.data", "t.mul_(w)"), ("t",)),
        "t.mul_(w)"),
    # the write into the expanded view's base ran an in-place copy into the expanded tensor: a raw RuntimeError
    "an update through an expanded view": (Program(
        9, (_spec("b", (1, 4)),), ("t = b.expand(3, -1)", "t[1] += 1"), ("b",)), "t[1] += 1"),
    # eager's loop reads column 1 after writing it to zero, fulmen's functional update the old column: b[:, 2]
    # differed
    "an update reading what it writes elsewhere": (Program(
        14, (_spec("b", (4, 3)),), ("t = b[:, 1:2]", "b -= t"), ("b",)), "b -= t"),
    # the same, with the operand a view taken after an update (a view of the tensor's new value)
    "an update reading what it writes elsewhere, after an update": (Program(
        15, (_spec("a", (4, 4)),), ("a.mul_(2)", "t = a[:, 1]", "a.copy_(t)"), ("a",)), "a.copy_(t)"),
    # eager's maximum saves a itself and its backward reads the zeroed row; where eager saves a value computed from
    # a (`a.abs() + 1`) it reads the old one; fulmen saves other tensors than eager, so it read one or the other
    "an input read, then updated through .data": (Program(
        17, (_spec("a", (3, 4), dtype=torch.float64), _spec("b", (1, 4), grad="leaf")),
        ("t = torch.maximum(b, a)", "a[1].data.zero_()"), ("t",)), "a[1].data.zero_()"),
    # the same for an intermediate: sigmoid saves its result, which eager's backward then reads doubled
    "an intermediate made, then updated through .data": (Program(
        19, (_spec("c", (3, 4), grad="leaf"),), ("t = torch.sigmoid(c)", "t.data.mul_(2)", "u = torch.exp(t)"),
        ("u",)), "t.data.mul_(2)"),
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


def _main(argv: list[str]) -> None:
    """`SEED [executor ...]`: replays one program and shrinks a mismatch; `START:STOP [executor ...]`: runs a range."""
    first, executors = argv[0], argv[1:] or None
    if ":" in first:
        start, stop = (int(n) for n in first.split(":"))
        tally = fuzz(range(start, stop), executors)
        print(report(tally, f"seeds {first}, executors {executors or 'default'}"), *tally.mismatches, sep="\n\n")
        return
    program = valid_program(int(first))
    print("eager rejects this program" if program is None else program.describe())
    if program is not None:
        tally = fuzz_one(program, executors)
        print(report(tally, "replay"), *tally.mismatches, sep="\n")
        if tally.mismatches:
            print("shrunk:", *fuzz_one(shrink(program, executors), executors).mismatches, sep="\n")


if __name__ == "__main__":  # python -m tests.jit.test_program_fuzz SEED | START:STOP [executor ...]
    _main(sys.argv[1:])
