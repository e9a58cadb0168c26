"""The machine's own limits, measured in the same run as a benchmark so results are ratios:
``numpy.copyto`` (memcpy), a raw blocking loopback TCP stream between two processes, and a
raw blocking request/response between two processes (the floor of one small request); and
how much memory a run may take."""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

__all__ = [
    "MEMORY_FRACTION",
    "available_memory",
    "median_time",
    "memcpy_gbps",
    "raw_rpc_us",
    "raw_socket_gbps",
]

#: the most of the machine's available memory a bench run takes (both processes, all buffers)
MEMORY_FRACTION = 0.5


def available_memory() -> int:
    """Bytes of memory the kernel says are available now (``MemAvailable``; free pages where
    that is not known)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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


def _two_cpus() -> tuple[int, int]:
    """Two CPUs this thread may run on, of different cores where sysfs names the siblings
    (the last ones: the first CPU takes most interrupts); ``(-1, -1)`` with fewer than two."""
    if not hasattr(os, "sched_getaffinity"):
        return -1, -1
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return -1, -1
    first = cpus[-1]
    try:
        with open(f"/sys/devices/system/cpu/cpu{first}/topology/thread_siblings_list") as f:
            text = f.read()
        siblings = {int(x) for part in text.strip().split(",") for x in _span(part)}
    except (OSError, ValueError):
        siblings = {first}
    others = [c for c in reversed(cpus) if c not in siblings] or [c for c in cpus if c != first]
    return first, others[0]


def _span(part: str) -> range:
    lo, _, hi = part.partition("-")
    return range(int(lo), int(hi or lo) + 1)


@contextlib.contextmanager
def two_ends() -> Iterator[int]:
    """Run the calling thread on a CPU of its own for the block and yield another CPU for the
    other end of a request/response floor (``-1`` with fewer than two CPUs: nothing pinned),
    of a different core where sysfs says so; the thread's affinity is put back after. See
    :func:`raw_rpc_us` for why."""
    ours, theirs = _two_cpus()
    if ours < 0:
        yield -1
        return
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {ours})  # (this thread only)
    try:
        yield theirs
    finally:
        os.sched_setaffinity(0, saved)


_RPC_SERVER = """
import os, socket, sys
import numpy as np
port, size, cpu = map(int, sys.argv[1:])
if cpu >= 0 and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {cpu})
payload = memoryview(np.ones(size, np.uint8))
with socket.create_connection(("127.0.0.1", port)) as s:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        req = s.recv(8)
        if len(req) < 8:
            break
        s.sendall(payload)
"""


def raw_rpc_us(size: int, n: int = 500) -> tuple[float, float]:
    """A raw blocking request/response between two processes over loopback TCP (an 8-byte
    request, a ``size``-byte reply into a numpy buffer): p50 and p99 in microseconds, the
    floor of one request of that size.

    With two CPUs or more to run on (of different cores where the machine says so), each end
    runs on a CPU of its own, as two endpoints that each do real work run (and a prefill and a
    decode worker always do): left alone for a short run, the kernel keeps both on one CPU,
    where waking the other end needs no interrupt to an idle CPU (on this project's 2-vCPU VM
    23-25 us p50 for 64 KiB, against 57-63 us on two CPUs, which is also what
    ``rpc_floor.py`` finds once the kernel has spread them)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    view = np.empty(size, np.uint8).data
    lat = []
    with contextlib.closing(listener), two_ends() as theirs:
        child = subprocess.Popen(
            [sys.executable, "-c", _RPC_SERVER, str(port), str(size), str(theirs)]
        )
        try:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with conn:
                for i in range(n + 20):
                    t0 = time.perf_counter()
                    conn.sendall(b"\0" * 8)
                    got = 0
                    while got < size:
                        k = conn.recv_into(view[got:], size - got)
                        if k == 0:
                            raise RuntimeError("raw request/response: the server closed")
                        got += k
                    if i >= 20:  # warm-up
                        lat.append(time.perf_counter() - t0)
        finally:
            listener.close()  # (a child still connecting is refused, and ends)
            child.wait(timeout=30)
    lat.sort()
    return lat[len(lat) // 2] * 1e6, lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6
