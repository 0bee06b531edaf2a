"""Running PyTorch's own OpInfo samples (torch.testing._internal op_db) through fulmen.jit."""

from __future__ import annotations

import concurrent.futures
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch
import torch.testing._internal.opinfo.core as opinfo_core
from torch.testing._internal.common_methods_invocations import op_db

import fulmen
from fulmen.core.symbol import BoundSymbol, Tag, iter_proxies, map_proxies
from fulmen.executors.base import Executor, Implementation
from fulmen.ops import lookup
from fulmen.ops.rules.eager import EAGER_OPS
from fulmen.ops.rules.tables import RuleKind, table
from tests.sweeps import FULL_SWEEPS

# Samples per OpInfo, of up to several hundred: 381 OpInfos, within the CPU CI budget (each sweep's own cap below).
SAMPLES_PER_OP = 16
UNINITIALIZED = {"empty", "empty_like", "new_empty", "empty_strided"}

# Known limitations (never wrong results: fulmen raises a clear error for each), by sample id, and by OpInfo name
# for the samples that pass a tensor where the op reads its value to decide the output shape.
XFAIL: dict[str, str] = {
    "__getitem__-14": "indexing with a boolean mask is data-dependent (fulmen raises DataDependentError)",
}
XFAIL_TENSOR_ARGUMENT: dict[str, str] = {
    "repeat_interleave": "tensor repeats without output_size are data-dependent (fulmen raises DataDependentError)",
    "tensor_split": "split indices given as a tensor are data-dependent (fulmen raises DataDependentError)",
}
# By OpInfo name, samples fulmen refuses (with a clear error) for the values of their arguments: (which, why).
XFAIL_WHERE: dict[str, tuple[Callable[[object], bool], str]] = {
    name: (lambda sample: sample.kwargs.get("driver") in ("gelsd", "gelss")
           and sample.input.shape[-2] > sample.input.shape[-1],
           "lstsq's gelsd and gelss drivers give a tall matrix's residuals only where it has full rank: their shape "
           "depends on the values")
    for name in ("linalg.lstsq", "linalg.lstsq.grad_oriented")
}
# By OpInfo name, the keyword arguments fulmen refuses (with a clear error) where a sample sets them.
XFAIL_KWARGS: dict[str, dict[str, str]] = {
    "nn.functional.embedding_bag": {
        "max_norm": "max_norm renormalises the weight in place, which the backward's recompute would do again",
        "sparse": "sparse=True asks for a sparse grad, which fulmen's backward does not produce",
    },
}


@dataclass(frozen=True)
class Case:
    op_name: str  # OpInfo name, with its variant test name
    opinfo: object
    index: int
    sample: object

    @property
    def id(self) -> str:
        return f"{self.op_name}-{self.index}"

    @property
    def xfail_reason(self) -> str | None:
        if self.id in XFAIL:
            return XFAIL[self.id]
        values = (*self.sample.args, *self.sample.kwargs.values())
        if self.op_name in XFAIL_TENSOR_ARGUMENT and "output_size" not in self.sample.kwargs and any(
            isinstance(v, torch.Tensor) for v in values
        ):
            return XFAIL_TENSOR_ARGUMENT[self.op_name]
        where, why = XFAIL_WHERE.get(self.op_name, (None, None))
        if where is not None and where(self.sample):
            return why
        refused = XFAIL_KWARGS.get(self.op_name, {})
        return next((reason for name, reason in refused.items() if self.sample.kwargs.get(name)), None)


def _named_callable(name: str):
    """The torch callable an OpInfo's name spells ("nn.functional.embedding"), or None."""
    target = torch
    for part in name.split("."):
        target = getattr(target, part, None)
    return target


# OpInfos whose op is torch's Python (run inline) calling a builtin fulmen binds.
INLINED: dict[str, Callable] = {
    "tensordot": torch._C._VariableFunctions.tensordot,
    "chain_matmul": torch._C._VariableFunctions.chain_matmul,
    "block_diag": torch._C._VariableFunctions.block_diag,
    "cartesian_prod": torch._C._VariableFunctions.cartesian_prod,
    "stft": torch._C._VariableFunctions.stft,
}


def supported_opinfos() -> list:
    chosen = []
    for opinfo in op_db:
        # some OpInfos run their op through a wrapper (F.embedding's takes (weight, index)): the wrapper is traced,
        # so the op its name spells is what they test
        binding = lookup(opinfo.op) or lookup(_named_callable(opinfo.name)) or lookup(INLINED.get(opinfo.name))
        if binding is None or binding.symbol.tags & Tag.RANDOM:
            continue
        if torch.float32 not in opinfo.supported_dtypes("cpu"):
            continue
        chosen.append(opinfo)
    return chosen


def _full_name(opinfo) -> str:
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


def _samples(opinfos, dtype: torch.dtype, requires_grad: bool, limit: int) -> Iterator[Case]:
    """The first `limit` samples of each OpInfo, made on a thread of its own: OpInfo.sample_inputs walks the caller's
    stack (common_utils.extract_test_fn, inspect.stack), and on pytest's stack inspect.getmodule scans every loaded
    module for each frame (~20x slower: 65 s instead of 3 s to collect test_op_db.py, most of the suite's collection
    time). The samples are the same: with no unittest.TestCase on the stack, sample_inputs seeds with its default."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return iter(pool.submit(lambda: list(_made_samples(opinfos, dtype, requires_grad, limit))).result())


def _made_samples(opinfos, dtype: torch.dtype, requires_grad: bool, limit: int) -> Iterator[Case]:
    for opinfo in opinfos:
        name = _full_name(opinfo)
        samples = opinfo.sample_inputs("cpu", dtype, requires_grad=requires_grad)
        for index, sample in enumerate(samples):
            if index >= limit:
                break
            if sample.kwargs.get("dropout_p", 0.0) > 0:  # a random draw: no value to compare with eager's
                continue
            yield Case(name, opinfo, index, sample)


def cases() -> Iterator[Case]:
    return _samples(supported_opinfos(), torch.float32, False, SAMPLES_PER_OP)


# --- composites run as their decompositions: the values fusion executors compile ---------------------------------
# Where a decomposition knowingly differs from eager's kernel, by value set (see EDGE_VALUES) and OpInfo name.
DECOMPOSITION_DIFFERS: dict[tuple[str, str], str] = {
    ("sampled", "nn.functional.scaled_dot_product_attention"):
        "the decomposition is the math attention, eager's CPU kernel the flash algorithm: they round differently "
        "(1.5e-5 in float32); GPUs run the attention kernels themselves (the sdpa executor)",
    ("nonfinite", "nn.functional.scaled_dot_product_attention"):
        "which scores turn NaN when a row holds inf differs between the math and the flash algorithm",
    ("nonfinite", "native_layer_norm"):
        "the mean output of a row holding inf: eager's Welford mean is NaN, the decomposition's inf (the normalised "
        "output is NaN in both)",
}


class DecomposedExecutor(Executor):
    """Runs every composite as its decomposition, prim by prim (each by torch): the values a fusion executor
    compiles, checked without compiling. (The torch executor alone would run each composite as eager's kernel.)"""

    def claims(self, bsym: BoundSymbol) -> Implementation | None:
        return Implementation(execution_transform=_replay(bsym)) if bsym.subsymbols else None


def _replay(composite: BoundSymbol):
    """An execution transform calling the symbols of `composite`'s recorded decomposition again."""

    def transform(*args, **kwargs):
        renamed: dict[str, object] = {}

        def current(p):
            return renamed.get(p.pname, p)

        for sub in composite.subsymbols:
            out = sub.sym(*map_proxies(sub.args, current), **map_proxies(sub.kwargs, current))
            renamed.update((old.pname, new) for old, new in zip(iter_proxies(sub.output), iter_proxies(out)))
        return map_proxies(composite.output, current)

    return transform


DECOMPOSED = DecomposedExecutor("decomposed (tests)")


def run_case(case: Case) -> None:
    """The sample's values equal eager's with every composite run as its decomposition (what fusion executors
    compile), or as eager's kernel where the decomposition is knowingly another algorithm."""
    op, sample = case.opinfo.op, case.sample
    executors = None if ("sampled", case.op_name) in DECOMPOSITION_DIFFERS else [DECOMPOSED]

    def program(inp, args, kwargs):
        return op(inp, *args, **kwargs)

    expected = program(sample.input, sample.args, sample.kwargs)
    actual = fulmen.jit(program, executors=executors)(sample.input, sample.args, sample.kwargs)
    if case.opinfo.name in UNINITIALIZED:  # values are undefined: compare what is defined
        assert (actual.shape, actual.dtype, actual.device) == (expected.shape, expected.dtype, expected.device)
        return
    torch.testing.assert_close(actual, expected, equal_nan=True, rtol=1e-5, atol=1e-5)


# --- float64 VJP checks -------------------------------------------------------------------------------------------
VJP_SAMPLES_PER_OP = 4
VJP_XFAIL_OPS: dict[str, str] = {
    "as_strided": "fulmen refuses to differentiate as_strided (storage layout is not modeled)",
    "as_strided.partial_views": "fulmen refuses to differentiate as_strided (storage layout is not modeled)",
    "as_strided_scatter": "fulmen refuses to differentiate as_strided_scatter (storage layout is not modeled)",
}
# OpInfos left out of the grad checks, by name: every differentiable sample is refused by design (with a clear
# error naming the line). None now: the FFTs' and linalg.eig's complex outputs are differentiated as eager does
# (fulmen.ops.complex), and tests/ops/test_complex.py checks complex grads bit for bit.
NOT_DIFFERENTIATED: dict[str, str] = {}
# OpInfo gradcheck wrappers that map any input onto the inputs the op is defined on (a hermitian or a triangular
# matrix): finite differences of the bare op would perturb the elements it never reads.
INPUT_WRAPPERS = (opinfo_core.gradcheck_wrapper_hermitian_input,
                  opinfo_core.gradcheck_wrapper_triangular_input_real_positive_diagonal)
# Keyword arguments whose eager grads are not the finite differences' (torch.autograd.gradcheck fails on eager
# too), by OpInfo name: left out of the VJP check; test_op_db_grads checks that fulmen's grads are eager's.
VJP_EAGER_INEXACT: dict[str, tuple[str, str]] = {
    "cov": ("aweights", "eager's backward of cov for aweights is not the derivative of its forward"),
}
# The same, by OpInfo name, where the OpInfo has no wrapper: cholesky_solve reads one triangle of its factor, and
# eager's backward (like fulmen's, which is eager's) gives a grad for the whole matrix.
VJP_INPUT_WRAPPERS: dict[str, Callable] = {
    "cholesky_solve": lambda op, b, factor, upper=False: op(b, factor.triu() if upper else factor.tril(), upper),
}


def vjp_xfail_reason(case: Case) -> str | None:
    return VJP_XFAIL_OPS.get(case.op_name) or case.xfail_reason


def _differentiable_opinfos() -> list:
    return [o for o in supported_opinfos() if o.supports_autograd and torch.float64 in o.supported_dtypes("cpu")
            and _full_name(o) not in NOT_DIFFERENTIATED]


def vjp_cases() -> Iterator[Case]:
    differentiable = _differentiable_opinfos()
    return _samples(differentiable, torch.float64, True, VJP_SAMPLES_PER_OP)


class NotDifferentiable(Exception):
    """The sample has no floating output that depends on an input requiring grad: nothing to check."""


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def run_vjp_case(case: Case, eps: float = 1e-6) -> None:
    """Checks <J u, v> == <u, J^T v>: J u by central differences of eager, J^T v by fulmen's backward."""
    op, sample = case.opinfo.op, case.sample
    structure = (sample.input, sample.args, sample.kwargs)
    inexact = VJP_EAGER_INEXACT.get(case.op_name, ("", ""))[0]
    wrt = [t for t in _tensors(structure) if t.requires_grad and t.dtype.is_floating_point
           and t is not sample.kwargs.get(inexact)]
    if not wrt:
        raise NotDifferentiable
    wrapper = case.opinfo.gradcheck_wrapper if case.opinfo.gradcheck_wrapper in INPUT_WRAPPERS else None
    wrapper = VJP_INPUT_WRAPPERS.get(case.op_name, wrapper)

    def program(inp, args, kwargs):
        return wrapper(op, inp, *args, **kwargs) if wrapper is not None else op(inp, *args, **kwargs)

    def floating(out) -> list[torch.Tensor]:
        return [t for t in _tensors(out) if t.dtype.is_floating_point]

    outs = [o for o in floating(fulmen.jit(program)(*structure)) if o.requires_grad]
    if not outs:
        raise NotDifferentiable
    generator = torch.Generator().manual_seed(case.index)
    v = [torch.randn(o.shape, dtype=o.dtype, generator=generator) for o in outs]
    u = [torch.randn(t.shape, dtype=t.dtype, generator=generator) for t in wrt]
    grads = torch.autograd.grad(outs, wrt, v, allow_unused=True)
    vjp = sum((g * d).sum() for g, d in zip(grads, u) if g is not None)

    def shifted(sign: float):
        replacement = {id(t): (t.detach() + sign * eps * d) for t, d in zip(wrt, u)}
        moved = torch.utils._pytree.tree_map(
            lambda x: replacement.get(id(x), x.detach() if isinstance(x, torch.Tensor) else x), structure)
        with torch.no_grad():
            return [o for o in floating(program(*moved))]

    plus, minus = shifted(1.0), shifted(-1.0)
    eager_outs = [o for o in floating(program(*structure))]
    keep = [i for i, o in enumerate(eager_outs) if o.requires_grad]
    jvp = sum(((plus[i] - minus[i]) / (2 * eps) * w).sum() for i, w in zip(keep, v))
    torch.testing.assert_close(torch.as_tensor(vjp, dtype=torch.float64), torch.as_tensor(jvp, dtype=torch.float64),
                               rtol=1e-5, atol=1e-5, equal_nan=True)


# --- torch.func as the oracle: fulmen.jvp and fulmen.vmap on float64 samples ---------------------------------------
FUNCTIONAL_SAMPLES_PER_OP = 2
BATCH = 2


class NoOracle(Exception):
    """torch.func cannot transform the sample (no forward-mode AD formula, a vmap it refuses): nothing to compare."""


def functional_cases() -> Iterator[Case]:
    chosen = [o for o in supported_opinfos() if torch.float64 in o.supported_dtypes("cpu")]
    return _samples(chosen, torch.float64, False, FUNCTIONAL_SAMPLES_PER_OP)


def _flat_program(case: Case):
    """The sample as a function of its tensor leaves (in order), the leaves, and nothing else captured."""
    op, sample = case.opinfo.op, case.sample
    structure = (sample.input, sample.args, sample.kwargs)
    leaves, spec = torch.utils._pytree.tree_flatten(structure)
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def program(*tensors):
        filled = list(leaves)
        for i, t in zip(positions, tensors):
            filled[i] = t
        inp, args, kwargs = torch.utils._pytree.tree_unflatten(filled, spec)
        return op(inp, *args, **kwargs)

    return program, [leaves[i] for i in positions]


def _oracle(fn):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()
    except Exception as error:  # noqa: BLE001 - torch.func's own limits are not fulmen's failures
        raise NoOracle(f"{type(error).__name__}: {error}") from error


def _assert_same(actual, expected, values: bool = True) -> None:
    """The same structure, shapes and dtypes, and (unless `values` is False: uninitialized outputs) values."""
    got, want = torch.utils._pytree.tree_leaves(actual), torch.utils._pytree.tree_leaves(expected)
    assert len(got) == len(want), (len(got), len(want))
    for g, w in zip(got, want):
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor) and g.shape == w.shape and g.dtype == w.dtype, (g, w)
            if values:
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, equal_nan=True)
        else:
            assert g == w


def run_jvp_case(case: Case) -> str:
    """fulmen.jvp against torch.func.jvp with respect to every floating tensor of the sample; returns how fulmen
    computed it: "rules", or "fallback" when some op went through torch's forward-mode AD."""
    program, tensors = _flat_program(case)
    floating = [i for i, t in enumerate(tensors) if t.dtype.is_floating_point]
    if not floating:
        raise NotDifferentiable

    def of_floats(*primals):
        args = list(tensors)
        for i, p in zip(floating, primals):
            args[i] = p
        return program(*args)

    primals = tuple(tensors[i] for i in floating)
    generator = torch.Generator().manual_seed(case.index)
    tangents = tuple(torch.randn(p.shape, dtype=p.dtype, generator=generator) for p in primals)
    expected = _oracle(lambda: torch.func.jvp(of_floats, primals, tangents))
    jitted = fulmen.jit(lambda p, t: fulmen.jvp(of_floats, p, t))
    (out, tangent_out) = jitted(primals, tangents)
    _assert_same(out, expected[0], values=case.opinfo.name not in UNINITIALIZED)
    _assert_same(tangent_out, expected[1])
    return "fallback" if "impls.torch_jvp" in str(fulmen.last_traces(jitted)[-1]) else "rules"


def _batched(x: torch.Tensor, dim: int, generator: torch.Generator) -> torch.Tensor:
    """A batch of BATCH examples along `dim`: `x` and `x` with its elements permuted (valid wherever `x` is: the same
    values, so indices stay in range and unique indices stay unique)."""
    order = torch.randperm(x.numel(), generator=generator)
    other = x.flatten()[order].reshape(x.shape) if x.numel() else x
    return torch.stack([x, other], dim)


def run_vmap_case(case: Case) -> str:
    """fulmen.vmap against torch.func.vmap, every tensor of the sample batched (the first along a dim that varies
    with the sample, every third one not batched); returns "rules", or "loop" when some op ran once per example."""
    program, tensors = _flat_program(case)
    generator = torch.Generator().manual_seed(case.index)
    in_dims, batched = [], []
    for k, t in enumerate(tensors):
        dim = case.index % (t.dim() + 1) if k == 0 else (None if k % 3 == 2 else 0)
        in_dims.append(dim)
        batched.append(t if dim is None else _batched(t, dim, generator))
    if all(d is None for d in in_dims):
        raise NotDifferentiable  # nothing to map over
    expected = _oracle(lambda: torch.func.vmap(program, in_dims=tuple(in_dims))(*batched))
    mapped = fulmen.vmap(program, in_dims=tuple(in_dims))
    _assert_same(mapped(*batched), expected, values=case.opinfo.name not in UNINITIALIZED)
    return "loop" if "impls.batch_loop" in str(fulmen.last_traces(mapped)[-1]) else "rules"


# --- torch.func as the oracle: forward-over-reverse, fulmen.jvp(fulmen.grad(f)) on float64 samples ------------------
# One sample per OpInfo: of every OpInfo fulmen differentiates with a grad or JVP rule of its own, every 4th of those
# it differentiates through their decomposition (the prims' rules, which many share) and every 10th of those it
# differentiates by eager's backward (impls.torch_vjp and torch_jvp of it, the same for all; the rest is torch's).
# Compiling a grad and its JVP costs ~0.15-0.3 s per OpInfo, on the CPU budget. FULMEN_FULL_SWEEPS=1: every one.
JVP_OF_GRAD_SAMPLES_PER_OP = 1
JVP_OF_GRAD_STRIDES = {"rules": 1, "decomposition": 4, "eager": 10}


def differentiated_by(opinfo) -> str:
    """How fulmen differentiates the OpInfo's op: by a rule of its own (a grad or JVP rule), through its
    decomposition, or (autodiff's fallback) by eager's backward ("eager")."""
    binding = lookup(opinfo.op) or lookup(_named_callable(opinfo.name)) or lookup(INLINED.get(opinfo.name))
    sym = binding.symbol
    if sym in table(RuleKind.GRAD) or sym in table(RuleKind.JVP):
        return "rules"
    return "decomposition" if sym.decomposition is not None else "eager"


def jvp_of_grad_cases() -> list[Case]:
    """The first sample of each OpInfo chosen."""
    by_kind: dict[str, list] = {kind: [] for kind in JVP_OF_GRAD_STRIDES}
    for opinfo in sorted(_differentiable_opinfos(), key=_full_name):
        by_kind[differentiated_by(opinfo)].append(opinfo)
    strides = {kind: 1 for kind in by_kind} if FULL_SWEEPS else JVP_OF_GRAD_STRIDES
    chosen = [o for kind, opinfos in by_kind.items() for o in opinfos[::strides[kind]]]
    return list(_samples(chosen, torch.float64, True, JVP_OF_GRAD_SAMPLES_PER_OP))


def _scalarised(case: Case):
    """The sample as a scalar function of its floating tensors that require grad, `sum(c * out * out)` over its
    floating outputs (c fixed, random): its Hessian holds both the op's second derivative (weighted by the outputs)
    and the op's Jacobian twice, so it sees the JVP of every part of the op's backward. Returns the function and
    the primals; the sample's other tensors are captured."""
    op, sample = case.opinfo.op, case.sample
    structure = (sample.input, sample.args, sample.kwargs)
    leaves, spec = torch.utils._pytree.tree_flatten(structure)
    positions = [i for i, x in enumerate(leaves)
                 if isinstance(x, torch.Tensor) and x.requires_grad and x.dtype.is_floating_point]
    if not positions:
        raise NotDifferentiable
    wrapper = case.opinfo.gradcheck_wrapper if case.opinfo.gradcheck_wrapper in INPUT_WRAPPERS else None
    wrapper = VJP_INPUT_WRAPPERS.get(case.op_name, wrapper)

    def outputs(*primals):
        filled = list(leaves)
        for i, p in zip(positions, primals):
            filled[i] = p
        inp, args, kwargs = torch.utils._pytree.tree_unflatten(filled, spec)
        out = wrapper(op, inp, *args, **kwargs) if wrapper is not None else op(inp, *args, **kwargs)
        return [o for o in _tensors(out) if o.dtype.is_floating_point]

    primals = tuple(leaves[i].detach() for i in positions)
    with torch.no_grad():
        shapes = [o.shape for o in outputs(*primals)]
    if not shapes:
        raise NotDifferentiable
    generator = torch.Generator().manual_seed(case.index)
    weights = [torch.randn(shape, dtype=torch.float64, generator=generator) for shape in shapes]

    def scalar(*primals):
        return sum((c * o * o).sum() for c, o in zip(weights, outputs(*primals)))

    return scalar, primals


def run_jvp_of_grad_case(case: Case) -> None:
    """fulmen.jvp(fulmen.grad(f)) against torch.func.jvp(torch.func.grad(f)) (the gradient and its directional
    derivative, a Hessian-vector product) for f the sample scalarised, with respect to every input that requires
    grad (NotDifferentiable: none; NoOracle: torch.func cannot)."""
    scalar, primals = _scalarised(case)
    generator = torch.Generator().manual_seed(case.index + 1)
    tangents = tuple(torch.randn(p.shape, dtype=p.dtype, generator=generator) for p in primals)
    argnums = tuple(range(len(primals)))
    expected = _oracle(lambda: torch.func.jvp(torch.func.grad(scalar, argnums), primals, tangents))
    actual = fulmen.jit(lambda p, t: fulmen.jvp(fulmen.grad(scalar, argnums), p, t))(primals, tangents)
    _assert_same(actual, expected)


# --- eager autograd as the oracle: fulmen's gradients equal eager's, at edge values too ------------------------------
# Values each floating input is drawn from, beyond the sample's own: ties, zeros and clamp bounds ("kinks"), and
# the values where formulas read 0/0, inf - inf or 0 * inf ("nonfinite"). Finite differences cannot see these
# (nor backward-only flags such as scale_grad_by_freq): eager's backward decides what the gradient is there.
EDGE_VALUES: dict[str, tuple[float, ...] | None] = {
    "sampled": None,
    "kinks": (-2.0, -1.0, 0.0, 1.0, 2.0),
    "nonfinite": (0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 1e-300, -3.0),
}
GRAD_SAMPLES_PER_OP = 8


def grad_cases() -> Iterator[Case]:
    differentiable = _differentiable_opinfos()
    return _samples(differentiable, torch.float64, True, GRAD_SAMPLES_PER_OP)


class NoEagerAnswer(Exception):
    """Eager itself raises on the sample (values outside the op's domain): nothing to compare."""


def _with_values(case: Case, values: tuple[float, ...] | None):
    structure = (case.sample.input, case.sample.args, case.sample.kwargs)
    if values is None:
        return structure
    pool = torch.tensor(values, dtype=torch.float64)
    generator = torch.Generator().manual_seed(case.index)

    def drawn(t):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or t.is_sparse:
            return t
        picked = pool[torch.randint(0, len(pool), t.shape, generator=generator)].to(t.dtype)
        return picked.requires_grad_(t.requires_grad)

    return torch.utils._pytree.tree_map(drawn, structure)


def run_grad_case(case: Case, values: str) -> None:
    """fulmen's outputs, which of them require grad, and the grads of every floating input equal eager's
    (bit-close in float64, NaN where eager's is NaN; a missing grad counts as zeros)."""
    op = case.opinfo.op
    structure = _with_values(case, EDGE_VALUES[values])
    executors = None if (values, case.op_name) in DECOMPOSITION_DIFFERS else [DECOMPOSED]
    wrt = [t for t in _tensors(structure) if t.requires_grad and t.dtype.is_floating_point]
    if not wrt:
        raise NotDifferentiable

    def program(inp, args, kwargs):
        return op(inp, *args, **kwargs)

    try:
        expected = _tensors(program(*structure))
        eager_outs = [o for o in expected if o.requires_grad]
        if not eager_outs:
            raise NotDifferentiable
        generator = torch.Generator().manual_seed(case.index)
        v = [torch.randn(o.shape, dtype=o.dtype, generator=generator) for o in eager_outs]
        want = torch.autograd.grad(eager_outs, wrt, v, allow_unused=True)
    except (RuntimeError, ValueError) as error:
        raise NoEagerAnswer(str(error)) from error
    actual = _tensors(fulmen.jit(program, executors=executors)(*structure))
    assert [o.requires_grad for o in actual] == [o.requires_grad for o in expected], "outputs requiring grad differ"
    for got, ref in zip(actual, expected):
        torch.testing.assert_close(got, ref, rtol=1e-7, atol=1e-7, equal_nan=True, check_stride=False)
    got_grads = torch.autograd.grad([o for o in actual if o.requires_grad], wrt, v, allow_unused=True)
    for i, (got, ref) in enumerate(zip(got_grads, want)):
        # No grad (None) and a grad of zeros are the same gradient here; eager itself gives either, op by op
        # (vector_norm of order 0: None; floor: zeros). test_edge_gradients checks the rules that must give zeros.
        got, ref = (torch.zeros_like(wrt[i]) if t is None else t for t in (got, ref))
        assert got.layout == ref.layout, f"grad of input {i}: {got.layout} where eager gives {ref.layout}"
        got, ref = (got.to_dense(), ref.to_dense()) if ref.is_sparse else (got, ref)
        torch.testing.assert_close(got, ref, rtol=1e-7, atol=1e-7, equal_nan=True,
                                   msg=lambda m, i=i: f"grad of input {i}: {m}")


@dataclass
class Sweep:
    """The outcome of running an oracle over op_db samples: how many compared equal, how many eager itself could
    not answer, and a line per sample that differs."""

    compared: int = 0
    no_oracle: int = 0
    failures: list[str] = field(default_factory=list)


def sweep(cases: list[Case], run: Callable[[Case], None]) -> Sweep:
    """`run` on every case but those fulmen refuses with a clear error (test_op_db_vjp checks the refusals),
    reporting every failing sample, not only the first."""
    result = Sweep()
    for case in cases:
        if vjp_xfail_reason(case):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run(case)
            result.compared += 1
        except NotDifferentiable:
            continue
        except NoEagerAnswer:
            result.no_oracle += 1
        except Exception as error:  # noqa: BLE001 - every sample is reported
            result.failures.append(f"{case.id}: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
    return result


# --- eager autocast as the oracle: the conversions autocast makes, stated in the trace -----------------------------
AUTOCAST_SAMPLES_PER_OP = 5


def autocast_cases(dtype: torch.dtype) -> Iterator[Case]:
    chosen = [o for o in supported_opinfos() if dtype in o.supported_dtypes("cpu")]
    differentiated = [o for o in chosen if _full_name(o) not in NOT_DIFFERENTIATED]
    forward_only = [o for o in chosen if _full_name(o) in NOT_DIFFERENTIATED]
    yield from _samples(differentiated, dtype, True, AUTOCAST_SAMPLES_PER_OP)
    yield from _samples(forward_only, dtype, False, AUTOCAST_SAMPLES_PER_OP)


# Where eager's forward takes another path when its input requires grad (fulmen's forward runs as eager's does
# without grad), by OpInfo name.
AUTOCAST_FORWARD_DIFFERS: dict[str, str] = {
    "norm.nuc": "eager's svdvals computes the singular vectors too when its input requires grad: another LAPACK path, "
                "1 ulp apart",
    "linalg.svdvals": "eager's svdvals computes the singular vectors too when its input requires grad: another LAPACK "
                      "path, 1 ulp apart",
    "linalg.cond": "eager's svdvals computes the singular vectors too when its input requires grad: another LAPACK "
                   "path, 1 ulp apart",
    "linalg.eigvalsh": "eager's eigvalsh computes the eigenvectors too when its input requires grad: another LAPACK "
                       "path, 1 ulp apart",
    **dict.fromkeys(("linalg.lstsq", "linalg.lstsq.grad_oriented"),
                    "MKL's gelsy is not bit-reproducible in eager itself: two calls on the same inputs can differ by "
                    "an ulp (its blocking follows the buffers' alignment)"),
}
# fulmen refuses these under autocast, naming the reason (autocast converts values computed inside the op), by
# OpInfo name.
AUTOCAST_REFUSED: dict[str, str] = {
    "linalg.matrix_power": "a negative power inverts, then multiplies in lower precision: inside the op",
}

# Samples whose eager float32 grads are rounding noise, by sample id.
AUTOCAST_EAGER_GRAD_INEXACT: dict[str, str] = {
    "nn.functional.layer_norm-2": "a layer norm over one element has zero grads; eager's fused kernel cancels to "
                                  "1e-4 in float32, fulmen gives 0",
}


def run_autocast_case(case: Case, autocast_dtype: torch.dtype = torch.bfloat16) -> None:
    """Under CPU autocast, fulmen's outputs have eager's dtypes and bits, and the grads of every floating input
    equal eager's (a low-precision input's bit for bit, a float32 input's to float32 precision)."""
    op, sample = case.opinfo.op, case.sample
    structure = (sample.input, sample.args, sample.kwargs)

    def program(inp, args, kwargs):
        return op(inp, *args, **kwargs)

    try:
        with torch.autocast("cpu", dtype=autocast_dtype):
            expected = _tensors(program(*structure))
    except (RuntimeError, ValueError) as error:
        raise NoEagerAnswer(str(error)) from error
    if sample.kwargs.get("requires_grad"):  # a factory making a leaf of autograd inside the program: refused
        with pytest.raises(fulmen.UnsupportedOpError, match="leaf of autograd"):
            fulmen.jit(program)(*structure)
        return
    binding = lookup(op) or lookup(_named_callable(case.opinfo.name))
    if binding is not None and binding.symbol in EAGER_OPS:  # differentiated by eager's backward: refused here
        with pytest.raises(fulmen.UnsupportedOpError, match="under torch.autocast"), \
                torch.autocast("cpu", dtype=autocast_dtype):
            fulmen.jit(program)(*structure)
        return
    try:
        with torch.autocast("cpu", dtype=autocast_dtype):
            actual = _tensors(fulmen.jit(program)(*structure))
    except fulmen.UnsupportedOpError as error:
        if case.op_name in AUTOCAST_REFUSED and "under torch.autocast" in str(error):
            return
        raise
    assert [t.dtype for t in actual] == [t.dtype for t in expected], "output dtypes differ"
    if case.opinfo.name not in UNINITIALIZED:
        exact = {} if case.op_name in AUTOCAST_FORWARD_DIFFERS else {"rtol": 0, "atol": 0}
        for got, ref in zip(actual, expected):
            torch.testing.assert_close(got, ref, equal_nan=True, check_stride=False, **exact)
    wrt = [t for t in _tensors(structure) if t.requires_grad and t.dtype.is_floating_point]
    outs = [i for i, o in enumerate(expected) if o.requires_grad]
    if not wrt or not outs or case.id in AUTOCAST_EAGER_GRAD_INEXACT:
        return
    generator = torch.Generator().manual_seed(case.index)
    v = [torch.randn(expected[i].shape, generator=generator).to(expected[i].dtype) for i in outs]
    try:
        want = torch.autograd.grad([expected[i] for i in outs], wrt, v, allow_unused=True)
    except RuntimeError:
        return  # eager cannot differentiate the sample
    got_grads = torch.autograd.grad([actual[i] for i in outs], wrt, v, allow_unused=True)
    for i, (got, ref) in enumerate(zip(got_grads, want)):
        got, ref = (torch.zeros_like(wrt[i]) if t is None else t for t in (got, ref))
        assert got.dtype == ref.dtype, f"grad of input {i}: {got.dtype} where eager gives {ref.dtype}"
        # Low-precision grads bit for bit (fulmen rounds where eager rounds); float32 grads to a few units, where
        # the order of a sum differs (masked_fill's value, rms_norm's composite).
        exact = ref.dtype in (torch.bfloat16, torch.float16)
        tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(got, ref, equal_nan=True, **tolerance, msg=lambda m, i=i: f"grad of input {i}: {m}")
