"""The README's fresh-machine commands and the declared dependency ranges, checked where CI runs them."""

import importlib.util
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands_module():
    spec = importlib.util.spec_from_file_location("readme_commands", ROOT / ".ci" / "readme_commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_holds_the_two_commands_ci_runs():
    main_job, tests = _readme_commands_module().readme_commands((ROOT / "README.md").read_text())
    # torch's CPU build first: a bare `torch` requirement would pull a CUDA build of several GB.
    assert main_job == "pip install torch==2.13.0 && pip install -e . && python -m fulmen.pretrain"
    assert tests == ('pip install torch==2.13.0 && pip install -e ".[test]" && '
                     'python -m pytest -q -n auto --maxprocesses 4 --dist loadfile tests')
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv" in ci and "readme_commands.py README.md" in ci and "pip check" in ci


@pytest.mark.parametrize(
    "readme, message",
    [
        ("# x\n", "no '## On a fresh machine'"),
        ("## On a fresh machine\n\n    pip install -e .\n", "exactly two"),
        ("## On a fresh machine\n\n    pytest\n\n    python -m fulmen.pretrain\n", "main job"),
    ],
)
def test_readme_commands_refuses_a_broken_section(readme, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _readme_commands_module().readme_commands(readme)


def _declared_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    return [Requirement(r) for r in [*project["dependencies"], *(r for extra in extras for r in extra)]]


def _probe_versions(*specifier_sets) -> set[Version]:
    """Every version either side names, and the next patch, minor and major releases after each."""
    versions = set()
    for specifiers in specifier_sets:
        for spec in specifiers:
            v = Version(spec.version.replace(".*", ""))
            major, minor, micro = (*v.release, 0, 0)[:3]
            versions |= {v, Version(f"{major}.{minor}.{micro + 1}"), Version(f"{major}.{minor + 1}"),
                         Version(f"{major + 1}.0"), Version(f"{major}.{max(minor - 1, 0)}")}
    return versions


# A range wider than litgpt's or lightning's for a shared package made pip's resolver give up on a fresh machine
# (jsonargparse[signatures]>=4.30 against litgpt's <=4.41): ours must admit nothing theirs refuses.
@pytest.mark.parametrize("upstream", ["litgpt", "lightning", "transformers"])
def test_declared_ranges_sit_inside_upstream_ranges(upstream):
    theirs = {}
    for text in metadata.requires(upstream) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            theirs[req.name.lower()] = req.specifier
    checked = 0
    for ours in _declared_requirements():
        if ours.name.lower() not in theirs or ours.name.lower() == upstream:
            continue
        theirs_spec = theirs[ours.name.lower()]
        probes = _probe_versions(ours.specifier, theirs_spec)
        wider = sorted(v for v in probes if v in ours.specifier and v not in theirs_spec)
        assert not wider, f"{ours} admits {wider[0]}, which {upstream} refuses ({ours.name}{theirs_spec})"
        checked += 1
    assert upstream == "transformers" or checked >= 2, f"no shared dependency with {upstream} was checked"


def test_installed_versions_meet_declared_ranges():
    for req in _declared_requirements():
        if req.marker is not None and not req.marker.evaluate({"extra": "test"}):
            continue
        try:
            installed = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            continue  # an optional extra this environment did not install
        assert req.specifier.contains(installed, prereleases=True), f"{req.name} {installed} is outside {req}"


def _source_files() -> set[str]:
    """What the wheel must hold: every module of fulmen/ and of the folders setup.py maps into fulmen, the corpus."""
    mapped = {"strategies": "fulmen/strategies", "pretrain": "fulmen/pretrain", "unsloth": "fulmen/unsloth",
              "liger": "fulmen/liger"}
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "fulmen").rglob("*.py")}
    for folder, package in mapped.items():
        files |= {f"{package}/{p.relative_to(ROOT / folder)}" for p in (ROOT / folder).rglob("*.py")}
    return {f for f in files if "__pycache__" not in f} | {"fulmen/pretrain/corpus.txt"}


def test_a_wheel_built_from_the_tree_holds_every_module(tmp_path):
    # An editable install reads the tree, so a package left out of the wheel shows only in a real install: a list
    # written by hand once omitted fulmen.dynamo, and `import fulmen` failed from every built wheel.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("fulmen-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        held = {name for name in archive.namelist() if ".dist-info/" not in name}
    missing = sorted(_source_files() - held)
    assert not missing, f"the wheel lacks {missing[:5]} ({len(missing)} files)"
