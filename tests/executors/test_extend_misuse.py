"""The extend API misused: kernels that break what their operator declares are refused on their first run, at the
user's line, where fulmen would otherwise compute something other than eager does."""

from __future__ import annotations

import itertools

import pytest
import torch

import fulmen
from fulmen import TensorProxy, get_grad, put_grad
from fulmen.core.errors import ExecutorContractError
from fulmen.extend import OperatorExecutor

_names = itertools.count()


def _operator(fn, like=lambda x: TensorProxy(like=x), grad=None):
    n = next(_names)
    ex = OperatorExecutor(f"misuse{n}")
    op = ex.register_operator(f"kernel{n}", like=like, fn=fn)
    if grad is not None:
        ex.register_implementation(op, grad_transform=lambda x: grad(op, x))
    return ex, op


def _identity_grad(op, x):
    y = op(x)
    put_grad(x, get_grad(y) * 2)
    return y


def test_a_kernel_of_another_dtype_is_refused():
    # the trace drops y.float() as a no-op (like= says float32): it returned float16 where eager gives float32
    ex, op = _operator(lambda x: (x * 2).half())
    jitted = fulmen.jit(lambda x: op(x).float() + 1, executors=[ex])
    with pytest.raises(ExecutorContractError, match=rf"(?s){op.name} \(executor '{ex.name}'\) returned cpu f16\[4, 3\]"
                       r".*built for cpu f32\[4, 3\].*test_extend_misuse.py"):
        jitted(torch.randn(4, 3))


def test_a_kernel_of_another_shape_is_refused():
    # torch.ones(y.shape) bakes in the declared shape: broadcasting made a (4, 3) result where eager gives (4, 1)
    ex, op = _operator(lambda x: x[:, :1] * 2)
    jitted = fulmen.jit(lambda x: op(x) * torch.ones(op(x).shape), executors=[ex])
    with pytest.raises(ExecutorContractError, match=r"returned cpu f32\[4, 1\].*built for cpu f32\[4, 3\]"):
        jitted(torch.randn(4, 3))


def test_a_kernel_returning_another_number_of_outputs_is_refused():
    ex, op = _operator(lambda x: (x * 2, x * 3))
    with pytest.raises(ExecutorContractError, match=r"returned a tuple of 2, but the trace was built for a tensor"):
        fulmen.jit(lambda x: op(x) + 1, executors=[ex])(torch.randn(4, 3))
    ex, op = _operator(lambda x: x * 2, like=lambda x: (TensorProxy(like=x), TensorProxy(like=x)))
    with pytest.raises(ExecutorContractError, match=r"returned a tensor cpu f32\[4, 3\], but .* tuple of 2"):
        fulmen.jit(lambda x: op(x)[0] + op(x)[1], executors=[ex])(torch.randn(4, 3))


def _rows_in_memory_order(x):
    """A kernel that reads its input's memory as contiguous rows (as a Triton kernel on its data pointer does)."""
    return torch.as_strided(x, x.shape, (x.shape[1], 1)) * 1.0


def test_a_kernel_of_another_layout_is_refused_and_a_declared_layout_is_kept():
    transposed = lambda x: x.t().contiguous().t() * 2  # noqa: E731  (values right, layout column-major)
    n = next(_names)
    ex = OperatorExecutor(f"layout{n}")
    raw = ex.register_operator(f"raw{n}", like=lambda x: TensorProxy(like=x), fn=_rows_in_memory_order)
    op = ex.register_operator(f"transposed{n}", like=lambda x: TensorProxy(like=x), fn=transposed)

    def program(x):
        return raw(op(x).contiguous())  # the .contiguous() is dropped: like= says the value is contiguous

    x = torch.randn(4, 3)
    want = _rows_in_memory_order(transposed(x).contiguous())
    with pytest.raises(ExecutorContractError, match=r"(?s)returned its output with strides \(1, 4\).*\(3, 1\)"):
        fulmen.jit(program, executors=[ex])(x)
    # a like= that returns a meta tensor of the kernel's layout: the trace keeps the .contiguous()
    declared = ex.register_operator(f"declared{n}", fn=transposed, like=lambda x: torch.empty(
        x.shape[1], x.shape[0], dtype=x.dtype, device="meta").t())
    got = fulmen.jit(lambda x: raw(declared(x).contiguous()), executors=[ex])(x)
    torch.testing.assert_close(got, want)


def _mutating(x):
    x.mul_(2)  # writes into its argument
    return x + 1


def test_a_kernel_writing_into_a_saved_argument_is_refused():
    # sin's backward reads the saved t = x @ w, which the kernel doubled in place: x's grad came out wrong, silently
    ex, op = _operator(_mutating, grad=_identity_grad)

    def program(x, w):
        t = x @ w
        return torch.sin(t) * op(t)

    jitted = fulmen.jit(program, executors=[ex])
    with pytest.raises(ExecutorContractError, match=r"(?s)modified its tensor argument 0 .* in place.*still needs"
                       r".*in program: \"return torch.sin\(t\) \* op\(t\)\""):
        jitted(torch.randn(4, 3, requires_grad=True), torch.randn(3, 5))


def test_a_kernel_may_reuse_an_argument_nothing_reads_afterwards():
    ex, op = _operator(_mutating, grad=_identity_grad)
    x = torch.randn(5, requires_grad=True)
    out = fulmen.jit(lambda x: op(x * 3).sin(), executors=[ex])(x)
    out.sum().backward()
    leaf = x.detach().requires_grad_()
    want = (leaf * 3 * 2 + 1).sin()
    want.sum().backward()
    torch.testing.assert_close(out, want)
    # the rule says d(op)/dx = 2, where the kernel computes 2x + 1: eager's grad of the same rule
    torch.testing.assert_close(x.grad, (leaf * 6 + 1).cos().detach() * 2 * 3)


def test_a_kernel_returning_its_argument_is_refused():
    # the output is the program's x itself: x.mul_(2) then changed y too, which the trace took for a new tensor
    ex, op = _operator(lambda x: x)

    def program(x):
        y = op(x)
        x.mul_(2)
        return y, y + x

    with pytest.raises(ExecutorContractError, match=r"(?s)returned output 0 in the memory of its tensor argument 0"
                       r".*test_extend_misuse.py:\d+ in program: \"y = op\(x\)\""):
        fulmen.jit(program, executors=[ex])(torch.ones(3))


def test_calls_after_the_first_run_go_to_the_kernel_directly():
    calls = []
    ex, op = _operator(lambda x: calls.append(1) or x * 2)
    jitted = fulmen.jit(lambda x: op(x) + op(x + 1), executors=[ex])
    x = torch.randn(3)
    for _ in range(2):
        torch.testing.assert_close(jitted(x), x * 2 + (x + 1) * 2)
    assert len(calls) == 4 and fulmen.cache_misses(jitted) == 1
