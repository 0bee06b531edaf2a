"""The class of a parameter, and NumPy arrays a program hands to torch, inside a trace: as eager, or refused.

A proxy answers `isinstance` and `x.__class__` with the class of the tensor it stands for (an nn.Parameter argument,
a module's own parameter, a subclass of Parameter, a tensor marked by nn.Buffer), and the cache key holds that class:
a plain tensor passed where a Parameter was traced takes a trace of its own. `type(x)` cannot be answered so (the
proxy's type is fulmen's): it is refused for a proxy of another class, naming the line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

import fulmen
from fulmen.core.errors import TraceError, UnsupportedOpError


def _isinstance_parameter(x, p):
    return x + 1 if isinstance(p, nn.Parameter) else x


def _class_reads(x, p):
    out = x * 2 if p.__class__ is nn.Parameter else x
    out = out + 10 if p.__class__.__name__ == "Parameter" else out
    return out + 100 if isinstance(p * 1, nn.Parameter) else out  # what an op returns is a plain Tensor


class _Scale(nn.Parameter):
    pass


def _subclass_reads(x, p):
    return x * 3 if isinstance(p, _Scale) else x * 5


@pytest.mark.parametrize("fn", [_isinstance_parameter, _class_reads, _subclass_reads])
def test_the_class_of_a_parameter_argument_is_eagers_and_guarded(fn: Callable):
    x = torch.ones(3)
    param, scale, plain = nn.Parameter(torch.full((3,), 2.0)), _Scale(torch.full((3,), 2.0)), torch.full((3,), 2.0)
    jitted = fulmen.jit(fn)
    # a Parameter, a plain tensor (same metadata but requires_grad), a subclass, then the first again
    for p in (param, plain.requires_grad_(), scale, plain.detach(), param):
        torch.testing.assert_close(jitted(x, p), fn(x, p), rtol=0, atol=0)
    assert jitted.stats.hits == 1  # the last call reuses the Parameter's trace; the others each traced their own


def test_a_parameter_argument_keeps_eagers_grad():
    x, p = torch.randn(4), nn.Parameter(torch.randn(4))
    fn = lambda x, p: (x * p).sum() if isinstance(p, nn.Parameter) else x.sum()
    fulmen.jit(fn)(x, p).backward()
    got = p.grad.clone()
    p.grad = None
    fn(x, p).backward()
    torch.testing.assert_close(got, p.grad, rtol=0, atol=0)


class _Classes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        self.marked = nn.Buffer(torch.ones(2))  # a Buffer: isinstance(self.marked, nn.Buffer) holds in eager
        self.register_buffer("plain", torch.ones(2))

    def forward(self, x):
        out = x + 1 if isinstance(self.w, nn.Parameter) else x
        out = out + 10 if self.w.__class__.__name__ == "Parameter" else out
        out = out + 100 if isinstance(self.marked, nn.Buffer) else out
        return out + 1000 if isinstance(self.plain, nn.Buffer) else out


def test_a_modules_own_parameters_and_buffers_answer_isinstance_as_eager():
    model, x = _Classes(), torch.zeros(2)
    jitted = fulmen.jit(model)
    torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
    assert model(x).tolist() == [111.0, 111.0]
    # the module's buffer replaced by one of the other kind (same metadata): a trace of its own
    model.plain = nn.Buffer(torch.ones(2))
    model.marked = torch.ones(2)
    assert not isinstance(model.marked, nn.Buffer)
    torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
    assert model(x).tolist() == [1011.0, 1011.0]


def test_type_of_a_parameter_is_refused_naming_the_line():
    def fn(x, p):
        return x + 1 if type(p) is nn.Parameter else x

    with pytest.raises(TraceError, match=r"type\(\) of the Parameter p.*isinstance\(x, Parameter\)") as error:
        fulmen.jit(fn)(torch.ones(2), nn.Parameter(torch.ones(2)))
    assert "type(p) is nn.Parameter" in str(error.value)  # the user's line


def test_an_uninitialized_parameter_is_refused_naming_the_fix():
    with pytest.raises(TraceError, match="uninitialized parameter or buffer of a lazy module.*call the module once"):
        fulmen.jit(nn.LazyLinear(2))(torch.ones(1, 3))


# --- NumPy data ----------------------------------------------------------------------------------------------------
# A NumPy array a program converts is read on every call as it is then (its memory is the trace's input), small
# or over the 64 KiB up to which a guard compares an array's bytes.
SMALL = np.arange(6.0)
LARGE = np.zeros(10_000)  # 80 KB

CONVERSIONS = {
    "tensor": lambda x: x * torch.tensor(SMALL[:3]),
    "tensor dtype": lambda x: x * torch.tensor(SMALL[1:4], dtype=torch.float32),
    "tensor of a transposed array": lambda x: x * torch.tensor(SMALL.reshape(3, 2).T)[1],
    "as_tensor": lambda x: x * torch.as_tensor(SMALL)[:3],
    "as_tensor dtype": lambda x: x * torch.as_tensor(SMALL, dtype=torch.float32)[2:5],
    "from_numpy": lambda x: x * torch.from_numpy(SMALL)[3:],
    "new_tensor": lambda x: x * x.new_tensor(SMALL[:3]),
    "large as_tensor": lambda x: x + torch.as_tensor(LARGE)[:3],
    "index": lambda x: x[np.array([2, 0])],
    "index in a tuple": lambda x: x.reshape(3, 1).expand(3, 2)[np.array([1, 2]), 1],
    "index by an int32 array": lambda x: x[np.array([1, 1], dtype=np.int32)],
    # (a 0-dim tensor does not take part in type promotion: these keep the data's own dtype)
    "numpy scalars keep their dtype": lambda x: torch.tensor(np.float64(2.0)) + torch.as_tensor(np.int32(3)),
    "a 0-dim array keeps its dtype": lambda x: torch.tensor(np.array(2, dtype=np.int16)) + 1,
    "setitem": lambda x: _set(x.clone(), np.array([0, 2]), torch.tensor([5.0, 6.0])),
}


def _set(x, index, value):
    x[index] = value
    return x


@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_numpy_data_converts_as_eager_and_is_read_anew(name: str):
    fn, x = CONVERSIONS[name], torch.arange(1.0, 4.0)
    jitted = fulmen.jit(fn)
    try:
        for step in range(3):
            expected, got = fn(x), jitted(x)
            assert got.dtype == expected.dtype
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
            SMALL[:] += step + 1  # the caller changes the arrays in place between calls
            LARGE[:3] = step + 10
    finally:
        SMALL[:] = np.arange(6.0)
        LARGE[:] = 0.0


def test_an_array_argument_is_read_anew_and_keyed_by_identity():
    fn = lambda x, a: x + torch.tensor(a) * torch.as_tensor(a)
    jitted, x, a = fulmen.jit(fn), torch.ones(3), np.arange(3.0)
    torch.testing.assert_close(jitted(x, a), fn(x, a), rtol=0, atol=0)
    a[0] = 5.0
    torch.testing.assert_close(jitted(x, a), fn(x, a), rtol=0, atol=0)
    other = np.full(3, 7.0)
    torch.testing.assert_close(jitted(x, other), fn(x, other), rtol=0, atol=0)


def test_a_copy_of_an_array_the_program_makes_is_fresh_on_every_call():
    fn = lambda x: (x + 1, torch.tensor(np.zeros(2)))
    jitted, x = fulmen.jit(fn), torch.ones(2)
    for _ in range(2):
        _, made = jitted(x)
        assert made.tolist() == fn(x)[1].tolist() == [0.0, 0.0]
        made.add_(5.0)  # the caller's change of one call's result is not the next call's


def _update_through_from_numpy(x):
    shared = torch.from_numpy(np.zeros(2))
    shared.add_(1.0)
    return x + shared


def _update_through_as_tensor(x):
    shared = torch.as_tensor(SMALL)
    shared[0] = 4.0
    return x + shared[:2]


def _returns_from_numpy(x):
    return x + 1, torch.from_numpy(np.zeros(2))


def _returns_view_of_as_tensor(x):
    return x + 1, torch.as_tensor(SMALL)[:2]


def _numpy_changes_after_conversion(x):
    indices = np.array([0, 0])
    first = x[indices]
    indices += 1
    return first + x[indices]


@pytest.mark.parametrize(("fn", "message", "line"), [
    (_update_through_from_numpy, "in-place update of a torch.float64 tensor of shape \\(2,\\) sharing memory",
     "shared.add_(1.0)"),
    (_update_through_as_tensor, "in-place update of .* sharing memory torch does not own", "shared[0] = 4.0"),
    (_returns_from_numpy, "cannot return a torch.float64 tensor .* eager's result shares that memory",
     "torch.from_numpy(np.zeros(2))"),
    (_returns_view_of_as_tensor, "cannot return .* \\(or a view of it\\)", "torch.as_tensor(SMALL)[:2]"),
    (_numpy_changes_after_conversion, "changes a torch.int64 tensor .* after reading it, by code fulmen does not see",
     "first = x[indices]"),
])
def test_where_sharing_an_arrays_memory_matters_it_is_refused_naming_the_line(fn: Callable, message: str, line: str):
    before = SMALL.copy()
    fn(torch.ones(2))  # eager runs it
    SMALL[:] = before
    with pytest.raises(TraceError, match=message) as error:
        fulmen.jit(fn)(torch.ones(2))
    assert line in str(error.value)
    np.testing.assert_array_equal(SMALL, before)  # the refused trace wrote nothing


@pytest.mark.filterwarnings("ignore:Creating a tensor from a list of numpy.ndarrays")
def test_numpy_arrays_inside_other_data_are_refused_naming_the_op():
    fn = lambda x: x * torch.tensor([np.ones(2), np.ones(2)])  # eager: a 2x2 tensor (slowly)
    assert fn(torch.ones(2)).shape == (2, 2)
    with pytest.raises(UnsupportedOpError, match="cannot pass a NumPy array to torch.tensor") as error:
        fulmen.jit(fn)(torch.ones(2))
    assert "torch.tensor([np.ones(2), np.ones(2)])" in str(error.value)
    with pytest.raises(TypeError, match="must be Tensor, not numpy.ndarray"):  # where eager's own parser refuses
        fulmen.jit(lambda x: torch.add(x, np.ones(2)))(torch.ones(2))


# --- memory torch does not own, held by a global ---------------------------------------------------------------------
# A tensor of a file torch.load(mmap=True) or torch.from_file maps, or of a buffer (torch.frombuffer), that a global
# of the program's module held before the call: every call reads, updates and returns the caller's tensor itself, as
# eager's program does (its memory is no first call's). The caller changes it in place between calls. Set by the
# fixture below.
MAPPED = FROM_FILE = BUFFERED = torch.empty(0)


@pytest.fixture
def foreign_globals(tmp_path, monkeypatch):
    path = tmp_path / "weights.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    torch.arange(4.0).numpy().tofile(tmp_path / "raw.bin")
    monkeypatch.setattr(sys.modules[__name__], "MAPPED", torch.load(path, mmap=True)["w"])
    monkeypatch.setattr(sys.modules[__name__], "FROM_FILE",
                        torch.from_file(str(tmp_path / "raw.bin"), size=4, dtype=torch.float32))
    monkeypatch.setattr(sys.modules[__name__], "BUFFERED", torch.frombuffer(bytearray(16), dtype=torch.float32))
    held = (MAPPED, FROM_FILE, BUFFERED)
    assert all(not t.untyped_storage().resizable() for t in held)  # what made them refused before
    return held


def _reads_foreign(x):
    return x * MAPPED + FROM_FILE - BUFFERED


def _updates_foreign(x):
    MAPPED.add_(1.0)
    FROM_FILE[1:3] *= 2.0
    BUFFERED.copy_(x + MAPPED)
    return x + MAPPED + FROM_FILE


def _returns_foreign(x):
    return x + 1, MAPPED[:2], FROM_FILE.view(2, 2), BUFFERED


@pytest.mark.parametrize("fn", [_reads_foreign, _updates_foreign, _returns_foreign])
def test_foreign_memory_a_global_holds_is_read_updated_and_returned_as_eager(fn: Callable, foreign_globals):
    jitted = fulmen.jit(fn)
    for step in range(3):
        x = torch.arange(4.0) + step
        before = [t.clone() for t in foreign_globals]
        expected = fn(x)
        after = [t.clone() for t in foreign_globals]
        for t, value in zip(foreign_globals, before):
            t.copy_(value)
        got = jitted(x)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        for t, value in zip(foreign_globals, after):  # the globals' memory updated as eager's
            torch.testing.assert_close(t, value, rtol=0, atol=0)
        if fn is _returns_foreign:  # the returned views share the globals' memory, as eager's
            assert [o.data_ptr() for o in got[1:]] == [o.data_ptr() for o in expected[1:]]
            assert got[3] is BUFFERED
        for t in foreign_globals:  # the caller changes them in place between calls
            t.mul_(3.0).add_(step + 1)


def _update_through_frombuffer(x):
    shared = torch.frombuffer(bytearray(8), dtype=torch.float32)  # new memory on every eager call
    shared.add_(1.0)
    return x + shared


def _update_a_global_it_assigns(x):
    global BUFFERED
    BUFFERED = torch.frombuffer(bytearray(8), dtype=torch.float32)
    BUFFERED.add_(1.0)
    return x + BUFFERED


def _update_a_global_it_sets_unseen(x):  # writes no global-store instruction names
    globals()["BUFFERED"] = torch.frombuffer(bytearray(8), dtype=torch.float32)
    BUFFERED.add_(1.0)
    sys.modules[__name__].BUFFERED = torch.frombuffer(bytearray(8), dtype=torch.float32)
    BUFFERED.add_(1.0)
    return x + BUFFERED


@pytest.mark.parametrize("fn", [_update_through_frombuffer, _update_a_global_it_assigns,
                                _update_a_global_it_sets_unseen])
def test_foreign_memory_the_program_makes_is_still_refused_where_it_is_updated(fn: Callable, foreign_globals,
                                                                              monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "BUFFERED", BUFFERED)  # undone after the program assigns it
    with pytest.raises(TraceError, match="in-place update of a torch.float32 tensor of shape \\(2,\\) sharing "
                                         "memory torch does not own") as error:
        fulmen.jit(fn)(torch.ones(2))
    assert "add_(1.0)" in str(error.value)
