"""A function or module `torch.compile` made, called by a program fulmen acquires: traced as what it wraps.

`torch.compile(fn)` (and a compiled module's forward) is Dynamo's `compile_wrapper`: it installs Dynamo's frame
evaluation on this thread and calls `fn`, whose frames Dynamo then captures and compiles. Inside an acquisition
that would run Dynamo on fulmen's proxies, and Dynamo's own bookkeeping (the resume functions it adds to the
program's module globals) would reach the trace as writes of the program. As a nested `fulmen.jit` is, the call is
traced as the function it wraps: at each line of the wrapper, after Dynamo installed its frame evaluation and before
`fn` runs, the evaluation is set off again, on this thread only (as a debugger would set it); the wrapper's own
`finally` restores what it found. Either way the call computes what `fn` computes, and eager is what fulmen matches.
Nothing of Dynamo changes: other threads, and the same compiled function called outside fulmen, are compiled.
"""

from __future__ import annotations

import types
from typing import Any

import torch._dynamo.eval_frame
from torch._C._dynamo.eval_frame import get_eval_frame_callback, set_eval_frame

from fulmen.observation.frame_tap import QuietWatch


def _wrapper_code() -> types.CodeType | None:
    """The code of `compile_wrapper`, the function `_TorchDynamoContext.__call__` wraps a callable in."""
    code = torch._dynamo.eval_frame._TorchDynamoContext.__call__.__code__
    return next((c for c in code.co_consts if type(c) is types.CodeType and c.co_name == "compile_wrapper"), None)


COMPILE_WRAPPER_CODE = _wrapper_code()  # None on a torch whose wrapper is made otherwise: Dynamo then runs


class CompiledCallWatch(QuietWatch):
    """A call of a compiled function (frame_tap.CallWatch on `compile_wrapper`)."""

    def enter(self, frame: types.FrameType) -> Any:
        return self

    def line(self, token: Any, frame: types.FrameType) -> None:
        if get_eval_frame_callback() is not None:
            set_eval_frame(None)
