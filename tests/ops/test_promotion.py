"""Type promotion and result metadata, with eager PyTorch as the oracle.

OpInfo samples rarely mix dtypes, so here every supported elementwise op meets every pair of dtypes, as a dimensioned
tensor, a 0-dim tensor or a Python scalar on either side. Each case compares fulmen's output dtype, shape and exact
values with eager's, through the default executors and through the DecomposedExecutor (each composite replayed prim
by prim, as a fusion executor compiles it). Where eager raises, fulmen must raise too, naming the problem.

To keep the sweep fast, the cases eager answers run as one jitted program per op (a list of calls); the cases eager
refuses run one by one.
"""

from __future__ import annotations

import collections
import math
import operator
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import fulmen
from fulmen.core.errors import FulmenError
from tests.ops.opdb import DECOMPOSED
from tests.sweeps import FULL_SWEEPS

DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.complex64)
SCALARS = (True, -3, 2.5, 1.5 - 2j)
# Executor lists, each with the stride of the answered cases it runs. Tracing (torch's Python meta kernels) is the
# cost, and both traces hold the same metadata; the default executors run eager's own kernel for every torch-level
# call, so only the conversions fulmen inserts can differ there: every third case is enough for them. The
# decomposed replay, where the decompositions' values show, runs them all.
EXECUTORS: dict[str, tuple[list | None, int]] = {"decomposed": ([DECOMPOSED], 1), "default": (None, 3)}
# test_binary's cases eager refuses are each a trace of their own, most of a refusing op's time (lshift: 341 of 448
# cases, 9.6 of 12 s): on CI, of those with the same dtypes (the shapes aside), every other one, the first included, so
# that every refused dtype combination is checked (FULMEN_FULL_SWEEPS=1: all of them).
REFUSED_STRIDE = 1 if FULL_SWEEPS else 2

# Values by operand position: the first holds zeros, extremes, NaN and infinities (that wrap or overflow when
# converted and multiplied); the second holds no zero (integer division by zero raises in eager: tested apart),
# negatives, and for uint8 254 (a shift past the bit width).
FIRST = ((-3.5, -0.0, 7.25), (math.inf, -128.0, math.nan))
FIRST_INTEGRAL = ((-3, 0, 7), (100, -128, 2))
SECOND = (-2.5, 3.0, 1.5)
ZERO_DIM = (-7.5, 3.5)


def make(dtype: torch.dtype, shape: str, position: int) -> torch.Tensor:
    """A tensor of shape (2, 3) ("t"), (3,) ("v") or () ("z") holding the values of its position."""
    if shape == "z":
        values: Any = ZERO_DIM[position]
    elif shape == "t" and position == 0:
        values = FIRST if dtype.is_floating_point or dtype.is_complex else FIRST_INTEGRAL
    else:
        values = SECOND if shape == "v" else (SECOND, tuple(-v for v in SECOND))
    wide = torch.tensor(values, dtype=torch.float64)
    if dtype == torch.bool:
        return wide != 0
    if dtype.is_floating_point or dtype.is_complex:
        out = wide.to(dtype)
        return out + 0.5j * out.nan_to_num() if dtype.is_complex else out
    return wide.to(torch.int64).to(dtype)  # wraps as eager's conversion does (uint8: -3 is 253)


def short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{short(x.dtype)}{list(x.shape)}"
    if isinstance(x, (tuple, list)) and not isinstance(x, torch.Size):
        return "(" + ", ".join(map(describe, x)) + ")"
    return repr(x)


Case = tuple[str, tuple]  # (description, arguments)


def binary_cases(scalar_first: bool = True, scalars: Sequence[Any] = SCALARS) -> list[Case]:
    """Every dtype pair as (2,3)-with-(3,), (2,3)-with-0-dim (either side) and 0-dim-with-0-dim tensors; every dtype
    with every scalar kind, the scalar second (and first, where the spelling takes it)."""
    pairs: list[tuple] = []
    for a in DTYPES:
        for b in DTYPES:
            pairs += [(make(a, "t", 0), make(b, "v", 1)), (make(a, "t", 0), make(b, "z", 1)),
                      (make(a, "z", 0), make(b, "t", 1))]
            if a == b or b in (torch.int64, torch.float32):  # two 0-dim tensors promote as dimensioned ones do
                pairs.append((make(a, "z", 0), make(b, "z", 1)))
        for s in scalars:
            pairs += [(make(a, "t", 0), s), (make(a, "z", 0), s)]
            if scalar_first:
                pairs.append((s, make(a, "t", 1)))
    return [(", ".join(map(describe, p)), p) for p in pairs]


def inplace_cases(scalars: Sequence[Any] = SCALARS) -> list[Case]:
    """A (2,3) target of every dtype updated by a (3,), a 0-dim tensor or a scalar of every kind; a (3,) target
    updated by a (2,3) tensor (broadcasting the target: eager refuses)."""
    cases: list[tuple] = []
    for a in DTYPES:
        for b in DTYPES:
            cases += [(make(a, "t", 0), make(b, "v", 1)), (make(a, "t", 0), make(b, "z", 1))]
        cases += [(make(a, "t", 0), s) for s in scalars]
    cases.append((make(torch.float32, "v", 1), make(torch.float32, "t", 0)))
    return [(", ".join(map(describe, c)), c) for c in cases]


# --- the oracle ----------------------------------------------------------------------------------------------------
def _eager(op: Callable[..., Any], args: tuple) -> tuple[Any, BaseException | None]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return op(*args), None
    except Exception as error:  # noqa: BLE001 - an eager error is an answer fulmen must give too
        return None, error


def _jitted(op: Callable[..., Any], executors: list | None) -> Callable[..., Any]:
    def one(*args: Any) -> Any:
        return op(*args)

    return fulmen.jit(one, executors=executors)


def _same(got: Any, want: Any, what: str, exact: bool = True) -> str | None:
    """Why `got` is not `want` (dtype, shape, exact values, NaN where eager's is NaN), or None. `exact=False`: floating
    values to torch's default tolerances for their dtype."""
    got_leaves, want_leaves = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    if len(got_leaves) != len(want_leaves):
        return f"{what}: {len(got_leaves)} outputs where eager gives {len(want_leaves)}"
    for g, w in zip(got_leaves, want_leaves):
        if not isinstance(w, torch.Tensor):
            if type(g) is not type(w) or g != w:
                return f"{what}: {g!r} where eager gives {w!r}"
            continue
        if not isinstance(g, torch.Tensor) or g.dtype != w.dtype or g.shape != w.shape:
            return f"{what}: {describe(g)} where eager gives {describe(w)}"
        try:
            tolerance = {"rtol": 0, "atol": 0} if exact or not (w.is_floating_point() or w.is_complex()) else {}
            torch.testing.assert_close(g, w, equal_nan=True, **tolerance)
        except AssertionError as error:
            return f"{what}: values differ: {' '.join(str(error).split())[:240]}"
    return None


def _without_shapes(text: str) -> str:
    """A case's description with the shapes left out: its dtypes and scalars ("int8, 2.5")."""
    return re.sub(r"\[[^\]]*\]", "", text)


def _raised_alike(got: BaseException, want: BaseException) -> bool:
    """fulmen's error is eager's: the same type, or a trace error naming the user's line (torch's meta kernels word
    some refusals differently: "torch.bool not supported for floor_divide" where the CPU kernel says "not implemented
    for 'Bool'"). fulmen's own consistency checks are no answer: they name no problem of the program."""
    if isinstance(got, type(want)):
        return True
    return isinstance(got, FulmenError) and "\n  at " in str(got) and "decomposition of" not in str(got)


def _with_metadata(result: Any) -> Any:
    """Each tensor with its dtype and shape as the program reads them: in a trace those are the proxy's, so a meta
    kernel that disagrees with eager's shows even where the executed kernel then gives eager's tensor."""
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: (t, t.dtype, t.shape), result)


def check(op: Callable[..., Any], cases: list[Case], refused: dict[str, str] | None = None,
          exact: bool = True, executors: dict[str, tuple[list | None, int]] = EXECUTORS,
          refused_stride: int = 1) -> list[str]:
    """Every case through fulmen, against eager: the failures, one line each. `refused`: descriptions (substrings) of
    cases fulmen knowingly refuses where eager answers, with the message fulmen's error must contain. `exact=False`:
    floating values to torch's default tolerances (reductions, whose decompositions sum in another order).
    `refused_stride`: of the cases eager refuses with the same dtypes (their descriptions without the shapes), every
    refused_stride-th, the first included."""
    refused = refused or {}
    answered: list[tuple[str, tuple, Any]] = []
    failures: list[str] = []
    refusals: collections.Counter = collections.Counter()
    for text, args in cases:
        want, error = _eager(op, args)
        if error is None:
            answered.append((text, args, _with_metadata(want)))
            continue
        refusals[_without_shapes(text)] += 1
        if (refusals[_without_shapes(text)] - 1) % refused_stride:
            continue
        try:
            got = _jitted(op, None)(*args)
        except Exception as raised:  # noqa: BLE001 - compared with eager's error
            if not _raised_alike(raised, error):
                failures.append(f"{text}: eager raises {type(error).__name__}: {str(error)[:120]}; fulmen raises "
                                f"{type(raised).__name__}: {str(raised)[:200]}")
            continue
        failures.append(f"{text}: eager raises {type(error).__name__}: {str(error)[:120]}; fulmen gives "
                        f"{describe(got)}")

    def batch(arguments: list[tuple]) -> list[Any]:
        return [_with_metadata(op(*args)) for args in arguments]

    for name, (chosen_executors, stride) in executors.items():
        chosen = answered[::stride]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results = fulmen.jit(batch, executors=chosen_executors)([args for _, args, _ in chosen])
        except Exception:  # noqa: BLE001 - some case fails: find which, one at a time
            results = None
        for i, (text, args, want) in enumerate(chosen):
            if results is None:
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        got = _jitted(lambda *a: _with_metadata(op(*a)), chosen_executors)(*args)
                except Exception as raised:  # noqa: BLE001 - eager answers: only a documented refusal may raise
                    reason = next((m for key, m in refused.items() if key in text), None)
                    if reason is None or reason not in str(raised):
                        failures.append(f"{text} [{name}]: eager gives {describe(want)}; fulmen raises "
                                        f"{type(raised).__name__}: {' '.join(str(raised).split())[:240]}")
                    continue
            else:
                got = results[i]
            differs = _same(got, want, f"{text} [{name}]", exact)
            if differs is not None:
                failures.append(differs)
    return failures


def assert_none(failures: list[str]) -> None:
    assert not failures, f"{len(failures)} cases differ from eager:\n" + "\n".join(failures[:40])


# --- binary ops ----------------------------------------------------------------------------------------------------
# name -> (the call, whether a Python scalar may come first: the operator spellings take one through the reflected
# dunder, torch's functions refuse it)
BINARY: dict[str, tuple[Callable[..., Any], bool]] = {
    "add": (operator.add, True),
    "sub": (operator.sub, True),
    "mul": (operator.mul, True),
    "truediv": (operator.truediv, True),
    "true_divide": (torch.true_divide, False),
    "div_trunc": (lambda a, b: torch.div(a, b, rounding_mode="trunc"), False),
    "div_floor": (lambda a, b: torch.div(a, b, rounding_mode="floor"), False),
    "floordiv": (operator.floordiv, True),
    "floor_divide": (torch.floor_divide, False),
    "mod": (operator.mod, True),
    "fmod": (torch.fmod, False),
    "pow": (operator.pow, True),
    "atan2": (torch.atan2, False),
    "maximum": (torch.maximum, False),
    "minimum": (torch.minimum, False),
    "eq": (operator.eq, True),
    "ne": (torch.ne, False),
    "lt": (operator.lt, True),
    "le": (torch.le, False),
    "gt": (torch.gt, False),
    "ge": (operator.ge, True),
    "logical_and": (torch.logical_and, False),
    "logical_or": (torch.logical_or, False),
    "logical_xor": (torch.logical_xor, False),
    "bitwise_and": (operator.and_, True),
    "bitwise_or": (torch.bitwise_or, False),
    "bitwise_xor": (operator.xor, True),
    "lshift": (operator.lshift, True),
    "rshift": (operator.rshift, True),
    "hypot": (torch.hypot, False),
    "copysign": (torch.copysign, False),
}


@pytest.mark.parametrize("name", BINARY)
def test_binary(name: str) -> None:
    op, scalar_first = BINARY[name]
    assert_none(check(op, binary_cases(scalar_first), refused_stride=REFUSED_STRIDE))


def random_cases(scalar_first: bool) -> list[Case]:
    """Many values per dtype, where the fixed ones above are few and round: a rounding that differs from eager's
    kernel shows in some of them. Divisors and exponents stay away from zero."""
    generator = torch.Generator().manual_seed(0)

    def drawn(dtype: torch.dtype, shape: tuple[int, ...], scale: float) -> torch.Tensor:
        x = torch.randn(shape, generator=generator, dtype=torch.float64) * scale
        x = torch.where(x.abs() < 0.25, 0.25, x)
        return x.to(dtype) if dtype.is_floating_point else x.round().clamp(-100, 100).to(torch.int64).to(dtype)

    cases: list[Case] = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.uint8):
        x, y = drawn(dtype, (64, 16), 8.0), drawn(dtype, (16,), 3.0)
        cases += [(f"random {short(dtype)}, {short(dtype)}", (x, y)),
                  (f"random {short(dtype)}, float32[]", (x, drawn(torch.float32, (), 3.0))),
                  (f"random {short(dtype)}, 0.3", (x, 0.3)), (f"random {short(dtype)}, 7", (x, 7))]
        if scalar_first:
            cases.append((f"0.3, random {short(dtype)}", (0.3, y)))
    return cases


@pytest.mark.parametrize("name", BINARY)
def test_binary_random_values(name: str) -> None:
    op, scalar_first = BINARY[name]
    # the values are what differs here, and only decompositions compute values of their own
    assert_none(check(op, random_cases(scalar_first), executors={"decomposed": EXECUTORS["decomposed"]}))


ALPHAS = (True, 3, 2.5, 0.1, 300)  # 300 overflows 8-bit integers: eager refuses it


@pytest.mark.parametrize("name", ["add", "sub"])
def test_alpha(name: str) -> None:
    """`torch.add(x, y, alpha=a)`: eager computes x + a * y in one rounding (half precision in float32), and refuses
    a float alpha for integers and a non-bool alpha for bools."""
    fn = getattr(torch, name)
    cases = []
    for a in DTYPES:
        for other in [make(b, "v", 1) for b in DTYPES] + [s for s in (True, 7, 0.1, 2.5)]:
            for alpha in ALPHAS:
                cases.append((f"{short(a)}, {describe(other)}, alpha={alpha!r}", (make(a, "t", 0), other, alpha)))
    assert_none(check(lambda x, y, alpha: fn(x, y, alpha=alpha), cases))


# Documented exceptions: cases eager answers and fulmen refuses, by case description, with the words fulmen's error
# must hold (each names the value and the user's line).
REFUSED: dict[str, str] = {
    # torch's meta kernel for where refuses it; eager accepts it with a deprecation warning
    "uint8 condition": "expected predicate to be bool, got torch.uint8",
}


KEYWORDS: dict[str, Callable[..., Any]] = {
    "add(other=, alpha=)": lambda x, y: torch.add(x, other=y, alpha=2),
    "sub(input=, other=)": lambda x, y: torch.sub(input=x, other=y),
    "rsub(other=, alpha=)": lambda x, y: torch.rsub(x, other=y, alpha=3),
    "mul(other=)": lambda x, y: torch.mul(x, other=y),
    "div(other=, rounding_mode=)": lambda x, y: torch.div(x, other=y, rounding_mode="trunc"),
    "floor_divide(other=)": lambda x, y: torch.floor_divide(x, other=y),
    "remainder(other=)": lambda x, y: x.remainder(other=y),
    "pow(exponent=)": lambda x, y: torch.pow(x, exponent=y),
    "maximum(other=)": lambda x, y: torch.maximum(x, other=y),
    "eq(other=)": lambda x, y: x.eq(other=y),
    "logical_xor(other=)": lambda x, y: torch.logical_xor(x, other=y),
    "where(input=, other=)": lambda x, y: torch.where(x > 0, input=x, other=y),
    "clamp(min=, max=)": lambda x, y: torch.clamp(x, min=y, max=y + 4),
}


@pytest.mark.parametrize("name", KEYWORDS)
def test_keyword_arguments(name: str) -> None:
    """Arguments passed by torch's keyword names reach the decompositions."""
    cases = [(f"{short(a)}, {short(b)}", (make(a, "t", 0), make(b, "v", 1)))
             for a, b in ((torch.int32, torch.int32), (torch.int8, torch.float16), (torch.float32, torch.int64))]
    assert_none(check(KEYWORDS[name], cases))


# --- ternary ops ---------------------------------------------------------------------------------------------------
def test_where() -> None:
    condition = torch.tensor([[True, False, True], [False, True, False]])
    cases = [(f"bool, {text}", (condition, *args)) for text, args in binary_cases()]
    cases.append(("uint8 condition", (condition.to(torch.uint8), make(torch.float32, "t", 0), 1.0)))
    assert_none(check(torch.where, cases, refused=REFUSED))


def test_clamp() -> None:
    """Tensor and number bounds, each alone and together: the result dtype promotes over all three."""
    cases: list[Case] = []
    for a in DTYPES:
        x = make(a, "t", 0)
        for b in DTYPES:
            for bound in (make(b, "v", 1), make(b, "z", 1)):
                cases += [(f"{describe(x)}, min={describe(bound)}", (x, bound, None)),
                          (f"{describe(x)}, max={describe(bound)}", (x, None, bound))]
            low, high = make(b, "v", 1), make(b, "z", 1)
            cases.append((f"{describe(x)}, min={describe(low)}, max={describe(high)}", (x, low, high)))
        for s in (True, -3, 2.5, -1.5, math.nan):
            cases += [(f"{describe(x)}, min={s!r}", (x, s, None)), (f"{describe(x)}, max={s!r}", (x, None, s)),
                      (f"{describe(x)}, min={s!r}, max=5", (x, s, 5))]
    assert_none(check(lambda x, low, high: torch.clamp(x, low, high), cases))


FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64)


def test_lerp() -> None:
    cases: list[Case] = []
    for a in DTYPES:
        for b in DTYPES:
            start, end = make(a, "t", 0), make(b, "v", 1)
            for weight in (0.25, 2, make(b, "z", 0), make(a, "v", 0)):
                cases.append((f"{describe(start)}, {describe(end)}, weight={describe(weight)}", (start, end, weight)))
    assert_none(check(torch.lerp, cases))


@pytest.mark.parametrize("name", ["addcmul", "addcdiv"])
def test_addcmul_addcdiv(name: str) -> None:
    fn = getattr(torch, name)
    cases: list[Case] = []
    for a in DTYPES:
        for b in DTYPES:
            for value in (1, 2, 0.5, True):
                x, t1, t2 = make(a, "t", 0), make(b, "v", 1), make(b, "z", 1)
                cases.append((f"{describe(x)}, {describe(t1)}, {describe(t2)}, value={value!r}", (x, t1, t2, value)))
    assert_none(check(lambda x, t1, t2, value: fn(x, t1, t2, value=value), cases))


# --- in-place ------------------------------------------------------------------------------------------------------
def _augmented(update: Callable[[torch.Tensor, Any], Any]) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    def op(x: torch.Tensor, y: Any) -> torch.Tensor:
        x = x.clone()
        update(x, y)
        return x

    return op


def _iadd(x: torch.Tensor, y: Any) -> None:
    x += y


def _isub(x: torch.Tensor, y: Any) -> None:
    x -= y


def _imul(x: torch.Tensor, y: Any) -> None:
    x *= y


def _itruediv(x: torch.Tensor, y: Any) -> None:
    x /= y


def _ifloordiv(x: torch.Tensor, y: Any) -> None:
    x //= y


def _imod(x: torch.Tensor, y: Any) -> None:
    x %= y


def _ipow(x: torch.Tensor, y: Any) -> None:
    x **= y


def _iand(x: torch.Tensor, y: Any) -> None:
    x &= y


def _ilshift(x: torch.Tensor, y: Any) -> None:
    x <<= y


INPLACE: dict[str, Callable[[torch.Tensor, Any], Any]] = {
    "add_": lambda x, y: x.add_(y),
    "add_alpha": lambda x, y: x.add_(y, alpha=2),
    "sub_": lambda x, y: x.sub_(y),
    "mul_": lambda x, y: x.mul_(y),
    "div_": lambda x, y: x.div_(y),
    "div_floor_": lambda x, y: x.div_(y, rounding_mode="floor"),
    "iadd": _iadd,
    "isub": _isub,
    "imul": _imul,
    "itruediv": _itruediv,
    "ifloordiv": _ifloordiv,
    "imod": _imod,
    "ipow": _ipow,
    "iand": _iand,
    "ilshift": _ilshift,
    "clamp_": lambda x, y: x.clamp_(min=y),
    "lt_": lambda x, y: x.lt_(y),
    "maximum_via_copy": lambda x, y: x.copy_(torch.maximum(x, y)) if isinstance(y, torch.Tensor) else x,
    "addcmul_": lambda x, y: x.addcmul_(y, y) if isinstance(y, torch.Tensor) else x,
}


@pytest.mark.parametrize("name", INPLACE)
def test_inplace(name: str) -> None:
    """The update computes in the promoted dtype and writes in the target's; eager refuses a result type that can't
    be cast to the target's (`result type Float can't be cast to the desired output type Long`), and fulmen must
    refuse it with a RuntimeError naming the cast."""
    assert_none(check(_augmented(INPLACE[name]), inplace_cases()))


@pytest.mark.parametrize("target", [torch.int64, torch.uint8, torch.bool, torch.float16])
def test_inplace_cast_error(target: torch.dtype) -> None:
    """The refusal itself: a RuntimeError, as eager's, whose message names the cast."""
    x = make(target, "t", 0)
    other = 2.5 if target != torch.float16 else 1j

    def program(x: torch.Tensor) -> torch.Tensor:
        x.add_(other)
        return x

    with pytest.raises(RuntimeError, match="can't be cast") as eager:
        program(x.clone())
    with pytest.raises(RuntimeError, match="can't be cast") as raised:
        fulmen.jit(program)(x.clone())
    assert short(target) in str(raised.value), (str(raised.value), str(eager.value))


def test_inplace_updates_the_input() -> None:
    """An update of a program input (written back to it) in the input's dtype."""
    def program(x: torch.Tensor, y: Any, z: torch.Tensor) -> None:
        x.mul_(y)
        z += x

    for a, b, y in ((torch.int8, torch.float16, 3), (torch.float16, torch.float32, 2.5), (torch.uint8, torch.int32, -1),
                    (torch.bool, torch.bool, True)):
        x, z = make(a, "t", 0), make(b, "t", 0)
        x_eager, z_eager = x.clone(), z.clone()
        program(x_eager, y, z_eager)
        fulmen.jit(program)(x, y, z)
        assert_none([d for d in (_same(x, x_eager, "x"), _same(z, z_eager, "z")) if d])


# --- integer edges -------------------------------------------------------------------------------------------------
def test_integer_edges() -> None:
    """Wrapping, division by zero (eager on CPU raises ZeroDivisionError for integer `//` and `%`), shifts past the
    bit width and negative powers of integers."""
    i8 = torch.tensor([-128, 127, 100, -1, 5], dtype=torch.int8)
    u8 = torch.tensor([255, 0, 200, 1, 5], dtype=torch.uint8)
    i32 = torch.tensor([2**31 - 1, -2**31, 7, -7, 0], dtype=torch.int32)
    i64 = torch.tensor([2**63 - 1, -2**63, 7, -7, 0], dtype=torch.int64)
    zero = torch.tensor([0, 1, 2, 0, 3])
    shifts = torch.tensor([0, 7, 8, 9, 64])
    cases: list[tuple[str, Callable[..., Any], tuple]] = []
    for x in (i8, u8, i32, i64):
        t = short(x.dtype)
        cases += [
            (f"{t} + 1", operator.add, (x, 1)),
            (f"{t} * 3", operator.mul, (x, 3)),
            (f"{t} - x", operator.sub, (0, x)),
            (f"-{t}", operator.neg, (x,)),
            (f"abs {t}", torch.abs, (x,)),
            (f"{t} << shifts", operator.lshift, (x, shifts.to(x.dtype))),
            (f"{t} >> shifts", operator.rshift, (x, shifts.to(x.dtype))),
            (f"{t} << 40", operator.lshift, (x, 40)),
            (f"{t} >> 70", operator.rshift, (x, 70)),
            (f"{t} // 0", operator.floordiv, (x, 0)),
            (f"{t} % 0", operator.mod, (x, 0)),
            (f"{t} // zeros", operator.floordiv, (x, zero.to(x.dtype))),
            (f"{t} % zeros", operator.mod, (x, zero.to(x.dtype))),
            (f"fmod {t} by zeros", torch.fmod, (x, zero.to(x.dtype))),
            (f"div trunc {t} by zeros", lambda a, b: torch.div(a, b, rounding_mode="trunc"), (x, zero.to(x.dtype))),
            (f"{t} / 0", operator.truediv, (x, 0)),
            (f"{t} ** -1", operator.pow, (x, -1)),
            (f"{t} ** -2 tensor", operator.pow, (x, torch.full_like(x, -2) if x.dtype != torch.uint8 else x)),
            (f"2 ** {t}", operator.pow, (2, x.clamp(0, 6))),
            (f"{t} ** 2", operator.pow, (x, 2)),
            (f"{t} ** 3", operator.pow, (x, 3)),
            (f"{t} ** 0.5", operator.pow, (x, 0.5)),
            (f"{t}.sum()", torch.sum, (x,)),
            (f"{t}.prod()", torch.prod, (x,)),
            (f"{t}.cumsum()", lambda a: torch.cumsum(a, 0), (x,)),
        ]
    ops = {text: op for text, op, _ in cases}
    assert_none(check(lambda text, *args: ops[text](*args), [(text, (text, *args)) for text, _, args in cases]))


# --- half precision roundings --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=short)
def test_half_precision_rounds_after_each_op(dtype: torch.dtype) -> None:
    """Eager rounds every op's result to the dtype: `a * b + c` is two roundings, `torch.add(c, b, alpha=a)` one;
    decompositions must round where the kernels round."""
    generator = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(4096, generator=generator).to(dtype) for _ in range(3))
    programs: dict[str, Callable[..., Any]] = {
        "a * b + c": lambda a, b, c: a * b + c,
        "add(c, b, alpha=1.1)": lambda a, b, c: torch.add(c, b, alpha=1.1),
        "sub(c, b, alpha=3)": lambda a, b, c: torch.sub(c, b, alpha=3),
        "addcmul(c, a, b, value=0.3)": lambda a, b, c: torch.addcmul(c, a, b, value=0.3),
        "addcdiv(c, a, b, value=0.3)": lambda a, b, c: torch.addcdiv(c, a, b, value=0.3),
        "lerp(a, b, 0.3)": lambda a, b, c: torch.lerp(a, b, 0.3),
        "lerp(a, b, c)": lambda a, b, c: torch.lerp(a, b, c),
        "a / b * c - a": lambda a, b, c: a / b * c - a,
        "(a - b) ** 2": lambda a, b, c: (a - b) ** 2,
        "hypot(a, b)": torch.hypot,
        "clamp(a, b, c)": lambda a, b, c: torch.clamp(a, b, c),
        "clamp(a, -0.3, 0.7)": lambda a, b, c: torch.clamp(a, -0.3, 0.7),
        "div(a, b, trunc)": lambda a, b, c: torch.div(a, b, rounding_mode="trunc"),
        "remainder(a, b)": lambda a, b, c: torch.remainder(a, b),
        "a + 0.1 (float32 mix)": lambda a, b, c: a + torch.tensor(0.1) * c.float(),
        "2.5 - a": lambda a, b, c: 2.5 - a,
        "1 / a": lambda a, b, c: 1 / a,
        "a.float() * b": lambda a, b, c: a.float() * b,
    }
    assert_none(check(lambda text, *args: programs[text](*args), [(text, (text, a, b, c)) for text in programs]))


# --- unary ops and reductions --------------------------------------------------------------------------------------
UNARY: dict[str, Callable[..., Any]] = {
    name: getattr(torch, name) for name in (
        "abs neg sign floor ceil round trunc frac bitwise_not logical_not isfinite isnan isinf signbit sqrt rsqrt "
        "exp exp2 expm1 log log1p sin tanh sigmoid reciprocal erf square positive relu").split()
}
UNARY["round_decimals"] = lambda x: torch.round(x, decimals=1)
UNARY["neg_operator"] = operator.neg
UNARY["invert_operator"] = operator.invert
UNARY["abs_operator"] = operator.abs


@pytest.mark.parametrize("name", UNARY)
def test_unary(name: str) -> None:
    cases = [(describe(x), (x,)) for dtype in DTYPES for x in (make(dtype, "t", 0), make(dtype, "z", 0))]
    assert_none(check(UNARY[name], cases))


REDUCTIONS: dict[str, Callable[..., Any]] = {
    "sum": torch.sum,
    "sum_dim": lambda x: torch.sum(x, 0),
    "sum_keepdim": lambda x: x.sum(-1, keepdim=True),
    "prod": torch.prod,
    "prod_dim": lambda x: torch.prod(x, 0),
    "cumsum": lambda x: torch.cumsum(x, -1),
    "cumprod": lambda x: torch.cumprod(x, -1),
    "mean": torch.mean,
    "mean_dtype": lambda x: torch.mean(x, dtype=torch.float64),
    "amax": lambda x: torch.amax(x, -1),
    "amin": torch.amin,
    "max": torch.max,
    "max_dim": lambda x: torch.max(x, -1),
    "min_dim": lambda x: torch.min(x, 0),
    "argmax": torch.argmax,
    "argmin_dim": lambda x: torch.argmin(x, -1),
    "all": torch.all,
    "any_dim": lambda x: torch.any(x, 0),
    "count_nonzero": torch.count_nonzero,
    "var": torch.var,
    "std_dim": lambda x: torch.std(x, 0),
    "logsumexp": lambda x: torch.logsumexp(x, -1),
    "norm": torch.linalg.vector_norm,
    "softmax": lambda x: torch.softmax(x, -1),
}


@pytest.mark.parametrize("name", REDUCTIONS)
def test_reduction(name: str) -> None:
    cases = [(describe(x), (x,)) for dtype in DTYPES for x in (make(dtype, "t", 0), make(dtype, "v", 1))]
    # exact for integer and bool results; floating ones to tolerance: a decomposition sums in another order than
    # eager's vectorized kernel (the promotion, not the summation order, is what this file checks)
    assert_none(check(REDUCTIONS[name], cases, exact=False))


# --- factories and the default dtype -------------------------------------------------------------------------------
FACTORIES: dict[str, Callable[[torch.Tensor], Any]] = {
    "zeros": lambda x: torch.zeros(2, 3),
    "ones": lambda x: torch.ones((2,)),
    "full_float": lambda x: torch.full((2,), 2.5),
    "full_int": lambda x: torch.full((2,), 2),
    "full_bool": lambda x: torch.full((2,), True),
    "full_complex": lambda x: torch.full((2,), 1j),
    "arange_int": lambda x: torch.arange(5),
    "arange_float": lambda x: torch.arange(0, 1, 0.25),
    "linspace": lambda x: torch.linspace(0, 1, 5),
    "eye": lambda x: torch.eye(3),
    "empty_shape": lambda x: torch.empty(2, 3).shape,
    "empty_dtype": lambda x: torch.empty(2, 3).dtype,
    "rand_dtype": lambda x: torch.rand(3).dtype,
    "randn_dtype": lambda x: torch.randn(3).dtype,
    "zeros_like": torch.zeros_like,
    "full_like": lambda x: torch.full_like(x, 2),
    "new_ones": lambda x: x.new_ones(2),
    "new_full": lambda x: x.new_full((2,), 3),
    "new_tensor_ops": lambda x: x + torch.ones(3),
    "int_times_float": lambda x: x * 2.5,
    "int_true_divide": lambda x: x / 2,
    "int_sqrt": torch.sqrt,
    "int_mean": lambda x: x.float().mean() + x.to(torch.get_default_dtype()).sum(),
    "int_atan2": lambda x: torch.atan2(x, x),
    "int_lerp_weight": lambda x: torch.lerp(x.double(), torch.ones(3), 0.5),
}


@pytest.mark.parametrize("default", [torch.float32, torch.float64], ids=short)
def test_factories_and_default_dtype(default: torch.dtype) -> None:
    """Factories without dtype=, and integer ops that produce floats, follow torch's default dtype, which the trace
    guards (a jitted program called again under another default retraces)."""
    x = torch.tensor([1, -2, 3])
    cases = [(name, (name, x)) for name in FACTORIES]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        failures = check(lambda name, x: FACTORIES[name](x), cases)
    finally:
        torch.set_default_dtype(previous)
    assert_none(failures)


def test_default_dtype_change_retraces() -> None:
    program = fulmen.jit(lambda x: (x / 2, torch.ones(2), x * 0.5))
    x = torch.tensor([1, 2, 3])
    assert [t.dtype for t in program(x)] == [torch.float32] * 3
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert [t.dtype for t in program(x)] == [torch.float64] * 3
    finally:
        torch.set_default_dtype(previous)
