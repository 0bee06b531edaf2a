"""Decompositions recorded once per kind of call and taken again (trace speed, issue 48).

A model's repeated blocks make the same calls with the same metadata again and again: the 22 blocks of a TinyLlama
decompose 4,704 calls of 130 kinds into prims, and with symbolic sizes every decomposition pays its SymInt arithmetic
again (a third of the trace's time). A `Template` holds the parts one decomposition recorded with each proxy replaced
by a token: an argument's position, an output's, or an intermediate's name as an offset from where the namespace's
counter stood. A later call with the same key (`template_key`: the arguments' metadata as the meta cache keys them,
which of them are the same proxy, their devices, grad flags and conjugate bits, the grad mode, autocast, the default
dtype and the checkpoint region) gets the same parts on its own proxies, named as running the decomposition would have
named them, with the call's line. A decomposition is not kept where its key may not fix its parts: a part that draws
random numbers, reads a proxy that is neither an argument nor its own, makes a view of another tensor than those
(a view of one of them becomes the same view of the new call's), is named by a hint, or was recorded at another line
or region.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from fulmen.core import pytree
from fulmen.core.proxies import TensorProxy
from fulmen.core.source import SourceLocation
from fulmen.core.symbol import BoundSymbol, iter_proxies, map_proxies

_FRESH = re.compile(r"t(\d+)")
# Off: every call runs its decomposition (tests compare the traces both ways).
ENABLED = True
_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str  # "arg", "out" or "mid"
    index: int


@dataclass(frozen=True, slots=True)
class _Intermediate:
    offset: int  # its name's number past the namespace's counter as the decomposition began
    meta: torch.Tensor
    device: torch.device
    requires_grad: bool
    view_of: _Token | None = None  # a view: of the storage of this argument's or earlier intermediate's meta

    def make(self, name: str, base: TensorProxy | None) -> TensorProxy:
        meta = self.meta
        if base is None:
            meta = meta.detach()
        else:  # the same view of the new base (the template's base had its layout: the key fixes it)
            meta = _root(base.meta).as_strided(meta.shape, meta.stride(), meta.storage_offset())
        return TensorProxy(name, meta, self.device, self.requires_grad)


@dataclass(frozen=True, slots=True)
class Template:
    parts: tuple[BoundSymbol, ...]  # tokens where the decomposition's parts had proxies
    intermediates: tuple[_Intermediate, ...]
    names_taken: int  # how far the decomposition moved the namespace's counter


class _NotATemplate(Exception):
    pass


def _root(meta: torch.Tensor) -> torch.Tensor:
    return meta._base if meta._is_view() else meta


def _is_token(obj: Any) -> bool:
    return type(obj) is _Token


def template_key(meta_key: Any, args: tuple, kwargs: dict[str, Any], output: Any, region: int) -> tuple:
    """What a decomposition's parts depend on beyond `meta_key` (TraceBuilder's key of the call's metadata)."""
    proxies = list(iter_proxies((args, kwargs)))
    first: dict[int, int] = {}
    same = tuple(first.setdefault(id(p), i) for i, p in enumerate(proxies))  # mul(a, a) is not mul(a, b)
    flags = tuple((p.device, p.requires_grad, p.is_conj(), p.is_neg(), p._fulmen_class) for p in proxies)
    outputs = tuple((p.device, p.requires_grad) for p in iter_proxies(output))
    autocast = tuple(torch.is_autocast_enabled(device) for device in _AUTOCAST_DEVICES)
    return (meta_key, same, flags, outputs, torch.is_grad_enabled(), autocast, torch.get_default_dtype(), region)


def make_template(parts: list[BoundSymbol], args: tuple, kwargs: dict[str, Any], output: Any, start: int, end: int,
                  source: SourceLocation | None, region: int) -> Template | None:
    """The template of `parts`, which a decomposition recorded while the namespace's counter went from `start` to
    `end`; None where its key may not fix them (see the module docstring)."""
    arguments: dict[str, int] = {}
    for i, p in enumerate(iter_proxies((args, kwargs))):
        arguments.setdefault(p.pname, i)
    outputs = {p.pname: i for i, p in enumerate(iter_proxies(output))}
    mids: dict[str, int] = {}
    intermediates: list[_Intermediate] = []
    roots = {id(_root(p.meta)): _Token("arg", i) for i, p in reversed(list(enumerate(iter_proxies((args, kwargs)))))}

    def token(p: TensorProxy) -> _Token:
        name = p.pname
        if name in outputs:
            return _Token("out", outputs[name])
        if name in arguments:
            return _Token("arg", arguments[name])
        if name not in mids:
            fresh = _FRESH.fullmatch(name)
            if (fresh is None or not start <= int(fresh[1]) < end or p.is_conj() or p.is_neg()
                    or p._fulmen_class is not torch.Tensor):
                raise _NotATemplate
            view_of = None
            if p.meta._is_view():
                view_of = roots.get(id(p.meta._base))
                if view_of is None or p.meta._base.dtype != p.dtype:
                    raise _NotATemplate
            mids[name] = len(intermediates)
            intermediates.append(_Intermediate(int(fresh[1]) - start, p.meta, p.device, p.requires_grad, view_of))
            roots.setdefault(id(_root(p.meta)), _Token("mid", mids[name]))
        return _Token("mid", mids[name])

    def tokenized(part: BoundSymbol) -> BoundSymbol:
        if part.draws_random() or part.source is not source or part.checkpoint_region != region or part.executor:
            raise _NotATemplate
        return part.from_bsym(args=map_proxies(part.args, token), kwargs=map_proxies(part.kwargs, token),
                              output=map_proxies(part.output, token),
                              subsymbols=[tokenized(sub) for sub in part.subsymbols])

    try:
        return Template(tuple(tokenized(part) for part in parts), tuple(intermediates), end - start)
    except _NotATemplate:
        return None


def instantiate(template: Template, namespace: Any, args: tuple, kwargs: dict[str, Any], output: Any,
                source: SourceLocation | None) -> list[BoundSymbol] | None:
    """The template's parts on this call's proxies, its intermediates named from the namespace's counter on; None
    where one of those names is taken already (the caller then runs the decomposition)."""
    start = namespace.counter
    names = [f"t{start + m.offset}" for m in template.intermediates]
    if not namespace.take(names, start + template.names_taken):
        return None
    arguments, outputs = list(iter_proxies((args, kwargs))), list(iter_proxies(output))
    mids: list[TensorProxy] = []
    values = {"arg": arguments, "out": outputs, "mid": mids}

    def value(token: _Token) -> TensorProxy:
        return values[token.kind][token.index]

    for name, m in zip(names, template.intermediates):
        mids.append(m.make(name, value(m.view_of) if m.view_of is not None else None))

    def built(part: BoundSymbol) -> BoundSymbol:
        return part.from_bsym(args=pytree.tree_map(value, part.args, _is_token),
                              kwargs=pytree.tree_map(value, part.kwargs, _is_token),
                              output=pytree.tree_map(value, part.output, _is_token),
                              subsymbols=[built(sub) for sub in part.subsymbols], source=source)

    return [built(part) for part in template.parts]

