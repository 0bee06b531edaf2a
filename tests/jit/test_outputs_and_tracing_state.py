"""What a jitted program returns and what it sees: objects holding tensors come back with real, fresh tensors on
every call; objects it is given never keep traced tensors; where eager's path reads a tensor value, it is acquired
again seeing `torch.compiler.is_compiling()`, the path libraries keep for tracers."""

from __future__ import annotations

import pytest
import torch

import fulmen


class Cache:
    """A KV-cache-like object: tensors in attributes, one level down in a list of layer objects."""

    def __init__(self) -> None:
        self.layers: list[Layer] = []
        self.note = "kept"


class Layer:
    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys


def program(x: torch.Tensor) -> dict:
    cache = Cache()
    cache.layers.append(Layer(x * 2))
    cache.layers.append(Layer(x + 1))
    return {"out": x.sum(), "cache": cache}


def test_objects_holding_tensors_come_back_real_and_fresh_on_every_call():
    jitted = fulmen.jit(program)
    results = []
    for _ in range(2):
        x = torch.randn(3)
        result = jitted(x)
        results.append(result["cache"])
        assert result["cache"].note == "kept"
        for layer, want in zip(result["cache"].layers, (x * 2, x + 1)):
            assert type(layer.keys) is torch.Tensor
            torch.testing.assert_close(layer.keys, want)
    assert fulmen.cache_hits(jitted) == 1
    assert results[0] is not results[1] and results[0].layers[0] is not results[1].layers[0]
    torch.testing.assert_close(results[0].layers[0].keys * 0, torch.zeros(3))  # the first call's values stayed


def test_an_object_returned_twice_is_refused():
    def twice(x):
        cache = Cache()
        cache.layers.append(Layer(x * 2))
        return cache, cache

    with pytest.raises(fulmen.TraceError, match="appears twice"):
        fulmen.jit(twice)(torch.randn(3))


def test_objects_given_to_the_program_must_not_keep_traced_tensors():
    def fill(x, cache):
        cache.last = Layer(x * 2)
        return x + 1

    def extend(x, cache):
        cache.layers.append(Layer(x * 2))
        return x + 1

    cache = Cache()
    with pytest.raises(fulmen.TraceError, match=r"attribute `last` of Cache object \(.*in fill\): it stores a Layer "
                                                r".* holding one \(`\.last\.keys`\)"):
        fulmen.jit(fill)(torch.randn(3), cache)
    cache = Cache()
    with pytest.raises(fulmen.TraceError, match=r"changes the list attribute layers of Cache object \(.*in extend"):
        fulmen.jit(extend)(torch.randn(3), cache)
    assert cache.layers == []  # the refused call left it as it was


def test_the_tracer_path_is_taken_only_where_eagers_path_reads_values():
    def library(x):
        if torch.compiler.is_compiling():  # what a library does under a tracer: no value read
            return x * 2
        return x * 2 if x.sum() > 0 else x * 2  # eager's path reads a value (same result either way)

    x = torch.randn(3)
    torch.testing.assert_close(fulmen.jit(library)(x), x * 2)
    assert not torch.compiler.is_compiling()

    def plain(x):
        return x + 1 if torch.compiler.is_compiling() else x  # no value read: acquired as eager runs it

    torch.testing.assert_close(fulmen.jit(plain)(x), x)

    def reads_either_way(x):
        return x if x.sum() > 0 else -x

    with pytest.raises(fulmen.DataDependentError, match="__bool__"):
        fulmen.jit(reads_either_way)(x)


def test_both_ways_of_setting_the_flag_are_seen_and_restored():
    from fulmen.acquisition import is_compiling

    for session in (is_compiling.seen_as_compiling, is_compiling._session_flag):
        with session():
            assert torch.compiler.is_compiling()
        assert not torch.compiler.is_compiling()


# --- grad mode inside the program ---------------------------------------------------------------------------------
def _inner_no_grad(x, w):
    with torch.no_grad():
        constant = x * 3
    return constant, x * 3 * w  # the same call with grad enabled is another value


def _inner_enable_grad(x, w):
    with torch.enable_grad():
        y = x * w
    return y, x * w


def _run_and_backward(fn, grad_enabled: bool):
    x, w = torch.ones(3, requires_grad=True), torch.full((3,), 2.0, requires_grad=True)
    with torch.set_grad_enabled(grad_enabled):
        outputs = fn(x, w)
    flags = [out.requires_grad for out in outputs]
    scale = torch.ones(3, requires_grad=True)  # a backward through the outputs that have a history
    sum(((out * scale).sum() for out in outputs), torch.zeros(())).backward()
    return [out.detach() for out in outputs], flags, x.grad, w.grad, scale.grad


@pytest.mark.parametrize(("fn", "grad_enabled"), [(_inner_no_grad, True), (_inner_enable_grad, False)])
def test_grad_mode_set_inside_the_program_decides_its_outputs_history_as_in_eager(fn, grad_enabled):
    expected = _run_and_backward(fn, grad_enabled)
    jitted = fulmen.jit(fn)
    for _ in range(2):  # traced, then a cache hit
        actual = _run_and_backward(jitted, grad_enabled)
        torch.testing.assert_close(actual, expected)
    assert fulmen.cache_hits(jitted) == 1


def test_inference_mode_records_no_history_even_where_the_program_enables_grad():
    jitted = fulmen.jit(_inner_enable_grad)
    x, w = torch.ones(3), torch.ones(3, requires_grad=True)
    with torch.no_grad():
        assert [out.requires_grad for out in jitted(x, w)] == [True, False]
    for fn in (_inner_enable_grad, jitted):  # the same cache entry: inference mode is grad mode off to the key
        with torch.inference_mode():
            assert [(out.requires_grad, out.is_inference()) for out in fn(x, w)] == [(False, True), (False, True)]
