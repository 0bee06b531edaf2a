"""FulmenCheckpointIO: Lightning's `torch.save` checkpoints, written so that a kill never leaves a half-written one
where a checkpoint is expected, and checked on load.

    fabric = L.Fabric(devices=1, plugins=[FulmenCheckpointIO()])   # any Lightning strategy
    fabric.save("out/step-10/lit_model.pth", state)               # + lit_model.pth.manifest.json

Lightning's TorchCheckpointIO serialises into memory and writes through a temporary file in the system's temporary
directory; when that is another filesystem the final move is a copy, and a kill mid-copy leaves a truncated file at
the destination (and the temporary file behind). This plugin writes beside the destination, fsyncs, renames, and
writes a manifest last (see fulmen.distributed.manifest); loading checks the manifest first. ThunderDDPStrategy
and ThunderFSDPStrategy use it by default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH

from fulmen.distributed import manifest
from fulmen.distributed.checkpoint import missing_checkpoint, write_full


class FulmenCheckpointIO(TorchCheckpointIO):
    """`torch.save` files with a manifest; `load_checkpoint` raises `CheckpointError` for one that does not match
    its manifest, before reading it (a file without a manifest, written by another tool, loads unverified)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        write_full(checkpoint, path)

    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        path = Path(path)
        if not path.exists():
            raise missing_checkpoint(path)
        manifest.verify(path)
        return torch.load(path, map_location=map_location or "cpu", weights_only=weights_only)

    def remove_checkpoint(self, path: _PATH) -> None:
        path = Path(path)
        manifest.remove(manifest.manifest_path(path))
        manifest.remove(path)

