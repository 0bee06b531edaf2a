"""NumPy data a program hands to torch (`torch.tensor(array)`, `torch.as_tensor`, `x[np.array([0, 2])]`): as eager.

An array becomes a trace input: `torch.from_numpy(array)`, a tensor sharing the array's memory, captured as any
real tensor the program reads is (acquire.Interpreter._constant), one per array object. Each call of the trace so
reads what the array holds then, as eager's conversion does, whatever its size; a new array in its place fails the
guard of the place it is read from (the observer's, by identity) or the cache key (an argument, by identity). What
eager copies (`torch.tensor`, an index) the trace copies from it; what eager shares (`torch.as_tensor` without a
conversion) the program gets as that input itself. A NumPy scalar is a number of its dtype (`torch.tensor(
np.float64(2))` is float64).

Memory torch does not own (a NumPy array's, also through the program's own `torch.from_numpy`, a buffer's through
`torch.frombuffer`, a file's through `torch.load(mmap=True)` or `torch.from_file`) comes to a trace as a real tensor:
one the caller holds, or one the program made during its first call, which the trace would keep writing into and
returning on every call where eager's program makes new memory. Which of the two cannot be told from the memory
(torch's own storage facts are the same: not resizable), so it is told from where the program got the tensor: a
module's global it did not assign during the call (observer.Observer.held_by_global), which the guard on that global
finds there again on every call, is the caller's, and the trace reads, updates and returns it as any tensor a global
holds. Any other (an array the acquisition converted, a tensor a call of the program made) is refused, naming the
line, where its memory matters: an in-place update, a returned tensor that shares it. For all of them a change of
the memory, after the program read it, by code fulmen does not see (NumPy's own operations) is refused: eager's later
reads would see it and the trace's would not.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.source import SourceLocation


def is_array(obj: Any) -> bool:
    kind = type(obj)
    return kind.__name__ == "ndarray" and kind.__module__ == "numpy"  # numpy is not imported unless the program does


def is_numpy_scalar(obj: Any) -> bool:
    """A NumPy scalar (np.float32(2.0)): what `array[i]` gives."""
    return type(obj).__module__ == "numpy" and hasattr(obj, "dtype") and not is_array(obj)


def scalar_dtype(obj: Any) -> torch.dtype:
    """The torch dtype of a NumPy scalar, as torch.tensor(np.float64(2)) has it."""
    return torch.from_numpy(obj.__array__().reshape(1)).dtype


@dataclass(frozen=True, slots=True)
class Conversion:
    """A call making a tensor of NumPy data: `torch.tensor`, `torch.as_tensor`, `Tensor.new_tensor`."""

    data: Any
    dtype: torch.dtype | None
    device: torch.device | str | None
    copy: bool  # eager copies (torch.tensor, new_tensor), or shares where no conversion is asked (as_tensor)


def conversion(func: Any, args: tuple, kwargs: dict[str, Any]) -> Conversion | None:
    """The conversion `func(*args, **kwargs)` asks for, where its data is NumPy's; None for other data, or for what
    the call's own path refuses (requires_grad=True)."""
    like = args[0] if func is torch.Tensor.new_tensor else None
    rest = args[1:] if like is not None else args
    data = rest[0] if rest else kwargs.get("data")
    if not (is_array(data) or is_numpy_scalar(data)) or kwargs.get("requires_grad"):
        return None
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    if like is not None:
        return Conversion(data, dtype or like.dtype, device or like.device, True)
    return Conversion(data, dtype, device, func is torch.tensor)


def external(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s memory is not torch's own allocation (a NumPy array's, a buffer's, a mapped file's,
    DLPack's): torch cannot resize it. Module tensors are never asked (only real tensors the program reads)."""
    return tensor.device.type == "cpu" and not tensor.untyped_storage().resizable()


@dataclass
class _Read:
    tensor: torch.Tensor
    proxy: TensorProxy
    snapshot: torch.Tensor  # what the memory held when the program first read it
    location: SourceLocation | None
    held: bool  # a global holds it (Arrays.held_by_caller): the caller's memory on every call, not the first call's


def _nothing_held(tensor: torch.Tensor) -> bool:
    return False


class Arrays:
    """The NumPy arrays one acquisition converted, and the real tensors of memory torch does not own it read."""

    def __init__(self) -> None:
        self._tensors: dict[int, tuple[Any, torch.Tensor]] = {}  # id(array) -> (array, its from_numpy tensor)
        self._reads: list[_Read] = []
        # Whether the caller holds a real tensor where each call's guards find it again (the driver sets it from its
        # observer; where none watches, as in fulmen.dynamo's graphs, nothing is known to be held)
        self.held_by_caller: Callable[[torch.Tensor], bool] = _nothing_held

    def tensor(self, array: Any) -> torch.Tensor:
        """The tensor sharing `array`'s memory (eager's own conversion, with its errors: negative strides, objects)."""
        found = self._tensors.get(id(array))
        if found is None:
            with warnings.catch_warnings():  # a read-only array: fulmen never writes into it (refuse_changes)
                warnings.simplefilter("ignore", UserWarning)
                found = self._tensors[id(array)] = (array, torch.from_numpy(array))
        return found[1]

    def read(self, tensor: torch.Tensor, proxy: TensorProxy, location: SourceLocation | None) -> None:
        """The program read the real `tensor`, captured as `proxy`: its memory is checked at the end if external."""
        with torch._C.DisableTorchFunction():  # outside __torch_function__ the acquisition mode would see these
            if external(tensor):
                self._reads.append(_Read(tensor, proxy, tensor.clone(), location, self.held_by_caller(tensor)))

    def hold(self, tensor: torch.Tensor) -> None:
        """The caller holds `tensor` where each call's guards find it again (an optimizer's parameters and state,
        which fulmen.jit.optimizer_steps guards by identity): its memory is each call's, whoever owns it."""
        for read in self._reads:
            if read.tensor is tensor:
                read.held = True

    def refuse_changes(self, written: Callable[[TensorProxy], bool],
                       written_at: Callable[[TensorProxy], SourceLocation | None]) -> None:
        """Once the program ran: an update of memory torch does not own and the caller does not hold
        (`written(proxy)`, at `written_at(proxy)`), or that memory changed since the program read it, is refused."""
        for read in self._reads:
            if written(read.proxy) and not read.held:
                raise TraceError(
                    f"fulmen cannot trace an in-place update of {_what(read)}: eager writes into that memory, "
                    "and a trace would write on every call into the memory of its first call. Copy it first "
                    "(torch.tensor(array)), keep it in a global (whose tensor each call updates), or update it "
                    "outside the jitted function", written_at(read.proxy))
            with torch._C.DisableTorchFunction():
                same = _same(read.tensor, read.snapshot)
            if not same:
                raise TraceError(
                    f"fulmen cannot trace a program that changes {_what(read)} after reading it, by code "
                    "fulmen does not see (NumPy's own operations): eager's later reads see the change, a trace's "
                    "would not. Convert a copy (torch.tensor(array)) after the change, or change it outside the "
                    "jitted function", read.location)

    def refuse_returned(self, values: list[Any], root: Callable[[TensorProxy], TensorProxy]) -> None:
        """A returned value (`root(value)`: what it is a view of) sharing memory torch does not own and the caller
        does not hold is refused."""
        shared = {id(read.proxy): read for read in self._reads if not read.held}
        for value in values:
            read = shared.get(id(root(value))) if type(value) is TensorProxy else None
            if read is not None:
                raise TraceError(
                    f"fulmen cannot return {_what(read)} (or a view of it): eager's result shares that "
                    "memory, and a trace would return the memory of its first call on every call. Return a copy "
                    "(torch.tensor(array), .clone())", read.location)


def _what(read: _Read) -> str:
    with torch._C.DisableTorchFunction():  # the acquisition mode would see the shape read
        shape = tuple(read.tensor.shape)
    how = "" if read.held else " that the program did not read from a global"
    return (f"a {read.tensor.dtype} tensor of shape {shape} sharing memory torch does not own (a NumPy array's: "
            "torch.from_numpy, torch.as_tensor; a buffer's: torch.frombuffer; a mapped file's: torch.from_file, "
            f"torch.load(mmap=True)){how}")


def _same(now: torch.Tensor, then: torch.Tensor) -> bool:
    if torch.equal(now, then):
        return True
    return bool(((now == then) | (now.isnan() & then.isnan())).all()) if now.is_floating_point() else False
