"""fulmen's caches that the user's program fills stay bounded: an LRU keeps at most its size, a cache by identity
drops an entry when its key dies, and a hit still hits (the programs give eager's values throughout)."""

from __future__ import annotations

import gc
import linecache

import pytest
import torch
from torch import nn

import fulmen
from fulmen.acquisition import autograd_functions
from fulmen.core.bounded import LRU, ByIdentity
from fulmen.jit import module_inputs
from fulmen.observation import frame_tap
from fulmen.transforms import autocast


def test_an_lru_keeps_its_size_and_its_recently_used_entries():
    cache: LRU[str, int] = LRU(2)
    cache["a"], cache["b"] = 1, 2
    assert cache.get("a") == 1  # a hit makes "a" recent: "b" goes next
    cache["c"] = 3
    assert len(cache) == 2 and "b" not in cache and cache.get("a") == 1 and cache.get("c") == 3
    assert cache.get("b", "missing") == "missing"
    with pytest.raises(ValueError, match="at least one entry"):
        LRU(0)


def _function(n: int):
    namespace: dict = {}
    exec(f"def f(x):\n    return x * {n} + 1\n", namespace)  # noqa: S102 - a function defined again, as in a notebook
    return namespace["f"]


def test_a_cache_by_identity_tells_equal_codes_apart_and_drops_an_entry_with_its_key():
    cache: ByIdentity = ByIdentity()
    first, second = _function(2), _function(2)
    assert first.__code__ == second.__code__ and first.__code__ is not second.__code__
    cache[first.__code__] = "first"
    assert cache.get(first.__code__) == "first" and second.__code__ not in cache
    del first
    gc.collect()
    assert len(cache) == 0


def _trace_entries() -> set[str]:
    return {name for name in linecache.cache if str(name).startswith("<fulmen trace")}


def test_a_compiled_traces_source_lines_go_with_it():
    before = _trace_entries()
    jitted = fulmen.jit(_function(3))
    x = torch.randn(4)
    torch.testing.assert_close(jitted(x), x * 3 + 1)
    made = _trace_entries() - before
    assert made  # while the trace lives, tracebacks through it show its lines
    assert all(linecache.getline(name, 1).startswith("# Constructed by") for name in made)
    del jitted
    gc.collect()
    assert not made & _trace_entries()


def test_the_frame_taps_read_sites_go_with_their_code():
    x = torch.randn(4)
    kept = _function(5)
    jitted = fulmen.jit(kept)
    torch.testing.assert_close(jitted(x), x * 5 + 1)
    sites = frame_tap._SITES.get(kept.__code__, "missing")
    assert sites != "missing"
    start = len(frame_tap._SITES)
    for n in range(20):  # functions defined again and again: each a new code, gone when its function goes
        torch.testing.assert_close(fulmen.jit(_function(n))(x), x * n + 1)
    gc.collect()
    assert len(frame_tap._SITES) <= start + 2
    torch.testing.assert_close(fulmen.jit(kept)(x), x * 5 + 1)
    assert frame_tap._SITES.get(kept.__code__, "missing") is sites  # a code still alive keeps its entry: a hit


def test_autocasts_probes_are_bounded_and_still_hit(monkeypatch):
    assert isinstance(autocast._PROBES, LRU)  # the module's own is bounded; a small one fills here
    monkeypatch.setattr(autocast, "_PROBES", LRU(2))

    def program(a, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return a @ b

    def run(jitted, n: int) -> None:
        a, b = torch.randn(n, 3), torch.randn(3, n)
        got = jitted(a, b)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, program(a, b), rtol=0, atol=0)
        assert len(autocast._PROBES) <= 2

    def plans() -> dict:  # the matmul's plan per shape of its first argument
        return {key[3][0][1]: plan for key, plan in autocast._PROBES._entries.items()}

    jitted = fulmen.jit(program)
    for n in (2, 3, 4, 5):
        run(jitted, n)
    held = plans()
    assert set(held) == {(4, 3), (5, 3)}
    run(fulmen.jit(program), 5)  # a fresh jit traces anew: the plan comes from the cache
    assert plans()[(5, 3)] is held[(5, 3)]
    run(fulmen.jit(program), 2)  # probed again; the least recently used goes
    assert set(plans()) == {(5, 3), (2, 3)}


def _function_class(scale: float) -> type:
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * scale

        @staticmethod
        def backward(ctx, grad):
            return grad * scale

    return Scale


def test_the_recording_classes_of_autograd_functions_are_bounded_and_still_hit(monkeypatch):
    assert isinstance(autograd_functions._RECORDED, LRU)  # the module's own is bounded; a small one fills here
    monkeypatch.setattr(autograd_functions, "_RECORDED", LRU(2))
    x = torch.randn(3, requires_grad=True)
    classes = [_function_class(float(n)) for n in range(4)]
    for n, cls in enumerate(classes):
        jitted = fulmen.jit(lambda x, cls=cls: cls.apply(x) + 1)
        out = jitted(x)
        (grad,) = torch.autograd.grad(out.sum(), x)
        torch.testing.assert_close(out, x * n + 1)
        torch.testing.assert_close(grad, torch.full_like(x, float(n)))
        assert len(autograd_functions._RECORDED) <= 2
    recorded = autograd_functions._recording_class(classes[-1])
    assert autograd_functions._recording_class(classes[-1]) is recorded  # a hit
    assert issubclass(recorded, classes[-1])


def _module_class(n: int) -> type:
    return type(f"Scaled{n}", (nn.Linear,), {"forward": lambda self, x: nn.Linear.forward(self, x) * n})


def test_the_shadow_classes_of_modules_are_bounded_and_still_hit(monkeypatch):
    assert isinstance(module_inputs._SHADOW_CLASSES, LRU)  # the module's own is bounded; a small one fills here
    monkeypatch.setattr(module_inputs, "_SHADOW_CLASSES", LRU(2))
    x = torch.randn(2, 3)
    for n in range(4):
        model = _module_class(n)(3, 3)
        torch.testing.assert_close(fulmen.jit(model)(x), model(x))
        assert len(module_inputs._SHADOW_CLASSES) <= 2
    cls = type(model)
    assert module_inputs._shadow_class(cls) is module_inputs._shadow_class(cls)  # a hit
