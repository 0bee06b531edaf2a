"""`python killed_save.py MOMENT SAVE -- <fulmen.pretrain arguments>`: runs the pretraining CLI in this process and
sends it SIGKILL (kill -9) at MOMENT of its SAVE-th checkpoint save (1-based). The moments, in the order a save
passes them:

    data-half        half of the checkpoint's bytes are in the file being written
    data-written     the data is complete and fsync'd, not yet renamed into place
    manifest-before  the data is in place, its manifest not yet written
    manifest-half    the manifest is written beside its place, not yet renamed into it

`sharded PATH MOMENT` writes two sharded (DCP) checkpoints of a small state at PATH with
`fulmen.distributed.checkpoint.write_sharded` and kills the second save at MOMENT instead (data-written: the DCP
files and meta.pt are complete in the partial directory; manifest-before, manifest-half as above).
"""

from __future__ import annotations

import io
import os
import signal
import sys
from pathlib import Path

import torch

from fulmen.distributed import checkpoint, manifest

CHECKPOINT_FILES = ("lit_model.pth", "sharded")


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class Trap:
    """Counts the saves of checkpoint data and kills the process at `moment` of save number `save`."""

    def __init__(self, moment: str, save: int) -> None:
        self.moment, self.save, self.seen = moment, save, 0
        self.real_save, self.real_replace, self.real_rename = torch.save, os.replace, Path.rename
        self.real_write_bytes, self.real_checksums = manifest.write_bytes, manifest.checksums

    @staticmethod
    def is_data(path: object) -> bool:
        name = Path(str(path)).name
        return any(name.startswith(f"{stem}{manifest.PARTIAL_MARK}") for stem in CHECKPOINT_FILES)

    def armed(self, moment: str) -> bool:
        return self.moment == moment and self.seen == self.save

    def torch_save(self, obj: object, target: object, *args: object, **kwargs: object) -> None:
        if not self.is_data(target):
            return self.real_save(obj, target, *args, **kwargs)
        self.seen += 1
        if not self.armed("data-half"):
            return self.real_save(obj, target, *args, **kwargs)
        buffer = io.BytesIO()
        self.real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        with open(target, "wb") as stream:
            stream.write(data[: len(data) // 2])
            stream.flush()
            os.fsync(stream.fileno())
        die()

    def checksums(self, root: Path, *args: object, **kwargs: object) -> manifest.Manifest:
        if self.is_data(root) and root.is_dir():  # a DCP directory: counted here, its data is complete now
            self.seen += 1
            if self.armed("data-written"):
                die()
        return self.real_checksums(root, *args, **kwargs)

    def replace(self, source: object, target: object) -> None:
        name = Path(str(source)).name
        if self.is_data(source) and self.armed("data-written"):
            die()
        if manifest.MANIFEST_SUFFIX + manifest.PARTIAL_MARK in name and self.armed("manifest-half"):
            die()
        self.real_replace(source, target)

    def write_bytes(self, path: Path, data: bytes) -> None:
        if path.name.endswith(manifest.MANIFEST_SUFFIX) and self.armed("manifest-before"):
            die()
        self.real_write_bytes(path, data)

    def install(self) -> None:
        torch.save = self.torch_save
        os.replace = self.replace
        manifest.write_bytes = self.write_bytes
        manifest.checksums = self.checksums


def sharded(path: Path, moment: str) -> None:
    Trap(moment, 2).install()
    for value in (1.0, 2.0):
        print(f"saving {value}", flush=True)
        checkpoint.write_sharded({"w": torch.full((1000,), value), "step": int(value)}, path)


def main() -> None:
    if sys.argv[1] == "sharded":
        sharded(Path(sys.argv[2]), sys.argv[3])
        return
    moment, save = sys.argv[1], int(sys.argv[2])
    Trap(moment, save).install()
    from fulmen.pretrain import cli

    cli.main(sys.argv[sys.argv.index("--") + 1:])


if __name__ == "__main__":
    main()
