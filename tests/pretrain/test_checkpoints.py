"""Pretraining loses nothing: a run killed (SIGKILL, a real subprocess) at any moment of a checkpoint save, with
out_dir on another filesystem than the temporary directory, resumes from the last complete checkpoint and reaches
the uninterrupted run's final loss exactly, leaving nothing behind; a truncated, emptied, bit-flipped or otherwise
damaged latest checkpoint is skipped with a message naming it and why; resuming refuses a checkpoint of another
model unless allowed. The sharded (DCP) writer is killed at the same moments."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path

import pytest
import torch

from fulmen.distributed import checkpoint, manifest
from fulmen.pretrain import cli

KILLER = Path(__file__).with_name("killed_save.py")
STEPS = 3
RUN = ["--compiler", "null", "--train.max_steps", str(STEPS), "--train.save_interval", "1",
       "--train.global_batch_size", "4", "--train.micro_batch_size", "4", "--train.max_seq_length", "32",
       "--train.lr_warmup_steps", "1", "--eval.interval", "0", "--eval.final_validation", "false",
       "--train.log_interval", "1"]


def second_filesystem() -> Path | None:
    """A writable directory on another device than the temporary directory (where Lightning's own writer stages
    checkpoints), so moving a file there would be a copy."""
    temp = os.stat(tempfile.gettempdir()).st_dev
    for candidate in ("/dev/shm", "/run/shm", os.environ.get("XDG_RUNTIME_DIR", "")):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK) \
                and os.stat(candidate).st_dev != temp:
            return Path(candidate)
    return None


@pytest.fixture
def elsewhere():
    root = second_filesystem()
    if root is None:
        pytest.skip(f"no writable directory on another filesystem than {tempfile.gettempdir()} (tried /dev/shm, "
                    "/run/shm, $XDG_RUNTIME_DIR)")
    directory = root / f"fulmen-test-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[list[float], Path]:
    """The run that is never killed, and its out_dir (a checkpoint after every step)."""
    out = tmp_path_factory.mktemp("whole")
    return cli.parse_and_run(["--out_dir", str(out), *RUN])["losses"], out


def resume(out: Path, capsys) -> tuple[dict, str]:
    result = cli.parse_and_run(["--out_dir", str(out), *RUN, "--resume", "auto"])
    return result, capsys.readouterr().out


@pytest.mark.parametrize("moment", ["data-half", "data-written", "manifest-before", "manifest-half"])
def test_a_run_killed_while_saving_resumes_from_the_last_complete_checkpoint(moment, elsewhere, tmp_path,
                                                                             uninterrupted, capsys):
    losses, _ = uninterrupted
    temp = tmp_path / "tmpdir"
    temp.mkdir()
    killed = subprocess.run([sys.executable, str(KILLER), moment, "2", "--", "--out_dir", str(elsewhere), *RUN],
                            env={**os.environ, "TMPDIR": str(temp)}, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert list(temp.iterdir()) == []  # nothing staged in the temporary directory
    partial = sorted(elsewhere.rglob(f"*{manifest.PARTIAL_MARK}*"))
    assert bool(partial) == (moment != "manifest-before"), partial  # (then the data is in place, unlisted)
    assert manifest.problem(elsewhere / "step-00000002" / "lit_model.pth") is not None
    result, printed = resume(elsewhere, capsys)
    assert f"resume: skipping {elsewhere / 'step-00000002'}: " in printed
    assert f"resume: from {elsewhere / 'step-00000001' / 'lit_model.pth'} (the newest complete checkpoint)" in printed
    assert ("removed what interrupted saves left: " + ", ".join(map(str, partial))) in printed or not partial
    assert result["losses"] == losses[1:]  # steps 2 and 3, bitwise the uninterrupted run's
    assert list(elsewhere.rglob(f"*{manifest.PARTIAL_MARK}*")) == []
    for step in ("step-00000002", "step-00000003", "final"):
        assert checkpoint.verify(elsewhere / step / "lit_model.pth"), step


def flip_a_bit_in_tensor_data(path: Path) -> None:
    """Flips one bit in the middle of the largest tensor's bytes (inside the zip record torch.save wrote)."""
    with zipfile.ZipFile(path) as archive:
        record = max((info for info in archive.infolist() if "/data/" in info.filename), key=lambda i: i.file_size)
        with open(path, "rb") as stream:  # the record's data follows its local header (30 bytes + name + extra)
            stream.seek(record.header_offset + 26)
            name_length, extra_length = (int.from_bytes(stream.read(2), "little") for _ in range(2))
        offset = record.header_offset + 30 + name_length + extra_length + record.file_size // 2
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "truncated": (truncate, "has {half} bytes, its manifest says {size} (truncated)"),
    "empty": (lambda p: p.write_bytes(b""), "has 0 bytes, its manifest says {size} (truncated)"),
    "bit-flipped": (flip_a_bit_in_tensor_data, "is damaged: bytes 0-{size} of {path} do not match the checksum"),
    "manifest-garbled": (lambda p: manifest.manifest_path(p).write_text("{not json"), "manifest.json is damaged"),
    "manifest-missing": (lambda p: manifest.manifest_path(p).unlink(), "has no manifest"),
    "deleted": (lambda p: p.unlink(), "is missing (its manifest is there)"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_latest_checkpoint_is_skipped_with_a_message(damage, tmp_path, uninterrupted, capsys):
    losses, whole = uninterrupted
    out = tmp_path / "run"
    shutil.copytree(whole, out)
    latest = out / f"step-{STEPS:08d}" / "lit_model.pth"
    size = latest.stat().st_size
    spoil, message = DAMAGE[damage]
    spoil(latest)
    result, printed = resume(out, capsys)
    expected = message.format(size=size, half=size // 2, path=latest)
    assert f"resume: skipping {latest.parent if damage != 'bit-flipped' else latest}: " in printed
    assert expected in printed, printed
    assert f"resume: from {out / f'step-{STEPS - 1:08d}' / 'lit_model.pth'}" in printed
    assert result["losses"] == losses[-1:]  # the last step again, exactly as the uninterrupted run took it
    assert checkpoint.verify(latest)  # and its checkpoint written anew


def test_a_flipped_bit_would_load_silently_without_the_manifest(tmp_path, uninterrupted):
    _, whole = uninterrupted
    path = tmp_path / "lit_model.pth"
    shutil.copy(whole / "final" / "lit_model.pth", path)
    shutil.copy(whole / "final" / "lit_model.pth.manifest.json", manifest.manifest_path(path))
    flip_a_bit_in_tensor_data(path)
    original = torch.load(whole / "final" / "lit_model.pth", weights_only=True)["model"]
    flipped = torch.load(path, weights_only=True)["model"]  # torch.load itself does not notice
    assert [k for k in original if not torch.equal(original[k], flipped[k])] != []
    with pytest.raises(checkpoint.CheckpointError, match="do not match the checksum saved with them"):
        checkpoint.verify(path)


@pytest.mark.parametrize(("key", "value", "saved"), [("parallel_residual", "true", False),
                                                     ("rotary_percentage", "0.5", 1.0)])
def test_resuming_another_model_is_refused_unless_allowed(key, value, saved, tmp_path, uninterrupted, capsys):
    losses, whole = uninterrupted
    out = tmp_path / "run"
    shutil.copytree(whole, out, ignore=shutil.ignore_patterns(f"step-{STEPS:08d}"))
    before = sorted(out.rglob("*"))
    argv = ["--out_dir", str(out), *RUN, "--resume", "auto", f"--model_config.{key}", value]
    with pytest.raises(ValueError, match=rf"is of another model than this run's:\n  {key}: checkpoint {saved}, "
                                         rf"this run {float(value) if key == 'rotary_percentage' else True}\n"):
        cli.parse_and_run(argv)
    assert sorted(out.rglob("*")) == before  # refused before anything was written
    result = cli.parse_and_run([*argv, "--allow_model_change", "true"])
    assert f"resume: {out / f'step-{STEPS - 1:08d}' / 'lit_model.pth'}'s model differs (allow_model_change): " \
           f"{key}" in capsys.readouterr().out
    assert len(result["losses"]) == 1 and result["losses"][0] != losses[-1]  # the same weights, another model


def test_sharded_checkpoints_killed_while_saving(tmp_path):
    for moment in ("data-written", "manifest-before", "manifest-half"):
        path = tmp_path / moment / "sharded"
        killed = subprocess.run([sys.executable, str(KILLER), "sharded", str(path), moment], capture_output=True,
                                text=True, timeout=300)
        assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
        assert "saving 2.0" in killed.stdout
        beside = sorted(p.name for p in path.parent.iterdir())
        if moment == "data-written":  # the previous checkpoint is whole and loads; the new one is a partial
            assert checkpoint.verify(path)
            assert torch.equal(checkpoint.read_sharded(path, {})["w"], torch.full((1000,), 1.0))
            assert any(name.startswith("sharded.partial-") for name in beside), beside
        else:  # the new data is in place without its manifest: refused, never mistaken for a checkpoint
            assert manifest.problem(path) == f"{path} has no manifest (sharded.manifest.json): its save was " \
                                             "interrupted"
        checkpoint.write_sharded({"w": torch.full((1000,), 3.0), "step": 3}, path)  # the next save cleans up
        assert sorted(p.name for p in path.parent.iterdir()) == ["sharded", "sharded.manifest.json"]
        assert checkpoint.verify(path) and checkpoint.read_sharded(path, {})["step"] == 3
