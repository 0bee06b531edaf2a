"""Finding the user's frame, so that traces and errors point at the user's own line."""

from __future__ import annotations

import itertools
import linecache
import os
import re
import sys
from dataclasses import dataclass
from types import FrameType, TracebackType

import torch

_FULMEN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Frames inside these folders are library frames, never "the user's line".
_LIBRARY_DIRS: tuple[str, ...] = (
    _FULMEN_DIR,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,  # torch/
    os.path.dirname(os.path.abspath(__import__("contextlib").__file__)) + os.sep + "contextlib.py",
)


@dataclass(frozen=True, slots=True)
class SourceLocation:
    filename: str
    lineno: int
    function: str

    @property
    def line(self) -> str:
        return linecache.getline(self.filename, self.lineno).strip()

    def describe(self) -> str:
        return f'{self.filename}:{self.lineno} in {self.function}: "{self.line}"'

    def short(self) -> str:
        return f"{os.path.basename(self.filename)}:{self.lineno} in {self.function}"


def _is_library(filename: str) -> bool:
    return filename.startswith(_LIBRARY_DIRS)


def is_fulmens(frame: FrameType) -> bool:
    """Whether `frame` runs fulmen's own code."""
    return frame.f_code.co_filename.startswith(_FULMEN_DIR)


def user_location(skip: int = 1) -> SourceLocation | None:
    """The innermost frame outside fulmen and torch, or None."""
    return frame_location(sys._getframe(skip))


def frame_location(frame: FrameType | None) -> SourceLocation | None:
    """`frame` or the innermost frame it was called from that is outside fulmen and torch, or None. A line of a
    graph Dynamo captured (torch.compile with the fulmen.dynamo backend) is the user's line its node came from."""
    while frame is not None:
        code = frame.f_code
        if not _is_library(code.co_filename):
            if code.co_filename.startswith(_FX_CODE) and (location := _graph_node_location(frame)) is not None:
                return location
            return SourceLocation(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return None


_FX_CODE = "<eval_with_key>"  # the file name torch.fx gives a GraphModule's generated code
_TRACEBACK_ENTRY = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _graph_node_location(frame: FrameType) -> SourceLocation | None:
    """The innermost user frame of the stack trace Dynamo kept for the node a GraphModule's line runs, or None."""
    module = frame.f_locals.get("self")
    lines = getattr(module, "_lineno_map", None)
    if not isinstance(module, torch.fx.GraphModule) or not lines:
        return None
    index = lines.get(frame.f_lineno - getattr(module, "_prologue_start", 0))
    if index is None:
        return None
    node = next(itertools.islice(module.graph.nodes, index, None), None)
    return stack_trace_location(node.meta.get("stack_trace")) if node is not None else None


def stack_trace_location(stack: str | None) -> SourceLocation | None:
    """The innermost user frame of a stack trace torch kept as text (an FX node's `stack_trace`), or None."""
    entries = [entry for entry in _TRACEBACK_ENTRY.findall(stack or "") if not _is_library(entry[0])]
    if not entries:
        return None
    filename, lineno, function = entries[-1]
    return SourceLocation(filename, int(lineno), function)


# torch's dispatch plumbing between a library's line and fulmen's handler; never the line that does the reading
_DISPATCH_FILES: tuple[str, ...] = tuple(
    os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), name) for name in ("module_inputs.py", "_tensor.py")
)


def library_location(skip: int = 1) -> SourceLocation | None:
    """The innermost frame outside fulmen and torch's dispatch plumbing when it lies inside torch (torch.nn's
    modules and functionals), which `user_location` skips; None otherwise."""
    frame: FrameType | None = sys._getframe(skip)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith((_FULMEN_DIR, *_DISPATCH_FILES)):
            if not _is_library(filename):
                return None
            return SourceLocation(filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return None


def traceback_location(tb: TracebackType | None) -> SourceLocation | None:
    """The innermost frame of a traceback outside fulmen and torch, or None."""
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if not _is_library(code.co_filename):
            found = SourceLocation(code.co_filename, tb.tb_lineno, code.co_name)
        tb = tb.tb_next
    return found
