"""The ``llmdd-async`` command's conventions: ``--version``, plain-text help, and a missing
optional package refused in one line (exit 2) before anything starts."""

from __future__ import annotations

import subprocess
import sys

import llmdd_async

# NIXL hidden from this one process, as on a machine without it.
_WITHOUT_NIXL = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("nixl", "nixl_cu12", "nixl_cu13"):
            raise ModuleNotFoundError(name)
        return None
sys.meta_path.insert(0, Hide())
from llmdd_async._cli import main
sys.exit(main(sys.argv[1:]))
"""


def _cli(*args: str, without_nixl: bool = False) -> subprocess.CompletedProcess[str]:
    head = ["-c", _WITHOUT_NIXL] if without_nixl else ["-m", "llmdd_async"]
    return subprocess.run(
        [sys.executable, *head, *args], capture_output=True, text=True, timeout=120
    )


def test_version() -> None:
    done = _cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"llmdd-async {llmdd_async.__version__}"


def test_help_is_plain_text() -> None:
    for args in (("--help",), ("demo", "--help"), ("bench", "--help")):
        done = _cli(*args)
        assert done.returncode == 0, done.stderr
        assert "usage:" in done.stdout and "``" not in done.stdout, args


def test_a_missing_transport_is_one_line_with_the_fix() -> None:
    done = _cli("demo", "--transport", "nixl", without_nixl=True)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "nixl is not installed" in errors[0], done.stderr
    assert "pip install --no-deps nixl-cu12" in errors[0]


def test_the_version_is_written_once() -> None:
    from importlib.metadata import version

    assert version("llmdd-async") == llmdd_async.__version__  # pyproject reads it from there
