"""Grads rounded where eager rounds them: bit for bit equal to eager's in bfloat16, float16 and float32.

Eager differentiates tanh, sigmoid, silu, gelu, softmax, log_softmax and layer_norm with one kernel each, which
computes in float32 for half-precision tensors and rounds once; written as separate torch calls, the same formula
rounds after every step and lands several bfloat16 units away. Other grads (div, atan2, erf, rsqrt) are formulas of
a few eager calls, whose grouping decides the roundings. And cross-entropy rounds where eager's log_softmax kernel
rounds, which differs by device. On realistic sizes (vectorised kernel paths, a vocabulary-sized row), forward
values and grads must be `torch.equal` to eager's: any tolerance would hide exactly these differences."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fulmen
from tests.ops.opdb import DECOMPOSED

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


ROWS, COLS = 64, 515  # not a multiple of any vector width: vectorised and scalar kernel paths both run


def _scaled(n):
    return [n(ROWS, COLS) * 3]


def _ce(reduction, ignore_index=-100):
    def loss(logits, target):
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)

    return loss


# name -> (program, its float inputs made from a standard-normal sampler `n(*shape)`)
PROGRAMS = {
    "tanh": (torch.tanh, _scaled),
    "sigmoid": (torch.sigmoid, _scaled),
    "silu": (F.silu, _scaled),
    "gelu": (F.gelu, _scaled),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), _scaled),
    "softmax_last": (lambda x: torch.softmax(x, -1), _scaled),
    "softmax_first": (lambda x: torch.softmax(x, 0), _scaled),
    "log_softmax_last": (lambda x: torch.log_softmax(x, -1), _scaled),
    "softmax_to_float": (lambda x: torch.softmax(x, -1, dtype=torch.float32), _scaled),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b),
                   lambda n: [n(ROWS, COLS) * 3 + 1, n(COLS), n(COLS)]),
    "layer_norm_plain": (lambda x: F.layer_norm(x, x.shape[-1:]), _scaled),
    # eager's rms_norm: a composite differentiated op by op on CPU, a fused kernel with its own backward on GPUs
    "rms_norm": (lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-6), lambda n: [n(ROWS, COLS) * 3 + 1, n(COLS)]),
    "rms_norm_plain": (lambda x: F.rms_norm(x, x.shape[-1:]), _scaled),
    "erf": (torch.erf, _scaled),
    "erfc": (torch.erfc, _scaled),
    "erfinv": (torch.erfinv, lambda n: [torch.tanh(n(ROWS, COLS)) * 0.99]),  # where erfinv is finite
    "rsqrt": (torch.rsqrt, lambda n: [n(ROWS, COLS).abs() + 0.5]),
    "div": (torch.div, lambda n: [n(ROWS, COLS) * 3, n(ROWS, COLS)]),
    "atan2": (torch.atan2, lambda n: [n(ROWS, COLS), n(ROWS, COLS)]),
    # eager's kernels take the exponent in the tensor's dtype and cube as two rounded products
    "powers": (lambda x: x ** 3 - (x * x + 0.1) ** 0.3 + x ** -2, _scaled),
}


def _float_inputs(name: str, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    inputs = PROGRAMS[name][1](lambda *shape: torch.randn(*shape, generator=generator))
    return [t.to(device, dtype).requires_grad_() for t in inputs]


def _eager_and_fulmen(program, inputs: list, wrt: list[torch.Tensor], executors=None):
    """The outputs and the grads of `wrt`, by eager and by fulmen, for the same cotangent."""
    expected = program(*inputs)
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1)).to(expected)
    actual = fulmen.jit(program, executors=executors)(*inputs)
    want = torch.autograd.grad(expected, wrt, cotangent)
    return (actual, expected), list(zip(torch.autograd.grad(actual, wrt, cotangent), want))


def _assert_grads_equal(program, inputs: list, wrt: list[torch.Tensor], executors=None) -> None:
    (actual, expected), grads = _eager_and_fulmen(program, inputs, wrt, executors)
    assert torch.equal(actual, expected), "forward values differ from eager's"
    for i, (g, w) in enumerate(grads):
        differ = int((g != w).sum())
        assert differ == 0, f"grad of input {i}: {differ} of {w.numel()} elements differ from eager's"


def _run_op(name: str, dtype: torch.dtype, device: str, executors=None) -> None:
    inputs = _float_inputs(name, dtype, device)
    _assert_grads_equal(PROGRAMS[name][0], inputs, inputs, executors)


def _run_cross_entropy(reduction: str, dtype: torch.dtype, device: str, executors=None) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 32003, generator=generator) * 4).to(device, dtype).requires_grad_()
    target = torch.randint(0, 32003, (64,), generator=generator)
    target[::5] = -1  # ignored rows
    _assert_grads_equal(_ce(reduction, ignore_index=-1), [logits, target.to(device)], [logits], executors)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_grads_are_eagers_bit_for_bit(name, dtype):
    _run_op(name, dtype, "cpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_is_eagers_bit_for_bit(reduction, dtype):
    """The loss goes through eager's log_softmax and nll_loss kernels, the grad through eager's nll_loss grad
    (mean: the cotangent divided by the count of valid rows in the logits' dtype) and log_softmax backward kernel."""
    _run_cross_entropy(reduction, dtype, "cpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_decompositions_give_the_same_grads(name, dtype):
    """What a fusion executor compiles instead (every composite, forward and backward, run as its decomposition):
    the same grads to a few units of the dtype's precision at the grad's scale, in every dtype. (test_op_db_grads
    checks the decompositions in float64 at edge values.)"""
    inputs = _float_inputs(name, dtype, "cpu")
    _, grads = _eager_and_fulmen(PROGRAMS[name][0], inputs, inputs, executors=[DECOMPOSED])
    units = 3 if dtype.itemsize == 2 else 8
    for i, (g, w) in enumerate(grads):
        scale = w.double().abs().max().item()
        torch.testing.assert_close(g, w, rtol=0, atol=units * torch.finfo(dtype).eps * scale,
                                   msg=lambda m, i=i: f"grad of input {i}: {m}")


# name -> a norm of a half-precision activation with float32 parameters (of COLS elements each), as CPU autocast
# hands them over: eager's CPU kernels have a mixed-dtype form for them, which keeps the statistics in float32
MIXED_NORMS = {
    "layer_norm": (lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b), 2),
    "layer_norm_weight": (lambda x, w: F.layer_norm(x, x.shape[-1:], w), 1),
    "rms_norm": (lambda x, w: F.rms_norm(x, x.shape[-1:], w), 1),
    "group_norm": (lambda x, w, b: F.group_norm(x, 5, w, b), 2),
    "batch_norm": (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), 2),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(MIXED_NORMS))
def test_norms_of_half_precision_inputs_with_float32_parameters(name, dtype):
    """layer_norm's backward handed eager's kernel statistics rounded to the input's dtype, which selects its
    same-dtype form: aten's "expected scalar type Float but found BFloat16" where eager runs."""
    program, count = MIXED_NORMS[name]
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(ROWS, COLS, generator=generator) * 3 + 1).to(dtype).requires_grad_()
    params = [torch.randn(COLS, generator=generator).requires_grad_() for _ in range(count)]
    _assert_grads_equal(program, [x, *params], [x, *params])


def test_layer_norm_with_a_float32_weight_that_needs_no_grad():
    x = torch.randn(ROWS, COLS, dtype=torch.bfloat16, requires_grad=True)
    weight, bias = torch.randn(COLS), torch.randn(COLS, requires_grad=True)
    _assert_grads_equal(lambda x, b: F.layer_norm(x, (COLS,), weight, b), [x, bias], [x, bias])


def test_backward_kernels_show_in_the_backward_trace():
    """The rules call eager's kernels by name (readable, and claimable by an executor as one call)."""
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    jitted = fulmen.jit(lambda x: F.gelu(torch.tanh(x)).softmax(-1))
    jitted(x).sum().backward()
    source = str(fulmen.last_backward_traces(jitted)[-1])
    for kernel in ("impls.softmax_backward", "impls.gelu_backward", "impls.tanh_backward"):
        assert kernel in source, source


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_grads_are_eagers_bit_for_bit_without_fusion(dtype):
    """On CUDA the torch executor runs eager's CUDA kernels: the same bits as eager's. (Fusion regions compile
    the decompositions, which round once in float32 as the kernels do, but in Inductor's order of operations.)"""
    for name in PROGRAMS:
        _run_op(name, dtype, "cuda", executors=["torch"])
    for reduction in ("mean", "sum", "none"):
        _run_cross_entropy(reduction, dtype, "cuda", executors=["torch"])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_fused_half_precision_chains_are_eagers_bit_for_bit(dtype):
    """With the default executors, fusion regions round each op's result as eager does (Inductor's
    emulate_precision_casts): grads that eager computes as a chain of kernels are eager's bits too, and so are those
    of eager's CUDA kernels that round otherwise than its CPU ones (Tag.EAGER_ROUNDING): tanh's and sigmoid's
    backward, which round after each operation in the tensors' dtype, and powers (rsqrt's grad takes a cube), whose
    exponent is taken in the dtype and whose cube is two rounded products."""
    for name in ("erf", "erfc", "erfinv", "div", "atan2", "tanh", "sigmoid", "rsqrt", "powers"):
        _run_op(name, dtype, "cuda")
    _run_cross_entropy("mean", dtype, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["softmax_last", "softmax_first"])
def test_cuda_fused_softmax_grad_rounds_as_eagers_kernel(name, dtype):
    """eager's CUDA softmax backward is given `grad * output` rounded to the dtype; the region's decomposition
    rounds it there too. Only the order of the row sums (eager's warp reduction, Inductor's) still tells them
    apart: a few elements in 32,960, where a float32 product (the CPU kernel's formula) differs in a third."""
    inputs = _float_inputs(name, dtype, "cuda")
    _, [(grad, want)] = _eager_and_fulmen(PROGRAMS[name][0], inputs, inputs)
    differ = int((grad != want).sum())
    assert differ <= want.numel() // 1000, f"{differ} of {want.numel()} elements differ from eager's"
