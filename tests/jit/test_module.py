"""A jitted module behaves as the original for parameters, state dicts, modes, devices and optimizers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fulmen


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)
        self.register_buffer("offset", torch.ones(2))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) + self.offset


def test_module_surface_matches_original():
    model = Net()
    jitted = fulmen.jit(model)
    assert isinstance(jitted, nn.Module)
    assert [n for n, _ in jitted.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(jitted.parameters(), model.parameters()))
    assert list(jitted.state_dict()) == list(model.state_dict())
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    jitted.load_state_dict(state)
    assert torch.count_nonzero(model.fc1.weight) == 0
    jitted.eval()
    assert not model.training and not model.fc1.training
    assert jitted.fc1 is model.fc1  # attribute access reaches the original


def test_optimizer_trains_through_jitted_module():
    torch.manual_seed(0)
    eager, compiled = Net(), Net()
    compiled.load_state_dict(eager.state_dict())
    jitted = fulmen.jit(compiled)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(jitted.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(5, 4)
        for model, opt in ((eager, opt_e), (jitted, opt_c)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a, b)


def test_user_module_is_not_mutated_by_tracing():
    model = Net()
    before = {k: v for k, v in model.__dict__.items()}
    params = dict(model.named_parameters())
    fulmen.jit(model)(torch.randn(1, 4))
    assert model.__dict__.keys() == before.keys()
    assert all(p is params[n] for n, p in model.named_parameters())
    assert type(model) is Net and type(model.fc1) is nn.Linear


def test_dataclass_and_dict_inputs_and_outputs():
    from dataclasses import dataclass

    @dataclass
    class Batch:
        x: torch.Tensor
        scale: float

    def f(batch, extra):
        return {"y": batch.x * batch.scale + extra["b"], "shape": tuple(batch.x.shape)}

    batch, extra = Batch(torch.randn(2, 3), 2.0), {"b": torch.randn(3)}
    out = fulmen.jit(f)(batch, extra)
    ref = f(batch, extra)
    torch.testing.assert_close(out["y"], ref["y"])
    assert out["shape"] == (2, 3)


def test_half_precision_parameter_of_a_module_passed_as_argument_converts():
    """`weight.float()` on a real bf16 parameter (LitGPT's RMSNorm) captures it as a constant."""
    norm = torch.nn.Linear(4, 4).to(torch.bfloat16)

    def f(module, x):
        return x * module.weight.float()

    x = torch.randn(4, 4)
    torch.testing.assert_close(fulmen.jit(f)(norm, x), f(norm, x))


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.steps = 0
        self.last_len = None
        self.initialized = False

    def forward(self, x):
        self.steps += 1  # read, then written: the guard on steps misses next call
        self.last_len = x.shape[0]  # written only: stored again by every call using the trace
        if not self.initialized:
            self.initialized = True
        return x * self.steps


def test_python_attributes_the_forward_writes_are_stored_by_every_call():
    model, twin = Counter(), Counter()
    jitted = fulmen.jit(model)
    for n in (2, 3, 2, 2):
        x = torch.ones(n)
        torch.testing.assert_close(jitted(x), twin(x))
        assert (model.steps, model.last_len, model.initialized) == (twin.steps, twin.last_len, twin.initialized)


class LastLength(nn.Module):
    def forward(self, x):
        self.seen = x.shape  # a new attribute, the same for every call with this shape
        return x + 1


def test_a_written_attribute_is_stored_on_cache_hits():
    model = LastLength()
    jitted = fulmen.jit(model)
    for n in (2, 3, 2):
        jitted(torch.ones(n))
        assert model.seen == (n,)
    assert (fulmen.cache_hits(jitted), fulmen.cache_misses(jitted)) == (1, 2)


LAST = None


class _State:
    calls = 0


def test_globals_and_object_attributes_written_are_stored_on_cache_hits():
    state = _State()

    def program(x, s):
        global LAST
        LAST = x.shape[0]
        s.last = x.shape[0] * 2
        return x * 2

    jitted = fulmen.jit(program)
    for n in (2, 3, 2):
        jitted(torch.ones(n), state)
        assert (LAST, state.last) == (n, 2 * n)
    assert fulmen.cache_hits(jitted) == 1


def _scale(module, args, output):
    return output * 3


def _shift_input(module, args):
    return (args[0] + 1,)


def test_global_module_hooks_apply_once_per_module_call_as_in_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    x = torch.randn(2, 3)
    jitted = fulmen.jit(model)
    jitted(x)  # traced without hooks
    for register in (nn.modules.module.register_module_forward_hook,
                     nn.modules.module.register_module_forward_pre_hook):
        handle = register(_scale if register is nn.modules.module.register_module_forward_hook else _shift_input)
        try:
            torch.testing.assert_close(jitted(x), model(x))
            torch.testing.assert_close(fulmen.jit(model)(x), model(x))  # registered before the first call
        finally:
            handle.remove()
    torch.testing.assert_close(jitted(x), model(x))


def test_hooks_on_the_jitted_module_run_once_per_call_with_or_without_global_hooks():
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    jitted = fulmen.jit(model)
    jitted(x)
    calls = []
    handles = [
        jitted.register_forward_pre_hook(lambda module, args: (calls.append("pre"), (args[0] * 2,))[1]),
        jitted.register_forward_pre_hook(lambda module, args, kwargs: (calls.append("pre_kw"), None)[1],
                                         with_kwargs=True),
        jitted.register_forward_hook(lambda module, args, out: (calls.append("post"), out + 1)[1]),
        jitted.register_forward_hook(lambda module, args, kwargs, out: (calls.append("post_kw"), out * 3)[1],
                                     with_kwargs=True),
    ]
    expected = (model(x * 2) + 1) * 3
    torch.testing.assert_close(jitted(x), expected)
    assert calls == ["pre", "pre_kw", "post", "post_kw"]
    calls.clear()
    global_handle = nn.modules.module.register_module_forward_hook(_scale)
    try:
        torch.testing.assert_close(jitted(x), (model(x * 2) + 1) * 3)  # model's call here applies the global hook
        assert calls == ["pre", "pre_kw", "post", "post_kw"]
    finally:
        global_handle.remove()
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(jitted(x), model(x))


def test_a_backward_hook_inside_the_module_is_refused_and_one_on_the_jitted_module_runs():
    """A full backward hook on a submodule has no place in a trace: refused, naming the submodule (it was torch's
    'Error while setting up backward hooks'). The same hook on the module fulmen.jit returns runs as eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    x = torch.randn(2, 3, requires_grad=True)
    handle = model[1].register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 10,))
    with pytest.raises(fulmen.TraceError, match=r"module 1 \(Tanh\) with a backward hook"):
        fulmen.jit(model)(x)
    handle.remove()
    jitted = fulmen.jit(model)
    jitted(x)
    handle = torch.nn.modules.module.register_module_full_backward_hook(lambda module, grad_in, grad_out: None)
    try:  # registered after the first call: the cached trace is not used
        with pytest.raises(fulmen.TraceError, match="global module backward hooks"):
            jitted(x)
    finally:
        handle.remove()

    jitted = fulmen.jit(model)
    jitted.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 10,))
    jitted(x).sum().backward()
    got, x.grad = x.grad, None
    model.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 10,))
    model(x).sum().backward()
    torch.testing.assert_close(got, x.grad, rtol=0, atol=0)


def test_a_parametrized_module_inside_parametrize_cached_is_refused():
    """The parametrization cache would keep the trace's stand-ins past the acquisition (it was an internal dispatch
    error); outside `cached()` the module compiles and matches eager."""
    from torch.nn.utils import parametrize

    class Symmetric(nn.Module):
        def forward(self, weight):
            return weight.triu() + weight.triu(1).transpose(-1, -2)

    model = nn.Linear(3, 3)
    parametrize.register_parametrization(model, "weight", Symmetric())
    x = torch.randn(2, 3)
    with parametrize.cached(), pytest.raises(fulmen.TraceError, match=r"parametrize.cached\(\)"):
        fulmen.jit(model)(x)
    torch.testing.assert_close(fulmen.jit(model)(x), model(x), rtol=0, atol=0)


class HoldsLazyGraph(nn.Module):
    """A submodule that is a torch.fx lazy GraphModule with its code pending (as Dynamo hands a backend)."""

    def __init__(self) -> None:
        super().__init__()
        from torch.fx._lazy_graph_module import _LazyGraphModule

        traced = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(3, 3), nn.Tanh()))
        self.body = _LazyGraphModule(traced, traced.graph)
        self.body(torch.randn(2, 3))  # compiled on its first call
        self.body.recompile()  # a graph edit: compiled again on its next call

    def forward(self, x):
        return self.body(x) * 2


def test_a_lazy_graph_module_compiled_on_its_next_call_gives_eagers_result():
    # Compiled on fulmen's stand-in for it, its call used to call itself without end (RecursionError)
    model = HoldsLazyGraph()
    x = torch.randn(2, 3)
    jitted = fulmen.jit(model)
    for _ in range(2):
        torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
    assert fulmen.cache_misses(jitted) == 1


class OwnFlatten(nn.GRU):
    def flatten_parameters(self) -> None:
        self.flattened = getattr(self, "flattened", 0) + 1
        super().flatten_parameters()


def test_a_method_lookaside_stands_for_torchs_method_not_a_subclass_override():
    from fulmen.acquisition.lookasides import method_lookasides, rnn_flatten_parameters

    assert method_lookasides(nn.LSTM) == {"flatten_parameters": rnn_flatten_parameters}
    assert method_lookasides(OwnFlatten) == {}
    assert method_lookasides(nn.Linear) == {}


def test_a_deep_copy_is_its_own_jitted_module():
    """`copy.deepcopy` of a jitted module that ran (an EMA or DPO reference model): the copy holds its own tensors
    and traces anew; the original keeps training, the copy stays as it was. (It failed with 'aten.clone.default'.)"""
    torch.manual_seed(0)
    model = Net()
    jitted = fulmen.jit(model, executors=["torch"])
    jitted.register_forward_hook(lambda module, args, out: out * 2)
    x = torch.randn(3, 4)
    jitted(x).sum().backward()
    reference = copy.deepcopy(jitted)
    function = fulmen.jit(lambda t: jitted(t) + 1)
    function(x)
    function_copy = copy.deepcopy(function)
    frozen = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert type(reference) is type(jitted) and reference._jit.executors == jitted._jit.executors
    assert all(a is not b for a, b in zip(reference.parameters(), model.parameters()))
    torch.testing.assert_close(reference(x), frozen(x) * 2)  # the hook came along
    torch.testing.assert_close(jitted(x), model(x) * 2)
    torch.testing.assert_close(function_copy(x), jitted(x) + 1)  # a function shares what it closes over
    assert fulmen.cache_misses(reference) == 1
