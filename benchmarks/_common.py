"""Shared helpers for the benchmarks: timing, machine limits measured in the same run, output."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def median_time(fn: Callable[[], Any], repeat: int) -> float:
    """Median wall time of ``fn()`` over ``repeat`` runs (after one warm-up run)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_gbps(nbytes: int, repeat: int = 5) -> float:
    """``numpy.copyto`` of ``nbytes`` into an already-touched destination (the memcpy limit)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    return nbytes / median_time(lambda: np.copyto(dst, src), repeat) / 1e9


def raw_socket_gbps(nbytes: int, repeat: int = 3, chunk: int = 4 << 20) -> float:
    """A raw blocking loopback TCP stream of ``nbytes`` (sender in a thread, receiver here)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    payload = memoryview(np.ones(chunk, np.uint8))
    sink = np.empty(nbytes, np.uint8)
    results = []
    for _ in range(repeat + 1):

        def send() -> None:
            with socket.create_connection(("127.0.0.1", port)) as s:
                left = nbytes
                while left:
                    n = min(chunk, left)
                    s.sendall(payload[:n])
                    left -= n

        t = threading.Thread(target=send)
        t.start()
        conn, _ = listener.accept()
        view = memoryview(sink)
        got = 0
        t0 = time.perf_counter()
        while got < nbytes:
            n = conn.recv_into(view[got:], min(nbytes - got, chunk))
            if n == 0:
                break
            got += n
        results.append(time.perf_counter() - t0)
        conn.close()
        t.join()
    listener.close()
    return nbytes / statistics.median(results[1:]) / 1e9


def print_table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "" if v is None else str(v)


def write_json(name: str, payload: dict[str, Any], path: str | None = None) -> Path:
    out = Path(path) if path else RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        **payload,
    }
    out.write_text(json.dumps(payload, indent=2))
    return out
