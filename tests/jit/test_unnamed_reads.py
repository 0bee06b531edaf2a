"""Reads off values no variable names: what a call returned (`get_config().scale`), what a property or another Python
getter gave (`holder.config.scale`), an item at a variable key (`configs[i].scale`); and values a cache keeps beyond
the call (`functools.lru_cache`, `functools.cached_property`). Each case runs the same calls and state changes
eagerly and through fulmen.jit: a changed value retraces, an unchanged one hits."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

import fulmen

X = torch.ones(2)


class Config:
    def __init__(self, scale: float = 2.0) -> None:
        self.scale = scale


class Holder:
    def __init__(self) -> None:
        self._config = Config()

    @property
    def config(self) -> Config:
        return self._config

    def get(self) -> Config:
        return self._config


class Forwarding:
    """Answers unknown names from what it wraps, as wrappers of models and configs do."""

    def __init__(self) -> None:
        self.wrapped = {"config": Config()}

    def __getattr__(self, name: str):
        return self.wrapped[name]


class Described:
    """A descriptor of our own answering the read."""

    def __get__(self, obj, owner=None):
        return obj.__dict__["_config"]


class WithDescriptor:
    config = Described()

    def __init__(self) -> None:
        self._config = Config()


def _state() -> dict:
    holder = Holder()
    return {"holder": holder, "configs": [Config(), Config()], "by_name": {"a": Config()},
            "forwarding": Forwarding(), "described": WithDescriptor(), "config": lambda: holder._config,
            "holder of": lambda: holder}


def _scale(get: Callable[[dict], Config], value: float = 3.0) -> Callable[[dict], None]:
    return lambda s: setattr(get(s), "scale", value)


# program(state) -> the function to jit (arguments x, i, key); change(state) -> what the user changes between calls
CASES: dict[str, tuple[Callable, Callable]] = {
    "a function's result": (lambda s: lambda x, i, key: x * s["config"]().scale, _scale(lambda s: s["holder"]._config)),
    "a method's result": (lambda s: lambda x, i, key: x * s["holder"].get().scale,
                          _scale(lambda s: s["holder"]._config)),
    "a property": (lambda s: lambda x, i, key: x * s["holder"].config.scale, _scale(lambda s: s["holder"]._config)),
    "__getattr__": (lambda s: lambda x, i, key: x * s["forwarding"].config.scale,
                    _scale(lambda s: s["forwarding"].wrapped["config"])),
    "a descriptor's __get__": (lambda s: lambda x, i, key: x * s["described"].config.scale,
                               _scale(lambda s: s["described"]._config)),
    "a list item at a variable index": (lambda s: lambda x, i, key: x * s["configs"][i].scale,
                                        _scale(lambda s: s["configs"][1])),
    "a dict item at a variable key": (lambda s: lambda x, i, key: x * s["by_name"][key].scale,
                                      _scale(lambda s: s["by_name"]["a"])),
    "a result's property": (lambda s: lambda x, i, key: x * s["holder of"]().config.scale,
                            _scale(lambda s: s["holder"]._config)),
}


@pytest.mark.parametrize("case", CASES)
def test_a_read_off_a_value_no_variable_names_is_guarded(case):
    program, change = CASES[case]
    results = []
    for run in (lambda fn: fn, fulmen.jit):
        state = _state()
        fn = run(program(state))
        first, again = fn(X, 1, "a"), fn(X, 1, "a")
        change(state)
        results.append((first, again, fn(X, 1, "a")))
    torch.testing.assert_close(results[1], results[0])
    assert not torch.equal(results[0][2], results[0][0])  # the change matters
    assert fulmen.cache_hits(fn) == 1 and fulmen.cache_misses(fn) == 2  # unchanged state: no retrace
    assert "scale" in fulmen.last_cache_miss_reasons(fn)[0]


def test_a_tensor_an_lru_cache_would_keep_is_refused_naming_the_line_and_dropped():
    @functools.lru_cache
    def mask(n: int) -> torch.Tensor:
        return torch.tril(torch.ones(n, n))

    def program(x):
        return x @ mask(x.shape[0])

    x = torch.randn(3, 3)
    with pytest.raises(fulmen.TraceError, match="lru_cache of .*mask") as error:
        fulmen.jit(program)(x)
    assert error.value.location.line == "return x @ mask(x.shape[0])"
    assert mask.cache_info().currsize == 0  # fulmen's stand-in is not left in the user's cache
    torch.testing.assert_close(program(x), x @ torch.tril(torch.ones(3, 3)))  # eager use works on
    fn = fulmen.jit(program)  # with the cache filled first, the trace captures the cached tensor, as eager reads it
    torch.testing.assert_close(fn(x), program(x))


def test_an_object_an_lru_cache_would_keep_is_refused():
    @functools.cache
    def config() -> Config:
        return Config()

    with pytest.raises(fulmen.TraceError, match="keeps a Config object the program creates"):
        fulmen.jit(lambda x: x * config().scale)(X)
    assert config.cache_info().currsize == 0


def test_an_lru_cache_of_numbers_keeps_them_as_eager():
    @functools.lru_cache
    def width(n: int) -> int:
        return 2 * n

    fn = fulmen.jit(lambda x: x * width(x.shape[0]))
    torch.testing.assert_close(fn(X), X * 4)
    assert width.cache_info().currsize == 1 and width(2) == 4


def test_a_tensor_a_cached_property_would_keep_is_refused_and_dropped():
    class Tables:
        @functools.cached_property
        def table(self) -> torch.Tensor:
            return torch.arange(2.0)

    tables = Tables()
    with pytest.raises(fulmen.TraceError, match="cached_property table"):
        fulmen.jit(lambda x: x + tables.table)(X)
    assert "table" not in vars(tables)
    fn = fulmen.jit(lambda x: x + tables.table)
    torch.testing.assert_close(tables.table, torch.arange(2.0))  # filled eagerly: then read as state
    torch.testing.assert_close(fn(X), X + torch.arange(2.0))
