"""CUDA graphs (fulmen.transforms.cudagraphs) on CPU.

Without a GPU, the transform must decline with its reason and leave results unchanged. The replay protocol (warm-up,
capture, static copies of moving arguments, in-place reads, invalidation, pairing forwards with backwards, clones of
what the caller receives) is checked with a simulator of CUDA graphs: a capture records every aten call of the
region, and a replay runs the recording again writing each result into the tensor the capture produced, so a
replay reads and writes fixed tensors as a CUDA graph reads and writes fixed addresses. The same checks on a GPU
are in tests/training/test_cuda_graphs.py.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from litgpt import GPT
from torch.utils._python_dispatch import TorchDispatchMode

import fulmen
from fulmen.transforms import cudagraphs
from tests.models.litgpt_configs import shrunk
from tests.training_steps import grads_of, train


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        yield from _tensors(list(value.values()))


class _RecordedGraph:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for func, args, kwargs, outputs, addresses in self.calls:
            # a CUDA graph reads addresses: a tensor whose memory moved since the capture would be read stale
            assert [t.data_ptr() for t in _tensors((args, kwargs))] == addresses, f"{func} reads moved memory"
            results = func(*args, **kwargs)
            for out, result in zip(_tensors(outputs), _tensors(results)):
                if out.data_ptr() != result.data_ptr():
                    out.copy_(result)


class _Recording(TorchDispatchMode):
    def __init__(self, graph: _RecordedGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        outputs = func(*args, **kwargs)
        self.graph.calls.append((func, args, kwargs, outputs, [t.data_ptr() for t in _tensors((args, kwargs))]))
        return outputs


class _Device:
    total_memory = 2**34


class _Stream:
    def wait_stream(self, other) -> None:
        pass


@contextlib.contextmanager
def _capture(graph, pool=None, stream=None):
    with _Recording(graph):
        yield


@pytest.fixture
def simulated_graphs(monkeypatch):
    """CUDA graphs simulated on the CPU (see the module docstring); yields the graphs made."""
    made: list[_RecordedGraph] = []

    def new_graph() -> _RecordedGraph:
        made.append(_RecordedGraph())
        return made[-1]

    monkeypatch.setattr(cudagraphs, "CAPTURE_DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, len(made)))
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", new_graph)
    monkeypatch.setattr(torch.cuda, "graph", _capture)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Device())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return made


def _loss(model, idx, targets):
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _model():
    torch.manual_seed(0)
    return GPT(shrunk("Llama-3.2-1B"))


def _batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 96, (2, 16), generator=generator) for _ in range(2))


def _jit(fn, graphs: bool = True):
    # the torch executor only: the simulator records aten calls, which compiled regions do not make
    return fulmen.jit(fn, executors=["torch"], options=fulmen.JitOptions(cuda_graphs=graphs))


def _trains_as_without_graphs(batches: list) -> Any:
    """Trains a model on `batches` with CUDA graphs and without: each step's loss and gradients are the same. The
    jitted loss with graphs, for its traces."""
    graphed = _jit(_loss)
    losses, grads = train(graphed, _model(), batches, lr=1e-2)
    want_losses, want_grads = train(_jit(_loss, graphs=False), _model(), batches, lr=1e-2)
    for step, (loss, want) in enumerate(zip(losses, want_losses)):
        torch.testing.assert_close(loss, want, msg=f"loss of step {step}")
        for got, ref in zip(grads[step], want_grads[step]):
            torch.testing.assert_close(got, ref, msg=f"a gradient of step {step}")
    return graphed


@pytest.mark.parametrize("new_batches", [False, True], ids=["same_batch", "new_batch_each_step"])
def test_replays_train_as_without_graphs(simulated_graphs, new_batches):
    same = _batch(1)
    batches = [_batch(step) if new_batches else same for step in range(6)]
    graphed = _trains_as_without_graphs(batches)
    forward, backward = fulmen.last_traces(graphed)[-1], fulmen.last_backward_traces(graphed)[-1]
    assert "CUDAGraph0(" in str(forward) and "CUDAGraph0(" in str(backward)
    # warm-up on step 1, capture on step 2, replays after: one forward and one backward graph, 4 replays each more
    assert len(simulated_graphs) == 2
    assert [graph.replays for graph in simulated_graphs] == [5, 5]


def test_outputs_the_caller_keeps_are_not_overwritten(simulated_graphs):
    model = _model()
    graphed = _jit(_loss)
    kept = []
    for step in range(5):
        idx, targets = _batch(step)
        loss = graphed(model, idx, targets)
        loss.backward()
        kept.append((loss, [p.grad for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    for step, (loss, grads) in enumerate(kept):
        idx, targets = _batch(step)
        want = _loss(model, idx, targets)
        want.backward()
        torch.testing.assert_close(loss, want, msg=f"the loss of step {step} changed")
        for grad, p in zip(grads, model.parameters()):
            torch.testing.assert_close(grad, p.grad, msg=f"a gradient of step {step} changed")
        model.zero_grad(set_to_none=True)


def test_a_forward_before_the_previous_backward_runs_without_graphs(simulated_graphs):
    model = _model()
    graphed = _jit(_loss)
    for step in range(3):  # warmed up and captured
        graphed(model, *_batch(step)).backward()
    model.zero_grad(set_to_none=True)
    first, second = _batch(10), _batch(11)
    loss_first = graphed(model, *first)  # replays: its saved values are the graphs' outputs
    loss_second = graphed(model, *second)  # must not overwrite them: runs without graphs
    grads_second, grads_first = grads_of(model, loss_second, loss_first)
    for batch, loss, grads in ((first, loss_first, grads_first), (second, loss_second, grads_second)):
        want = _loss(model, *batch)
        want.backward()
        torch.testing.assert_close(loss, want)
        for grad, p in zip(grads, model.parameters()):
            torch.testing.assert_close(grad, p.grad)
        model.zero_grad(set_to_none=True)


def test_a_moved_parameter_recaptures(simulated_graphs):
    model = _model()
    graphed = _jit(_loss)
    for step in range(3):
        graphed(model, *_batch(step)).backward()
    weight = model.lm_head.weight
    weight.data = weight.data * 0.5  # a new tensor: the graphs read the old one in place
    model.zero_grad(set_to_none=True)
    for step in range(3, 7):
        loss = graphed(model, *_batch(step))
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        want = _loss(model, *_batch(step))
        want.backward()
        torch.testing.assert_close(loss, want, msg=f"step {step}")
        for grad, p in zip(grads, model.parameters()):
            torch.testing.assert_close(grad, p.grad, msg=f"step {step}")
        model.zero_grad(set_to_none=True)
    pool = fulmen.last_traces(graphed)[-1].bound_symbols[0].sym.impl.pool
    assert pool.invalidations == 1 and pool.disabled is None
    assert len(simulated_graphs) == 4  # captured twice


def test_in_place_writes_run_outside_graphs(simulated_graphs):
    def f(x, buffer):
        y = torch.tanh(x) * 2
        buffer.add_(y)  # an in-place write to an input: its write-back is not captured
        return (buffer * y).sum()

    graphed = _jit(f)
    x = torch.randn(4, 4)
    buffer, want_buffer = torch.zeros(4, 4), torch.zeros(4, 4)
    for _ in range(4):
        torch.testing.assert_close(graphed(x, buffer), f(x, want_buffer))
        torch.testing.assert_close(buffer, want_buffer)
    trace = fulmen.last_traces(graphed)[-1]
    names = [bsym.sym.name for bsym in trace.bound_symbols if bsym.sym.name != "del"]
    assert names == ["CUDAGraph0", "copy_", "clone"]  # the loss the caller gets is cloned out of the graph


def test_declines_without_cuda_with_its_reason():
    model = _model()
    graphed = _jit(_loss)
    idx, targets = _batch(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = graphed(model, idx, targets)
    messages = [str(w.message) for w in caught if "CUDA graphs" in str(w.message)]
    reason = "CUDA is not available" if not torch.cuda.is_available() else "runs on cpu, not on a CUDA device"
    assert len(messages) == 1 and reason in messages[0] and "_loss" in messages[0]
    assert caught[0].filename == __file__  # the warning points at the user's call
    torch.testing.assert_close(loss, _loss(model, idx, targets))
    assert "CUDAGraph" not in str(fulmen.last_traces(graphed)[-1])


def test_option_is_typed():
    with pytest.raises(TypeError, match="cuda_graphs must be a bool"):
        fulmen.JitOptions(cuda_graphs="yes")


def _batch_of(seed: int, length: int):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 96, (2, length), generator=generator) for _ in range(2))


def test_a_symbolic_trace_keeps_one_set_of_graphs_per_shape(simulated_graphs):
    """A trace with a symbolic length runs each length's own graphs (warm-up, capture, replays per shape): a graph
    captured at one length never replays another's; the graphs of the shapes seen stay, up to a bound."""
    lengths = [5, 5, 9, 9, 9, 12, 12, 5, 9, 12, 5, 7, 7]
    batches = [_batch_of(step, length) for step, length in enumerate(lengths)]
    graphed = _trains_as_without_graphs(batches)
    assert fulmen.cache_misses(graphed) == 2
    assert '"cpu i64[2, s0]"' in str(fulmen.last_traces(graphed)[-1])
    # a forward and a backward graph per shape run at least twice: the static trace's (5), the symbolic one's (9, 12,
    # 7); before, the symbolic trace replayed the graph of its first captured length ("The size of tensor a (9) must
    # match the size of tensor b (12)")
    assert len(simulated_graphs) == 8
    # calls after each shape's warm-up (the capture replays once): 5 and 9 run 4 times, 12 3 times, 7 twice
    assert sum(graph.replays for graph in simulated_graphs) == 2 * (3 + 3 + 2 + 1)


def test_the_graphs_of_a_region_are_bounded_least_recently_used_first(simulated_graphs, monkeypatch):
    monkeypatch.setattr(cudagraphs, "MAX_SHAPES", 2)
    region = cudagraphs.CUDAGraphRegion(lambda x: (x * 2,), cudagraphs.GraphPool("test"), "CUDAGraph0")
    for n in (3, 3, 3, 4, 4, 5, 5, 3, 3, 4):
        x = torch.randn(n)
        assert torch.equal(region(x)[0], x * 2), n
    # 3, 4 captured; 5 drops 3 (the least recently used); 3 again warms up and drops 4, whose next call warms up
    assert region.captures == 4 and list(region.shapes) == [cudagraphs.layout_key((torch.randn(n),)) for n in (3, 4)]


def test_the_graphs_of_a_program_keep_at_most_their_share_of_memory(simulated_graphs, monkeypatch):
    """Graphs keep their outputs; past the pool's budget (MAX_KEPT_SHARE of the device's memory), the region drops
    its least recently used graphs, never the one just captured."""
    monkeypatch.setattr(cudagraphs, "MAX_KEPT_SHARE", 100 * 4 / _Device.total_memory)  # 100 floats
    pool = cudagraphs.GraphPool("test")
    region = cudagraphs.CUDAGraphRegion(lambda x: (x * 2,), pool, "CUDAGraph0")
    for n in (30, 30, 30, 40, 40, 40, 50, 50, 50, 120, 120, 120, 30, 30):
        x = torch.randn(n)
        assert torch.equal(region(x)[0], x * 2), n
    # 30 and 40 fit (70 floats), 50 drops 30; 120 alone is over the budget and drops 40 and 50, but stays; 30 again
    # warms up (its graph was dropped), then its capture drops 120
    kept = [key for key, state in region.shapes.items() if state.graph is not None]
    assert kept == [cudagraphs.layout_key((torch.randn(30),))]
    assert pool.kept_bytes == 30 * 4 and pool.budget == 100 * 4 and region.captures == 5
