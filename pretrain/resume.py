"""Which checkpoint a run resumes from: the newest complete one (its manifest present and its files the sizes it
lists; the checksums are compared when it loads), for a model that is the run's own."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from litgpt.config import Config

from fulmen.distributed import manifest
from fulmen.pretrain.settings import Settings, SettingsError

CHECKPOINT_FILE = "lit_model.pth"  # LitGPT's name; a directory for sharded FSDP checkpoints
CONFIG_FILE = "model_config.yaml"
STEP_DIR = re.compile(r"step-(\d+)")


@dataclass
class Resume:
    """The checkpoints to try, best first (the first that loads is taken), and what was skipped and why."""

    candidates: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    required: bool = False  # resume: True or a path: failing to load one is an error, not a fresh start


def step_dirs(out_dir: Path) -> list[Path]:
    """out_dir's `step-N` directories, newest first."""
    found = [(int(m.group(1)), d) for d in out_dir.glob("step-*") if (m := STEP_DIR.fullmatch(d.name)) and d.is_dir()]
    return [d for _, d in sorted(found, reverse=True)]


def plan(settings: Settings, config: Config) -> Resume:
    """Looks at out_dir (or the given path) without changing anything; refuses a checkpoint of another model."""
    resume = settings.resume
    if resume is False:
        return Resume()
    if resume is True or resume == "auto":
        found = Resume(required=resume is True)
        for directory in step_dirs(settings.out_dir):
            issue = manifest.problem(directory / CHECKPOINT_FILE)
            if issue is None:
                found.candidates.append(directory / CHECKPOINT_FILE)
            else:
                found.notes.append(f"resume: skipping {directory}: {issue}")
        if not found.candidates and resume is True:
            raise SettingsError(f"resume: True, but {settings.out_dir} holds no complete step-*/{CHECKPOINT_FILE}"
                                + "".join(f"\n  {note}" for note in found.notes)
                                + "\nuse resume: auto to start afresh when there is none")
    else:
        path = Path(resume)
        path = path / CHECKPOINT_FILE if (path / CHECKPOINT_FILE).exists() else path
        if not path.exists():
            raise SettingsError(f"resume: no checkpoint at {resume}")
        found = Resume([path], required=True)
        if manifest.read_manifest(path) is None:
            found.notes.append(f"resume: {path} has no manifest (written by another tool, or a save interrupted "
                               "right before its manifest): it loads unverified")
        elif (issue := manifest.problem(path)) is not None:
            raise manifest.CheckpointError(f"resume: {issue}")
    if found.candidates:
        found.notes += check_model(found.candidates[0], config, settings.allow_model_change)
    return found


def check_model(checkpoint: Path, config: Config, allow: bool) -> list[str]:
    """Refuses `checkpoint` when the model_config.yaml beside it is not `config`, naming the keys that differ;
    with `allow`, returns them as notes instead."""
    saved = checkpoint.parent / CONFIG_FILE
    if not saved.is_file():
        differences = [f"{saved} is missing, so the checkpoint's model is unknown"]
    else:
        try:
            theirs = dataclasses.asdict(Config.from_file(saved))
        except (yaml.YAMLError, ValueError, TypeError) as error:
            raise SettingsError(f"resume: {saved} cannot be read as a LitGPT Config ({error})") from None
        ours = dataclasses.asdict(config)
        differences = [f"{key}: checkpoint {theirs.get(key)!r}, this run {ours.get(key)!r}"
                       for key in sorted(set(theirs) | set(ours)) if theirs.get(key) != ours.get(key)]
    if not differences:
        return []
    if not allow:
        raise SettingsError(f"resume: the checkpoint {checkpoint} is of another model than this run's:\n  "
                            + "\n  ".join(differences)
                            + "\nresume with the same model_config (or model_name), or set allow_model_change: true to "
                              "load its weights into this model anyway")
    return [f"resume: {checkpoint}'s model differs (allow_model_change): " + "; ".join(differences)]


def remove_partials(out_dir: Path) -> list[Path]:
    """What interrupted saves left in out_dir, its step directories and final/, removed."""
    directories = [out_dir, out_dir / "final", *step_dirs(out_dir)]
    return [item for directory in directories for item in manifest.remove_partials(directory)]


def save_config(config: Config, directory: Path) -> None:
    """LitGPT's model_config.yaml, written so that it is either the previous file or the whole new one."""
    manifest.write_bytes(directory / CONFIG_FILE, yaml.dump(dataclasses.asdict(config)).encode())
