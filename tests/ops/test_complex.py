"""Complex numbers on PyTorch's OpInfo samples, eager (and torch.func, and finite differences) as the oracle: the
ops of fulmen.ops.complex and the elementwise arithmetic on complex values, in each complex dtype op_db has them in.

- forward: every sample's values equal eager's, composites run as their decompositions (tests.ops.opdb.run_case);
- grads: in complex128 bit for bit eager's, through fulmen.jit's backward (torch's conjugate convention), and
  torch.autograd.gradcheck (finite differences, Wirtinger calculus) of the jitted function;
- jvp / vmap: fulmen.jvp and fulmen.vmap against torch.func's on the complex128 samples.

Beyond these ops, the first samples of every other OpInfo fulmen supports in complex64 and complex128 (forward,
and grads against eager's), which before fulmen.ops.complex reached autodiff's refusal of complex values.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

import fulmen
from fulmen.ops import lookup
from tests.ops.opdb import (
    INLINED,
    UNINITIALIZED,
    Case,
    NoOracle,
    NotDifferentiable,
    _assert_same,
    _flat_program,
    _named_callable,
    _oracle,
    _samples,
    run_case,
    run_vmap_case,
)
from tests.ops.outcomes import Outcomes

COMPLEX_DTYPES = (torch.complex64, torch.complex128, torch.complex32)
# The OpInfos of fulmen.ops.complex, and the arithmetic RoPE and other complex programs use
COMPLEX_OPS = frozenset(
    "view_as_real view_as_complex real imag complex polar angle conj conj_physical resolve_conj resolve_neg sgn "
    "isreal abs add sub rsub mul div true_divide neg square reciprocal exp".split()
)


def _bound(opinfo) -> bool:
    return (lookup(opinfo.op) or lookup(_named_callable(opinfo.name)) or lookup(INLINED.get(opinfo.name))) is not None


def opinfos(names=COMPLEX_OPS) -> list:
    return [o for o in op_db if o.name in names and _bound(o)]


@dataclass(frozen=True)
class DtypeCase:
    """An op_db case with its dtype in its id."""

    case: Case
    dtype: torch.dtype

    @property
    def id(self) -> str:
        return f"{self.case.id}-{str(self.dtype).removeprefix('torch.')}"


def dtype_cases(chosen: list, dtypes, requires_grad: bool, limit: int) -> list[DtypeCase]:
    cases = []
    for dtype in dtypes:
        supporting = [
            o for o in chosen if dtype in o.supported_dtypes("cpu") and (not requires_grad or o.supports_autograd)
        ]
        cases += [DtypeCase(c, dtype) for c in _samples(supporting, dtype, requires_grad, limit)]
    return cases


# Grads refused with a clear error, by OpInfo name (as for real values)
GRADS_REFUSED: dict[str, str] = dict.fromkeys(
    ("as_strided", "as_strided.partial_views", "as_strided_scatter"),
    "fulmen refuses to differentiate as_strided (storage layout is not modeled)",
)
# Samples passing an input with its conjugate bit set (`x.conj()` as an argument): refused, naming the argument
CONJUGATE_INPUT = "an input is a lazy conjugate view: fulmen refuses it, naming resolve_conj() (proxies.unproxyable)"
# Eager's forward takes another LAPACK path when its input requires grad (it computes the vectors too), fulmen's
# forward runs without grad: their values are 1 ulp apart, as for real inputs (tests/ops/opdb.py)
FORWARD_PATH_DIFFERS = frozenset({"linalg.cond", "linalg.eigvalsh", "linalg.svdvals", "norm.nuc"})


def expected_failure(dcase: DtypeCase, grads: bool = False) -> str | None:
    case = dcase.case
    if grads and case.op_name in GRADS_REFUSED:
        return GRADS_REFUSED[case.op_name]
    if any(t.is_conj() for t in _tensors((case.sample.input, case.sample.args, case.sample.kwargs))):
        return CONJUGATE_INPUT
    return case.xfail_reason


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _differentiable(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def _equal(got: torch.Tensor, want: torch.Tensor, what: str, exact: bool = True) -> None:
    assert (got.shape, got.dtype) == (want.shape, want.dtype), (
        f"{what}: {got.shape} {got.dtype}, eager's {want.shape} {want.dtype}"
    )
    tolerance = 0 if exact else 1e-7
    torch.testing.assert_close(
        got, want, rtol=tolerance, atol=tolerance, equal_nan=True, check_stride=False, msg=lambda m: f"{what}: {m}"
    )


def _random_like(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(t.shape, dtype=t.dtype, generator=generator)


def run_grad_case(dcase: DtypeCase) -> None:
    """fulmen.jit's outputs and backward equal eager's bit for bit (the torch executor runs eager's kernels, and the
    grads on complex values follow eager's formulas or are eager's backward)."""
    case = dcase.case
    op, sample = case.opinfo.op, case.sample
    structure = (sample.input, sample.args, sample.kwargs)
    wrt = [t for t in _tensors(structure) if t.requires_grad and _differentiable(t)]
    if not wrt:
        raise NotDifferentiable

    def program(inp, args, kwargs):
        return op(inp, *args, **kwargs)

    try:
        expected = _tensors(program(*structure))
        outs = [o for o in expected if o.requires_grad]
        if not outs:
            raise NotDifferentiable
        generator = torch.Generator().manual_seed(case.index)
        v = [_random_like(o, generator) for o in outs]
        want = torch.autograd.grad(outs, wrt, v, allow_unused=True)
    except (RuntimeError, ValueError, NotImplementedError) as error:
        raise NoOracle(str(error)) from error
    actual = _tensors(fulmen.jit(program)(*structure))
    assert [o.requires_grad for o in actual] == [o.requires_grad for o in expected], "outputs requiring grad differ"
    exact = case.op_name not in FORWARD_PATH_DIFFERS
    for i, (got, ref) in enumerate(zip(actual, expected)):
        if case.opinfo.name not in UNINITIALIZED:
            _equal(got, ref, f"output {i}", exact)
    got_grads = torch.autograd.grad([o for o in actual if o.requires_grad], wrt, v, allow_unused=True)
    for i, (got, ref) in enumerate(zip(got_grads, want)):
        got, ref = (torch.zeros_like(wrt[i]) if t is None else t for t in (got, ref))
        _equal(got, ref, f"grad of input {i}", exact)


def run_gradcheck_case(dcase: DtypeCase) -> None:
    """torch.autograd.gradcheck of the jitted sample, as a function of its tensors that require grad: fulmen's
    backward against finite differences (for complex inputs and outputs, of each's real and imaginary parts)."""
    program, tensors = _flat_program(dcase.case)
    wrt = [i for i, t in enumerate(tensors) if t.requires_grad and _differentiable(t)]
    if not wrt:
        raise NotDifferentiable

    def of_wrt(*primals):
        filled = list(tensors)
        for i, p in zip(wrt, primals):
            filled[i] = p
        return program(*filled)

    primals = tuple(tensors[i].detach().requires_grad_(True) for i in wrt)
    try:
        with torch.no_grad():
            outs = [o for o in _tensors(of_wrt(*primals)) if _differentiable(o)]
    except (RuntimeError, ValueError) as error:
        raise NoOracle(str(error)) from error
    if not outs:
        raise NotDifferentiable
    jitted = fulmen.jit(of_wrt)
    assert torch.autograd.gradcheck(
        lambda *p: tuple(o for o in _tensors(jitted(*p)) if _differentiable(o)), primals, eps=1e-6, atol=1e-5, rtol=1e-4
    )


def run_jvp_case(dcase: DtypeCase) -> str:
    """fulmen.jvp against torch.func.jvp with respect to every floating and complex tensor of the sample."""
    case = dcase.case
    program, tensors = _flat_program(case)
    chosen = [i for i, t in enumerate(tensors) if _differentiable(t)]
    if not chosen:
        raise NotDifferentiable

    def of_chosen(*primals):
        args = list(tensors)
        for i, p in zip(chosen, primals):
            args[i] = p
        return program(*args)

    primals = tuple(tensors[i] for i in chosen)
    generator = torch.Generator().manual_seed(case.index)
    tangents = tuple(_random_like(p, generator) for p in primals)
    expected = _oracle(lambda: torch.func.jvp(of_chosen, primals, tangents))
    jitted = fulmen.jit(lambda p, t: fulmen.jvp(of_chosen, p, t))
    out, tangent_out = jitted(primals, tangents)
    _assert_same(out, expected[0], values=case.opinfo.name not in UNINITIALIZED)
    _assert_same(tangent_out, expected[1])
    return "fallback" if "impls.torch_jvp" in str(fulmen.last_traces(jitted)[-1]) else "rules"


def _vmap(dcase: DtypeCase) -> str:
    return run_vmap_case(dcase.case)


def _forward(dcase: DtypeCase) -> None:
    run_case(dcase.case)


_SKIP = ((NotDifferentiable, lambda error: "skip"), (NoOracle, lambda error: "skip"))
FORWARD = Outcomes(_forward)
GRADS = Outcomes(run_grad_case, _SKIP)
GRADCHECK = Outcomes(run_gradcheck_case, _SKIP)
JVP = Outcomes(lambda case: run_jvp_case(case) and None, _SKIP)
VMAP = Outcomes(lambda case: _vmap(case) and None, _SKIP)

CHOSEN = opinfos()
FORWARD_CASES = dtype_cases(CHOSEN, (torch.float32, *COMPLEX_DTYPES), False, 16)
GRAD_CASES = dtype_cases(CHOSEN, (torch.complex128, torch.float64), True, 8)
GRADCHECK_CASES = dtype_cases(CHOSEN, (torch.complex128,), True, 2)
FUNCTIONAL_CASES = dtype_cases(CHOSEN, (torch.complex128,), False, 3)
# every other OpInfo bound to a symbol: its first two samples in each dtype
OTHERS = [o for o in op_db if o.name not in COMPLEX_OPS and _bound(o)]
OTHER_FORWARD_CASES = dtype_cases(OTHERS, (torch.complex64,), False, 1)
OTHER_GRAD_CASES = dtype_cases(OTHERS, (torch.complex128,), True, 1)


def _params(cases, grads: bool = False):
    params = []
    for c in cases:
        reason = expected_failure(c, grads)
        params.append(pytest.param(c, id=c.id, marks=[pytest.mark.xfail(reason=reason, strict=True)] if reason else []))
    return params


def _check(outcomes: Outcomes, dcase: DtypeCase, grads: bool = False) -> None:
    outcome = outcomes(dcase)
    if outcome == "skip":
        if expected_failure(dcase, grads):
            raise AssertionError("expected a refusal, got nothing to compare")
        pytest.skip("nothing to differentiate, or no answer from the oracle")
    assert outcome == "pass", outcome


@pytest.mark.parametrize("dcase", _params(FORWARD_CASES))
def test_forward(dcase):
    _check(FORWARD, dcase)


@pytest.mark.parametrize("dcase", _params(GRAD_CASES, grads=True))
def test_grads_equal_eagers(dcase):
    _check(GRADS, dcase, grads=True)


@pytest.mark.parametrize("dcase", _params(GRADCHECK_CASES, grads=True))
def test_gradcheck(dcase):
    _check(GRADCHECK, dcase, grads=True)


@pytest.mark.parametrize("dcase", _params(FUNCTIONAL_CASES))
def test_jvp(dcase):
    _check(JVP, dcase)


@pytest.mark.parametrize("dcase", _params(FUNCTIONAL_CASES))
def test_vmap(dcase):
    _check(VMAP, dcase)


@pytest.mark.parametrize("dcase", _params(OTHER_FORWARD_CASES))
def test_other_ops_forward(dcase):
    _check(FORWARD, dcase)


@pytest.mark.parametrize("dcase", _params(OTHER_GRAD_CASES, grads=True))
def test_other_ops_grads_equal_eagers(dcase):
    _check(GRADS, dcase, grads=True)


def test_summary(summary):
    lines, failures = [], []
    for name, outcomes, cases, grads in (
        ("forward", FORWARD, FORWARD_CASES, False),
        ("grads (bit for bit)", GRADS, GRAD_CASES, True),
        ("gradcheck", GRADCHECK, GRADCHECK_CASES, True),
        ("jvp", JVP, FUNCTIONAL_CASES, False),
        ("vmap", VMAP, FUNCTIONAL_CASES, False),
        ("other ops forward (complex64)", FORWARD, OTHER_FORWARD_CASES, False),
        ("other ops grads (complex128)", GRADS, OTHER_GRAD_CASES, True),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            counts, unexpected = outcomes.tally(
                cases,
                lambda case, outcome, grads=grads: (
                    outcome if outcome in ("pass", "skip") else "refused" if expected_failure(case, grads) else "fail"
                ),
            )
        ops = len({c.case.op_name for c in cases})
        lines.append(
            f"complex op_db {name}: {ops} OpInfos, {len(cases)} samples: {counts['pass']} pass, "
            f"{counts['skip']} skip, {counts['refused']} refused as expected, {counts['fail']} fail"
        )
        failures += unexpected
    summary("\n".join(lines))
    assert not failures, "\n".join(failures[:20])
