"""What a jitted call keeps alive once the caller drops its tensors, against eager: nothing.

Measured deterministically, with the cyclic garbage collector off (training loops turn it off, and a cycle it would
free still holds the memory until it runs): a weak reference to each storage the caller was given or gave, checked
after `del`. Eager frees them all at once; so must fulmen, whether the backward runs or not.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import fulmen


@pytest.fixture
def without_cyclic_gc() -> Iterator[None]:
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _embedding_and_gram(idx, w):
    e = F.embedding(idx, w)
    v = e.reshape(-1, w.shape[1])  # a view of an output, saved for the backward of the matmul
    return e, (v @ v.T).sum()


def _output_saved(x):
    y = x @ x.T  # an output, saved for the backward of y * y
    return y, (y * y).sum()


class _EmbeddingGram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)

    def forward(self, idx):
        e = self.emb(idx)
        v = e.view(-1, 32)
        return e, (v @ v.T).sum()


def _embedding_args() -> tuple[torch.Tensor, ...]:
    return torch.randint(0, 50, (8, 16)), torch.randn(50, 32, requires_grad=True)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _storages(tensors: list[torch.Tensor]) -> list[StorageWeakRef]:
    return [StorageWeakRef(t.untyped_storage()) for t in tensors]


def _alive_after_calls(fn: Callable[..., Any], make_args: Callable[[], tuple], calls: int) -> tuple[int, int]:
    """How many storages of the outputs, then of the arguments made for each call, are still alive after `calls`
    calls whose outputs were dropped without a backward (the first call traces, the later ones hit the cache)."""
    outputs, arguments = [], []
    for _ in range(calls):
        args = make_args()
        out = fn(*args)
        outputs += _storages(_tensors(out))
        arguments += _storages([a for a in args if isinstance(a, torch.Tensor)])
        del args, out
    return sum(not r.expired() for r in outputs), sum(not r.expired() for r in arguments)


@pytest.mark.parametrize("program, make_args", [
    pytest.param(_embedding_and_gram, _embedding_args, id="view-of-an-output-saved"),
    pytest.param(_output_saved, lambda: (torch.randn(16, 8, requires_grad=True),), id="output-saved"),
])
def test_outputs_dropped_without_a_backward_are_freed(without_cyclic_gc, program, make_args):
    """A forward with grad enabled whose outputs are dropped (no backward): eager frees them at once. fulmen kept
    every call's outputs: the autograd node held the saved view of an output, whose base's grad_fn is that node (a
    cycle through C++ that no collector frees), or the output itself (freed only by the cyclic collector)."""
    assert _alive_after_calls(program, make_args, 4) == (0, 0)  # the oracle
    assert _alive_after_calls(fulmen.jit(program), make_args, 4) == (0, 0)


def test_a_modules_outputs_dropped_without_a_backward_are_freed(without_cyclic_gc):
    torch.manual_seed(0)
    model = _EmbeddingGram()
    jitted = fulmen.jit(model)
    make = lambda: (torch.randint(0, 50, (8, 16)),)
    assert _alive_after_calls(model, make, 4) == (0, 0)
    assert _alive_after_calls(jitted, make, 4) == (0, 0)


@pytest.mark.parametrize("hooks", ["save_on_cpu", "identity"])
def test_outputs_dropped_under_saved_tensor_hooks_are_freed(without_cyclic_gc, hooks):
    """Under saved-tensor hooks the saved values go through save_for_backward; a pack hook that keeps the tensor it
    is given (save_on_cpu on a CPU tensor gives it back) kept the view of the output, and so the node, alive."""
    def context():
        if hooks == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu()
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    jitted = fulmen.jit(_embedding_and_gram)
    for fn in (_embedding_and_gram, jitted):
        with context():
            assert _alive_after_calls(fn, _embedding_args, 3) == (0, 0)


def _grads_then_freed(fn: Callable[..., Any], keep_output: bool) -> tuple[list[torch.Tensor], int]:
    """Runs two calls, keeping or dropping the first output before the backward; the grads of w and the number of
    output storages alive once everything is dropped."""
    torch.manual_seed(0)
    idx, w = _embedding_args()
    grads, refs = [], []
    for _ in range(2):
        e, loss = fn(idx, w)
        refs += _storages([e, loss])
        if not keep_output:
            del e
        (loss * 2).backward()
        grads.append(w.grad.clone())
        w.grad = None
        if keep_output:
            del e
        del loss
    return grads, sum(not r.expired() for r in refs)


@pytest.mark.parametrize("keep_output", [True, False])
def test_a_backward_that_runs_afterwards_gives_eagers_grads(without_cyclic_gc, keep_output):
    expected, alive = _grads_then_freed(_embedding_and_gram, keep_output)
    assert alive == 0
    grads, alive = _grads_then_freed(fulmen.jit(_embedding_and_gram), keep_output)
    assert alive == 0
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


def test_kept_outputs_stay_usable_and_are_freed_when_dropped(without_cyclic_gc):
    """Outputs kept across later calls live as long as the caller holds them, and a backward through any of them
    gives eager's grads; dropping them frees them, whether their backward ran or not."""
    torch.manual_seed(0)
    x = torch.randn(16, 8, requires_grad=True)
    jitted = fulmen.jit(_output_saved)
    kept = [jitted(x) for _ in range(4)]
    refs = _storages([t for pair in kept for t in pair])
    y_eager = x @ x.T
    (want,) = torch.autograd.grad((y_eager * y_eager).sum(), x)
    for y, loss in kept[::2]:  # the others' backward never runs
        (grad,) = torch.autograd.grad(loss, x)
        torch.testing.assert_close(y, y_eager)
        torch.testing.assert_close(grad, want)
    assert all(not r.expired() for r in refs)
    del kept, y, loss
    assert sum(not r.expired() for r in refs) == 0


def test_an_in_place_update_of_a_saved_output_still_fails_the_backward():
    """The node keeps a detached alias of a saved output: it shares the output's version counter, so an update of the
    output before the backward is refused as eager refuses it."""
    jitted = fulmen.jit(_output_saved)
    for fn in (_output_saved, jitted):
        x = torch.randn(16, 8, requires_grad=True)
        y, loss = fn(x)
        with torch.no_grad():
            y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def _reads_autograd_facts(x, w):
    y = x @ w
    return (y.relu() if x.is_leaf else y.sigmoid()), x.is_inference(), x.grad_fn is None


@pytest.mark.parametrize("program, make_args", [
    pytest.param(lambda x, w: (x @ w).relu().sum(), lambda: (torch.randn(4, 16), torch.randn(16, 8)),
                 id="no-grad"),
    pytest.param(lambda x, w: (x @ w).relu().sum(), lambda: (torch.randn(4, 16), torch.randn(16, 8,
                                                                                             requires_grad=True)),
                 id="grad"),
    pytest.param(_reads_autograd_facts, lambda: (torch.randn(4, 16, requires_grad=True) * 1,
                                                 torch.randn(16, 8, requires_grad=True)), id="facts-read"),
])
def test_the_inputs_of_a_call_that_traces_are_freed(without_cyclic_gc, program, make_args):
    """The inputs of a call that traces (each call here traces: a new jitted function) were held by a cycle through
    the autograd facts' dict of inputs until the cyclic collector ran; eager frees them at once."""
    for fn in (program, *(fulmen.jit(program) for _ in range(2))):
        assert _alive_after_calls(fn, make_args, 1) == (0, 0)


def test_the_input_of_a_module_call_that_traces_is_freed(without_cyclic_gc):
    model = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), nn.ReLU())
    make = lambda: (torch.randn(4, 16),)
    assert _alive_after_calls(model, make, 1) == (0, 0)
    assert _alive_after_calls(fulmen.jit(model), make, 1) == (0, 0)
    # a change of mode traces again: its input is freed too
    model.eval()
    jitted = fulmen.jit(model)
    assert _alive_after_calls(jitted, make, 1) == (0, 0)
    model.train()
    assert _alive_after_calls(jitted, make, 1) == (0, 0)


def test_the_autograd_facts_read_while_tracing_still_match_eager():
    """The facts are read when the trace starts, not kept with the tensor: a leaf and a non-leaf input still get
    eager's answers, each from its own trace."""
    jitted = fulmen.jit(_reads_autograd_facts)
    w = torch.randn(16, 8, requires_grad=True)
    base = torch.randn(4, 16, requires_grad=True)
    for x in (base, base * 1, base, base * 1):
        got, want = jitted(x, w), _reads_autograd_facts(x, w)
        torch.testing.assert_close(got[0], want[0])
        assert got[1:] == want[1:]
