"""`fulmen.jit` of an `nn.Module`: the module that runs its wrapped module's forward through a `JittedFunction`, and
finding the `JittedFunction` behind either result of `fulmen.jit` (`core`, `pipeline`)."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from fulmen.acquisition.acquire import current_interpreter
from fulmen.executors.base import Executor
from fulmen.jit.jitted import JittedFunction
from fulmen.jit.module_hooks import call_with_own_hooks, has_global_hooks
from fulmen.jit.pipeline import Pipeline
from fulmen.options import JitOptions


class JittedModule(nn.Module):
    """An `nn.Module` that runs the wrapped module's forward through fulmen.

    Parameters, buffers, state dicts, train/eval and device moves are the wrapped module's own (no prefix), so
    optimizers, Fabric and checkpoints see the original module. Its call runs the hooks registered on it, never the
    global module hooks: the trace holds those of the wrapped module's call (see module_hooks.py).
    """

    def __init__(self, model: nn.Module, options: JitOptions, executors: tuple[Executor, ...] = ()) -> None:
        super().__init__()
        self._model = model
        self._jit = JittedFunction(model.forward, options, module=model, executors=executors)

    def __deepcopy__(self, memo: dict[int, Any]) -> JittedModule:
        """The wrapped module copied (an EMA or reference model), jitted anew with the same options and executors;
        the hooks registered on this wrapper come along, as nn.Module's deepcopy copies them."""
        copied = JittedModule(copy.deepcopy(self._model, memo), self._jit._options, self._jit.executors)
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            if name not in ("_jit", "_modules"):
                copied.__dict__[name] = copy.deepcopy(value, memo)
        return copied

    # fulmen.transforms.distribution's ModuleWrapper: ddp / fsdp distribute the wrapped module
    @property
    def wrapped_module(self) -> nn.Module:
        return self._model

    @property
    def has_run(self) -> bool:
        return self._jit.stats.misses > 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if current_interpreter() is not None:
            # Inside a program another fulmen.jit acquires (self is then its stand-in, see module_inputs.py), the
            # wrapped module is traced as part of it, with its parameters as that trace's module inputs.
            return self._model(*args, **kwargs)
        return self._jit(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if current_interpreter() is not None:
            return super().__call__(*args, **kwargs)  # its hooks and forward, traced as eager runs them
        # The trace holds the wrapped module's call, global module hooks included: they must not run here again.
        if not (self._forward_pre_hooks or self._forward_hooks or self._backward_pre_hooks or self._backward_hooks):
            return self._jit(*args, **kwargs)
        if not has_global_hooks():
            return super().__call__(*args, **kwargs)
        return call_with_own_hooks(self, self._jit, args, kwargs)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._model.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._model.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False):
        return self._model.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_model"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        model = self.__dict__.get("_modules", {}).get("_model")
        if model is not None and not name.startswith("_") and hasattr(model, name) and name not in self.__dict__:
            setattr(model, name, value)  # e.g. `jitted.max_seq_length = 64` configures the wrapped model
        else:
            super().__setattr__(name, value)


def pipeline(fn: JittedFunction | JittedModule) -> Pipeline:
    """The passes the result of `fulmen.jit` runs, in order (`print(fulmen.pipeline(jitted))`; fulmen.jit.pipeline):
    fulmen's own and the transforms it was given, each at its stage."""
    return core(fn).pipeline


def core(fn: JittedFunction | JittedModule) -> JittedFunction:
    """The `JittedFunction` behind the result of `fulmen.jit`."""
    inner = getattr(fn, "_forward_module", None)  # Lightning Fabric's wrapper of a module it set up
    if isinstance(inner, JittedModule):
        fn = inner
    if isinstance(fn, JittedModule):
        return fn._jit
    if isinstance(fn, JittedFunction):
        return fn
    raise TypeError(f"expected the result of fulmen.jit, got {type(fn).__name__}")
