"""Tensor proxies: storage-less tensors that stand for values of a trace.

A `TensorProxy` is a wrapper subclass of `torch.Tensor`: it carries the real shape, strides, dtype, device and
requires_grad (so user code that inspects tensors works unchanged) plus a meta tensor used to run torch's own meta
kernels for shape inference, and a name that the trace prints. It owns no storage and must never reach the
dispatcher: every operation on it is intercepted by the acquisition mode first.
"""

from __future__ import annotations

import sys

import torch

from fulmen.core.dtypes import short_name
from fulmen.core.errors import UnsupportedOpError
from fulmen.core.source import frame_location, is_fulmens
from fulmen.core.symbolic import size_string


class ProxyDispatchError(RuntimeError):
    pass


class TrackedMetas:
    """Suspends inference mode, keeping grad mode, while fulmen makes meta tensors (a no-op outside inference mode).

    Tensors made under `torch.inference_mode()` are inference tensors, and torch records no view relation for them
    (nor for a view of one taken outside): `meta[:1]._is_view()` is False. The functionalizer reads in-place
    updates through views off that relation, so under inference mode a write into `buffer[:n]` (LitGPT's KV cache)
    never reached the buffer. Metas are fulmen's own bookkeeping: the program still runs in the caller's mode.
    """

    __slots__ = ("_guard",)

    def __enter__(self) -> None:
        self._guard = None
        if torch.is_inference_mode_enabled():
            grad = torch.is_grad_enabled()
            self._guard = torch._C._InferenceMode(False)  # restores the whole autograd state when dropped
            torch._C._set_grad_enabled(grad)

    def __exit__(self, *exc: object) -> None:
        self._guard = None


def tracked_meta(meta: torch.Tensor) -> torch.Tensor:
    """`meta` as a tensor torch tracks views of: the same layout (shape, strides, storage offset and size)."""
    if not meta.is_inference():
        return meta
    with TrackedMetas():
        return torch.empty(0, dtype=meta.dtype, device="meta").set_(meta.untyped_storage(), meta.storage_offset(),
                                                                    meta.shape, meta.stride())


class TensorProxy(torch.Tensor):
    pname: str
    meta: torch.Tensor
    # The class of the tensor the proxy stands for (an nn.Parameter argument or module parameter), which `isinstance`
    # and `x.__class__` answer as eager does; what an op returns is a plain Tensor, as eager's is. (`type(x)` is
    # still TensorProxy: the observer refuses it for a proxy of another class, type_refusal.)
    _fulmen_class: type = torch.Tensor

    # Only the acquisition mode handles proxies; the subclass itself stays inert.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @property  # isinstance falls back to it where the real type does not match
    def __class__(self) -> type:  # type: ignore[override]
        return self._fulmen_class

    @staticmethod
    def __new__(cls, name: str | None = None, meta: torch.Tensor | None = None, device: torch.device | None = None,
                requires_grad: bool = False, *, like: TensorProxy | None = None, shape=None,
                dtype: torch.dtype | None = None):
        if like is not None:
            # A template, as an operator's `like=` function returns it: the symbol's binding names it.
            meta = torch.empty(tuple(like.shape) if shape is None else tuple(shape), dtype=dtype or like.dtype,
                               device="meta")
            name, device = name or "template", like.device
        elif name is None or meta is None or device is None:
            raise TypeError("TensorProxy(name, meta, device) or TensorProxy(like=proxy, shape=..., dtype=...)")
        if meta._has_symbolic_sizes_strides:
            # the meta's storage size given: torch would compute it again from the symbolic sizes and strides, which
            # costs most of a proxy's making (~0.2 ms in SymInt arithmetic, 20x a static proxy); a proxy's storage
            # holds nothing and nothing reads its size
            proxy = torch.Tensor._make_wrapper_subclass(
                cls,
                meta.shape,
                strides=meta.stride(),
                storage_offset=meta.storage_offset(),
                storage_size=meta.untyped_storage().nbytes(),
                dtype=meta.dtype,
                device=device,
                requires_grad=requires_grad,
            )
        else:
            proxy = torch.Tensor._make_wrapper_subclass(
                cls,
                meta.shape,
                strides=meta.stride(),
                storage_offset=meta.storage_offset(),
                dtype=meta.dtype,
                device=device,
                requires_grad=requires_grad,
            )
        proxy.pname = name
        proxy.meta = tracked_meta(meta)
        # a lazy conjugate or negative view (torch.conj(x), its .imag) says so, as eager's does (x.is_conj())
        if meta.is_conj():
            torch._C._set_conj(proxy, True)
        if meta.is_neg():
            torch._C._set_neg(proxy, True)
        return proxy

    def __init__(self, *args, **kwargs):
        pass

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        caller = sys._getframe(1)
        if not is_fulmens(caller):
            # The program called a tensor method that torch runs without a torch-function call (Tensor.set_)
            raise UnsupportedOpError(f"fulmen does not support {func}: torch runs it without a call fulmen can trace",
                                     frame_location(caller))
        raise ProxyDispatchError(
            f"internal error: {func} reached the dispatcher with a fulmen proxy; "
            "proxies are only valid inside fulmen's acquisition"
        )

    # `x.real = v` and `x.imag = v` reach no torch function (eager's setter copies into the part in C++): stated as
    # the copy eager makes, `torch.real(x).copy_(v)`, so acquisition records it as an update through a view of x
    @property
    def real(self) -> torch.Tensor:
        return torch.Tensor.real.__get__(self)

    @real.setter
    def real(self, value: object) -> None:
        _copy_into(torch.real(self), value)

    @property
    def imag(self) -> torch.Tensor:
        return torch.Tensor.imag.__get__(self)

    @imag.setter
    def imag(self, value: object) -> None:
        _copy_into(torch.imag(self), value)

    def type_string(self) -> str:
        device = self.device
        dims = ", ".join(size_string(s) for s in self.shape)
        return f"{device} {short_name(self.dtype)}[{dims}]"

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"<TensorProxy {self.pname}: {self.type_string()}>"

    def __reduce_ex__(self, protocol):
        raise TypeError(f"TensorProxy {self.pname} cannot be pickled or deep-copied")


def _copy_into(part: torch.Tensor, value: object) -> None:
    if isinstance(value, torch.Tensor):
        part.copy_(value)
    else:  # a number: eager copies a 0-dim tensor of the part's dtype
        part.fill_(value)


def is_proxy(x: object) -> bool:
    return type(x) is TensorProxy


# What torch's own tensor classes read off an instance to answer `isinstance`: Parameter's check reads `_is_param`,
# Buffer's `_is_buffer` (nn.Buffer(t) returns t marked so, with its `persistent` flag).
CLASS_MARKERS = ("_is_param", "_is_buffer", "persistent")


def stand_for(proxy: TensorProxy, tensor: torch.Tensor) -> None:
    """`proxy` answers `isinstance` and `__class__` as `tensor` does: its class, and the markers torch's classes read.
    The cache key holds both (guards.argument_key, guards.module_key)."""
    kind = type(tensor)
    if kind is not torch.Tensor:
        proxy._fulmen_class = kind
    state = tensor.__dict__
    for name in CLASS_MARKERS:
        if name in state:
            proxy.__dict__[name] = state[name]


def type_refusal(obj: object) -> str | None:
    """Why `type(obj)` cannot be answered as eager answers it, where `obj` is a proxy of a class other than Tensor
    (an nn.Parameter): its real type is TensorProxy, which no program can be given in its place."""
    if type(obj) is not TensorProxy or obj._fulmen_class is torch.Tensor:
        return None
    name = obj._fulmen_class.__qualname__
    return (f"fulmen cannot answer type() of the {name} {obj.pname}: inside a trace it is fulmen's stand-in "
            f"(TensorProxy), so `type(x) is {name}` would be False where eager's is True. Ask isinstance(x, {name}) "
            "or x.__class__, which answer as eager does")


# A subclass keeping one of these runs torch's own code on every call, as a plain tensor does (nn.Parameter, Buffer).
_PLAIN_FUNCTION = (torch.Tensor.__torch_function__.__func__, torch._C._disabled_torch_function_impl)


def unproxyable(tensor: torch.Tensor) -> str | None:
    """Why a proxy cannot stand for `tensor`, or None: a proxy is a dense strided tensor that runs torch's own
    operators, so a tensor whose class changes what they do would lose it silently."""
    kind = type(tensor)
    if isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin):
        return ("it is an uninitialized parameter or buffer of a lazy module (nn.LazyLinear, ...), which eager "
                "materializes on the module's first call; call the module once before fulmen.jit")
    if kind is not torch.Tensor and kind is not TensorProxy:
        if kind.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
            return (f"its class {kind.__qualname__} overrides __torch_dispatch__ (a wrapper subclass such as DTensor "
                    "or a quantized weight), which fulmen does not trace; fulmen.distributed shards plain tensors "
                    "itself")
        if getattr(kind.__torch_function__, "__func__", kind.__torch_function__) not in _PLAIN_FUNCTION:
            return (f"its class {kind.__qualname__} overrides __torch_function__, which eager runs on every torch "
                    "call and a trace would skip; pass `t.as_subclass(torch.Tensor)` or call the function eagerly")
    if tensor.layout is not torch.strided:
        return f"its layout is {tensor.layout}; fulmen traces dense (strided) tensors only"
    if tensor.is_conj() or tensor.is_neg():
        what = "conjugate" if tensor.is_conj() else "negative"
        return (f"it is a lazy {what} view (its {what} bit is set: torch.conj(x), or the .imag of one), whose bit a "
                f"trace's inputs do not carry; pass `t.resolve_{'conj' if tensor.is_conj() else 'neg'}()`")
    if tensor.is_nested or tensor.is_quantized:
        return f"it is a {'nested' if tensor.is_nested else 'quantized'} tensor; fulmen traces dense tensors only"
    return None
