"""Print the README's fresh-machine commands, one per line: `.ci/run` runs exactly these, so they cannot drift apart.

The section "## On a fresh machine" holds exactly two indented command lines: the first installs and runs the main
job, the second installs and runs the tests. Anything else there is an error, so a broken README fails CI.
"""

import sys
from pathlib import Path

SECTION = "## On a fresh machine"


def readme_commands(readme: str) -> list[str]:
    lines = readme.splitlines()
    if SECTION not in lines:
        raise ValueError(f"README.md has no {SECTION!r} section")
    start = lines.index(SECTION) + 1
    commands = []
    for line in lines[start:]:
        if line.startswith("## "):
            break
        if line.startswith("    ") and line.strip():
            commands.append(line.strip())
    if len(commands) != 2:
        raise ValueError(f"{SECTION!r} must hold exactly two indented commands (main job, tests); found {commands}")
    main_job, tests = commands
    if "fulmen.pretrain" not in main_job or "pytest" not in tests:
        raise ValueError(f"expected the main job (fulmen.pretrain) then the tests (pytest); found {commands}")
    return commands


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    print("\n".join(readme_commands(path.read_text())))
