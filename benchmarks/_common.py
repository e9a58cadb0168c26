"""Shared helpers for the benchmarks: timing, machine limits measured in the same run, output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmdd_async._doctor import cpu_idle
from llmdd_async.bench.limits import median_time, memcpy_gbps, raw_socket_gbps

__all__ = ["median_time", "memcpy_gbps", "raw_socket_gbps"]

RESULTS = Path(__file__).resolve().parent / "results"


def print_table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = [max([len(c), *(len(_fmt(r.get(c))) for r in rows)]) for c in columns]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "" if v is None else str(v)


def parser(doc: str | None, name: str) -> argparse.ArgumentParser:
    """An argument parser whose help shows every option's default, with the ``--json`` option
    (default: ``benchmarks/results/<name>.json``)."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        default=str(RESULTS / f"{name}.json"),
        help="where to write the results (JSON)",
    )
    return p


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def csv_of(*choices: str) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated list of ``choices``."""

    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {', '.join(choices)}, got {text!r}"
            )
        return items

    return parse


def positive_floats(text: str) -> list[float]:
    """argparse type: a comma-separated list of numbers > 0."""
    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be > 0, got {text!r}")
    return values


def write_json(name: str, payload: dict[str, Any], path: str | None = None) -> Path:
    out = Path(path) if path else RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            # (how idle CPUs wait moves small requests' latency by a third on a VM)
            "cpu_idle": cpu_idle().detail,
        },
        **payload,
    }
    out.write_text(json.dumps(payload, indent=2))
    return out
