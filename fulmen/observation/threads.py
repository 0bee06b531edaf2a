"""Threads the program starts while it is acquired.

The observer follows only the thread that runs the program. A thread started during the acquisition runs code of
its own, which the trace does not hold: one that runs alongside the program (tqdm's monitor, started by the first
progress bar of the process; a logging or prefetching thread) is not the program's, and its start is a side effect
that happens once, as in eager. One the program waits for (`Thread.join`) did part of the call's work: what it
wrote or computed would not happen again on a later call of the trace, so it is refused.
"""

from __future__ import annotations

import threading
import types
from typing import Any

from fulmen.core.errors import TraceError
from fulmen.core.source import SourceLocation, frame_location
from fulmen.observation.frame_tap import QuietWatch

START_CODE = threading.Thread.start.__code__
JOIN_CODE = threading.Thread.join.__code__


class Threads:
    """The threads started during one acquisition (by id, with the program's line that started each) and the
    refusal of a join of one of them. Its watches (frame_tap.CallWatch) are on `Thread.start` and `Thread.join`."""

    def __init__(self) -> None:
        self._started: dict[int, tuple[threading.Thread, SourceLocation | None]] = {}
        self.refused: TraceError | None = None
        self.watches = {START_CODE: _Start(self), JOIN_CODE: _Join(self)}

    def started(self, thread: Any, frame: types.FrameType) -> None:
        if isinstance(thread, threading.Thread):
            self._started[id(thread)] = (thread, frame_location(frame.f_back))

    def joined(self, thread: Any, frame: types.FrameType) -> None:
        known = self._started.get(id(thread))
        if known is None or known[0] is not thread or self.refused is not None:
            return
        location = frame_location(frame.f_back)
        start = f" at {known[1].short()}" if known[1] is not None else ""
        where = f" ({location.short()})" if location is not None else ""
        self.refused = TraceError(
            f"fulmen cannot compile a program that waits for a thread it started: thread {thread.name!r}, started"
            f"{start}, is joined{where}. fulmen traces the thread that runs the program, so what that thread did "
            f"during the call would not happen again on later calls. Start and join the thread outside the jitted "
            f"program, or do its work in the program's own thread.", location)


class _Start(QuietWatch):
    __slots__ = ("threads",)

    def __init__(self, threads: Threads) -> None:
        self.threads = threads

    def enter(self, frame: types.FrameType) -> Any:
        self.threads.started(frame.f_locals.get("self"), frame)
        return None  # nothing to do around the call


class _Join(_Start):
    __slots__ = ()

    def enter(self, frame: types.FrameType) -> Any:
        self.threads.joined(frame.f_locals.get("self"), frame)
        return None


def building_thread(frame: types.FrameType) -> bool:
    """`frame` runs the `__init__` of a thread: what it gets (a clock to call later) is for that thread to use."""
    code = frame.f_code
    return (code.co_name == "__init__" and code.co_argcount > 0
            and isinstance(frame.f_locals.get(code.co_varnames[0]), threading.Thread))
