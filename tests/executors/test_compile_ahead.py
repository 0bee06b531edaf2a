"""Fusion regions compiled ahead in worker processes (fulmen.core.compile_ahead): a worker compiles each region into
Inductor's FX graph cache as soon as the executors claim it, and the region's first call compiles it here, a cache
hit when the worker has finished. What runs is what this process compiles without workers: the same values and
grads bit for bit. A worker that has not finished, or failed, leaves the compile to this process.

Every test compiles into an Inductor cache directory of its own (the workers inherit it), so the hits counted are
the workers'."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
from litgpt.model import GPT
from torch._dynamo.utils import counters

import fulmen
from fulmen.core.compile_ahead import CompileAhead, InputSpec
from fulmen.core.inductor import InductorFunction
from fulmen.executors.torch_compile import TorchCompileExecutor
from tests.models.litgpt_configs import shrunk

# a region as the torchcompile executor hands it to a worker: Python that defines it (a printed trace)
SOURCE = """
import torch

def region(a, b):
    return torch.nn.functional.gelu(a) * b + a.shape[-1], (a * b).sum(-1)
"""
_namespace: dict = {}
exec(SOURCE, _namespace)  # noqa: S102
_region = _namespace["region"]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    def fresh(name: str) -> None:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / name))
        counters.clear()

    return fresh


def test_a_region_a_worker_compiled_is_a_cache_hit_here(cache_dir):
    a, b = torch.randn(2, 9, 16), torch.randn(16)
    cache_dir("here")
    alone = InductorFunction(_region)
    want = alone(a, b)
    assert counters["inductor"]["fxgraph_cache_miss"] == 1
    cache_dir("ahead")
    pool = CompileAhead(1)
    compiled = InductorFunction(_region)
    compiled.ahead(SOURCE, "region", (InputSpec.of(a), InputSpec.of(b)), pool)
    assert len(pool.jobs) == 1
    pool.jobs[0].result(timeout=600)  # the worker's compile done before the first call
    got = compiled(a, b)
    assert dict(counters["inductor"]).get("fxgraph_cache_miss", 0) == 0
    assert counters["inductor"]["fxgraph_cache_hit"] == 1
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    pool.shutdown()


def test_a_symbolic_region_compiles_here_and_never_from_the_cache(cache_dir):
    """Inductor's cache entry of a region's graph (tensor arguments alone) keeps no guard on its sizes
    (fulmen.core.inductor._guarded): a symbolic region is neither sent to a worker nor looked up."""
    dynamic = (frozenset({1}), frozenset())
    a, b = torch.randn(2, 9, 16), torch.randn(16)
    cache_dir("symbolic")
    pool = CompileAhead(1)
    compiled = InductorFunction(_region, dynamic=dynamic)
    compiled.ahead(SOURCE, "region", (InputSpec.of(a, dynamic[0]), InputSpec.of(b)), pool)
    assert not pool.jobs and not compiled._ahead
    for _ in range(2):  # the second function finds the first's graph in no cache
        again = InductorFunction(_region, dynamic=dynamic)
        torch.testing.assert_close(again(a, b), _region(a, b))
    assert not dict(counters["inductor"]).get("fxgraph_cache_hit") and not dict(counters["inductor"]).get(
        "fxgraph_cache_miss")  # not looked up (a bypass)
    c = torch.randn(2, 13, 16)  # another length: the same variant
    torch.testing.assert_close(again(c, b), _region(c, b))
    assert len(again.guarded) == 1
    pool.shutdown()


def test_a_litgpt_model_with_workers_trains_as_without(cache_dir):
    """Whichever region the workers finish before its first call: the same values and grads bit for bit, over a
    static and a symbolic trace, and every job completes."""
    torch.manual_seed(0)
    model = GPT(shrunk("pythia-14m"))
    batches = [torch.randint(0, model.config.padded_vocab_size, (2, n)) for n in (5, 9, 12)]
    ran = {}
    for workers in (0, 1):
        cache_dir(f"workers{workers}")
        executor = TorchCompileExecutor(name=f"torchcompile-ahead-{workers}", compile_workers=workers)
        jitted = fulmen.jit(model, executors=["sdpa", executor, "torch"])
        results = []
        for idx in batches:
            out = jitted(idx)
            out.sum().backward()
            results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
            model.zero_grad(set_to_none=True)
        assert fulmen.cache_misses(jitted) == 2
        for job in executor.ahead.jobs:
            assert job.result(timeout=600) is None
        ran[workers] = results, len(executor.ahead.jobs), dict(counters["inductor"])
        executor.ahead.shutdown()
    (serial, no_jobs, serial_counts), (ahead, jobs, ahead_counts) = ran[0], ran[1]
    assert no_jobs == 0 < jobs
    for (out, grads), (out_ahead, grads_ahead) in zip(serial, ahead, strict=True):
        assert torch.equal(out, out_ahead)
        assert all(torch.equal(g, h) for g, h in zip(grads, grads_ahead, strict=True))
    compiles = serial_counts["fxgraph_cache_miss"]
    assert serial_counts.get("fxgraph_cache_hit", 0) == 0
    assert ahead_counts.get("fxgraph_cache_hit", 0) + ahead_counts.get("fxgraph_cache_miss", 0) == compiles


class _FailingPool:
    """Workers whose every job failed."""

    workers = 1

    def submit(self, source, name, specs, options) -> Future:
        job: Future = Future()
        job.set_exception(RuntimeError("the worker died"))
        return job


def test_a_failed_worker_leaves_the_compile_to_this_process():
    compiled = InductorFunction(_region)
    a, b = torch.randn(4, 8), torch.randn(8)
    compiled.ahead(SOURCE, "region", (InputSpec.of(a), InputSpec.of(b)), _FailingPool())
    compiled.ahead(SOURCE, "region", (InputSpec.of(a), InputSpec.of(b)), _FailingPool())  # the same layout: one job
    assert len(compiled._ahead) == 1
    torch.testing.assert_close(compiled(a, b), _region(a, b))
    assert not compiled._ahead and len(compiled.variants) == 1
    # a layout no job compiled (transposed strides): a variant of its own, compiled here
    t = torch.randn(8, 4).t()
    torch.testing.assert_close(compiled(t, b), _region(t, b))
    assert len(compiled.variants) == 2


def test_a_job_that_cannot_be_sent_leaves_the_compile_to_this_process():
    pool = CompileAhead(1)
    compiled = InductorFunction(_region)
    a, b = torch.randn(4, 8), torch.randn(8)
    specs = (InputSpec.of(a), InputSpec.of(b))
    assert pool.submit(SOURCE, "region", specs, {"a_hook": lambda graph: graph}) is None  # options that do not pickle
    assert not pool.jobs and pool._pool is None  # nothing sent, no process started
    compiled.ahead(SOURCE, "region", specs, CompileAhead(0))  # no workers: nothing traced ahead either
    assert not compiled._ahead
    torch.testing.assert_close(compiled(a, b), _region(a, b))


@pytest.mark.parametrize("workers", [-1, 1.5, True, "2"])
def test_compile_workers_must_be_a_count(workers):
    with pytest.raises(ValueError, match="compile_workers"):
        TorchCompileExecutor(name="torchcompile-bad", compile_workers=workers)
