"""Measuring what a training step keeps in memory, the same way for eager and jitted code, on any device.

`SavedTensors` counts the tensors autograd saves for backward (through saved-tensor hooks, which see eager's
saved tensors and fulmen's alike). `PeakMemory` tracks the bytes of live tensor storages created inside its
block with a dispatch mode, so it needs no CUDA caching allocator: it works on CPU.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class SavedTensors:
    """Inside the block, records each distinct storage autograd saves for backward.

    `activation_bytes` leaves out storages that existed before the block (parameters, inputs), which saving
    does not keep alive any longer than their owners do.
    """

    def __init__(self, *existing: torch.Tensor) -> None:
        self.existing = {_storage_key(t) for t in existing}
        self.tensors: dict[int, tuple[tuple[int, ...], torch.dtype, int]] = {}  # storage -> shape, dtype, bytes
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self.tensors:
            self.tensors[key] = (tuple(tensor.shape), tensor.dtype, tensor.untyped_storage().nbytes())
        return tensor

    def __enter__(self) -> SavedTensors:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def total_bytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self.tensors.values())

    @property
    def activation_bytes(self) -> int:
        return sum(nbytes for key, (_, _, nbytes) in self.tensors.items() if key not in self.existing)


class PeakMemory(TorchDispatchMode):
    """The peak of the bytes held by storages allocated inside the block (and still alive at each op)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key not in self._live:
                    self._live[key] = (StorageWeakRef(storage), storage.nbytes())
        self._sweep()
        return out

    def _sweep(self) -> None:
        dead = [key for key, (ref, _) in self._live.items() if ref.expired()]
        for key in dead:
            del self._live[key]
        self.current = sum(nbytes for _, nbytes in self._live.values())
        self.peak = max(self.peak, self.current)
