"""Torch's own Python functions that fulmen has no symbol for (`F.multi_head_attention_forward`, `F.gumbel_softmax`,
`F.interpolate`, ...) run inline: the torch calls they make are traced one by one, as eager makes them.

Such a function starts by handing itself to the active torch-function mode (`if has_torch_function(...): return
handle_torch_function(...)`), which is how acquisition sees it as one call. To run its body under the mode without
coming back to that check, fulmen calls a copy of the function whose globals answer no to `has_torch_function*`.
Only that frame is affected: the functions its body calls keep their own check, so each is traced, or inlined in
turn. torch's modules themselves are left as they are.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
# torch._jit_internal.boolean_dispatch's wrapper (F.max_pool2d and its return_indices twin): it has no check of its
# own; the function its flag chooses has one, and hands the wrapper to the mode.
_BOOLEAN_DISPATCH = F.max_pool2d.__code__


def _no_torch_function(*args: Any) -> bool:
    return False


def inlinable(func: Any) -> bool:
    """A function written in Python in torch's own modules (not a builtin, not the program's)."""
    return (type(func) is types.FunctionType and func.__module__ is not None
            and func.__module__.split(".", 1)[0] == "torch")


def target(func: types.FunctionType, args: tuple, kwargs: dict[str, Any]) -> types.FunctionType:
    """The function whose torch-function check handed `func` to the mode: `func` itself, or the one a
    boolean_dispatch wrapper chooses for these arguments."""
    if func.__code__ is not _BOOLEAN_DISPATCH:
        return func
    cells = dict(zip(func.__code__.co_freevars, (cell.cell_contents for cell in func.__closure__)))
    name, index = cells["arg_name"], cells["arg_index"]
    flag = kwargs[name] if name in kwargs else args[index] if index < len(args) else cells["default"]
    return cells["if_true"] if flag else cells["if_false"]


@functools.cache
def body(func: types.FunctionType) -> Callable[..., Any]:
    """`func` whose own torch-function check answers no (a copy; `func` is unchanged)."""
    scope = dict(func.__globals__)
    answers = dict.fromkeys(_CHECKS, _no_torch_function)
    scope.update(answers)
    if scope.get("overrides") is torch.overrides:  # `overrides.has_torch_function_unary(a)` (torch.sym_int)
        scope["overrides"] = types.SimpleNamespace(**{**vars(torch.overrides), **answers})
    copy = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    copy.__qualname__ = func.__qualname__
    return copy
