"""The machine's own limits, measured in the same run as a benchmark so results are ratios:
``numpy.copyto`` (memcpy) and a raw blocking loopback TCP stream between two processes."""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["median_time", "memcpy_gbps", "raw_socket_gbps"]


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


_SENDER = """
import socket, sys
import numpy as np
port, nbytes, repeat, chunk = map(int, sys.argv[1:])
payload = memoryview(np.ones(chunk, np.uint8))
for _ in range(repeat):
    with socket.create_connection(("127.0.0.1", port)) as s:
        left = nbytes
        while left:
            n = min(chunk, left)
            s.sendall(payload[:n])
            left -= n
"""


def raw_socket_gbps(nbytes: int, repeat: int = 3, chunk: int = 4 << 20) -> float:
    """A raw blocking loopback TCP stream of ``nbytes`` from another process into this one:
    the library's topology (two processes) with nothing but ``sendall`` and ``recv_into``."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    sink = np.empty(nbytes, np.uint8)
    sender = subprocess.Popen(
        [sys.executable, "-c", _SENDER, str(port), str(nbytes), str(repeat + 1), str(chunk)]
    )
    results = []
    try:
        for _ in range(repeat + 1):
            conn, _ = listener.accept()
            view = sink.data
            got = 0
            t0 = time.perf_counter()
            while got < nbytes:
                n = conn.recv_into(view[got:], min(nbytes - got, chunk))
                if n == 0:
                    break
                got += n
            results.append(time.perf_counter() - t0)
            conn.close()
    finally:
        sender.wait(timeout=60)
        listener.close()
    return nbytes / statistics.median(results[1:]) / 1e9
