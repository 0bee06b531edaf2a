"""Parameters, buffers and tensor attributes of a module enter the trace as named inputs.

The user's module is never changed. Acquisition runs the forward of a *shadow* tree: a shallow copy of every
submodule whose `_parameters`, `_buffers` and tensor attributes hold proxies (the override map), and whose class
reports every attribute the program reads to the observer (observer.py), so guards check exactly those on the user's
module: plain and container attributes, submodules, parameter and buffer slots, hooks, methods. Assignments the
program makes during the forward land on the shadow and are reported to the observer: tensor rebinds are returned
by the trace, other values stored again on the user's module by every call (state_writes.py); buffers it registers are
registered again by every call (buffer_registrations.py). Tied weights (one tensor in two places) are one trace input,
fetched from the first place, and guarded to stay tied.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.nn.modules import module as torch_module
from torch.nn.utils import parametrize

from fulmen.acquisition.lookasides import method_lookasides
from fulmen.core.bounded import LRU
from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy, unproxyable
from fulmen.jit.buffer_registrations import Registered, Registration, registered
from fulmen.observation.observer import Observer

CONTAINERS = ("_parameters", "_buffers", "__dict__")


@dataclass(frozen=True, slots=True)
class ModuleInput:
    """Where a tensor input of the trace lives: `getattr(module, container)[name]`."""

    module: nn.Module
    container: str  # "_parameters", "_buffers" or "__dict__"
    name: str
    qualified: str  # "transformer.h.0.attn.qkv.weight"

    def fetch(self) -> Any:
        return getattr(self.module, self.container).get(self.name)



@dataclass
class ShadowTree:
    root: nn.Module
    observer: Observer
    # method -> the function traced in its place (the active executors' method lookasides, replacements.py)
    lookasides: dict[Callable[..., Any], Callable[..., Any]] = field(default_factory=dict)
    inputs: list[ModuleInput] = field(default_factory=list)
    proxies: list[TensorProxy] = field(default_factory=list)
    # id(shadow) -> (shadow, original, {container: {name: proxy given}})
    given: dict[int, tuple[nn.Module, nn.Module, dict[str, dict[str, TensorProxy]]]] = field(default_factory=dict)
    def rebinds(self) -> list[tuple[nn.Module, str, str, TensorProxy, TensorProxy]]:
        """(original module, container, name, proxy given, value now) for tensors the forward reassigned."""
        changed = []
        for shadow, original, given in self.given.values():
            for container, names in given.items():
                now_map = getattr(shadow, container)
                for name, proxy in names.items():
                    now = now_map.get(name)
                    if now is not proxy and isinstance(now, torch.Tensor):
                        changed.append((original, container, name, proxy, now))
            # a buffer the forward registered (given None): the trace returns it, as eager's module holds it after
            changed += [(r.module, "_buffers", r.name, None, r.value) for r in self._registered(shadow, original)
                        if r.name not in given["_buffers"] and type(r.value) is TensorProxy]
        return changed

    def registrations(self) -> list[Registration]:
        """The `register_buffer` calls the forward made on the shadows, to make on the user's modules every call."""
        return [r.registration() for shadow, original, _ in self.given.values()
                for r in self._registered(shadow, original)]

    @staticmethod
    def _registered(shadow: nn.Module, original: nn.Module) -> list[Registered]:
        state, before = vars(shadow), vars(original)
        if "_buffers" not in state or "_non_persistent_buffers_set" not in state:
            return []
        return registered(original, state["_buffers"], before["_buffers"], state["_non_persistent_buffers_set"],
                          before["_non_persistent_buffers_set"])


# Module class -> its shadow class. Bounded, not weak: the shadow subclasses the class, so a weak key would never
# die; classes made at run time would grow it without end
_SHADOW_CLASSES: LRU[type, type] = LRU(1024)


def _shadow_class(cls: type) -> type:
    shadow = _SHADOW_CLASSES.get(cls)
    if shadow is None:
        namespace = {"__getattribute__": _recording_getattribute, "__getattr__": _recording_getattr(cls.__getattr__),
                     "__setattr__": _recording_setattr(cls.__setattr__),
                     "__delattr__": _recording_delattr(cls.__delattr__), "__module__": cls.__module__}
        namespace.update(method_lookasides(cls))
        shadow = type(cls.__name__, (cls,), namespace)
        _SHADOW_CLASSES[cls] = shadow
    return shadow


# A module of a shadow class that the program itself creates (`ModuleList.__getitem__` with a slice builds one of
# `self.__class__`) has no original behind it: what the program reads of it, it made, and needs no guard.
# A method with a lookaside is answered with the lookaside, bound to the shadow.
def _recording_getattribute(self: nn.Module, name: str) -> Any:
    value = object.__getattribute__(self, name)
    if name[:2] != "__":
        state = object.__getattribute__(self, "__dict__")
        if "_fulmen_tree" in state:
            tree = state["_fulmen_tree"]
            tree.observer.module_read(state["_fulmen_original"], type(self), name, value)
            if tree.lookasides and type(value) is types.MethodType:
                lookaside = tree.lookasides.get(value.__func__)
                if lookaside is not None:
                    return types.MethodType(lookaside, self)
    return value


def _recording_getattr(fallback: Callable[[nn.Module, str], Any]) -> Callable[[nn.Module, str], Any]:
    def __getattr__(self: nn.Module, name: str) -> Any:  # parameters, buffers and submodules (nn.Module.__getattr__)
        state = object.__getattribute__(self, "__dict__")
        try:
            value = fallback(self, name)
        except AttributeError:  # found nowhere (`hasattr`): it must stay so
            if "_fulmen_tree" in state:
                state["_fulmen_tree"].observer.module_absent(state["_fulmen_original"], name)
            raise
        if "_fulmen_tree" in state:
            state["_fulmen_tree"].observer.module_fallback(state["_fulmen_original"], name)
        return value

    return __getattr__


def _recording_setattr(store: Callable[[nn.Module, str, Any], None]) -> Callable[[nn.Module, str, Any], None]:
    def __setattr__(self: nn.Module, name: str, value: Any) -> None:  # lands on the shadow, stored again by each call
        store(self, name, value)
        state = object.__getattribute__(self, "__dict__")
        if "_fulmen_tree" in state:
            state["_fulmen_tree"].observer.module_write(self, state["_fulmen_original"], name, sys._getframe(1))

    return __setattr__


def _recording_delattr(delete: Callable[[nn.Module, str], None]) -> Callable[[nn.Module, str], None]:
    def __delattr__(self: nn.Module, name: str) -> None:
        delete(self, name)
        state = object.__getattribute__(self, "__dict__")
        if "_fulmen_tree" in state:
            state["_fulmen_tree"].observer.module_write(self, state["_fulmen_original"], name, sys._getframe(1),
                                                        deleted=True)

    return __delattr__


def build_shadow(module: nn.Module, make_proxy: Callable[[torch.Tensor, str], TensorProxy], observer: Observer,
                 lookasides: dict[Callable[..., Any], Callable[..., Any]] | None = None) -> ShadowTree:
    if torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks:
        raise TraceError("fulmen cannot compile a module while global module backward hooks are registered "
                         "(register_module_full_backward_hook / register_module_full_backward_pre_hook): remove them, "
                         "or register the hook on the module fulmen.jit returned", None)
    tree = ShadowTree(root=module, observer=observer, lookasides=lookasides or {})
    by_tensor: dict[int, TensorProxy] = {}  # tied weights share one proxy
    first: dict[int, ModuleInput] = {}  # where each tensor was first found
    shadows: dict[int, nn.Module] = {}

    def proxy_for(tensor: torch.Tensor, qualified: str, where: ModuleInput) -> TensorProxy:
        proxy = by_tensor.get(id(tensor))
        if proxy is None:
            if (why := unproxyable(tensor)) is not None:
                raise TraceError(f"fulmen cannot trace the module's tensor {qualified}: {why}", None)
            proxy = make_proxy(tensor, "t_" + qualified.replace(".", "_"))
            by_tensor[id(tensor)] = proxy
            first[id(tensor)] = where
            tree.inputs.append(where)
            tree.proxies.append(proxy)
            observer.module_tensor(proxy, tensor)
        else:  # fetched only where it was first found: the trace holds while both places hold one tensor
            observer.tied(where, first[id(tensor)])
        return proxy

    def visit(original: nn.Module, prefix: str) -> nn.Module:
        if id(original) in shadows:
            return shadows[id(original)]
        if parametrize._cache_enabled and parametrize.is_parametrized(original):
            # the cache would hold the trace's stand-in tensors past the acquisition
            raise TraceError(
                f"fulmen cannot compile the parametrized module {prefix.rstrip('.') or 'the root'} "
                f"({type(original).__qualname__}) inside torch.nn.utils.parametrize.cached(): call the jitted module "
                "outside it (the trace computes each parametrization once per call anyway)", None)
        if original._backward_hooks or original._backward_pre_hooks:
            # torch calls them on the module's input grads through a BackwardHook node around its call, which a
            # trace has no place for (eager's own setup fails on the trace's stand-in tensors)
            raise TraceError(
                f"fulmen cannot compile module {prefix.rstrip('.') or 'the root'} ({type(original).__qualname__}) with "
                "a backward hook (register_full_backward_hook / register_full_backward_pre_hook): register it on "
                "the module fulmen.jit returned (its hooks run around the compiled call), or a hook on a tensor "
                "(tensor.register_hook)", None)
        # A lazy GraphModule (what Dynamo hands a backend) compiles its code on its next call, patching its class: on
        # the shadow that would patch the shadow class, whose call then calls itself without end. Eager compiles it
        # at that call too.
        _LazyGraphModule.force_recompile(original)
        shadow = object.__new__(_shadow_class(type(original)))
        shadows[id(original)] = shadow
        state = dict(original.__dict__)
        given: dict[str, dict[str, TensorProxy]] = {}
        for container in CONTAINERS:
            source = original.__dict__ if container == "__dict__" else original.__dict__[container]
            replaced = {}
            for name, value in source.items():
                if isinstance(value, torch.Tensor):
                    qualified = f"{prefix}{name}"
                    replaced[name] = proxy_for(value, qualified, ModuleInput(original, container, name, qualified))
            given[container] = replaced
            if container == "__dict__":
                state.update(replaced)
            else:
                state[container] = {**source, **replaced}
        if "_non_persistent_buffers_set" in state:  # the forward's register_buffer calls change the shadow's own
            state["_non_persistent_buffers_set"] = set(state["_non_persistent_buffers_set"])
        state["_modules"] = {
            name: (visit(child, f"{prefix}{name}.") if child is not None else None)
            for name, child in original._modules.items()
        }
        state["_fulmen_original"] = original
        state["_fulmen_tree"] = tree
        shadow.__dict__.update(state)
        tree.given[id(shadow)] = (shadow, original, given)
        return shadow

    tree.root = visit(module, "")
    return tree


def qualified_names(tree: ShadowTree | None, captured: list[tuple[torch.Tensor, TensorProxy]],
                    modules: list[nn.Module]) -> dict[str, tuple[str, ...]]:
    """The module tensors a trace takes (`tree`'s inputs, tensors the program `captured`), by proxy name: their
    qualified names under `modules` (the modules the program names, each root before its submodules), one per place a
    tied tensor sits, without a wrapper's own references (Fabric's `_forward_module.`)."""
    places: dict[int, list[str]] = {}
    covered: set[int] = set()
    for root in modules:
        if id(root) in covered:
            continue
        covered.update(id(m) for m in root.modules())
        for name, tensor in [*root.named_parameters(remove_duplicate=False),
                             *root.named_buffers(remove_duplicate=False)]:
            parts = name.split(".")
            while len(parts) > 1 and parts[0].startswith("_"):
                parts.pop(0)
            if ".".join(parts) not in places.setdefault(id(tensor), []):
                places[id(tensor)].append(".".join(parts))
    pairs = [(proxy, source.fetch()) for proxy, source in zip(tree.proxies, tree.inputs)] if tree is not None else []
    pairs += [(proxy, tensor) for tensor, proxy in captured]
    return {proxy.pname: tuple(places[id(t)]) for proxy, t in pairs if id(t) in places}
