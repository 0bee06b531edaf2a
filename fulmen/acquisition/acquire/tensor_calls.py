"""The torch calls the interpreter answers itself (`Interpreter.special`) rather than by recording the symbol bound
to them: indexing and item assignment, in-place copies and fills, conversions (`to`, `type`, `float`, ...),
`contiguous` and `flatten` where eager returns the tensor itself, autograd's flags and hooks, `out=`, batch_norm's
running statistics, packed sequences, torch.distributions' validation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch._prims_common import suggest_memory_format

from fulmen.acquisition import distribution_checks
from fulmen.acquisition.acquire.call_kinds import SIZED_FACTORIES, _describe
from fulmen.acquisition.autograd_facts import leaf_flag_error
from fulmen.acquisition.lookasides import is_fabric_backward_check
from fulmen.core.errors import DataDependentError, UnsupportedOpError
from fulmen.core.proxies import TensorProxy
from fulmen.ops import lookup, recurrent, shape
from fulmen.ops.effects import check_all_true
from fulmen.ops.nn import batch_norm_update
from fulmen.ops.registry import SYMBOLS

T = torch.Tensor


def _is_basic_index(index: Any) -> bool:
    """Whether eager's `x[index] = v` copies into the view `x[index]` (ints, slices, None and an Ellipsis among
    them), so x's grad_fn becomes CopySlices; an index of tensors or lists (or `x[...]` alone) writes x itself."""
    items = index if isinstance(index, tuple) else (index,)
    return any(item is not Ellipsis for item in items) and all(
        item is None or item is Ellipsis or isinstance(item, slice) or type(item) is int for item in items)


def _is_tensor_scalar(item: Any) -> bool:
    """A 0-dim integer tensor, which eager's indexing reads as a Python int (not a mask: bool and uint8 are)."""
    return (isinstance(item, torch.Tensor) and item.dim() == 0 and item.dtype not in (torch.bool, torch.uint8)
            and not item.dtype.is_floating_point and not item.dtype.is_complex)


def _indexed_dims(items: tuple, ndim: int) -> list[int]:
    """The dim of the indexed tensor each index item stands at (None and `...` take none themselves)."""
    consumed = [0 if item is None or item is Ellipsis or isinstance(item, bool) else
                item.dim() if isinstance(item, torch.Tensor) and item.dtype in (torch.bool, torch.uint8) else 1
                for item in items]
    if Ellipsis in items:
        consumed[items.index(Ellipsis)] = ndim - sum(consumed)
    dims, dim = [], 0
    for taken in consumed:
        dims.append(dim)
        dim += taken
    return dims



def _same_device(wanted: torch.device, have: torch.device) -> bool:
    return wanted.type == have.type and (wanted.index is None or wanted.index == have.index)


class TensorCalls:
    """The special cases of `Interpreter` (interpreter.py), which this class is a base of: they record through its
    `_record`, `_values`, `_proxy` and `_assign`, and read its state (`builder`, `functional`, `autograd`, `known`)."""

    def _setitem(self, x: TensorProxy, index: Any, value: Any) -> None:
        self._check_index(index, masks=True)  # a write through a mask keeps x's shape: nothing depends on values
        x, index = self._select_at_scalars(self._proxy(x), index)
        if index == ():  # `x[i] = v`: eager copies into the selected view
            self.functional.write(x, shape.copy(self.functional.resolve(x), self._values(value)))
            return
        items = index if isinstance(index, tuple) else (index,)
        if torch.is_grad_enabled() and not any(isinstance(item, torch.Tensor) for item in items):
            self.functional.refuse_leaf_update(x, through_view=True)  # eager copies into a view, as above
        current = self.functional.resolve(x)
        new = shape.setitem(current, self._values(index), self._values(value))
        self.functional.write(x, new, through_view=_is_basic_index(index))

    def _is_all_true(self, valid: Any) -> bool:
        """torch.distributions' validation: true now, checked when the trace runs (distribution_checks.py)."""
        location = self.builder.source
        text = distribution_checks.message(distribution_checks.caller())
        if text is None:
            raise DataDependentError("fulmen cannot trace torch._is_all_true: it reads tensor values, which are "
                                     "unknown while tracing", location)
        where = f"\n  (validated by fulmen's trace, for {location.describe()})" if location is not None else ""
        self._record(check_all_true, (valid, text + where), {})
        return True

    def _detach(self, x: Any, data: bool = False) -> Any:
        detach = lookup(torch.detach).symbol
        out = self._record(detach, (x,), {})
        self.functional.record_detached(detach, self._proxy(x), out, data)
        return out

    def _getitem(self, x: TensorProxy, index: Any) -> Any:
        self._check_index(index)
        x, index = self._select_at_scalars(x, index)
        return x if index == () else self._record(shape.getitem, (x, index), {})

    def _select_at_scalars(self, x: TensorProxy, index: Any) -> tuple[TensorProxy, Any]:
        """Eager reads the value of a 0-dim integer tensor in an index and selects with it before anything else (so
        `x[i]` is a view of `x`, and `z[i, :, j]` puts j's dims where `z[1, :, j]` does): `x` after those selects,
        and the rest of the index."""
        items = index if isinstance(index, tuple) else (index,)
        scalars = [p for p, item in enumerate(items) if _is_tensor_scalar(item)]
        if not scalars:
            return x, index
        dims = _indexed_dims(items, x.dim())
        for p in sorted(scalars, key=lambda p: -dims[p]):  # the highest dim first keeps the others' numbers
            x = self._record(shape.select_at, (x, dims[p], items[p]), {})
        return x, tuple(item for p, item in enumerate(items) if p not in scalars)

    def _check_index(self, index: Any, masks: bool = False) -> None:
        items = index if isinstance(index, tuple) else (index,)
        for item in items:
            if isinstance(item, slice) and any(isinstance(b, torch.Tensor) for b in (item.start, item.stop, item.step)):
                raise DataDependentError(
                    "fulmen cannot trace slicing with tensor bounds: the result's shape depends on tensor values",
                    self.builder.source,
                )
            if not masks and isinstance(item, torch.Tensor) and item.dtype in (torch.bool, torch.uint8):
                raise DataDependentError(
                    "fulmen cannot trace indexing with a boolean mask: the result's shape depends on tensor "
                    "values. Use torch.where(mask, x, other) or multiply by the mask instead.",
                    self.builder.source,
                )

    def _where(self, condition: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs:
            raise DataDependentError(
                "fulmen cannot trace torch.where(condition) with one argument: the result's shape depends on tensor "
                "values. Use the three-argument torch.where(condition, x, y).",
                self.builder.source,
            )
        return self._record(lookup(torch.where).symbol, (condition, *args), kwargs)

    def _requires_grad(self, x: torch.Tensor) -> bool:
        """What the tensor holds now answers: an in-place update may have given it a history."""
        if type(x) is TensorProxy:
            return self.functional.resolve(x).requires_grad
        with torch._C.DisableTorchFunction():
            return x.requires_grad

    def _refuse_read(self, what: str, why: str) -> None:
        raise UnsupportedOpError(f"fulmen cannot trace reading {what} inside a jitted function: {why}; read it outside "
                                 "the jitted function (and pass what you need as an argument)", self.builder.source)

    def _requires_grad_(self, x: Any, requires_grad: bool = True) -> Any:
        if self._requires_grad(x) == requires_grad or self.autograd.set_requires_grad(x, requires_grad):
            return x
        raise UnsupportedOpError(
            f"fulmen cannot trace requires_grad_({requires_grad}) on an input of the program (whose flag is the "
            "caller's), a view or a tensor with views: it would make (or unmake) a leaf of autograd inside the "
            "program, which a trace cannot represent; do it outside the jitted function", self.builder.source)

    def _set_requires_grad(self, x: Any, requires_grad: bool) -> None:
        """`x.requires_grad = flag`: unlike requires_grad_(True), eager's setter refuses any tensor not a leaf."""
        if not self.autograd.is_leaf(x):
            raise RuntimeError(leaf_flag_error(bool(requires_grad)))  # eager's
        self._requires_grad_(x, requires_grad)

    def _sizes_read(self, func: Callable[..., Any], args: tuple) -> tuple:
        """`args` of a factory with each 0-dim integer tensor among its sizes read as eager reads it (`__index__`):
        answered where its value is known while tracing, refused naming the line otherwise."""

        def read(size: Any) -> Any:
            if isinstance(size, (tuple, list)) and not isinstance(size, torch.Size):
                return type(size)(read(item) for item in size)
            if type(size) is TensorProxy and size.dim() == 0 and not size.dtype.is_floating_point:
                found, value = self.known.read(T.__index__, self.functional.resolve(size))
                if not found:
                    raise DataDependentError(f"fulmen cannot trace {_describe(func)} with a size given as a tensor: "
                                             "eager reads its value, unknown while tracing; pass a Python int",
                                             self.builder.source)
                return value
            return size

        every = SIZED_FACTORIES[func]
        return tuple(read(a) if every or i == 0 else a for i, a in enumerate(args))

    def _known_ints(self, x: Any, what: str) -> list:
        """The values of the integer tensor `x` where they are known while tracing (known_values.py)."""
        if type(x) is not TensorProxy:  # a captured tensor, read as eager reads it
            with torch._C.DisableTorchFunction():
                return x.tolist()
        found, values = self.known.read(T.tolist, self.functional.resolve(x))
        if not found:
            raise DataDependentError(
                f"fulmen cannot trace {what}: the packed sequence's shape depends on the lengths' values, unknown "
                f"while tracing (a tensor of shape {tuple(x.shape)}); pass the lengths as a Python list (a trace for "
                "each list of lengths), or pack outside the jitted function", self.builder.source)
        return values

    def _pack_padded_sequence(self, input: Any, lengths: Any, batch_first: bool) -> Any:
        values = self._known_ints(lengths, "pack_padded_sequence")
        with self:
            return recurrent.pack_padded(input, values, batch_first)

    def _pad_packed_sequence(self, data: Any, batch_sizes: Any, batch_first: bool, padding_value: float,
                             total_length: int) -> Any:
        values = self._known_ints(batch_sizes, "pad_packed_sequence")
        with self:
            return recurrent.pad_packed(data, values, batch_first, padding_value, total_length)

    def _retain_grad(self, x: torch.Tensor) -> None:
        """Eager keeps the grad of `x` after backward: the call does it on the tensor it returns for `x`, if any (one
        that does not leave the program cannot be looked at)."""
        if type(x) is not TensorProxy:  # a real tensor the program captured: its own, as eager's call
            with torch._C.DisableTorchFunction():
                T.retain_grad(x)
            return
        if not self._requires_grad(x):
            raise RuntimeError("can't retain_grad on Tensor that has requires_grad=False")  # eager's error
        self.retained[id(x)] = x

    def _register_hook(self, x: torch.Tensor, hook: Callable[..., Any]) -> Any:
        if not is_fabric_backward_check(hook):
            raise UnsupportedOpError("fulmen cannot trace Tensor.register_hook (a hook has no place in a trace); "
                                     "register it on the jitted function's output instead", self.builder.source)
        return None

    def _storage_offset(self, x: torch.Tensor) -> int:
        # a real tensor's offset (a captured tensor's, which its guard reads itself: value_checks.tensor_meta) leaves
        # the inputs' offsets free
        if isinstance(x, TensorProxy):
            self.reads_storage_offset = True
        with torch._C.DisableTorchFunction():
            return T.storage_offset(x)

    def _batch_norm(self, x: Any, running_mean: Any, running_var: Any, weight: Any = None, bias: Any = None,
                    training: bool = False, momentum: float | None = 0.1, eps: float = 1e-5) -> Any:
        """In training mode the running statistics are an in-place update: recorded functionally and written back
        once, so a backward that recomputes batch_norm leaves the buffers alone."""
        if not training or running_mean is None or running_var is None:
            return self._record(lookup(F.batch_norm).symbol,
                                (x, running_mean, running_var, weight, bias, training, momentum, eps), {})
        out, mean, var = self._record(batch_norm_update, (x, running_mean, running_var, weight, bias, momentum, eps),
                                      {})
        detach = lookup(torch.detach).symbol
        for stat, new in ((running_mean, mean), (running_var, var)):
            self._assign(self._proxy(stat), self._record(detach, (new,), {}), "batch_norm's running statistics")
        return out

    def _into(self, func: Callable[..., Any], out: Any, compute: Callable[[], Any]) -> Any:
        """`func(..., out=out)`: the result, computed out of place, copied into `out` (spectral_norm's power
        iteration writes its buffers so). Only where eager writes it as it stands: an `out` of the result's shape
        and dtype (eager would resize or convert it otherwise), outside autograd (where eager raises)."""
        what = f"the out= argument of {_describe(func)}"
        if not isinstance(out, torch.Tensor):
            raise UnsupportedOpError(f"fulmen supports {what} for a single tensor only", self.builder.source)
        result, target = compute(), self._proxy(out)
        if type(result) is not TensorProxy or result.requires_grad or target.requires_grad:
            raise UnsupportedOpError(f"fulmen supports {what} only for one result without grad (eager refuses "
                                     "out= under autograd); assign the result instead", self.builder.source)
        if tuple(result.shape) != tuple(target.shape) or result.dtype != target.dtype:
            raise UnsupportedOpError(f"fulmen supports {what} only where out has the result's shape and dtype "
                                     f"({result.type_string()}; out is {target.type_string()}): eager would resize "
                                     "or convert it; assign the result instead", self.builder.source)
        return self._copy_(out, result)

    def _copy_(self, dst: torch.Tensor, src: Any, non_blocking: bool = False) -> torch.Tensor:
        target = self._proxy(dst)
        self._refuse_order_dependent(target, src, "copy_")
        self.functional.write(target, shape.copy(self.functional.resolve(target), self._values(src)))
        return dst

    def _fill_(self, x: torch.Tensor, value: Any) -> torch.Tensor:
        target = self._proxy(x)
        self.functional.write(target, shape.fill(self.functional.resolve(target), self._values(value)))
        return x

    def _zero_(self, x: TensorProxy) -> TensorProxy:
        return self._fill_(x, 0)

    def _contiguous(self, x: TensorProxy, memory_format: torch.memory_format = torch.contiguous_format) -> Any:
        if self._values(x).meta.is_contiguous(memory_format=memory_format):
            return x  # eager returns the tensor itself
        kwargs = {} if memory_format is torch.contiguous_format else {"memory_format": memory_format}
        return self._record(lookup(T.contiguous).symbol, (x,), kwargs)

    def _flatten(self, x: TensorProxy, start_dim: Any = 0, end_dim: Any = -1) -> Any:
        if isinstance(start_dim, int) and isinstance(end_dim, int) and x.dim() > 0 and \
                start_dim % x.dim() == end_dim % x.dim():
            return x  # eager returns the tensor itself (a 1-D tensor's flatten()), so an update through it reaches x
        return self._record(lookup(torch.flatten).symbol, (x, start_dim, end_dim), {})

    def _to(self, x: TensorProxy, *args: Any, **kwargs: Any) -> Any:
        copy = kwargs.pop("copy", False)
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        return self._convert(x, device=device, dtype=dtype, copy=copy, memory_format=memory_format)

    def _type(self, x: TensorProxy, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None:  # the type's name: "torch.DoubleTensor", "torch.cuda.DoubleTensor"
            with torch._C.DisableTorchFunction():
                name = T.type(torch.empty(0, dtype=x.dtype))
            return name if x.device.type == "cpu" else name.replace("torch.", f"torch.{x.device.type}.", 1)
        if isinstance(dtype, torch.dtype):
            return self._convert(x, dtype=dtype)
        # A type's name ("torch.cuda.DoubleTensor") or class (torch.DoubleTensor): torch's parser reads it off an
        # empty tensor (its errors are eager's), and eager moves to the type's device only where the kind differs.
        with torch._C.DisableTorchFunction():
            typed = T.type(torch.empty(0), dtype)
        if typed.layout != torch.strided:
            raise UnsupportedOpError(f"fulmen cannot trace Tensor.type({dtype!r}): it makes a {typed.layout} tensor, "
                                     "and fulmen traces dense (strided) tensors only", self.builder.source)
        device = None if typed.device.type == x.device.type else torch.device(typed.device.type)
        return self._convert(x, device=device, dtype=typed.dtype)

    def _convert(
        self, x: TensorProxy, device: torch.device | None = None, dtype: torch.dtype | None = None, copy: bool = False,
        memory_format: torch.memory_format | None = None
    ) -> Any:
        current = self._values(x)  # a captured real tensor becomes a constant
        same_device = device is None or _same_device(torch.device(device), current.device)
        same_dtype = dtype is None or dtype == current.dtype
        if memory_format is torch.preserve_format:
            memory_format = None
        # eager's rule (aten's to_will_alias): the layout torch suggests for the tensor, not is_contiguous
        same_format = memory_format is None or suggest_memory_format(current.meta) == memory_format
        if same_device and same_dtype and same_format and not copy:
            return x  # eager returns the tensor itself, so later in-place updates alias it
        kwargs: dict[str, Any] = {}
        if not same_device:
            kwargs["device"] = torch.device(device)
        if not same_dtype:
            kwargs["dtype"] = dtype
        if copy:
            kwargs["copy"] = True
        if memory_format is not None:
            kwargs["memory_format"] = memory_format
        return SYMBOLS["torch.Tensor.to"](current, **kwargs)

