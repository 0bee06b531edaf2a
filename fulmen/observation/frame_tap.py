"""The frame tap of the observer: `sys.settrace` over the frames of the program's code while it is acquired.

Before each read site (read_sites.py) of an observed frame runs, the tap hands the site and the frame to the observer.
Frames of fulmen, torch (but for `torch.nn.modules`, whose module classes read module state and the hook registries)
and the standard library are not followed, nor imports the program triggers. While a symbol records its meta and
decomposition (the bulk of an acquisition's Python calls, none of them the program's), tracing is off (`Quiet`).

The tap sees only the thread that runs the program (`sys.settrace` and `sys.setprofile` are per thread): what a
thread started during the acquisition runs (tqdm's monitor, a DataLoader's pin-memory thread) is not the program's.
Calls of C functions are not followed; once the program got a C function that gives a new value on every call (a
clock), the tap also watches the program's C calls (`FrameTap.watch_calls`), so only a call of it is refused.

Two kinds of standard-library frames are seen though they are not followed: those that make an object without its
`__init__` (a copy's, `_NEW_OBJECT`: the object is the program's own, as one whose `__init__` runs), and those that
read all an object holds (`_STATE_READERS`: copies and dataclasses' helpers, called by the program or inside one
such call), whose argument the observer guards whole.
"""

from __future__ import annotations

import copy
import copyreg
import dataclasses
import inspect
import logging
import os
import sys
import sysconfig
import types
from collections.abc import Callable
from typing import Any, Protocol

import torch

from fulmen.core.bounded import ByIdentity
from fulmen.observation import read_sites


class CallWatch(Protocol):
    """What the acquisition does around one call of a function (replacements.py): `enter` as its frame starts
    (gives a token, None to leave this call alone), `exit` with the token and the value it returned (`raised`: an
    exception left the frame)."""

    def enter(self, frame: types.FrameType) -> Any: ...

    def line(self, token: Any, frame: types.FrameType) -> None: ...  # before each line of the frame runs

    def exit(self, token: Any, value: Any, raised: bool) -> None: ...


class QuietWatch:
    """A call watch whose `line` and `exit` do nothing: a watch subclasses it and defines what it acts on."""

    __slots__ = ()

    def line(self, token: Any, frame: types.FrameType) -> None:
        pass

    def exit(self, token: Any, value: Any, raised: bool) -> None:
        pass


class Reader(Protocol):
    expecting: dict  # what `returning` waits for: while empty, no frame needs asking

    def read(self, site: read_sites.Read, frame: types.FrameType) -> None: ...

    def returning(self, frame: types.FrameType) -> Any: ...  # the key to give `returned` for what `frame` returns

    def returned(self, key: Any, value: Any) -> None: ...

    def created(self, obj: Any) -> None: ...

    def read_state(self, obj: Any, reader: str) -> None: ...  # `reader` reads all `obj` holds

    def entered(self, code: types.CodeType) -> None: ...  # a frame of the program's code starts

    def called(self, function: Any, frame: types.FrameType) -> None: ...  # program code calls a C function (watched)


_FULMEN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_TORCH_MODULES = os.path.join(_TORCH, "nn", "modules") + os.sep
_PATHS = sysconfig.get_paths()
_STDLIB = tuple({os.path.abspath(_PATHS[k]) + os.sep for k in ("stdlib", "platstdlib")})
_PACKAGES = tuple({os.path.abspath(_PATHS[k]) + os.sep for k in ("purelib", "platlib")})


def frame_arguments(frame: types.FrameType) -> tuple[tuple, dict[str, Any]]:
    """The arguments a frame was called with, read off its parameters as it starts (positional ones by position)."""
    code, local = frame.f_code, frame.f_locals
    names, count, kwonly = code.co_varnames, code.co_argcount, code.co_kwonlyargcount
    args = [local[name] for name in names[:count]]
    kwargs = {name: local[name] for name in names[count:count + kwonly]}
    rest = count + kwonly
    if code.co_flags & inspect.CO_VARARGS:
        args.extend(local[names[rest]])
        rest += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        kwargs.update(local[names[rest]])
    return tuple(args), kwargs


# sympy (and its mpmath) run under torch's symbolic sizes (fulmen.core.symbolic): a program's `T > 64` on a symbolic
# size asks them, and their caches are theirs, never the program's state
_SYMBOLIC = tuple(os.path.dirname(os.path.abspath(module.__file__)) + os.sep
                  for module in (__import__("sympy"), __import__("mpmath")))


def _observed_file(filename: str) -> bool:
    if filename.startswith(_FULMEN) or filename.startswith(_SYMBOLIC):
        return False
    if filename.startswith(_TORCH):
        return filename.startswith(_TORCH_MODULES)
    return not filename.startswith(_STDLIB) or filename.startswith(_PACKAGES)


def observed(code: types.CodeType, namespace: dict) -> bool:
    """Whether the observer follows frames of `code`: the program's own code, not fulmen's, torch's (but for its
    module classes) or the standard library's. Generated code (`<string>`, e.g. a dataclass's `__init__`) counts as
    the code of the module whose globals it runs in."""
    filename = code.co_filename
    if filename.startswith("<"):
        if filename.startswith(("<frozen", "<fulmen")):
            return False
        module = sys.modules.get(namespace.get("__name__", ""))
        filename = (module.__dict__.get("__file__") if isinstance(module, types.ModuleType) else None) or ""
        return not filename or _observed_file(os.path.abspath(filename))
    return _observed_file(filename)


# The functions `copy.copy` and `copy.deepcopy` make an object with, without running its `__init__`.
_NEW_OBJECT = frozenset({copyreg.__newobj__.__code__, copyreg.__newobj_ex__.__code__})
# Standard-library functions that read all their first argument holds, in code the tap does not follow, by what the
# guard names them. The deep ones reach nested values by calling themselves (or the private helper listed with them).
_STATE_READERS = {function.__code__: name for function, name in (
    (copy.copy, "copy.copy"), (copy.deepcopy, "copy.deepcopy"), (dataclasses.replace, "dataclasses.replace"),
    (dataclasses.asdict, "dataclasses.asdict"), (getattr(dataclasses, "_asdict_inner", None), "dataclasses.asdict"),
    (dataclasses.astuple, "dataclasses.astuple"),
    (getattr(dataclasses, "_astuple_inner", None), "dataclasses.astuple")) if function is not None}

# Python 3.12 starts a code object's opcode events, asked for when its first frame starts, only at its next call or
# return: the read sites before it went unseen (no guards, no refusals on a first call). Setting the trace function
# again makes it instrument the code now; later frames of the code get them from the start.
_LATE_OPCODE_EVENTS = sys.version_info[:2] == (3, 12)
_LOGGER_HANDLE = logging.Logger.handle.__code__
# Each code's read sites (None: code the tap does not follow), by identity: equal codes of two functions are two
# entries, and an entry goes with its code (a function defined again in a notebook is a new code)
_SITES: ByIdentity[types.CodeType, dict[int, read_sites.Read] | None] = ByIdentity()
_UNSEEN = object()


def _sites_of(frame: types.FrameType) -> dict[int, read_sites.Read] | None:
    code = frame.f_code
    known = _SITES.get(code, _UNSEEN)
    if known is _UNSEEN:
        known = _SITES[code] = read_sites.read_sites(code) if observed(code, frame.f_globals) else None
    return known


class Quiet:
    __slots__ = ("tap",)

    def __init__(self, tap: FrameTap) -> None:
        self.tap = tap

    def __enter__(self) -> None:
        sys.settrace(None)
        if self.tap.profiling:
            sys.setprofile(None)

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self.tap.call)
        if self.tap.profiling:
            sys.setprofile(self.tap.profile)


class FrameTap:
    """The `sys.settrace` function of one acquisition; chains a tracer that was already set (a debugger).

    Imports the program triggers (a lazily imported module, with the import system's finders) are not followed:
    what they run defines state rather than reading it for the trace. Nor are a logger's handlers given a record
    the program logs (`Logger.handle`): a trace does not log again on later calls (as no compiled call does), and
    what a handler keeps (a list of records under pytest's log capture) is not the program's state."""

    def __init__(self, observer: Reader, previous: Callable[..., Any] | None,
                 watches: dict[types.CodeType, CallWatch]) -> None:
        self.observer = observer
        self.previous = previous
        self.watches = watches
        self.unfollowed = 0  # module bodies being imported and loggers handling records, running now
        self.reading = 0  # frames of _STATE_READERS the program called, running now
        self.returned = _Returned(observer)
        self.profiling = False  # the program's C calls are watched (watch_calls)

    def watch_calls(self) -> bool:
        """From now until the acquisition ends, tell the observer of every C function the program's code calls
        (`sys.setprofile` on this thread). False when a profiler is already set (cProfile): it is not replaced."""
        if not self.profiling:
            if sys.getprofile() is not None:
                return False
            sys.setprofile(self.profile)
            self.profiling = True
        return True

    def stop(self) -> None:
        """The acquisition ends: C calls are no longer watched."""
        if self.profiling:
            sys.setprofile(None)
            self.profiling = False

    def profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and not self.unfollowed and _sites_of(frame) is not None:
            self.observer.called(arg, frame)

    def call(self, frame: types.FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        local = _around(frame, self.watches, self._follow(frame, event, arg))
        if self.observer.expecting:
            key = self.observer.returning(frame)
            if key is not None:
                local = frame.f_trace = _WatchTap(self.returned, key, local).event
        return local

    def _follow(self, frame: types.FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        local = self.previous(frame, event, arg) if self.previous is not None else None
        code = frame.f_code
        if code.co_name == "<module>" or code.co_filename.startswith("<frozen importlib") or code is _LOGGER_HANDLE:
            return _CountingTap(self, "unfollowed", local).event
        if self.unfollowed:
            return local
        if code in _NEW_OBJECT:
            return _CreationTap(self.observer, local).event
        reader = _STATE_READERS.get(code)
        if reader is not None and (self.reading or _called_by_program(frame)):
            if code.co_argcount:
                self.observer.read_state(frame.f_locals.get(code.co_varnames[0]), reader)
            return _CountingTap(self, "reading", local).event
        first = code not in _SITES
        sites = _sites_of(frame)
        if sites is None:
            return local
        self.observer.entered(code)
        if code.co_name == "__init__" and code.co_argcount:
            # an object the program creates now: what it later reads of it, it made itself (no guard needed), and
            # it may change it after reading (a cache filled layer by layer)
            self.observer.created(frame.f_locals.get(code.co_varnames[0]))
        if not sites:
            return local
        tap = _LocalTap(self.observer, sites, local).event
        frame.f_trace = tap  # before f_trace_opcodes: Python 3.13 only instruments a frame that has a tracer
        if local is None:
            frame.f_trace_lines = False
        frame.f_trace_opcodes = True
        if first and _LATE_OPCODE_EVENTS:
            sys.settrace(sys.gettrace())
        return tap


def _around(frame: types.FrameType, watches: dict[types.CodeType, CallWatch],
            local: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """The local tracer of a frame just started: the watch of its code around `local`, if it has one."""
    watch = watches.get(frame.f_code)
    token = None if watch is None else watch.enter(frame)
    if token is None:
        return local
    tap = _WatchTap(watch, token, local).event
    frame.f_trace = tap
    frame.f_trace_lines = True  # a line event after an exception: it was caught inside
    return tap


class CallTap:
    """A `sys.settrace` function that only does the watches' work around their calls (no observer), for running
    torch code on proxies outside an acquisition (the Dynamo backend's probe); chains a tracer already set."""

    def __init__(self, watches: dict[types.CodeType, CallWatch]) -> None:
        self.watches = watches
        self.previous: Callable[..., Any] | None = None

    def call(self, frame: types.FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        local = self.previous(frame, event, arg) if self.previous is not None else None
        return _around(frame, self.watches, local)

    def __enter__(self) -> None:
        self.previous = sys.gettrace()
        sys.settrace(self.call)

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self.previous)


class _WatchTap:
    """The local tracer of a frame the acquisition does something around (a `CallWatch`), chaining the frame's own."""

    __slots__ = ("watch", "token", "previous", "raised")

    def __init__(self, watch: CallWatch, token: Any, previous: Callable[..., Any] | None) -> None:
        self.watch = watch
        self.token = token
        self.previous = previous
        self.raised = False

    def event(self, frame: types.FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if self.previous is not None:
            self.previous = self.previous(frame, event, arg)
        if event == "return":
            self.watch.exit(self.token, arg, self.raised)
        else:
            self.raised = event == "exception"
            if event == "line":
                self.watch.line(self.token, frame)
        return self.event


class _CountingTap:
    """The local tracer of a frame counted by one of the tap's counters (`unfollowed`, `reading`) while it runs."""

    __slots__ = ("tap", "counter", "previous")

    def __init__(self, tap: FrameTap, counter: str, previous: Callable[..., Any] | None) -> None:
        self.tap = tap
        self.counter = counter
        self.previous = previous
        setattr(tap, counter, getattr(tap, counter) + 1)

    def event(self, frame: types.FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if event == "return":
            setattr(self.tap, self.counter, getattr(self.tap, self.counter) - 1)
        if self.previous is not None:
            self.previous = self.previous(frame, event, arg)
        return self.event


def _called_by_program(frame: types.FrameType) -> bool:
    caller = frame.f_back
    return caller is not None and _sites_of(caller) is not None


class _Returned:
    """The CallWatch of a frame whose return value the observer waits for (Observer.returning; the token is its key):
    it gets that value unless an exception leaves the frame."""

    __slots__ = ("observer",)

    def __init__(self, observer: Reader) -> None:
        self.observer = observer

    def enter(self, frame: types.FrameType) -> Any:  # the token comes from Observer.returning
        return None

    def line(self, token: Any, frame: types.FrameType) -> None:
        pass

    def exit(self, token: Any, value: Any, raised: bool) -> None:
        if not raised:
            self.observer.returned(token, value)


class _CreationTap:
    """The local tracer of a frame making a new object without its `__init__` (a copy): the object it returns is
    one the program created, as one whose `__init__` the tap sees."""

    __slots__ = ("observer", "previous")

    def __init__(self, observer: Reader, previous: Callable[..., Any] | None) -> None:
        self.observer = observer
        self.previous = previous

    def event(self, frame: types.FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if self.previous is not None:
            self.previous = self.previous(frame, event, arg)
        if event == "return" and arg is not None:
            self.observer.created(arg)
        return self.event


class _LocalTap:
    __slots__ = ("observer", "sites", "previous")

    def __init__(self, observer: Reader, sites: dict[int, read_sites.Read], previous: Callable[..., Any] | None):
        self.observer = observer
        self.sites = sites
        self.previous = previous

    def event(self, frame: types.FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if event == "opcode":
            site = self.sites.get(frame.f_lasti)
            if site is not None:
                self.observer.read(site, frame)
        elif self.previous is not None:
            self.previous = self.previous(frame, event, arg)
        return self.event
