"""``llmdd-async doctor``: every optional dependency reported ok, missing or broken, with the
fix; a module that imports and then fails (a torchvision of another torch build) is broken; a
VM whose idle CPUs halt at once (``haltpoll`` without polling) is slow, with the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llmdd_async._doctor import _probe, cpu_idle


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
    assert names == [
        "python", "uvloop", "trio", "torch", "vllm", "nixl", "mooncake", "matplotlib", "cpu-idle",
    ]  # fmt: skip
    assert "python      ok" in done.stdout
    for line in done.stdout.splitlines():
        state = line.split()[1] if not line.startswith(" ") else None
        assert state in (None, "ok", "missing", "broken", "slow"), line
    # This machine's own answer, read the way the check reads it.
    assert f"cpu-idle    {cpu_idle().state}" in done.stdout


def _sysfs(
    root: Path, driver: str | None, poll_ns: str | None, governor: str | None = "haltpoll"
) -> Path:
    d = root / "devices/system/cpu/cpuidle"
    d.mkdir(parents=True)
    if driver is not None:
        (d / "current_driver").write_text(driver + "\n")
    if governor is not None:
        (d / "current_governor_ro").write_text(governor + "\n")
    if poll_ns is not None:
        m = root / "module/haltpoll/parameters"
        m.mkdir(parents=True)
        (m / "guest_halt_poll_ns").write_text(poll_ns + "\n")
    return root


def test_a_vm_whose_idle_cpus_halt_at_once_is_slow_with_the_fix(tmp_path: Path) -> None:
    slow = cpu_idle(_sysfs(tmp_path / "a", "haltpoll", "0"))
    assert slow.state == "slow" and "guest_halt_poll_ns=0" in slow.detail
    assert "guest_halt_poll_ns" in slow.fix and "llm.BusyPoll" in slow.fix
    polls = cpu_idle(_sysfs(tmp_path / "b", "haltpoll", "200000"))
    assert (polls.state, polls.detail) == ("ok", "haltpoll, polls up to 200 us before halting")
    assert polls.fix == ""
    assert cpu_idle(_sysfs(tmp_path / "b2", "haltpoll", "500")).detail == (
        "haltpoll, polls up to 0.5 us before halting"
    )
    # Bare metal, or a VM with another driver: reported as it is, never slow.
    assert cpu_idle(_sysfs(tmp_path / "c", "intel_idle", None, "menu")).detail == (
        "cpuidle driver intel_idle, governor menu"
    )
    assert cpu_idle(tmp_path / "none").detail == "no cpuidle driver"
    # guest_halt_poll_ns is the haltpoll governor's: under another one it means nothing.
    menu = cpu_idle(_sysfs(tmp_path / "f", "haltpoll", "0", "menu"))
    assert (menu.state, menu.detail) == ("ok", "cpuidle driver haltpoll, governor menu")
    # Whatever cannot be read is not called slow on a guess.
    for name, poll, governor in (
        ("d", None, "haltpoll"),
        ("e", "junk", "haltpoll"),
        ("g", "0", None),
    ):
        assert cpu_idle(_sysfs(tmp_path / name, "haltpoll", poll, governor)).state == "ok"
    undecodable = _sysfs(tmp_path / "h", None, None)
    (undecodable / "devices/system/cpu/cpuidle/current_driver").write_bytes(b"\xff\xfe\n")
    assert cpu_idle(undecodable).detail == "no cpuidle driver"
