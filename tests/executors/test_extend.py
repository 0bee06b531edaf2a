"""The extend API against eager: custom operators replacing user code, checkers, grad transforms, priority."""

from __future__ import annotations

import importlib
import itertools
import math
import threading
import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fulmen
from fulmen import TensorProxy, get_grad, put_grad, put_grads
from fulmen.executors.registry import PROVIDERS, resolve
from fulmen.extend import OperatorExecutor, register_executor

_names = itertools.count()
CALLS: Counter = Counter()


def tanh_gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class NewGELU(nn.Module):
    def forward(self, x):
        return tanh_gelu(x)


def scale_rows(x, w):
    """A module-level helper of the user's program, replaced by name."""
    return x * w.unsqueeze(0)


ORIGINAL_FORWARD = NewGELU.forward
ORIGINAL_SCALE_ROWS = scale_rows


def narrowing_helper(x):
    return x[:, :2] * 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.rand(8) + 0.5)
        self.act = NewGELU()
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return F.softmax(self.norm(scale_rows(self.act(self.fc(x)), self.w)), dim=-1)


# Kernels: eager code standing in for custom kernels, counting their calls.
def gelu_kernel(x):
    CALLS["gelu"] += 1
    return tanh_gelu(x)


def gelu_backward_kernel(x, g):
    CALLS["gelu_backward"] += 1
    with torch.enable_grad():
        x = x.detach().requires_grad_()
        return torch.autograd.grad(tanh_gelu(x), x, g)[0]


def scale_backward_kernel(x, w, g):
    CALLS["scale_backward"] += 1
    return g * w.unsqueeze(0), (g * x).sum(0)


def _executor(gelu_checker=lambda self, x: True):
    """A fresh executor replacing NewGELU.forward and scale_rows (names are unique per executor)."""
    n = next(_names)
    ex = OperatorExecutor(f"test{n}")
    gelu = ex.register_operator(f"gelu{n}", like=lambda x: TensorProxy(like=x), fn=gelu_kernel)
    gelu_bwd = ex.register_operator(f"gelu_bwd{n}", like=lambda x, g: TensorProxy(like=x), fn=gelu_backward_kernel)
    module_gelu = ex.register_operator(f"module_gelu{n}", like=lambda self, x: TensorProxy(like=x),
                                       fn=NewGELU.forward, replaces=NewGELU.forward)

    def gelu_grad(self, x):
        y = gelu(x)
        put_grad(x, gelu_bwd(x, get_grad(y)))
        return y

    ex.register_implementation(module_gelu, checker=gelu_checker, execution_transform=lambda self, x: gelu(x),
                               grad_transform=gelu_grad)
    scale_bwd = ex.register_operator(f"scale_bwd{n}", like=lambda x, w, g: (TensorProxy(like=x), TensorProxy(like=w)),
                                     fn=scale_backward_kernel)
    scale = ex.register_operator(f"scale{n}", like=lambda x, w: TensorProxy(like=x), fn=scale_rows,
                                 replaces=scale_rows)

    def scale_grad(x, w):
        y = x * w.unsqueeze(0)  # plain torch on proxies
        put_grads((x, w), scale_bwd(x, w, get_grad(y)))
        return y

    ex.register_implementation(scale, grad_transform=scale_grad)
    return ex, n


def _names_in(trace) -> set[str]:
    return {bsym.sym.name for bsym in trace.bound_symbols}


def _compare(model, jitted, x):
    CALLS.clear()
    out = jitted(x)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    ref = model(x)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(got, want)


def test_replaced_method_and_helper_are_claimed_in_forward_and_backward():
    ex, n = _executor()
    model = Net()
    jitted = fulmen.jit(model, executors=[ex])
    _compare(model, jitted, torch.randn(5, 8))
    acquired = _names_in(fulmen.last_traces(jitted)[0])
    assert {f"module_gelu{n}", f"scale{n}"} <= acquired
    forward = _names_in(fulmen.last_traces(jitted)[-1])
    backward = _names_in(fulmen.last_backward_traces(jitted)[-1])
    assert f"gelu{n}" in forward and f"module_gelu{n}" not in forward
    assert {f"gelu_bwd{n}", f"scale_bwd{n}"} <= backward
    assert CALLS["gelu"] == 1 and CALLS["gelu_backward"] == 1 and CALLS["scale_backward"] == 1
    assert "tanh" not in forward  # the user's GELU did not run
    # acquisition leaves the user's program as it is
    assert NewGELU.__dict__["forward"] is ORIGINAL_FORWARD and scale_rows is ORIGINAL_SCALE_ROWS


def test_replaced_functions_do_not_defeat_the_cache():
    # the guards on NewGELU.forward and scale_rows see the user's originals, during acquisition as after
    ex, _ = _executor()
    model = Net()
    jitted = fulmen.jit(model, executors=[ex])
    x = torch.randn(5, 8)
    for _ in range(3):
        torch.testing.assert_close(jitted(x), model(x))
    assert fulmen.cache_misses(jitted) == 1


def test_checker_false_descends_to_the_original_ops():
    ex, n = _executor(gelu_checker=lambda self, x: x.shape[0] > 100)
    model = Net()
    jitted = fulmen.jit(model, executors=[ex])
    _compare(model, jitted, torch.randn(5, 8))
    forward = _names_in(fulmen.last_traces(jitted)[-1])
    assert not any(name.startswith(("gelu", "module_gelu")) for name in forward)
    assert "tanh" in forward
    assert CALLS["gelu"] == 0 and CALLS["gelu_backward"] == 0
    # the helper's grad transform still applies (no checker)
    assert f"scale_bwd{n}" in _names_in(fulmen.last_backward_traces(jitted)[-1])


def test_without_the_executor_nothing_is_replaced():
    _executor()  # registered, but not in this jit's list
    model = Net()
    jitted = fulmen.jit(model, executors=["torch"])
    _compare(model, jitted, torch.randn(3, 8))
    assert all(bsym.sym.executor is None for bsym in fulmen.last_traces(jitted)[0].bound_symbols)


def test_no_grad_call_uses_the_execution_transform():
    ex, n = _executor()
    model = Net()
    jitted = fulmen.jit(model, executors=[ex])
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = jitted(x)
        ref = model(x)
    torch.testing.assert_close(out, ref)
    forward = _names_in(fulmen.last_traces(jitted)[-1])
    assert f"gelu{n}" in forward
    # scale has no execution transform: it descends to the helper's torch ops
    assert f"scale{n}" not in forward and "mul" in forward


def _softmax_executor(tag: str):
    ex = OperatorExecutor(f"softmax_{tag}_{next(_names)}")
    calls = []

    def kernel(x):
        if x.device.type != "meta":  # without like=, shapes come from running the kernel on meta tensors
            calls.append(tag)
        return torch.softmax(x, -1)

    op = ex.register_operator(f"softmax_{tag}_{next(_names)}", fn=kernel)  # shapes from running it on meta
    ex.register_implementation(fulmen.torch.softmax, checker=lambda x, dim, dtype=None: dim in (-1, x.dim() - 1),
                               execution_transform=lambda x, dim, dtype=None: op(x))
    return ex, op, calls


def test_torch_symbol_implementation_and_executor_order_decide_who_claims():
    first, first_op, first_calls = _softmax_executor("a")
    second, second_op, second_calls = _softmax_executor("b")
    x = torch.randn(3, 5, requires_grad=True)

    def f(x):
        return F.softmax(x * 2, dim=-1).sum(0) + torch.softmax(x, 0).sum(0)  # dim 0 is declined

    for order, winner in (([first, second], first_op), ([second, first], second_op)):
        jitted = fulmen.jit(f, executors=order)
        out = jitted(x)
        torch.testing.assert_close(out, f(x))
        (grad,) = torch.autograd.grad(out.sum(), x)
        (want,) = torch.autograd.grad(f(x).sum(), x)
        torch.testing.assert_close(grad, want)
        names = _names_in(fulmen.last_traces(jitted)[-1])
        assert winner.name in names and ({first_op.name, second_op.name} - {winner.name}).isdisjoint(names)
        assert "softmax" in names  # the dim-0 call stays with torch
    assert first_calls == ["a"] and second_calls == ["b"]


def test_replacing_a_torch_function():
    ex = OperatorExecutor(f"ln{next(_names)}")
    seen = []

    def layer_norm_kernel(x, shape, weight, bias, eps):
        if x.device.type != "meta":
            seen.append(x.shape)
        return F.layer_norm(x, shape, weight, bias, eps)

    kernel = ex.register_operator(f"ln_kernel{next(_names)}", fn=layer_norm_kernel)
    op = ex.register_operator(f"ln{next(_names)}", like=lambda x, *args, **kwargs: TensorProxy(like=x),
                              fn=F.layer_norm, replaces=F.layer_norm)
    # F.layer_norm hands weight, bias and eps over as keywords (torch's __torch_function__ protocol)
    ex.register_implementation(op, execution_transform=lambda x, shape, weight=None, bias=None, eps=1e-5:
                               kernel(x, shape, weight, bias, eps))
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    x = torch.randn(2, 4)
    jitted = fulmen.jit(model, executors=[ex])
    with torch.no_grad():
        torch.testing.assert_close(jitted(x), model(x))
    assert kernel.name in _names_in(fulmen.last_traces(jitted)[-1]) and seen == [(2, 6)]
    # with grad, no grad_transform: the grad comes from layer_norm's own rule, the forward still uses the kernel
    out = jitted(x)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for got, p in zip(grads, model.parameters()):
        torch.testing.assert_close(got, p.grad)


def test_errors_are_clear():
    ex = OperatorExecutor(f"errors{next(_names)}")
    name = f"op{next(_names)}"
    ex.register_operator(name, like=lambda x: TensorProxy(like=x), fn=torch.neg)
    with pytest.raises(ValueError, match="identifier"):
        ex.register_operator("not valid", fn=torch.neg)
    with pytest.raises(ValueError, match="unknown executor 'nope'"):
        fulmen.jit(lambda x: x, executors=["nope"])
    with pytest.raises(TypeError, match="list of executors"):
        fulmen.jit(lambda x: x, executors="sdpa")
    with pytest.raises(AttributeError, match="no symbol 'frobnicate'"):
        fulmen.torch.frobnicate  # noqa: B018
    with pytest.raises(ValueError, match="an executor named 'sdpa' is already registered: fulmen's own"):
        register_executor(OperatorExecutor("sdpa"))
    sdpa = fulmen.get_executor("sdpa")
    (own,) = [name for name in sdpa.operators if name.endswith("_forward")][:1]
    with pytest.raises(ValueError, match=f"an operator named '{own}' is already registered by executor 'sdpa'"):
        OperatorExecutor("sdpa").register_operator(own, fn=torch.neg)  # one of fulmen's own, under its name
    assert own in sdpa.operators


def test_two_executors_may_each_have_an_operator_of_the_same_name():
    """Operator names are per executor: two kernel libraries may each call theirs `attention`. Each keeps its own, a
    program may use both (the trace prints the later one after its executor's name), and neither replaces the other;
    fulmen's own executors stay protected (test_errors_are_clear)."""
    n = next(_names)
    first, second = OperatorExecutor(f"first{n}"), OperatorExecutor(f"second{n}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no 'registered again': the other executor's operator is not replaced
        doubled = first.register_operator(f"attention{n}", like=lambda x: TensorProxy(like=x), fn=lambda x: x * 2)
        shifted = second.register_operator(f"attention{n}", like=lambda x: TensorProxy(like=x), fn=lambda x: x + 3)
    assert first.operators[f"attention{n}"] is doubled and second.operators[f"attention{n}"] is shifted
    assert doubled.name == shifted.name == f"attention{n}"
    assert doubled.printed == f"attention{n}" and shifted.printed == f"second{n}_attention{n}"
    x = torch.randn(3)
    jitted = fulmen.jit(lambda x: doubled(x) - shifted(x), executors=[first, second])
    torch.testing.assert_close(jitted(x), x * 2 - (x + 3))
    source = fulmen.last_traces(jitted)[-1].python()
    assert f"attention{n}(x)" in source and f"second{n}_attention{n}(x)" in source
    # each executor registering its own again replaces only its own
    with pytest.warns(UserWarning, match=f"registered again by executor 'second{n}'"):
        tripled = second.register_operator(f"attention{n}", like=lambda x: TensorProxy(like=x), fn=lambda x: x * 3)
    assert first.operators[f"attention{n}"] is doubled and second.operators[f"attention{n}"] is tripled
    torch.testing.assert_close(fulmen.jit(lambda x: doubled(x) + tripled(x), executors=[first, second])(x), x * 5)


def _notebook_cell(scale: float) -> tuple[OperatorExecutor, object]:
    """What a notebook cell defining a custom kernel does; run again with another kernel."""
    ex = register_executor(OperatorExecutor("notebook"))
    op = ex.register_operator("notebook_scale", like=lambda x: TensorProxy(like=x), fn=lambda x: x * scale)
    ex.register_operator("notebook_double", fn=lambda x: x * 2.0, replaces=double)
    return ex, op


def double(x):
    return x * 2.0


def test_running_a_cell_that_registers_an_executor_again_replaces_it():
    ex, op = _notebook_cell(2.0)
    x = torch.randn(3)
    first = fulmen.jit(lambda x: op(x) + double(x), executors=["notebook"])
    torch.testing.assert_close(first(x), x * 2 + x * 2)
    assert "notebook_scale" in _names_in(fulmen.last_traces(first)[-1])
    with pytest.warns(UserWarning) as warned:
        again, op_again = _notebook_cell(3.0)  # the kernel edited, the cell run again
    messages = [str(w.message) for w in warned]
    assert any("an executor named 'notebook' is registered again" in m for m in messages), messages
    for name in ("notebook_scale", "notebook_double"):
        assert any(f"register_operator('{name}'): registered again by executor 'notebook'" in m
                   for m in messages), messages
    assert fulmen.get_executor("notebook") is again and set(again.operators) == {"notebook_scale", "notebook_double"}
    assert not ex.operators and not ex.replacements  # the old registration is gone, not left to shadow the new
    second = fulmen.jit(lambda x: op_again(x) + double(x), executors=["notebook"])
    torch.testing.assert_close(second(x), x * 3 + x * 2)
    with pytest.raises(TypeError, match="replaces= must be a function"):  # refused: the old registration stays
        again.register_operator("notebook_double", fn=lambda x: x * 2.0, replaces=123)
    assert again.operators["notebook_double"].executor is again and double in again.replacements
    with pytest.warns(UserWarning, match="registered again by executor 'notebook'"):  # the same executor, again
        again.register_operator("notebook_double", fn=lambda x: x * 2.0, replaces=double)
    with pytest.warns(UserWarning, match="registered again by executor 'notebook'"):  # the same executor, again
        op_third = again.register_operator("notebook_scale", like=lambda x: TensorProxy(like=x), fn=lambda x: x * 4)
    torch.testing.assert_close(fulmen.jit(lambda x: op_third(x) + 1, executors=[again])(x), x * 4 + 1)


def test_wrong_like_and_missing_grad_are_reported_at_the_user_line():
    ex = OperatorExecutor(f"bad{next(_names)}")
    bad = ex.register_operator(f"bad{next(_names)}", like=lambda x: TensorProxy(like=x), fn=narrowing_helper,
                               replaces=narrowing_helper)
    assert bad.executor is ex
    with pytest.raises(fulmen.TraceError, match=r"(?s)like= function says.*test_extend.py"):
        fulmen.jit(lambda x: narrowing_helper(x) + 1, executors=[ex])(torch.randn(3, 4))

    ex2 = OperatorExecutor(f"nograd{next(_names)}")
    op = ex2.register_operator(f"nograd{next(_names)}", like=lambda x: TensorProxy(like=x), fn=torch.neg)
    with pytest.raises(fulmen.TraceError, match="has no grad"):
        fulmen.jit(lambda x: op(x) * 2, executors=[ex2])(torch.randn(3, requires_grad=True))


def test_every_shipped_executor_is_known_by_its_name():
    """One table names them all; naming one imports the module that defines it."""
    assert {"sdpa", "torchcompile", "unsloth", "liger"} <= PROVIDERS.keys()
    for name, module in PROVIDERS.items():
        executor = fulmen.get_executor(name)
        assert executor.name == name and fulmen.get_executor(name) is executor
        assert any(value is executor for value in vars(importlib.import_module(module)).values())
    with pytest.raises(ValueError, match=r"registered executors: \[.*'liger'.*'sdpa'.*'torchcompile'.*'unsloth'"):
        fulmen.get_executor("nope")


def test_executor_list_resolution():
    sdpa = fulmen.get_executor("sdpa")
    assert [e.name for e in resolve(["torch", sdpa, "sdpa"])] == ["sdpa", "torch"]
    assert resolve(None)[-1].name == "torch"
    assert fulmen.get_default_executors()[0] is sdpa


def halve(x):
    """A helper whose output the backward of what follows needs (sin's backward reads its input)."""
    return x * 0.5


@pytest.mark.parametrize("recomputable", [True, False])
def test_recomputable_operators_are_rerun_in_the_backward_instead_of_saved(recomputable):
    n = next(_names)
    ex = OperatorExecutor(f"halving{n}")
    kernel = ex.register_operator(f"halve_kernel{n}", like=lambda x: TensorProxy(like=x), fn=lambda x: x * 0.5,
                                  recomputable=recomputable)
    replaced = ex.register_operator(f"halve{n}", like=lambda x: TensorProxy(like=x), fn=halve, replaces=halve)
    ex.register_implementation(replaced, execution_transform=kernel, grad_transform=lambda x: _halve_grad(kernel, x))
    x = torch.randn(6, 5, requires_grad=True)
    jitted = fulmen.jit(lambda x: torch.sin(halve(torch.exp(x))), executors=[ex])
    jitted(x).sum().backward()
    leaf = x.detach().requires_grad_()
    torch.sin(halve(torch.exp(leaf))).sum().backward()
    torch.testing.assert_close(x.grad, leaf.grad)
    rerun = kernel.name in _names_in(fulmen.last_backward_traces(jitted)[-1])
    assert rerun is recomputable  # otherwise the forward saves the kernel's output for sin's backward


def noisy(x):
    """Scales by uniform noise: a kernel that draws."""
    return x * torch.rand_like(x)


def test_random_operators_draw_once_per_call_as_eagers():
    n = next(_names)
    ex = OperatorExecutor(f"noise{n}")

    def draw(x):
        noise = torch.rand_like(x)
        return x * noise, noise

    kernel = ex.register_operator(f"noisy_kernel{n}", like=lambda x: (TensorProxy(like=x), TensorProxy(like=x)),
                                  fn=draw, random=True)
    replaced = ex.register_operator(f"noisy{n}", like=lambda x: TensorProxy(like=x), fn=noisy, replaces=noisy,
                                    random=True)

    def grad(x):
        y, noise = kernel(x)
        put_grad(x, get_grad(y) * noise)
        return y

    ex.register_implementation(replaced, execution_transform=lambda x: kernel(x)[0], grad_transform=grad)

    def program(x):  # two equal calls: eager draws twice, so merging them would change the result
        return torch.sin(noisy(x)) * torch.cos(noisy(x))

    jitted = fulmen.jit(program, executors=[ex])
    results = []
    for fn in (program, jitted):
        x = torch.arange(30.0).reshape(6, 5).requires_grad_()
        torch.manual_seed(3)
        out = fn(x)
        out.sum().backward()
        results.append((out, x.grad, torch.get_rng_state()))
    (want, want_grad, want_rng), (got, got_grad, got_rng) = results
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad) and torch.equal(got_rng, want_rng)
    assert [b.sym.name for b in fulmen.last_traces(jitted)[-1].bound_symbols].count(kernel.name) == 2
    assert kernel.name not in _names_in(fulmen.last_backward_traces(jitted)[-1])  # never drawn again

    def unused_draw(x):  # eager's draw advances the generator even though nothing reads it
        noisy(x)
        return torch.sin(noisy(x)) * torch.cos(noisy(x))

    for fn in (program, unused_draw):  # without grad, equal calls would be merged and unused ones dropped
        with torch.no_grad():
            x = torch.arange(30.0).reshape(6, 5)
            torch.manual_seed(4)
            want, want_rng = fn(x), torch.get_rng_state()
            torch.manual_seed(4)
            got, got_rng = fulmen.jit(fn, executors=[ex])(x), torch.get_rng_state()
        assert torch.equal(got, want) and torch.equal(got_rng, want_rng)
    with pytest.raises(ValueError, match="random operator cannot be recomputable"):
        ex.register_operator(f"both{n}", fn=draw, random=True, recomputable=True)


def _halve_grad(kernel, x):
    y = kernel(x)
    put_grad(x, get_grad(y) * 0.5)
    return y


class Squasher(nn.Module):
    def forward(self, x):
        return torch.tanh(x) * 3 + 1


def tanh_boundary(x):
    """The call boundary a lookaside of Squasher.forward introduces (module-level: replaced by name)."""
    return torch.tanh(x)


def test_lookaside_restates_a_method_while_its_executor_is_active():
    """LitGPT-style code with no call boundary around what a kernel replaces: the executor's lookaside restates the
    method through a function its operator replaces. Only that executor's acquisitions see it."""
    n = next(_names)
    ex = OperatorExecutor(f"lookaside{n}")
    seen = []

    def forward(self, x):
        seen.append(type(self).__name__)
        return tanh_boundary(x) * 3 + 1

    tanh_kernel = ex.register_operator(f"tanh_kernel{n}", like=lambda x: TensorProxy(like=x), fn=torch.tanh)
    replaced = ex.register_operator(f"tanh{n}", like=lambda x: TensorProxy(like=x), fn=tanh_boundary,
                                    replaces=tanh_boundary)
    ex.register_implementation(replaced, execution_transform=tanh_kernel)
    ex.register_lookaside(Squasher.forward, forward)
    original = Squasher.__dict__["forward"]
    model, x = Squasher(), torch.randn(4, 3)
    jitted = fulmen.jit(model, executors=[ex])
    torch.testing.assert_close(jitted(x), model(x))
    assert seen == ["Squasher"]  # the lookaside ran while acquiring, and not in the eager call
    assert tanh_kernel.name in _names_in(fulmen.last_traces(jitted)[-1])
    assert Squasher.__dict__["forward"] is original
    plain = fulmen.jit(Squasher(), executors=["torch"])
    plain(x)
    assert seen == ["Squasher"] and tanh_kernel.name not in _names_in(fulmen.last_traces(plain)[-1])
    with pytest.raises(ValueError, match="already traces"):
        ex.register_lookaside(Squasher.forward, forward)
    with pytest.raises(TypeError, match="two functions"):
        ex.register_lookaside(Squasher.forward, None)


def test_other_threads_run_the_original_while_a_lookaside_is_active():
    n = next(_names)
    ex = OperatorExecutor(f"threads{n}")
    inside, eager_done = threading.Event(), threading.Event()

    def forward(self, x):
        inside.set()
        assert eager_done.wait(timeout=60)  # the other thread calls Squasher.forward now
        return torch.tanh(x) * 3 + 1

    ex.register_lookaside(Squasher.forward, forward)
    model, x = Squasher(), torch.randn(4, 3)
    eager: list[torch.Tensor] = []

    def run_eagerly() -> None:
        assert inside.wait(timeout=60)
        eager.append(model(x))  # the lookaside is traced now, in the acquiring thread only
        eager_done.set()

    other = threading.Thread(target=run_eagerly)
    other.start()
    out = fulmen.jit(model, executors=[ex])(x)
    other.join(timeout=60)
    torch.testing.assert_close(out, model(x))
    torch.testing.assert_close(eager[0], model(x))
