"""The public API as a typed program sees it: ``mypy --strict`` passes on correct use
(``tests/typing/usage.py``, with ``assert_type``; ``examples/``; README's Python blocks) and
catches every misuse of ``tests/typing/misuse.py`` (each one's ``type: ignore`` must be
needed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="mypy (test extra)")

TYPING = Path(__file__).resolve().parent.parent / "typing"
ROOT = TYPING.parent.parent
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def _mypy_strict(*files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable, "-m", "mypy", "--strict", "--warn-unused-ignores",
            "--no-incremental", "--follow-imports=silent", *map(str, files),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,  # the package of this checkout, whatever is installed
    )  # fmt: skip


@pytest.mark.parametrize("program", ["usage.py", "misuse.py"])
def test_mypy_strict(program: str) -> None:
    done = _mypy_strict(TYPING / program)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_examples_and_the_readmes_python_blocks_pass_mypy_strict(tmp_path: Path) -> None:
    blocks = [
        m.group(2)
        for m in FENCE.finditer((ROOT / "README.md").read_text())
        if m.group(1) == "python"
    ]
    assert blocks
    files = []
    for i, code in enumerate(blocks):
        files.append(tmp_path / f"readme_block_{i}.py")
        files[-1].write_text(code)
    done = _mypy_strict(*files, *sorted((ROOT / "examples").glob("*.py")))
    assert done.returncode == 0, done.stdout + done.stderr
