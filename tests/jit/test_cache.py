"""Guards: each guarded property, changed alone, retraces exactly once; identical calls hit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fulmen


def add(a, b):
    return a + b


def _counts(fn):
    return fulmen.cache_hits(fn), fulmen.cache_misses(fn)


def test_identical_calls_hit():
    fn = fulmen.jit(add)
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    for _ in range(5):
        torch.testing.assert_close(fn(a, b), a + b)
    assert _counts(fn) == (4, 1)
    fn(torch.randn(3, 4), torch.randn(3, 4))  # new values, same metadata
    assert _counts(fn) == (5, 1)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda a: a.reshape(4, 3), id="shape"),
        pytest.param(lambda a: a.double(), id="dtype"),
        pytest.param(lambda a: a.detach().requires_grad_(), id="requires_grad"),
        pytest.param(lambda a: a.to("meta"), id="device"),
    ],
)
def test_changed_tensor_property_retraces_once(change):
    fn = fulmen.jit(lambda a: a * 2)
    a = torch.randn(3, 4)
    fn(a)
    changed = change(a)
    if changed.device.type != "meta":
        torch.testing.assert_close(fn(changed), changed * 2)
    else:
        fn(changed)
    fn(changed)
    assert _counts(fn) == (1, 2)
    fn(a)  # the first entry is still there
    assert _counts(fn) == (2, 2)


def test_grad_mode_retraces_once():
    fn = fulmen.jit(add)
    a, b = torch.randn(2), torch.randn(2)
    fn(a, b)
    with torch.no_grad():
        fn(a, b)
        fn(a, b)
    assert _counts(fn) == (1, 2)


def test_autocast_state_retraces_once():
    fn = fulmen.jit(add)
    a, b = torch.randn(2), torch.randn(2)
    fn(a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fn(a, b)
        fn(a, b)
    assert _counts(fn) == (1, 2)


def test_attention_backend_switches_retrace_once():
    # the sdpa executor's kernel choice follows them, so a trace made under other switches must not be reused
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fn = fulmen.jit(add)
    a, b = torch.randn(2), torch.randn(2)
    fn(a, b)
    with sdpa_kernel([SDPBackend.MATH]):
        fn(a, b)
        fn(a, b)
    fn(a, b)
    assert _counts(fn) == (2, 2)


def test_python_value_is_specialised():
    fn = fulmen.jit(lambda a, scale: a * scale)
    a = torch.randn(2)
    torch.testing.assert_close(fn(a, 2.0), a * 2.0)
    torch.testing.assert_close(fn(a, 3.0), a * 3.0)
    fn(a, 3.0)
    assert _counts(fn) == (1, 2)


def test_container_structure_is_guarded():
    fn = fulmen.jit(lambda xs: sum(xs[1:], xs[0]))
    xs = [torch.randn(2) for _ in range(3)]
    torch.testing.assert_close(fn(xs), xs[0] + xs[1] + xs[2])
    torch.testing.assert_close(fn(xs[:2]), xs[0] + xs[1])
    fn(xs[:2])
    assert _counts(fn) == (1, 2)


class Dropoutish(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale_outputs = True

    def forward(self, x):
        y = self.lin(x)
        if self.training:
            y = y * 2
        return y * 3 if self.scale_outputs else y


def test_module_attributes_read_are_guarded():
    model = Dropoutish()
    jitted = fulmen.jit(model)
    x = torch.randn(2, 4)
    torch.testing.assert_close(jitted(x), model(x))
    jitted.eval()  # `training` was read by the program: one retrace
    assert not model.training
    torch.testing.assert_close(jitted(x), model(x))
    torch.testing.assert_close(jitted(x), model(x))
    assert _counts(jitted) == (1, 2)
    model.scale_outputs = False  # a plain attribute the program read: one retrace
    torch.testing.assert_close(jitted(x), model(x))
    jitted(x)
    assert _counts(jitted) == (2, 3)
    jitted.train()
    model.scale_outputs = True
    jitted(x)  # back to the first configuration: a hit
    assert _counts(jitted) == (3, 3)


def test_parameter_dtype_change_retraces():
    model = nn.Linear(3, 3)
    jitted = fulmen.jit(model)
    x = torch.randn(2, 3)
    jitted(x)
    jitted.double()
    torch.testing.assert_close(jitted(x.double()), model(x.double()))
    assert _counts(jitted) == (0, 2)


def test_ordered_and_default_dicts_are_containers():
    """Their tensors are inputs (a new value in the same structure hits the cache and is read, never a stale
    constant), outputs come back as the same types; a dict subclass fulmen cannot rebuild is refused when it holds
    tensors, and kept as a value when it does not."""
    from collections import OrderedDict, defaultdict

    double = fulmen.jit(lambda d: d["a"] * 2)
    for value in (1.0, 3.0):
        torch.testing.assert_close(double(OrderedDict(a=torch.full((2,), value))), torch.full((2,), 2 * value))
    assert fulmen.cache_misses(double) == 1 and fulmen.cache_hits(double) == 1

    regroup = fulmen.jit(lambda d: {"o": OrderedDict(x=d["a"] + 1), "dd": d})
    given = defaultdict(list, a=torch.ones(2))
    out = regroup(given)
    assert type(out["o"]) is OrderedDict and type(out["dd"]) is defaultdict and out["dd"].default_factory is list
    torch.testing.assert_close(out["o"]["x"], torch.full((2,), 2.0))
    torch.testing.assert_close(out["dd"]["a"], given["a"])

    class Settings(dict):
        pass

    with pytest.raises(TypeError, match=r"not inside a .*Settings; pass dict"):
        double(Settings(a=torch.ones(2)))
    torch.testing.assert_close(fulmen.jit(lambda d, x: x * d["k"])(Settings(k=3), torch.ones(2)), torch.full((2,), 3.0))


def test_the_content_of_a_container_held_whole_is_guarded():
    """A set, or a dict or list subclass, is handed to the program as it is and read through C methods (`in`,
    `.get`, `len`) that no guard sees: a hit after its content changed reused the branch taken before."""

    class Settings(dict):
        pass

    class Names(list):
        pass

    def pick(x, flags, settings, names):
        y = x * 2 if "double" in flags else x * 3
        return y * settings.get("scale", 1) + len(names)

    jitted = fulmen.jit(pick)
    x, flags, settings, names = torch.ones(2), {"double"}, Settings(scale=2), Names(["a"])
    for change in (lambda: None, lambda: flags.discard("double"), lambda: settings.update(scale=5),
                   lambda: names.append("b"), lambda: flags.add(0.0), lambda: flags.add(-0.0)):
        change()
        torch.testing.assert_close(jitted(x, flags, settings, names), pick(x, flags, settings, names))
    assert fulmen.cache_misses(jitted) == 5  # every change but the last (-0.0 == 0.0 in a set: the same content)
    jitted(x, set(flags), Settings(settings), Names(names))  # other objects: specialised on identity as before
    assert fulmen.cache_misses(jitted) == 6
