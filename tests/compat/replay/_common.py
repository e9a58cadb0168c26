"""What every replay shares: the process harness (:func:`run_replay`, :class:`Peer`) and
the memory helpers (deterministic contents, aligned and raw-address tensors, byte-exact
checks).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from llmdd_async.sync import (
    DataType,
    LLMStatusCode,
)

HOST = "127.0.0.1"
MiB = 1 << 20
BARRIER_TIMEOUT = 30.0
RECV_TIMEOUT = 30.0
#: the clients poll query_register_mem_status every second; the replays poll faster
POLL_S = 0.05

NP_TO_DT = {
    np.dtype(np.float16): DataType.DT_FLOAT16,
    np.dtype(np.float32): DataType.DT_FLOAT,
    np.dtype(np.int32): DataType.DT_INT32,
    np.dtype(np.int8): DataType.DT_INT8,
    np.dtype(np.int64): DataType.DT_INT64,
}


# ============================================================================ process harness
class Peer:
    """One replay process's view of the others: a shared barrier (the samples'
    ``dist.barrier()``) and inboxes (zmq / RPC / files of the real deployments)."""

    def __init__(self, name: str, barrier: Any, inboxes: dict[str, Any]) -> None:
        self.name = name
        self.barrier = barrier
        self.inboxes = inboxes

    def sync(self, timeout: float = BARRIER_TIMEOUT) -> None:
        self.barrier.wait(timeout)

    def send(self, to: str, message: Any) -> None:
        self.inboxes[to].put(message)

    def recv(self, timeout: float = RECV_TIMEOUT) -> Any:
        """The next message; gives up early once another process failed (barrier broken)."""
        end = time.monotonic() + timeout
        while True:
            try:
                return self.inboxes[self.name].get(timeout=0.2)
            except queue.Empty:
                if self.barrier.broken:
                    raise RuntimeError("another replay process failed") from None
                if time.monotonic() > end:
                    raise


def _child_main(fn: Callable[..., Any], peer: Peer, results: Any, kwargs: dict) -> None:
    try:
        data = fn(peer, **kwargs)
    except BaseException:
        results.put((peer.name, ("error", traceback.format_exc())))
        with contextlib.suppress(Exception):
            peer.barrier.abort()
        # A failed replay may leave threads blocked on its peer: leave at once (the result
        # is flushed first) instead of waiting for them in the interpreter's shutdown.
        results.close()
        results.join_thread()
        os._exit(1)
    results.put((peer.name, ("ok", data)))


def run_replay(
    roles: dict[str, tuple[Callable[..., Any], dict[str, Any]]], timeout: float = 60.0
) -> dict[str, Any]:
    """Run ``fn(peer, **kwargs)`` for every role in its own spawned process.

    Returns each role's returned data. Raises AssertionError with every child's traceback if
    a child raised, reported nothing within ``timeout`` seconds, did not exit afterwards, or
    exited with a non-zero code.
    """
    ctx = mp.get_context("spawn")
    names = list(roles)
    barrier = ctx.Barrier(len(names))
    inboxes = {n: ctx.Queue() for n in names}
    results = ctx.Queue()
    procs: dict[str, Any] = {}
    for n in names:
        fn, kwargs = roles[n]
        proc = ctx.Process(
            target=_child_main,
            args=(fn, Peer(n, barrier, inboxes), results, kwargs),
            name=f"replay-{n}",
            daemon=True,
        )
        proc.start()
        procs[n] = proc
    deadline = time.monotonic() + timeout
    outcomes: dict[str, tuple[str, Any]] = {}
    exited_at: dict[str, float] = {}
    try:
        while len(outcomes) < len(names) and time.monotonic() < deadline:
            try:
                name, outcome = results.get(timeout=0.2)
            except queue.Empty:
                now = time.monotonic()
                for n, proc in procs.items():
                    if (
                        n not in outcomes
                        and proc.exitcode is not None
                        and now - exited_at.setdefault(n, now) > 3.0
                    ):
                        outcomes[n] = ("error", f"exited ({proc.exitcode}) without a result")
                continue
            outcomes[name] = outcome
        for proc in procs.values():
            proc.join(max(1.0, min(15.0, deadline + 10.0 - time.monotonic())))
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    primary: list[str] = []
    secondary: list[str] = []
    for n in names:
        proc = procs[n]
        status, payload = outcomes.get(n, ("missing", None))
        if status == "missing":
            primary.append(f"--- {n}: no result within {timeout:.0f} s (killed)")
        elif status == "error":
            text = f"--- {n} raised:\n{payload}"
            (secondary if "BrokenBarrierError" in payload else primary).append(text)
        elif proc.exitcode != 0:
            primary.append(f"--- {n} returned but exited with code {proc.exitcode}")
    if primary or secondary:
        raise AssertionError("client replay failed\n" + "\n".join(primary + secondary))
    return {n: outcomes[n][1] for n in names}


# ============================================================================ memory helpers
def pattern(seed: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Deterministic contents: random bytes viewed as ``dtype`` (compare bytes, not values)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def aligned_zeros(shape: tuple[int, ...], dtype: Any, align: int = 2 * MiB) -> np.ndarray:
    """Zeroed memory starting on an ``align`` boundary (``aclrtMalloc(HUGE_ONLY)``-like)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def host_tensors(shape: Any, dtype: Any, addrs: list[int]) -> list[np.ndarray]:
    """Views of raw addresses, as ``torchair.llm_datadist.create_npu_tensors`` builds them."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    return [
        np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(int(a)))
        .view(dtype)
        .reshape(tuple(shape))
        for a in addrs
    ]


def assert_same(actual: np.ndarray, expected: np.ndarray, what: str) -> int:
    """Byte-exact comparison; returns the number of bytes compared."""
    a = np.ascontiguousarray(actual).reshape(-1).view(np.uint8)
    e = np.ascontiguousarray(expected).reshape(-1).view(np.uint8)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: {a.size} bytes received, {e.size} expected")
    diff = np.flatnonzero(a != e)
    if diff.size:
        raise AssertionError(
            f"{what}: {diff.size} of {a.size} bytes differ (first at byte {int(diff[0])})"
        )
    return int(a.size)


def check_ok(ret: Any, what: str) -> None:
    """The C++ client's check: anything but LLM_SUCCESS fails, logged as a hex code."""
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise AssertionError(f"{what} failed, ret = {int(ret):#x} ({ret!r})")


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)
