"""The extend API misused: kernels that break what their operator declares are refused on their first run, at the
user's line, where fulmen would otherwise compute something other than eager does."""

from __future__ import annotations

import functools
import itertools
import re

import pytest
import torch

import fulmen
import fulmen.extend
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


# --- grad rules that put no grad for an input ------------------------------------------------------------------------
def _doubling(grad_transform, checker=None):
    """An operator computing 2 * x (+ w), with the grad rule given, of a fresh executor."""
    n = next(_names)
    ex = OperatorExecutor(f"rule{n}")
    op = ex.register_operator(f"double{n}", like=lambda x, w=None: TensorProxy(like=x),
                              fn=lambda x, w=None: x * 2 if w is None else x * 2 + w)
    ex.register_implementation(op, checker=checker, grad_transform=functools.partial(grad_transform, op))
    return ex, op


def test_a_grad_rule_putting_no_grad_is_refused():
    # x.grad came out 1 (the op's grad taken as zero) where eager's is 2cos(2x) + 1
    ex, op = _doubling(lambda op, x: op(x))
    jitted = fulmen.jit(lambda x: op(x).sin() + x, executors=[ex])
    with pytest.raises(ExecutorContractError, match=(
            rf"(?s)the grad_transform of {op.name} \(executor '{ex.name}'\) puts no grad for its input x "
            r"\(cpu f32\[4\]\), which requires grad.*put_grad\(x, torch.zeros_like\(x\)\)"
            r".*test_extend_misuse.py:\d+ in <lambda>: "
            r"\"jitted = fulmen.jit\(lambda x: op\(x\).sin\(\) \+ x")):
        jitted(torch.randn(4, requires_grad=True))
    # with nothing else reaching x: torch's "element 0 of tensors does not require grad" at backward before
    with pytest.raises(ExecutorContractError, match=r"puts no grad for its input x"):
        fulmen.jit(lambda x: op(x).sin(), executors=[ex])(torch.randn(4, requires_grad=True))


def test_a_grad_rule_must_put_each_input_that_requires_grad():
    def rule(op, x, w):  # puts x's grad, forgets w's
        y = op(x, w)
        put_grad(x, get_grad(y) * 2)
        return y

    ex, op = _doubling(rule)
    jitted = fulmen.jit(lambda x, w: op(x, w).sum(), executors=[ex])
    with pytest.raises(ExecutorContractError, match=r"puts no grad for its input w \(cpu f32\[3\]\)"):
        jitted(torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True))
    # an input that needs no grad needs none put; the program is eager's then
    x = torch.randn(3, requires_grad=True)
    jitted(x, torch.randn(3)).backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def test_a_grad_rule_says_a_zero_grad_with_zeros():
    # a rounding kernel: eager's torch.round has a zero grad, which the rule puts explicitly
    def rule(op, x):
        y = op(x)
        put_grad(x, torch.zeros_like(x))
        return y

    n = next(_names)
    ex = OperatorExecutor(f"round{n}")
    op = ex.register_operator(f"round{n}", like=lambda x: TensorProxy(like=x), fn=torch.round)
    ex.register_implementation(op, grad_transform=lambda x: rule(op, x))
    x = torch.randn(5, requires_grad=True)
    leaf = x.detach().requires_grad_()
    fulmen.jit(lambda x: op(x).sin() + x * 3, executors=[ex])(x).sum().backward()
    (torch.round(leaf).sin() + leaf * 3).sum().backward()
    torch.testing.assert_close(x.grad, leaf.grad)


def test_fulmens_own_rules_may_leave_out_inputs_eager_gives_no_grad():
    # torch.where's condition and an integer index get no grad in fulmen's rules, as in eager
    x = torch.randn(5, requires_grad=True)
    leaf = x.detach().requires_grad_()
    program = lambda x: torch.where(x > 0, x, x * 2).gather(0, torch.tensor([4, 0])).sum()  # noqa: E731
    fulmen.jit(program)(x).backward()
    program(leaf).backward()
    torch.testing.assert_close(x.grad, leaf.grad)


# --- checkers that fail or answer other than a bool ------------------------------------------------------------------
def test_a_failing_checker_is_named():
    ex, op = _doubling(lambda op, x: op(x), checker=lambda x: {"a": 1}["b"])
    with pytest.raises(ExecutorContractError, match=(
            rf"(?s)the checker of {op.name} \(executor '{ex.name}'\) failed: KeyError: 'b'.*"
            r"test_extend_misuse.py:\d+ in <lambda>")) as info:
        fulmen.jit(lambda x: op(x) + 1, executors=[ex])(torch.randn(3))
    assert type(info.value.__cause__) is KeyError
    # computing with the arguments: a proxy has no values to compute with outside the trace
    ex, op = _doubling(lambda op, x: op(x), checker=lambda x: bool(x.sum() > 0))
    with pytest.raises(ExecutorContractError, match=r"the checker of .* failed \(a checker reads its arguments' "
                       r"metadata; it cannot compute with them\): UnsupportedOpError"):
        fulmen.jit(lambda x: op(x) + 1, executors=[ex])(torch.randn(3))


@pytest.mark.parametrize("answer, got", [(lambda x: x, "a tensor cpu f32\\[3\\]"), (lambda x: None, "NoneType")])
def test_a_checker_answering_other_than_a_bool_is_refused(answer, got):
    # bool() of a tensor (an argument returned by mistake) is data-dependent; None (a missing return) declined silently
    ex, op = _doubling(lambda op, x: op(x), checker=answer)
    with pytest.raises(ExecutorContractError, match=rf"the checker of {op.name} \(executor '{ex.name}'\) returned "
                       rf"{got}, not a bool"):
        fulmen.jit(lambda x: op(x) + 1, executors=[ex])(torch.randn(3))


# --- kernels that raise -----------------------------------------------------------------------------------------------
def _failing(x):
    raise IndexError("block size 37 unsupported")


def test_a_kernel_raising_on_its_first_run_names_the_call():
    # the traceback ended in the kernel, called from a line of generated code: which call of the program was it?
    ex, op = _operator(_failing)

    def program(x):
        y = x + 1
        return op(y) * 2

    with pytest.raises(IndexError, match="block size 37") as info:
        fulmen.jit(program, executors=[ex])(torch.randn(3))
    assert len(info.value.__notes__) == 1
    assert re.fullmatch(rf"fulmen: raised by {op.name} \(executor '{ex.name}'\), run for the program's call at "
                        r".*test_extend_misuse.py:\d+ in program: \"return op\(y\) \* 2\"", info.value.__notes__[0])


# --- registrations and defaults changing between calls ----------------------------------------------------------------
def _counting_sin(calls):
    n = next(_names)
    ex = OperatorExecutor(f"late{n}")
    op = ex.register_operator(f"counting_sin{n}", like=lambda x: TensorProxy(like=x),
                              fn=lambda x: calls.append(1) or torch.sin(x))
    return ex, op


def test_a_registration_after_the_first_call_traces_again():
    # the old trace was reused for this shape (the new implementation unused), a new shape took it: the callable
    # answered as neither a fresh fulmen.jit nor consistently
    calls = []
    ex, op = _counting_sin(calls)
    jitted = fulmen.jit(lambda x: torch.sin(x) * 2, executors=[ex])
    x = torch.randn(3)
    torch.testing.assert_close(jitted(x), torch.sin(x) * 2)
    assert calls == []
    ex.register_implementation(torch.sin, execution_transform=lambda x: op(x))
    torch.testing.assert_close(jitted(x), torch.sin(x) * 2)
    assert calls == [1] and fulmen.cache_misses(jitted) == 2
    assert fulmen.last_cache_miss_reasons(jitted) == [
        "trace 0: its executors' registrations (register_implementation, register_operator or register_lookaside "
        "since the trace was built) changed"]
    jitted(x)  # and it is cached again
    assert calls == [1, 1] and fulmen.cache_misses(jitted) == 2


def test_a_replacement_registered_after_the_first_call_traces_again():
    ex, _ = _counting_sin([])

    def helper(x):
        return torch.sin(x)

    jitted = fulmen.jit(lambda x: helper(x) + 1, executors=[ex])
    x = torch.randn(3)
    jitted(x)
    # acquired as the operator from now on (the helper's ops are its parts, run when nothing claims it)
    op = ex.register_operator(f"replacing{next(_names)}", like=lambda x: TensorProxy(like=x), fn=helper,
                              replaces=helper)
    torch.testing.assert_close(jitted(x), torch.sin(x) + 1)
    assert fulmen.cache_misses(jitted) == 2 and f"= {op.name}(" in str(fulmen.last_traces(jitted)[0])


def test_default_executors_are_taken_when_jitting():
    calls = []
    ex, op = _counting_sin(calls)  # not registered by name: set_default_executors looked it up by name and failed
    ex.register_implementation(torch.sin, execution_transform=lambda x: op(x))
    before = fulmen.jit(lambda x: torch.sin(x) + 1)
    x = torch.randn(3)
    before(x)
    try:
        with pytest.warns(UserWarning, match=r"callables fulmen.jit made earlier with the default executors keep the "
                          r"ones they were jitted with; jit them again"):
            fulmen.extend.set_default_executors([ex])
        after = fulmen.jit(lambda x: torch.sin(x) + 1)
        torch.testing.assert_close(after(x), torch.sin(x) + 1)
        assert calls == [1]
        torch.testing.assert_close(before(x), torch.sin(x) + 1)  # as the warning says: the list it was jitted with
        assert calls == [1]
    finally:
        with pytest.warns(UserWarning, match="set_default_executors"):
            fulmen.extend.set_default_executors(None)


def _mm_operator(fn=lambda x, w: x @ w, dtype=None):
    n = next(_names)
    ex = OperatorExecutor(f"autocast{n}")
    op = ex.register_operator(f"mm{n}", fn=fn,
                              like=lambda x, w: TensorProxy(like=x, shape=(x.shape[0], w.shape[1]), dtype=dtype))
    return ex, op


_BF16 = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)


def test_an_operator_called_under_autocast_computes_as_eager():
    # autocast converts x and w inside the kernel eagerly: the trace converts them in front (the kernel runs with
    # autocast off), and like= sees bf16 inputs; it ran on float32 and returned float32
    ex, op = _mm_operator()
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    with _BF16():
        got, want = fulmen.jit(lambda x, w: op(x, w) * 1, executors=[ex])(x, w), op(x, w) * 1
        # autocast off inside the program: the kernel's float32 as eager's
        off = fulmen.jit(lambda x, w: _without_autocast(op, x, w), executors=[ex])(x, w)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
    assert off.dtype == torch.float32 and torch.equal(off, x @ w)
    # like= declares float32 and eager returns it, of a bfloat16 matmul: so does the trace
    ex, op = _mm_operator(lambda x, w: (x @ w).float(), dtype=torch.float32)
    with _BF16():
        got, want = fulmen.jit(lambda x, w: op(x, w) * 1, executors=[ex])(x, w), op(x, w) * 1
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want) and not torch.equal(got, x @ w)
    # an operator autocast changes nothing in runs as declared
    ex, scale = _operator(lambda x: x * 2)
    with _BF16():
        got = fulmen.jit(lambda x: scale(x) + 1, executors=[ex])(x)
    assert got.dtype == torch.float32 and torch.equal(got, x * 2 + 1)


def _without_autocast(op, x, w):
    with torch.autocast("cpu", enabled=False):
        return op(x, w)


def test_an_operator_reads_its_arguments_after_in_place_updates():
    # it read the value from before x.add_(1)
    ex, op = _mm_operator()

    def program(x, w):
        x = x.clone()
        x.add_(1)
        return op(x, w)

    x, w = torch.randn(4, 3), torch.randn(3, 5)
    torch.testing.assert_close(fulmen.jit(program, executors=[ex])(x, w), program(x, w))


@torch.library.custom_op("fulmen_test::autocast_mm", mutates_args=())
def _library_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w  # autocast converts here eagerly; the fake below is what fake tensors run


@_library_mm.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


@pytest.mark.parametrize("fn, why", [
    (lambda x, w: torch.from_numpy(x.numpy() @ w.numpy()), r"its fn does not run on fake tensors"),
    (_library_mm, r"its fn calls fulmen_test.autocast_mm, inside which autocast's conversions are not seen"),
    (lambda x, w: x @ w, r"eager returns \(bfloat16\) there while its like= says \(float32\)"),
])
def test_an_operator_under_autocast_that_fulmen_cannot_state_is_refused(fn, why):
    # each ran the kernel on float32 with autocast off, where eager gives bfloat16
    ex, op = _mm_operator(fn, dtype=torch.float32)
    jitted = fulmen.jit(lambda x, w: op(x, w) * 1, executors=[ex])
    with _BF16(), pytest.raises(fulmen.core.errors.TraceError, match=(
            rf"(?s)operator {op.name} of executor '{ex.name}' is called under torch.autocast, but {why}.*"
            r"Call it with autocast off \(`with torch.autocast\('cpu', enabled=False\):`.*test_extend_misuse.py")):
        jitted(torch.randn(4, 3), torch.randn(3, 5))


def test_operators_in_rules_under_autocast_are_not_refused():
    # a grad_transform or execution_transform is fulmen's rule, whose dtypes autocast does not change
    n = next(_names)
    ex = OperatorExecutor(f"rules{n}")
    opaque = ex.register_operator(f"opaque{n}", like=lambda x: TensorProxy(like=x),
                                  fn=lambda x: torch.from_numpy(x.detach().numpy() * 2))
    op = ex.register_operator(f"double{n}", like=lambda x: TensorProxy(like=x), fn=lambda x: x * 2)

    def grad(x):
        y = op(x)
        put_grad(x, opaque(get_grad(y)))
        return y

    ex.register_implementation(op, execution_transform=lambda x: opaque(x), grad_transform=grad)
    x = torch.randn(4, 3, requires_grad=True)
    with _BF16():
        out = fulmen.jit(lambda x: op(x).sum(), executors=[ex])(x)
    out.backward()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, (x * 2).sum())
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
