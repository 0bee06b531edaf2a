"""The hooks of a jitted module's own call: those registered on it, never the global ones.

A trace of the wrapped module contains its call, global module hooks (`register_module_forward_hook`, ...)
included, so those must not run again around it: the `JittedModule` is no module call of the program. Hooks
registered on the `JittedModule` itself run outside the trace, once per call, as `nn.Module.__call__` runs them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules import module as torch_module

from fulmen.core.errors import TraceError


def has_global_hooks() -> bool:
    return bool(torch_module._global_forward_pre_hooks or torch_module._global_forward_hooks
                or torch_module._global_backward_pre_hooks or torch_module._global_backward_hooks)


def call_with_own_hooks(module: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """`forward(*args, **kwargs)` with the forward pre-hooks and hooks registered on `module`, as
    `nn.Module.__call__` runs them, while global hooks are registered (they run inside the trace)."""
    if module._backward_pre_hooks or module._backward_hooks:
        raise TraceError("fulmen cannot run backward hooks registered on a jitted module while global module hooks "
                         "are registered: register them on the module you jitted instead", None)
    for hook_id, hook in module._forward_pre_hooks.items():
        if hook_id in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"forward pre-hook must return None or a tuple of (new_args, new_kwargs), but "
                                       f"got {result}.")
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    ran: set[int] = set()
    output = None
    try:
        output = forward(*args, **kwargs)
        for hook_id, hook in module._forward_hooks.items():
            ran.add(hook_id)
            output = _run_hook(module, hook_id, hook, args, kwargs, output)
    except Exception:
        # hooks registered with always_call=True run even when the forward raised
        for hook_id, hook in module._forward_hooks.items():
            if hook_id in module._forward_hooks_always_called and hook_id not in ran:
                try:
                    output = _run_hook(module, hook_id, hook, args, kwargs, output)
                except Exception as error:  # noqa: BLE001 - silenced as nn.Module silences it, with a warning
                    warnings.warn("module forward hook with ``always_call=True`` raised an exception that was "
                                  f"silenced as another error was raised in forward: {error}", stacklevel=3)
        raise
    return output


def _run_hook(module: nn.Module, hook_id: int, hook: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
              output: Any) -> Any:
    if hook_id in module._forward_hooks_with_kwargs:
        result = hook(module, args, kwargs, output)
    else:
        result = hook(module, args, output)
    return output if result is None else result
