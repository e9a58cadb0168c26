"""Every ```python block of the READMEs runs as written, each in its own process.

Rules: a block is a complete program, run with ``python``; a block whose first line is
``# test_NAME.py -- run with: pytest ARGS`` is a test module, saved as ``test_NAME.py`` and run
with ``python -m pytest ARGS``. Files that the READMEs name (``examples/*.py``,
``benchmarks/*.py``) must exist.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

ROOT = REPO
DOCS = [ROOT / "README.md", ROOT / "examples" / "README.md"]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
TEST_MODULE = re.compile(r"^# (test_\w+\.py) -- run with: pytest (.*)$")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number, code)`` of each ```python block of a markdown text."""
    return [
        (text.count("\n", 0, m.start()) + 1, m.group(2))
        for m in FENCE.finditer(text)
        if m.group(1) == "python"
    ]


BLOCKS = [
    pytest.param(code, id=f"{doc.relative_to(ROOT)}:{line}")
    for doc in DOCS
    for line, code in python_blocks(doc.read_text())
]


def run_block(code: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    """Run one block by the rules above, in ``workdir``."""
    header = TEST_MODULE.match(code.splitlines()[0])
    if header is not None:
        (workdir / header.group(1)).write_text(code)
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
        command += shlex.split(header.group(2))
    else:
        (workdir / "block.py").write_text(code)
        command = [sys.executable, "block.py"]
    return subprocess.run(
        command, cwd=workdir, capture_output=True, text=True, timeout=120, check=False
    )


def test_readme_has_python_blocks() -> None:
    assert len(python_blocks((ROOT / "README.md").read_text())) >= 4


@pytest.mark.parametrize("code", BLOCKS)
def test_python_block_runs(code: str, tmp_path: Path) -> None:
    out = run_block(code, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_named_files_exist() -> None:
    for doc in DOCS:
        for name in re.findall(r"\b(?:examples|benchmarks)/\w+\.py\b", doc.read_text()):
            assert (ROOT / name).is_file(), f"{doc.name} names {name}, which does not exist"
        for name in re.findall(r"^- `(\w+\.py)`", doc.read_text(), re.MULTILINE):
            assert (doc.parent / name).is_file(), f"{doc.name} lists {name}"
