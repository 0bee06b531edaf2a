"""docs/ARCHITECTURE.md's examples run as written, each in a fresh interpreter (adding an op or an executor
registers it for the whole process), and assert their own results."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
BLOCKS = re.findall(r"^## (.+?)$|```python\n(.*?)```", DOC.read_text(), re.S | re.M)


def _examples() -> dict[str, str]:
    """The doc's python blocks by the heading they stand under."""
    examples, heading = {}, ""
    for title, code in BLOCKS:
        heading = title or heading
        if code:
            examples[heading] = code
    return examples


EXAMPLES = _examples()


def test_the_doc_shows_the_pipeline_and_how_to_add_an_op_an_executor_and_a_transform():
    assert set(EXAMPLES) == {"The pipeline and the traces it prints", "Adding an op", "Adding an executor",
                             "Adding a transform"}
    assert all(len(code.splitlines()) <= 30 for code in EXAMPLES.values())


@pytest.mark.parametrize("heading", sorted(EXAMPLES))
def test_example_runs(heading):
    done = subprocess.run([sys.executable, "-c", EXAMPLES[heading]], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert done.returncode == 0, done.stderr
