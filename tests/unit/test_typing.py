"""The public API as a typed program sees it: ``mypy --strict`` and pyright (strict) pass on
correct use (``tests/typing/usage.py``, with ``assert_type``; ``examples/``; the Python blocks
of README.md and of the docs) and catch every misuse of ``tests/typing/misuse.py`` (each one's
``type: ignore`` must be needed); and an installed package is visible to both from outside the
checkout."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="mypy (test extra)")

TYPING = Path(__file__).resolve().parent.parent / "typing"
ROOT = TYPING.parent.parent
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
CONTINUED = "# continued"


def _mypy_strict(*files: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable, "-m", "mypy", "--strict", "--warn-unused-ignores",
            "--no-incremental", "--follow-imports=silent", *map(str, files),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,  # ROOT: the package of this checkout, whatever is installed
    )  # fmt: skip


def _pyright(
    tmp: Path, *files: Path, checkout: bool = True, mode: str = "strict"
) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("pyright", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("pyright is not installed: pip install -e '.[test]'")
    config = {
        "typeCheckingMode": mode,
        # each misuse's `type: ignore` must be needed, as mypy's --warn-unused-ignores asks
        "reportUnnecessaryTypeIgnoreComment": "error",
        "pythonVersion": "3.10",
        # the package of this checkout first, whatever is installed
        "extraPaths": [str(ROOT)] if checkout else [],
    }
    (tmp / "pyrightconfig.json").write_text(json.dumps(config))
    return subprocess.run(
        # this interpreter's packages, also when its venv is not activated
        [
            exe,
            "-p",
            str(tmp / "pyrightconfig.json"),
            "--pythonpath",
            sys.executable,
            *map(str, files),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp,
    )


def python_programs(page: Path) -> list[str]:
    """A Markdown page's Python programs: each ```python block, with a block that starts with
    ``# continued`` appended to the one before it (the docs' convention, tests/docs)."""
    programs: list[str] = []
    for m in FENCE.finditer(page.read_text()):
        if m.group(1) != "python":
            continue
        code = m.group(2)
        if code.startswith(CONTINUED) and programs:
            programs[-1] += "\n" + code
        else:
            programs.append(code)
    return programs


def _documented_programs(tmp: Path) -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files = []
    for page in pages:
        stem = re.sub(r"\W", "_", str(page.relative_to(ROOT)))
        for i, code in enumerate(python_programs(page)):
            files.append(tmp / f"{stem}_{i}.py")
            files[-1].write_text(code)
    assert any("README" in f.name for f in files)
    return files


@pytest.mark.parametrize("program", ["usage.py", "misuse.py"])
def test_mypy_strict(program: str) -> None:
    done = _mypy_strict(TYPING / program)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_examples_and_the_documented_python_passes_mypy_strict(tmp_path: Path) -> None:
    files = _documented_programs(tmp_path)
    done = _mypy_strict(*files, *sorted((ROOT / "examples").glob("*.py")))
    assert done.returncode == 0, done.stdout + done.stderr


def test_pyright_strict_passes_on_use_and_catches_every_misuse(tmp_path: Path) -> None:
    done = _pyright(
        tmp_path, TYPING / "usage.py", TYPING / "misuse.py", *sorted(ROOT.glob("examples/*.py"))
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 errors" in done.stdout, done.stdout


def test_the_documented_python_passes_pyright(tmp_path: Path) -> None:
    # Standard mode: strict mode's "partially unknown" reports on numpy's own overloads say
    # nothing about this API (usage.py is checked strict for that).
    code = tmp_path / "code"
    code.mkdir()
    done = _pyright(tmp_path, *_documented_programs(code), mode="standard")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 errors" in done.stdout, done.stdout


def test_the_installed_package_is_visible_to_type_checkers_outside_the_checkout(
    tmp_path: Path,
) -> None:
    # An editable install made with an import hook (setuptools' default) is invisible to
    # mypy and pyright: they would see no llmdd_async at all, and check nothing of it.
    user = tmp_path / "user.py"
    user.write_text(
        "import llmdd_async as dd\n"
        "from typing_extensions import assert_type\n"
        "assert_type(dd.CacheDesc(2, [4], dd.DataType.DT_UINT8), dd.CacheDesc)\n"
    )
    done = _mypy_strict(user, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    done = _pyright(tmp_path, user, checkout=False)
    assert done.returncode == 0, done.stdout + done.stderr
