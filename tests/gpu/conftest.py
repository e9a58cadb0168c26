"""GPU proof (issue 24): every test here runs on ``cuda`` (skipped without a CUDA device) and
on ``cpu`` (torch CPU tensors through the very same torch adapter code, so CI runs the logic
every day), against a torch peer in a second OS process.

Figures (throughput, latency) are recorded with the ``figures`` fixture, printed at the end
and never asserted. With ``LLMDD_GPU_SUMMARY=path.json`` a JSON summary (environment, each
test's outcome, the figures) is written there when the session ends (``tests/gpu/run.sh``).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

try:
    import torch
except ImportError:  # the test modules skip themselves with a reason
    torch = None

HAVE_CUDA = bool(torch is not None and torch.cuda.is_available())

DEVICES = [
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not HAVE_CUDA, reason="no CUDA device here (torch.cuda.is_available() is False)"
        ),
        id="cuda",
    ),
    pytest.param("cpu", id="cpu"),
]

#: nodeid -> {"outcome", "duration_s", "message"?}
_OUTCOMES: dict[str, dict[str, Any]] = {}
#: nodeid -> {figure name: {"value", "unit"}}
_FIGURES: dict[str, dict[str, dict[str, Any]]] = {}
_STARTED = time.time()


@pytest.fixture(scope="session", params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """The torch device of both endpoints' caches: ``cuda`` or ``cpu``."""
    return str(request.param)


@pytest.fixture(scope="session")
def peer(device: str) -> Iterator[Any]:
    """A torch peer process on ``device`` (one per device for the whole session: starting
    torch costs seconds). Tests start and stop their own endpoints in it."""
    from gpu_kit import TorchPeer

    p = TorchPeer(device)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``figures(name, value, unit)`` records a figure of this test (printed, put in the
    summary, never asserted)."""

    def record(name: str, value: float, unit: str = "") -> None:
        _FIGURES.setdefault(request.node.nodeid, {})[name] = {"value": value, "unit": unit}
        request.node.user_properties.append((name, value))

    return record


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _OUTCOMES.setdefault(report.nodeid, {"outcome": "passed", "duration_s": 0.0})
    entry["duration_s"] = round(entry["duration_s"] + report.duration, 3)
    if report.passed:
        return
    if report.skipped:
        entry["outcome"] = "skipped"
        if isinstance(report.longrepr, tuple):  # (file, line, reason)
            entry["message"] = str(report.longrepr[2])
        return
    entry["outcome"] = "failed" if report.when == "call" else "error"
    entry["message"] = str(report.longrepr)[-4000:]


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "ci": os.environ.get("CI"),
    }
    if torch is not None:
        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
        env["cuda_available"] = HAVE_CUDA
        if HAVE_CUDA:
            env["cuda_device"] = torch.cuda.get_device_name(0)
            env["cuda_devices"] = torch.cuda.device_count()
    return env


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("LLMDD_GPU_SUMMARY")
    if not path:
        return
    counts: dict[str, int] = {}
    for entry in _OUTCOMES.values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    summary = {
        "exitstatus": int(exitstatus),
        "wall_s": round(time.time() - _STARTED, 1),
        "environment": _environment(),
        "counts": counts,
        "tests": _OUTCOMES,
        "figures": _FIGURES,
    }
    with open(path, "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _FIGURES:
        return
    terminalreporter.section("GPU proof figures (recorded, not asserted)")
    for nodeid, figs in _FIGURES.items():
        terminalreporter.write_line(nodeid.split("::", 1)[-1])
        for name, fig in figs.items():
            terminalreporter.write_line(f"    {name} = {fig['value']:.4g} {fig['unit']}")
