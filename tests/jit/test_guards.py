"""No wrong cache hits: each case a new user met (issue 17) gives eager's result, by a retrace or a clear error."""

from __future__ import annotations

import functools
import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fulmen
from fulmen.acquisition.aliasing import StorageGroups
from fulmen.jit.jitted_module import core as jitted_core


def _misses(fn) -> int:
    return fulmen.cache_misses(fn)


# --- 1. layout ------------------------------------------------------------------------------------------------------
def test_reshape_of_an_input_updated_in_place_follows_its_strides():
    def f(x):
        y = x.reshape(-1)
        y.add_(1)  # a copy for a transposed x, x itself for a contiguous one
        return x.sum()

    fn = fulmen.jit(f)
    assert fn(torch.zeros(4, 3).t()).item() == 0
    x = torch.zeros(3, 4)
    assert fn(x).item() == 12 and x.sum().item() == 12
    assert _misses(fn) == 2
    assert "strides" in fulmen.last_cache_miss_reasons(fn)[0]


def test_contiguous_copy_never_overwrites_the_input():
    def f(x):
        y = x.contiguous()
        y.mul_(0)
        return y + 1

    fn = fulmen.jit(f)
    a = torch.ones(3, 4)
    fn(a)
    assert a.sum() == 0  # eager: contiguous() returned a itself
    b = torch.ones(4, 3).t()
    torch.testing.assert_close(fn(b), torch.ones(3, 4))
    assert b.sum() == 12  # eager: contiguous() copied


@pytest.mark.parametrize("program", [
    pytest.param(lambda x: x * 2 if x.is_contiguous() else x * 3, id="is_contiguous"),
    pytest.param(lambda x: x * x.stride(0), id="stride"),
    pytest.param(lambda x: x + x.storage_offset(), id="storage_offset"),
])
def test_layout_reads_are_guarded(program):
    fn = fulmen.jit(program)
    base = torch.randn(6, 8)
    for x in (base[:3, :4].contiguous(), base[:4, :3].t(), base[1:4, 1:5], base[:3, :4].contiguous()):
        torch.testing.assert_close(fn(x), program(x))


def test_storage_offset_matters_only_to_a_program_that_reads_it():
    fn = fulmen.jit(lambda x: x * 2)
    for chunk in torch.randn(4, 3).chunk(4):  # micro-batches: offsets 0, 3, 6, 9
        torch.testing.assert_close(fn(chunk), chunk * 2)
    assert _misses(fn) == 1
    reads = fulmen.jit(lambda x: x + x.storage_offset())
    for chunk in torch.zeros(4, 3).chunk(4):
        torch.testing.assert_close(reads(chunk), chunk + chunk.storage_offset())
    assert _misses(reads) == 4
    assert "storage offsets" in fulmen.last_cache_miss_reasons(reads)[0]


def test_flatten_follows_the_memory_format():
    fn = fulmen.jit(lambda x: x.flatten(1))
    x = torch.randn(2, 3, 4, 5)
    channels_last = x.to(memory_format=torch.channels_last)
    torch.testing.assert_close(fn(channels_last), channels_last.flatten(1))
    torch.testing.assert_close(fn(x), x.flatten(1))
    assert _misses(fn) == 2


# --- 2. aliased inputs ----------------------------------------------------------------------------------------------
def update_first(x, y):
    x.add_(1)
    return y * 2


def test_the_same_tensor_twice_sees_its_update():
    fn = fulmen.jit(update_first)
    a = torch.zeros(2)
    torch.testing.assert_close(fn(a, a), torch.full((2,), 2.0))  # the first call already
    torch.testing.assert_close(a, torch.ones(2))
    b, c = torch.zeros(2), torch.zeros(2)
    torch.testing.assert_close(fn(b, c), torch.zeros(2))  # no aliasing: not the aliased trace
    assert "sharing memory changed: no inputs (traced with x and y)" in fulmen.last_cache_miss_reasons(fn)[0]
    torch.testing.assert_close(fn(a, a), torch.full((2,), 4.0))  # and back: a hit on the aliased trace
    assert _misses(fn) == 2


def test_a_captured_tensor_given_another_ones_memory_traces_again():
    """The entry admits a call by its storages' addresses while they stay put; `B.data = A.data` between calls
    moves one, and the groups computed again tell the call apart."""
    a, b = torch.zeros(2), torch.zeros(2)

    def f(x):
        a.add_(x)
        return b * 2

    fn = fulmen.jit(f)
    for _ in range(2):
        torch.testing.assert_close(fn(torch.ones(2)), torch.zeros(2))
    b.data = a.data
    torch.testing.assert_close(fn(torch.ones(2)), torch.full((2,), 6.0))  # eager: a is 3, and b is a
    torch.testing.assert_close(a, torch.full((2,), 3.0))
    assert _misses(fn) == 2 and "sharing memory changed" in fulmen.last_cache_miss_reasons(fn)[0]


def test_storage_groups_admit_by_addresses_and_fresh_tensors_apart():
    base, other = torch.zeros(8), torch.zeros(4)
    tensors = [base[:4], base[4:], other, torch.zeros(())]  # the last one is made anew by every call
    groups = StorageGroups(tensors, fresh=[3])
    assert groups.groups == (0, 0, 2, 3)
    assert groups.admits([base[:4], base[4:], other, torch.zeros(())])  # the fresh one elsewhere
    assert not groups.admits([base[:4], torch.zeros(4), other, torch.zeros(())])  # a member moved apart
    assert not groups.admits([base[:4], base[4:], other, other[0]])  # the fresh one shares another's storage
    assert not groups.admits([base[:4], base[4:], base[2:], torch.zeros(())])  # another joins the group
    assert groups.admits([base[:4], base[4:], other, torch.ones(())])


def test_overlapping_views_as_eager():
    fn = fulmen.jit(update_first)
    got, want = torch.arange(6.0), torch.arange(6.0)
    torch.testing.assert_close(fn(got[0:3], got[1:4]), update_first(want[0:3], want[1:4]))
    torch.testing.assert_close(got, want)
    got, want = torch.arange(6.0), torch.arange(6.0)  # a trace made without aliasing is not reused with it
    fn2 = fulmen.jit(update_first)
    fn2(torch.zeros(3), torch.zeros(3))
    torch.testing.assert_close(fn2(got[0:3], got[1:4]), update_first(want[0:3], want[1:4]))
    torch.testing.assert_close(got, want)


CAPTURED = torch.zeros(6)


def test_a_captured_tensor_sees_an_update_made_through_an_argument_viewing_it():
    def f(x):
        x.add_(1)
        return CAPTURED * 2

    got = fulmen.jit(f)(CAPTURED[1:3])
    torch.testing.assert_close(got, torch.tensor([0.0, 2.0, 2.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(CAPTURED, torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, 0.0]))


def test_aliased_update_with_grad_is_refused():
    fn = fulmen.jit(update_first)
    w = torch.zeros(4, requires_grad=True)
    base = w * 1
    with pytest.raises(fulmen.TraceError, match="share memory.*requires grad") as error:
        fn(base[0:2], base[1:3])
    assert error.value.location.line == "x.add_(1)"  # the update's line


# --- 3. Python state the program reads ---------------------------------------------------------------------------
SCALE = 1.0
WEIGHT = torch.ones(2)


def test_globals_are_guarded():
    global SCALE, WEIGHT
    fn = fulmen.jit(lambda x: x * SCALE + WEIGHT)
    x = torch.ones(2)
    try:
        torch.testing.assert_close(fn(x), torch.full((2,), 2.0))
        SCALE = 2.0
        torch.testing.assert_close(fn(x), torch.full((2,), 3.0))
        assert "global SCALE" in fulmen.last_cache_miss_reasons(fn)[0]
        WEIGHT = torch.full((2,), 5.0)
        torch.testing.assert_close(fn(x), torch.full((2,), 7.0))
        assert "global WEIGHT" in fulmen.last_cache_miss_reasons(fn)[1]
    finally:
        SCALE, WEIGHT = 1.0, torch.ones(2)


def test_closure_cells_and_the_lists_they_hold_are_guarded():
    factor, weights = 2.0, [1.0]

    def f(x):
        return x * factor * weights[0]

    fn = fulmen.jit(f)
    x = torch.ones(2)
    fn(x)
    factor = 3.0
    torch.testing.assert_close(fn(x), x * 3.0)
    weights.append(7.0)
    weights[0] = 5.0
    torch.testing.assert_close(fn(x), x * 15.0)
    assert "closure variable weights" in fulmen.last_cache_miss_reasons(fn)[1]


TABLE = [float(i) for i in range(300)]  # past the size whose checks are generated item by item


def test_large_containers_are_compared_whole():
    fn = fulmen.jit(lambda x: x * TABLE[-1])
    x = torch.ones(2)
    fn(x)
    TABLE[-1] = -0.0
    try:
        torch.testing.assert_close(fn(x), x * -0.0)
        fn(x)
        assert _misses(fn) == 2
    finally:
        TABLE[-1] = 299.0


class Config:
    shift = 0.0  # a class attribute

    def __init__(self):
        self.s = 1.0


def test_attributes_of_arguments_and_classes_are_guarded():
    fn = fulmen.jit(lambda x, cfg: x * cfg.s + cfg.shift + Config.shift)
    cfg, x = Config(), torch.ones(2)
    fn(x, cfg)
    cfg.s = 2.0
    torch.testing.assert_close(fn(x, cfg), x * 2.0)
    Config.shift = 1.0
    try:
        torch.testing.assert_close(fn(x, cfg), x * 2.0 + 2.0)
        assert "attribute shift" in fulmen.last_cache_miss_reasons(fn)[1]
    finally:
        Config.shift = 0.0


# --- 4. signed zeros and nan ----------------------------------------------------------------------------------------
def test_signed_zero_and_nan_scalars():
    fn = fulmen.jit(lambda x, a: x / a)
    x = torch.ones(2)
    torch.testing.assert_close(fn(x, 0.0), torch.full((2,), float("inf")))
    torch.testing.assert_close(fn(x, -0.0), torch.full((2,), float("-inf")))
    assert _misses(fn) == 2
    for _ in range(3):
        assert fn(x, float("nan")).isnan().all()
    assert _misses(fn) == 3  # nan retraced once, then hit


# --- 5. a bounded cache ---------------------------------------------------------------------------------------------
def test_cache_limit_warns_then_runs_eagerly():
    # static shapes: one trace per size (with symbolic sizes, the default, these sizes share one trace)
    fn = fulmen.jit(lambda x: x * 2, options=fulmen.JitOptions(dynamic=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(1, 51):
            x = torch.randn(n)
            torch.testing.assert_close(fn(x), x * 2)
    core = jitted_core(fn)
    assert len(core._cache.entries) == 8 and core.stats.eager_calls == 42
    limit_warnings = [w for w in caught if issubclass(w.category, fulmen.CacheLimitWarning)]
    assert len(limit_warnings) == 1
    assert "cache_limit=8" in str(limit_warnings[0].message) and "tensor argument x: shape (9,)" in str(
        limit_warnings[0].message)
    x = torch.randn(3)
    torch.testing.assert_close(fn(x), x * 2)  # cached traces still hit
    assert core.stats.eager_calls == 42


def test_cache_limit_error():
    fn = fulmen.jit(lambda x: x + 1, options=fulmen.JitOptions(cache_limit=2, cache_limit_action="error",
                                                               dynamic=False))
    fn(torch.ones(1))
    fn(torch.ones(2))
    with pytest.raises(fulmen.CacheLimitError, match="cache_limit=2.*shape"):
        fn(torch.ones(3))


@pytest.mark.parametrize("kwargs", [{"cache_limit": 0}, {"cache_limit": 2.0}, {"cache_limit_action": "ignore"}])
def test_cache_options_are_validated(kwargs):
    with pytest.raises(ValueError, match="JitOptions.cache_limit"):
        fulmen.JitOptions(**kwargs)


def test_cache_limit_action_accepts_the_enum():
    assert fulmen.JitOptions(cache_limit_action=fulmen.CacheLimitAction.ERROR).cache_limit_action == "error"


def test_a_module_list_slice_made_by_the_program():
    # ModuleList.__getitem__ with a slice builds a new ModuleList of the (shadow) class the program runs on
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
            self.depth = 2

        def forward(self, x):
            for layer in self.layers[: self.depth]:
                x = layer(x)
            return x

    model = Stack()
    jitted = fulmen.jit(model)
    x = torch.randn(2, 4)
    torch.testing.assert_close(jitted(x), model(x))
    torch.testing.assert_close(jitted(x), model(x))
    model.depth = 3
    torch.testing.assert_close(jitted(x), model(x))
    assert (fulmen.cache_hits(jitted), fulmen.cache_misses(jitted)) == (1, 2)


class _Switch:
    def __init__(self) -> None:
        self.on = False

    def set(self) -> None:
        self.on = True

    def reset(self) -> None:
        self.on = False


SWITCH = _Switch()


def test_state_the_program_sets_before_reading_it_is_not_a_guard():
    # a flag the program sets, reads and resets (transformers' CompileableContextVar does this under a tracer): what
    # it reads, it wrote in the same call, so the next call must not see the flag as changed
    def program(x):
        SWITCH.set()
        y = x * 2 if SWITCH.on else x
        SWITCH.reset()
        return y

    jitted = fulmen.jit(program)
    for _ in range(3):
        x = torch.randn(3)
        torch.testing.assert_close(jitted(x), x * 2)
    assert (fulmen.cache_hits(jitted), fulmen.cache_misses(jitted)) == (2, 1)
    assert SWITCH.on is False


# --- 6. functions and classes ---------------------------------------------------------------------------------------
def _remembers(x, seen=[]):  # noqa: B006 - the mutable default is the case under test
    seen.append(1)
    return x * len(seen)


def _scaled(x, k=2, *, shift=0.0):
    return x * k + shift


def _calls_scaled(x):
    return _scaled(x)


def test_a_mutable_default_the_program_changes_is_guarded():
    fn, x = fulmen.jit(_remembers), torch.ones(2)
    for expected in (1.0, 2.0, 3.0):
        torch.testing.assert_close(fn(x), x * expected)


def test_defaults_and_code_of_a_called_function_are_guarded():
    fn, x = fulmen.jit(_calls_scaled), torch.ones(2)
    saved = (_scaled.__defaults__, _scaled.__kwdefaults__, _scaled.__code__)
    fn(x)
    try:
        for change in (lambda: setattr(_scaled, "__defaults__", (7,)),
                       lambda: _scaled.__kwdefaults__.__setitem__("shift", 1.0),
                       lambda: setattr(_scaled, "__code__", (lambda x, k=2, *, shift=0.0: x - k).__code__)):
            change()
            torch.testing.assert_close(fn(x), _calls_scaled(x))
        assert _misses(fn) == 4
        assert "code or defaults of function _scaled" in fulmen.last_cache_miss_reasons(fn)[0]
    finally:
        _scaled.__defaults__, _scaled.__kwdefaults__, _scaled.__code__ = saved


def test_code_and_defaults_of_the_jitted_function_itself_are_guarded():
    """IPython's autoreload assigns `__code__` of the functions it reloads in place."""
    def program(x, k=2):
        return x * k

    fn, x = fulmen.jit(program), torch.ones(2)
    fn(x)
    program.__code__ = (lambda x, k=2: x - k).__code__
    torch.testing.assert_close(fn(x), x - 2)
    program.__defaults__ = (5,)
    torch.testing.assert_close(fn(x), x - 5)
    assert _misses(fn) == 3
    assert "code or defaults of function test_code_and_defaults" in fulmen.last_cache_miss_reasons(fn)[0]


def test_what_a_jitted_partial_binds_is_guarded():
    scale = torch.ones(2)
    bound = functools.partial(_scaled, shift=1.0, k=scale)
    fn, x = fulmen.jit(bound), torch.ones(2)
    torch.testing.assert_close(fn(x), bound(x))
    scale.mul_(3)  # read on every call: no retrace
    torch.testing.assert_close(fn(x), bound(x))
    bound.keywords["shift"] = 4.0
    torch.testing.assert_close(fn(x), bound(x))
    bound.keywords["k"] = torch.full((2,), 5.0)
    torch.testing.assert_close(fn(x), bound(x))
    assert _misses(fn) == 3
    assert "what functools.partial binds to _scaled changed" in fulmen.last_cache_miss_reasons(fn)[0]


class _Doubled(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_a_module_whose_class_is_swapped_retraces():
    model = nn.Sequential(nn.Linear(3, 3))
    fn, x = fulmen.jit(model), torch.randn(2, 3)
    fn(x)
    model[0].__class__ = _Doubled
    torch.testing.assert_close(fn(x), model(x))
    assert "class of the Linear module is now _Doubled" in fulmen.last_cache_miss_reasons(fn)[0]


# --- 7. state read through a function or an array --------------------------------------------------------------------
LOOKUP = np.array([1.0, 2.0])


@pytest.mark.parametrize("case", ["environ", "getenv", "deterministic", "tf32", "numpy"])
def test_state_behind_calls_and_arrays_is_guarded(case, monkeypatch):
    program = {
        "environ": lambda x: x * (2 if os.environ.get("FULMEN_TEST_FLAG") == "1" else 1),
        "getenv": lambda x: x * (2 if os.getenv("FULMEN_TEST_FLAG") == "1" else 1),
        "deterministic": lambda x: x * (2 if torch.are_deterministic_algorithms_enabled() else 1),
        "tf32": lambda x: x * (2 if torch.backends.cuda.matmul.allow_tf32 else 1),
        "numpy": lambda x: x * float(LOOKUP[0]),
    }[case]
    change = {
        "environ": lambda: monkeypatch.setenv("FULMEN_TEST_FLAG", "1"),
        "getenv": lambda: monkeypatch.setenv("FULMEN_TEST_FLAG", "1"),
        "deterministic": lambda: torch.use_deterministic_algorithms(True),
        "tf32": lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", not tf32),
        "numpy": lambda: LOOKUP.__setitem__(0, 5.0),
    }[case]
    monkeypatch.delenv("FULMEN_TEST_FLAG", raising=False)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    fn, x = fulmen.jit(program), torch.ones(2)
    try:
        torch.testing.assert_close(fn(x), program(x))
        change()
        torch.testing.assert_close(fn(x), program(x))
        assert _misses(fn) == 2
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        LOOKUP[0] = 1.0


def test_python_attributes_of_a_tensor_argument_are_read_and_guarded():
    """`x.scale` set on the argument: the first trace reads it (its proxy carries it), and setting, changing or
    deleting it retraces, with the reason named."""

    def f(x):
        return x * getattr(x, "scale", 1.0)

    jitted = fulmen.jit(f)
    x = torch.ones(2)
    x.scale = 3.0
    for value in (3.0, 4.0, None, 4.0):
        if value is None:
            del x.scale
        else:
            x.scale = value
        torch.testing.assert_close(jitted(x), f(x), rtol=0, atol=0)
    assert fulmen.cache_misses(jitted) == 3 and fulmen.cache_hits(jitted) == 1
    assert any("Python attributes" in reason for reason in fulmen.last_cache_miss_reasons(jitted))

    clashing = torch.ones(2)
    clashing.meta = "mine"  # a name fulmen's stand-in for the tensor uses itself
    with pytest.raises(fulmen.TraceError, match=r"Python attributes \['meta'\]"):
        fulmen.jit(f)(clashing)


def test_a_miss_on_a_python_value_of_the_arguments_names_where_it_changed():
    # LitGPT's generate passes input_pos_maxp1 as an int growing by one per token: each token traces anew (eager
    # from the cache limit on), and the reason says which argument did it
    def f(x, n, scale=1.0, opts=None):
        return x * n * scale

    fn = fulmen.jit(f)
    x = torch.randn(3)
    reasons = []
    for args, kwargs in [((x, 2), {}), ((x, 3), {}), ((x, 2), {"scale": 0.5}), ((x, 2, 1.0, {"a": [1, 2]}), {}),
                         ((x, 2, 1.0, {"a": [1, 3]}), {}), ((x, 2, 1.0, {"a": [1, 3, 4]}), {})]:
        torch.testing.assert_close(fn(*args, **kwargs), f(*args, **kwargs), rtol=0, atol=0)
        reasons.append(fulmen.last_cache_miss_reasons(fn))
    assert reasons[1] == ["trace 0: positional argument 1: 3, traced with 2"]
    assert reasons[2][0] == ("trace 0: the keyword arguments: a dict with keys ['scale'], traced with a dict with "
                             "keys []")
    assert reasons[4][-1] == "trace 3: positional argument 3['a'][1]: 3, traced with 2"
    assert reasons[5][-1] == "trace 4: positional argument 3['a']: a list of 3 items, traced with a list of 2 items"
