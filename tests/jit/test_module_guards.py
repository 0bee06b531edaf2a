"""No wrong cache hits on module state: a module's attributes, submodules, hooks, parameters and buffers changed
between calls (their values, their tensors' metadata, ties between them) give eager's result by a retrace, and
buffers a step updates are updated once (split from test_guards.py)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fulmen


def _misses(fn) -> int:
    return fulmen.cache_misses(fn)


# --- 1. module state ------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.dims = (1,)
        self.dtype = torch.float32
        self.coeffs = {"a": 1.0}
        self.extra = nn.ModuleList()

    def forward(self, x):
        y = self.act(self.lin(x)) * self.coeffs["a"]
        for layer in self.extra:
            y = layer(y)
        return y.sum(self.dims).to(self.dtype)


def _tuple(m):
    m.dims = (0,)


def _swap(m):
    m.act = nn.Tanh()


def _dtype(m):
    m.dtype = torch.float64


def _dict(m):
    m.coeffs["a"] = 3.0


def _append(m):
    m.extra.append(nn.Linear(4, 4))


def _hook(m):
    m.register_forward_hook(lambda module, args, out: out * 10)


def _pre_hook(m):
    m.lin.register_forward_pre_hook(lambda module, args: (args[0] + 1,))


class _Buffer:
    def __init__(self) -> None:
        self.items: list[torch.Tensor] = []


def test_objects_the_program_creates_and_fills_keep_cache_hits():
    # what the program reads of an object it made (a cache filled layer by layer) is derived from its inputs: no
    # guard, or every call would find the object changed after the read and trace again
    def program(x):
        buffer = _Buffer()
        buffer.items.append(x)
        count = len(buffer.items)
        buffer.items.append(x * 2)
        return buffer.items[-1] * count

    jitted = fulmen.jit(program)
    for _ in range(3):
        x = torch.randn(3)
        torch.testing.assert_close(jitted(x), program(x))
    assert (fulmen.cache_hits(jitted), fulmen.cache_misses(jitted)) == (2, 1)


def test_an_object_the_program_did_not_create_is_still_guarded_after_it_changes_it():
    shared = _Buffer()

    def program(x):
        scale = len(shared.items)  # read before the program changes it: a later call reads another length
        shared.items.append(x.shape[0])  # an immutable value: stored again by every call (containers.py)
        return x * scale

    jitted = fulmen.jit(program, options=fulmen.JitOptions(cache_limit=2))
    results = []
    for i in range(4):
        x = torch.randn(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fulmen.CacheLimitWarning)
            results.append(jitted(x))
        torch.testing.assert_close(results[-1], x * i)
    assert len(shared.items) == 4 and fulmen.cache_hits(jitted) == 0



@pytest.mark.parametrize("change", [_tuple, _swap, _dtype, _dict, _append, _hook, _pre_hook],
                         ids=lambda c: c.__name__.strip("_"))
def test_module_state_changes_retrace(change):
    model = Block()
    fn = fulmen.jit(model)
    x = torch.randn(3, 4)
    fn(x)
    change(model)
    twin = copy.deepcopy(model)  # deepcopy keeps hooks and the submodules' weights
    torch.testing.assert_close(fn(x), twin(x))
    assert _misses(fn) == 2


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        return self.lin(x) * self.scale


def _wider(m):
    m.lin.weight.data = torch.randn(4, 6)  # with an input of 6 features
    return torch.randn(3, 6)


def _transposed(m):
    m.lin.weight.data = m.lin.weight.data.t().contiguous().t()  # the same values, other strides


def _double(m):
    m.double()
    return torch.randn(3, 4, dtype=torch.float64)


def _frozen(m):
    m.lin.weight.requires_grad_(False)


def _buffer_resized(m):
    m.scale.resize_(1)
    m.scale.fill_(3.0)


@pytest.mark.parametrize("change", [_wider, _transposed, _double, _frozen, _buffer_resized],
                         ids=lambda c: c.__name__.strip("_"))
def test_module_tensors_changed_in_place_retrace(change):
    """The module tensors' key is not computed again while the call fetches the same tensors with the same metadata
    (guards.ModuleKeys, torch's C++ tensor check): a tensor changed in place between calls (`.data` given another
    shape, strides or dtype, requires_grad_, resize_) still traces again, and the call is eager's."""
    model = _Scaled()
    fn = fulmen.jit(model)
    x = torch.randn(3, 4)
    for _ in range(3):
        torch.testing.assert_close(fn(x), model(x))
    assert (_misses(fn), fulmen.cache_hits(fn)) == (1, 2)
    given = change(model)
    x = x if given is None else given
    twin = copy.deepcopy(model)
    out, want = fn(x), twin(x)
    assert _misses(fn) == 2, fulmen.last_cache_miss_reasons(fn)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out.sum().backward()
    want.sum().backward()
    for p, q in zip(model.parameters(), twin.parameters()):  # a frozen weight gets no grad, as eager's
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    fn(x)
    assert _misses(fn) == 2  # and the new key is reused


def test_hooks_and_instance_overrides_are_named_in_the_miss_reasons():
    model = Block()
    fn = fulmen.jit(model)
    x = torch.randn(3, 4)
    fn(x)
    handle = model.lin.register_forward_hook(lambda module, args, out: out * 10)
    torch.testing.assert_close(fn(x), model(x))
    assert "_forward_hooks of the Linear module no longer empty" in fulmen.last_cache_miss_reasons(fn)[0]
    handle.remove()
    original = model.forward
    model.forward = lambda y: original(y) * 2  # patched on the instance, as wrappers of forward do
    torch.testing.assert_close(fn(x), model(x))
    assert "forward now set on the Block module itself" in fulmen.last_cache_miss_reasons(fn)[0]


LINEAR = nn.Linear(3, 3)


def _through_global(x):
    return LINEAR(x)


def _replace_weight(m):
    m.weight = nn.Parameter(torch.zeros(3, 3))


def _drop_bias(m):
    m.bias = None


def _freeze(m):
    m.weight.requires_grad_(False)


@pytest.mark.parametrize("reach", ["argument", "closure", "global"])
def test_parameters_of_a_module_the_program_reaches_are_guarded(reach):
    """A module that is not the jitted one gives the program its real tensors: replacing, dropping or freezing one
    retraces."""
    global LINEAR
    module = LINEAR = nn.Linear(3, 3)
    program = {"argument": lambda x, m: m(x), "closure": lambda x: module(x),
               "global": lambda x: _through_global(x)}[reach]
    args = (module,) if reach == "argument" else ()
    fn = fulmen.jit(program)
    x = torch.randn(2, 3)
    torch.testing.assert_close(fn(x, *args), program(x, *args))
    for change in (_replace_weight, _drop_bias, _freeze):
        change(module)
        out = fn(x, *args)
        torch.testing.assert_close(out, program(x, *args))
        assert out.requires_grad == program(x, *args).requires_grad
    assert _misses(fn) == 4
    assert "parameter weight of a Linear module changed" in fulmen.last_cache_miss_reasons(fn)[2]


class _Tied(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.out = nn.Linear(3, 5, bias=False)
        if tied:
            self.out.weight = self.emb.weight

    def forward(self, i):
        return self.out(self.emb(i))


@pytest.mark.parametrize("tied", [True, False], ids=["untie", "tie"])
def test_tying_or_untying_weights_retraces(tied):
    model = _Tied(tied)
    twin = copy.deepcopy(model)
    fn, i = fulmen.jit(model), torch.tensor([0, 1, 2])
    torch.testing.assert_close(fn(i), twin(i))
    for m in (model, twin):
        m.out.weight = nn.Parameter(torch.randn(5, 3)) if tied else m.emb.weight
    m.out.weight.data.copy_(model.out.weight)
    out, ref = fn(i), twin(i)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    if tied:
        assert "out.weight is no longer the same tensor as emb.weight" in fulmen.last_cache_miss_reasons(fn)[0]


def test_module_list_delete():
    model = Block()
    model.extra.append(nn.Linear(4, 4))
    fn = fulmen.jit(model)
    x = torch.randn(3, 4)
    fn(x)
    del model.extra[0]
    torch.testing.assert_close(fn(x), model(x))


# --- 2. buffers updated once ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("grad", [True, False], ids=["train step", "no_grad"])
def test_batch_norm_running_statistics_update_once(grad):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    twin = copy.deepcopy(model)
    fn = fulmen.jit(model)
    x = torch.randn(8, 4)
    for _ in range(3):
        with torch.set_grad_enabled(grad):
            for m in (fn, twin):
                out = m(x)
                if grad:
                    out.square().sum().backward()
    for got, want in zip(model.state_dict().values(), twin.state_dict().values()):
        torch.testing.assert_close(got, want)
    if grad:
        torch.testing.assert_close(model[0].weight.grad, twin[0].weight.grad)
