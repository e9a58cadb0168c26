"""``llmdd-async doctor``: every optional dependency reported ok, missing or broken, with the
fix; a module that imports and then fails (a torchvision of another torch build) is broken."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llmdd_async._doctor import _probe


def test_missing_broken_and_ok_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "llmdd_broken_mod.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n"
    )
    (tmp_path / "llmdd_uses_missing.py").write_text("import llmdd_not_there_either\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    missing = _probe("x", "llmdd_not_installed_mod", "x", "pip install x", None)
    assert (missing.state, missing.fix) == ("missing", "pip install x")
    broken = _probe("y", "llmdd_broken_mod", "y", "fix y", None)
    assert broken.state == "broken" and "torchvision::nms" in broken.detail
    # a module that is there but needs one that is not: broken, not missing
    assert _probe("z", "llmdd_uses_missing", "z", "fix z", None).state == "broken"

    def fails() -> object:
        raise ValueError("no device")

    assert _probe("w", "json", "w", "fix w", fails).state == "broken"
    ok = _probe("json", "json", "json", "never shown", None)
    assert ok.state == "ok" and ok.fix == ""


def test_the_command_lists_every_check() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "llmdd_async", "doctor"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    names = [line.split()[0] for line in done.stdout.splitlines() if not line.startswith(" ")]
    assert names == ["python", "uvloop", "trio", "torch", "vllm", "nixl", "mooncake", "matplotlib"]
    assert "python      ok" in done.stdout
    for line in done.stdout.splitlines():
        state = line.split()[1] if not line.startswith(" ") else None
        assert state in (None, "ok", "missing", "broken"), line
