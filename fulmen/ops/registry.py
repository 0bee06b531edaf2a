"""The table from torch callables to fulmen symbols, and the helpers that fill it.

Every torch callable a program may call (function, method, operator, `torch.nn.functional` entry) maps to a
`TorchBinding`: the symbol it records and whether it is
the in-place form of that symbol (functionalized during acquisition). A symbol's `impl` is the torch callable
itself, so the torch executor runs exactly what eager runs. Reflected operators of commutative ops (`__radd__`)
alias the plain symbol, whose impl accepts (tensor, scalar); the others keep their own symbol (`__rsub__`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import resolve_name

from fulmen.core.symbol import Symbol, Tag


@dataclass(frozen=True, slots=True)
class TorchBinding:
    symbol: Symbol
    inplace: bool = False  # `a.add_(b)` records `add(a, b)` and rebinds `a`
    # Maps another spelling's arguments onto the symbol's signature (`F.softmax(x, dim=d)` records
    # `torch.softmax(x, d)`), so one op has one symbol: one grad rule, one place for executors to claim it.
    normalize: Callable[..., tuple[tuple, dict[str, Any]]] | None = None
    # The callable's `inplace` parameter, where it has one (`F.elu(x, inplace=True)`).
    flag: InplaceFlag | None = None
    # Whether eager gives back its first argument itself for these arguments (`torch.real` of a real tensor): the
    # call then records nothing and the program holds that object, so an update through either reaches both.
    returns_input: Callable[..., bool] | None = None


@dataclass(frozen=True, slots=True)
class InplaceFlag:
    """The `inplace` parameter of a callable such as `F.elu(input, alpha, inplace)`: set, the call updates its first
    argument, so it is recorded as `updating` records it (functionalised and written back, as `x.relu_()` is). A
    trace never holds the flag set: its torch executor would update a value other calls of the trace still read
    (and autodiff's eager-backward fallback would run the update on a leaf of autograd)."""

    position: int  # of `inplace` among the callable's parameters
    updating: TorchBinding  # an in-place binding

    def resolve(self, binding: TorchBinding, args: tuple, kwargs: dict[str, Any]
                ) -> tuple[TorchBinding, tuple, dict[str, Any]]:
        """The binding that records this call, and its arguments without the flag."""
        if "inplace" in kwargs:
            kwargs = dict(kwargs)
            flag = kwargs.pop("inplace")
        elif len(args) > self.position:
            flag, args = args[self.position], args[:self.position] + args[self.position + 1:]
        else:
            flag = False
        return (self.updating if flag else binding), args, kwargs


TORCH_BINDINGS: dict[Callable[..., Any], TorchBinding] = {}
# Symbols by the name printed in traces, for examine() and tests.
SYMBOLS: dict[str, Symbol] = {}


def lookup(fn: Callable[..., Any]) -> TorchBinding | None:
    binding = TORCH_BINDINGS.get(fn)
    if binding is None and isinstance(fn, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        binding = _operator_binding(fn)
    return binding


def _operator_binding(op: Any) -> TorchBinding | None:
    """A symbol for a registered operator the program calls directly (a `torch.library` custom op such as
    `torch.ops.transformers.grouped_mm_fallback`), made when first seen. It runs the operator itself, takes its
    output metadata from the operator's fake (meta) kernel and its grad from torch autograd on the operator.
    Operators that write to or alias their inputs stay unsupported: a trace could not order those effects."""
    packet = op if isinstance(op, torch._ops.OpOverloadPacket) else op.overloadpacket
    overloads = [getattr(packet, name) for name in packet.overloads()] if op is packet else [op]
    schemas = [overload._schema for overload in overloads]
    if any(item.alias_info is not None for schema in schemas for item in (*schema.arguments, *schema.returns)):
        return None
    seeded = any(torch.Tag.nondeterministic_seeded in overload.tags for overload in overloads)
    printed = f"torch.ops.{resolve_name(op)}"
    sym = Symbol(name=resolve_name(op), printed=printed, impl=op, tags=Tag.RANDOM if seeded else Tag.NONE)
    binding = TORCH_BINDINGS.setdefault(op, TorchBinding(sym))
    SYMBOLS.setdefault(printed, binding.symbol)
    return binding


def symbol_of(target: Symbol | Callable[..., Any], what: str) -> Symbol:
    """`target` itself, or the symbol fulmen records for the torch callable `target` (to register `what` for)."""
    if isinstance(target, Symbol):
        return target
    binding = lookup(target)
    if binding is None:
        raise ValueError(f"{target} has no fulmen symbol to register {what} for")
    return binding.symbol


def add_symbol(sym: Symbol) -> Symbol:
    """Makes `sym` findable by the name traces print for it; a second symbol printed the same way is refused (the
    printed name is how a trace calls it, so two would be one name for two ops)."""
    existing = SYMBOLS.get(sym.printed)
    if existing is not None and existing is not sym:
        raise ValueError(f"{sym.printed} is registered twice")
    SYMBOLS[sym.printed] = sym
    return sym


def printed_name(fn: Callable[..., Any]) -> str:
    name = resolve_name(fn)
    if name is None:
        raise ValueError(f"{fn} is not a torch callable")
    return name


def bind(fn: Callable[..., Any], binding: TorchBinding) -> None:
    existing = TORCH_BINDINGS.get(fn)
    if existing == binding:  # torch exposes some ops under several names that are one object (`__abs__`)
        return
    if existing is not None:
        raise ValueError(f"{printed_name(fn)} is registered twice")
    TORCH_BINDINGS[fn] = binding


def torch_symbol(
    fn: Callable[..., Any],
    *,
    decomposition: Callable[..., Any] | None = None,
    meta: Callable[..., Any] | None = None,
    aliases: tuple[Callable[..., Any], ...] = (),
    inplace: tuple[Callable[..., Any], ...] = (),
    tags: Tag = Tag.NONE,
    name: str | None = None,
    printed: str | None = None,
    differentiable_outputs: tuple[bool, ...] | None = None,
    returns_input: Callable[..., bool] | None = None,
) -> Symbol:
    """Registers `fn` (and its aliases) as one torch-level symbol executed by `fn` itself (`printed`: how traces call
    it, for callables torch.overrides cannot name; `returns_input`: see TorchBinding)."""
    printed = printed or printed_name(fn)
    sym = Symbol(
        name=name or printed.rsplit(".", 1)[-1],
        printed=printed,
        impl=fn,
        decomposition=decomposition,
        meta=meta,
        tags=tags,
        differentiable_outputs=differentiable_outputs,
    )
    add_symbol(sym)
    bind(fn, TorchBinding(sym, returns_input=returns_input))
    for alias in aliases:
        bind(alias, TorchBinding(sym, returns_input=returns_input))
    for alias in inplace:
        bind(alias, TorchBinding(sym, inplace=True))
    return sym


def takes_inplace_flag(fn: Callable[..., Any], updating: Symbol | None = None) -> None:
    """`fn` (bound already) takes an `inplace` flag: a call that sets it records `updating` (by default `fn`'s own
    symbol) as an in-place update of its first argument. `updating` is another symbol where eager's grad of the
    in-place op is not the out-of-place op's (ELU's reads the result)."""
    binding = TORCH_BINDINGS[fn]
    position = list(inspect.signature(fn).parameters).index("inplace")
    TORCH_BINDINGS[fn] = dataclasses.replace(
        binding, flag=InplaceFlag(position, TorchBinding(updating or binding.symbol, inplace=True)))


def impl_symbol(fn: Callable[..., Any], tags: Tag = Tag.NONE, meta: Callable[..., Any] | None = None,
                decomposition: Callable[..., Any] | None = None) -> Symbol:
    """A symbol executed by one of fulmen's own functional helpers (`fulmen.ops.kernels.impls`), bound to no torch
    callable (`meta`: its outputs, where running `fn` on meta tensors cannot tell them; `decomposition`: the prims that
    transforms without a rule for it, such as vmap and jvp, see)."""
    printed = f"impls.{fn.__name__}"
    sym = Symbol(name=fn.__name__, printed=printed, impl=fn, tags=tags, meta=meta, decomposition=decomposition)
    return add_symbol(sym)


def method(name: str) -> Callable[..., Any]:
    return getattr(torch.Tensor, name)


def methods(*names: str) -> tuple[Callable[..., Any], ...]:
    return tuple(getattr(torch.Tensor, n) for n in names if hasattr(torch.Tensor, n))
