"""State the program reads or writes in code no read site names: whole objects read by a copy, `vars`, `__dict__` or
dataclasses' helpers (the standard library reads them, not the program's bytecode), attributes, items and classes
read by C code it calls (`operator.attrgetter`, `str.format`, `isinstance`), and attributes or globals it deletes or
sets through `setattr` / `delattr`. Each case runs the same sequence of calls and state changes eagerly and
through fulmen.jit, and compares results and the state left behind."""

from __future__ import annotations

import copy
import dataclasses
import operator
import types
from collections.abc import Callable

import pytest
import torch

import fulmen

X = torch.ones(2)


class Config:
    def __init__(self) -> None:
        self.scale = 2.0
        self.inner = Inner()


class Inner:
    def __init__(self) -> None:
        self.shift = 1.0


@dataclasses.dataclass
class Settings:
    scale: float = 2.0
    nested: Inner = dataclasses.field(default_factory=Inner)


def _deep(state):
    return lambda x: x * copy.deepcopy(state["cfg"]).inner.shift


def _deepcopy_then_edit_the_copy(state):
    def program(x):  # transformers' get_text_config: deep-copies the config, then deletes and renames on the copy
        cfg = copy.deepcopy(state["cfg"])
        scale = cfg.scale
        delattr(cfg, "scale")
        cfg.renamed = scale
        return x * cfg.renamed + cfg.inner.shift
    return program


# program(state) -> the function to jit; change(state) -> what the user changes between calls
READERS: dict[str, tuple[Callable, Callable]] = {
    "__dict__": (lambda s: lambda x: x * s["cfg"].__dict__["scale"], lambda s: setattr(s["cfg"], "scale", 3.0)),
    "vars": (lambda s: lambda x: x * vars(s["cfg"])["scale"], lambda s: setattr(s["cfg"], "scale", 3.0)),
    "__dict__ items": (lambda s: lambda x: x * sum(v for k, v in s["cfg"].__dict__.items() if k == "scale"),
                       lambda s: setattr(s["cfg"], "scale", 3.0)),
    "copy.copy": (lambda s: lambda x: x * copy.copy(s["cfg"]).scale, lambda s: setattr(s["cfg"], "scale", 3.0)),
    "copy.deepcopy": (lambda s: lambda x: x * copy.deepcopy(s["cfg"]).scale, lambda s: setattr(s["cfg"], "scale", 3.0)),
    "copy.deepcopy nested": (_deep, lambda s: setattr(s["cfg"].inner, "shift", 5.0)),
    "copy.deepcopy edited": (_deepcopy_then_edit_the_copy, lambda s: setattr(s["cfg"].inner, "shift", 5.0)),
    "dataclasses.asdict": (lambda s: lambda x: x * dataclasses.asdict(s["settings"])["scale"],
                           lambda s: setattr(s["settings"], "scale", 3.0)),
    "dataclasses.asdict nested": (lambda s: lambda x: x * dataclasses.asdict(s["settings"])["nested"].shift,
                                  lambda s: setattr(s["settings"].nested, "shift", 5.0)),
    "dataclasses.astuple": (lambda s: lambda x: x * dataclasses.astuple(s["settings"])[0],
                            lambda s: setattr(s["settings"], "scale", 3.0)),
    "dataclasses.replace": (lambda s: lambda x: x * dataclasses.replace(s["settings"]).scale,
                            lambda s: setattr(s["settings"], "scale", 3.0)),
    "slots": (lambda s: lambda x: x * copy.copy(s["slotted"]).scale, lambda s: setattr(s["slotted"], "scale", 3.0)),
    "object.__getattribute__": (lambda s: lambda x: x * object.__getattribute__(s["cfg"], "scale"),
                                lambda s: setattr(s["cfg"], "scale", 3.0)),
    "a class's own __getattribute__": (lambda s: lambda x: x * s["mapped"].hidden,
                                       lambda s: setattr(s["mapped"], "width", 3.0)),
}


class Mapped:
    """Names mapped to others on lookup, as transformers' configs do with `attribute_map`."""

    attribute_map = {"hidden": "width"}

    def __init__(self) -> None:
        self.width = 2.0

    def __getattribute__(self, key: str):
        if key != "attribute_map" and key in super().__getattribute__("attribute_map"):
            key = super().__getattribute__("attribute_map")[key]
        return super().__getattribute__(key)


class Slotted:
    __slots__ = ("scale",)

    def __init__(self) -> None:
        self.scale = 2.0


def _state() -> dict:
    return {"cfg": Config(), "settings": Settings(), "slotted": Slotted(), "mapped": Mapped()}


@pytest.mark.parametrize("reader", READERS)
def test_a_whole_object_read_outside_the_programs_bytecode_is_guarded(reader):
    program, change = READERS[reader]
    results = []
    for run in (lambda fn: fn, fulmen.jit):
        state = _state()
        fn = run(program(state))
        first, again = fn(X), fn(X)
        change(state)
        results.append((first, again, fn(X)))
    (want_first, want_again, want_changed), (first, again, changed) = results
    torch.testing.assert_close(first, want_first)
    torch.testing.assert_close(again, want_again)
    torch.testing.assert_close(changed, want_changed)
    assert not torch.equal(want_changed, want_first)  # the change matters
    assert fulmen.cache_hits(fn) == 1 and fulmen.cache_misses(fn) == 2  # unchanged state: no retrace
    reason = fulmen.last_cache_miss_reasons(fn)[0]
    assert "read whole by" in reason or "attribute scale of Config object changed" in reason, reason


GET_SCALE = operator.attrgetter("scale")
GET_SHIFT = operator.attrgetter("inner.shift")
GET_BOTH = operator.attrgetter("scale", "inner.shift")


class Special(Config):
    pass


def _become_special(state):
    state["cfg"].__class__ = Special


def _scale_to(value):
    return lambda s: setattr(s["cfg"], "scale", value)


# program(state) -> the function to jit; change(state) -> what the user changes between calls; what the miss names
IN_C: dict[str, tuple[Callable, Callable, str]] = {
    "attrgetter": (lambda s: lambda x: x * GET_SCALE(s["cfg"]), _scale_to(3.0), "attribute scale"),
    "attrgetter dotted": (lambda s: lambda x: x * GET_SHIFT(s["cfg"]), lambda s: setattr(s["cfg"].inner, "shift", 5.0),
                          "attribute shift"),
    "attrgetter of two": (lambda s: lambda x: x * sum(GET_BOTH(s["cfg"])),
                          lambda s: setattr(s["cfg"].inner, "shift", 5.0), "attribute shift"),
    "str.format field": (lambda s: lambda x: x * len("{0.scale}".format(s["cfg"])),  # noqa: UP030 (a numbered field)
                         _scale_to(30.0), "attribute scale"),
    "str.format numbered automatically": (lambda s: lambda x: x * len("{}:{.inner.shift}".format(1, s["cfg"])),
                                          lambda s: setattr(s["cfg"].inner, "shift", 50.0), "attribute shift"),
    "str.format nested in a spec": (lambda s: lambda x: x * len("{0:>{1.width}}".format("a", s["mapped"])),
                                    lambda s: setattr(s["mapped"], "width", 5), "Mapped"),
    "isinstance": (lambda s: lambda x: x * (2.0 if isinstance(s["cfg"], Special) else 1.0), _become_special,
                   "the class of Config object"),
    "type": (lambda s: lambda x: x * (2.0 if type(s["cfg"]) is Special else 1.0), _become_special,
             "the class of Config object"),
}


@pytest.mark.parametrize("reader", IN_C)
def test_what_c_code_the_program_calls_reads_is_guarded(reader):
    program, change, named = IN_C[reader]
    results = []
    for run in (lambda fn: fn, fulmen.jit):
        state = _state()
        state["mapped"].width = 3
        fn = run(program(state))
        first, again = fn(X), fn(X)
        change(state)
        results.append((first, again, fn(X)))
    (want_first, want_again, want_changed), (first, again, changed) = results
    torch.testing.assert_close((first, again, changed), (want_first, want_again, want_changed))
    assert not torch.equal(want_changed, want_first)  # the change matters
    assert fulmen.cache_hits(fn) == 1 and fulmen.cache_misses(fn) == 2  # unchanged state: no retrace
    assert named in fulmen.last_cache_miss_reasons(fn)[0]


class Box:
    pass


def _deleting(box, namespace):
    def program(x):
        del box.flag
        return x + 1
    return program


def _delattr(box, namespace):
    def program(x):
        delattr(box, "flag")
        return x + 1
    return program


def _setattr(box, namespace):
    def program(x):
        box.flag = "train"
        return x + 1
    return program


def _object_setattr(box, namespace):
    def program(x):  # as a frozen dataclass writes
        object.__setattr__(box, "flag", "train")
        return x + 1
    return program


def _object_delattr(box, namespace):
    def program(x):
        object.__delattr__(box, "flag")
        return x + 1
    return program


def _store_then_delete(box, namespace):
    def program(x):
        box.flag = 7
        del box.flag
        return x + 1
    return program


def _deleting_a_global(box, namespace):
    exec("def program(x):\n    global flag\n    del flag\n    return x + 1", namespace)
    return namespace["program"]


WRITERS = {"del obj.name": _deleting, "delattr": _delattr, "setattr": _setattr, "object.__setattr__": _object_setattr,
           "object.__delattr__": _object_delattr,
           "store then delete": _store_then_delete, "del of a global": _deleting_a_global}


@pytest.mark.parametrize("writer", WRITERS)
def test_deletes_and_setattr_are_done_again_by_every_call(writer):
    states = []
    for run in (lambda fn: fn, fulmen.jit):
        box, namespace = Box(), {"__name__": "tests.jit.deleting_program"}
        fn = run(WRITERS[writer](box, namespace))
        seen = []
        for _ in range(3):
            box.flag = namespace["flag"] = "eval"  # the user puts it back between calls
            fn(X)
            seen.append((getattr(box, "flag", None), namespace.get("flag")))
        states.append(seen)
    assert states[0] == states[1]
    assert fulmen.cache_hits(fn) == 2


@pytest.mark.parametrize("writer", ["del obj.name", "delattr", "object.__delattr__", "del of a global"])
def test_deleting_what_is_no_longer_there_fails_as_in_eager(writer):
    box, namespace = Box(), {"__name__": "tests.jit.deleting_program"}
    box.flag = namespace["flag"] = 1
    fn = fulmen.jit(WRITERS[writer](box, namespace))
    fn(X)
    with pytest.raises((AttributeError, NameError)):  # eager: the first call deleted it
        fn(X)
    assert ("flag" in namespace, hasattr(box, "flag")) == ((False, True) if "global" in writer else (True, False))


def test_an_object_the_program_copies_is_its_own_and_needs_no_guard():
    # the copy's state is read, changed and deleted by the program: the next call must still hit
    settings = types.SimpleNamespace(scale=2.0)
    fn = fulmen.jit(lambda x: x * vars(copy.deepcopy(Settings(scale=settings.scale)))["scale"])
    for _ in range(3):
        torch.testing.assert_close(fn(X), X * 2)
    assert fulmen.cache_hits(fn) == 2
