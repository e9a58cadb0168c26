"""NIXL's Python API and the parts of its agent's work that know nothing of links: loading
the API, the poller thread that waits on requests, the layout of a cache as NIXL descriptors,
and the chunks a grant is cut into (``nixl`` explains the design).
"""

from __future__ import annotations

import bisect
import contextlib
import importlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np

from .._enums import LLMStatusCode
from .._errors import LLMException
from .._memory import CancelToken
from . import TRANSPORTS
from ._runs import U64, cuts, merged_runs

__all__ = [
    "BACKOFF_MAX",
    "BACKOFF_MIN",
    "CHUNK_BYTES",
    "PREP_INLINE",
    "SMALL_BYTES",
    "U64",
    "WINDOW",
    "Chunk",
    "Layout",
    "Poller",
    "cuts",
    "find1",
    "index1",
    "load_api",
    "merged_runs",
    "skip_unusable_ib",
]

INSTALL_HINT = TRANSPORTS["nixl"].install_hint
#: NIXL's Python API: the meta package (``nixl``, picks the build for the CUDA it finds) or a
#: build installed on its own
_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
#: requests up to this many bytes are posted on the event loop (cma copies inline in the post)
SMALL_BYTES = 1 << 20
#: bulk requests are posted in chunks of at most this many bytes, this many in flight
CHUNK_BYTES = 8 << 20
WINDOW = 4
#: prepared lists with more descriptors than this are made in a worker thread
PREP_INLINE = 4096
#: poller backoff bounds (seconds)
BACKOFF_MIN = 10e-6
BACKOFF_MAX = 1e-3
#: without NIXL's progress thread (it spins a core per agent) the poller progresses the agent:
#: every ``_IDLE_S`` when idle (connection setup, keepalive, one-sided pulls of the peer over
#: UCX tcp), as fast as the backoff allows
#: for ``_BUSY_S`` after this side granted a NIXL request (UCX tcp needs the target to progress)
_IDLE_S = 1e-3
_BUSY_S = 2.0

_api: Any = None
_api_lock = threading.Lock()


def load_api() -> Any:
    """NIXL's ``_api`` module, imported once.

    NIXL configures its ``nixl`` logger to print INFO lines to stdout and resets
    ``logging.raiseExceptions`` on import; this library's processes use stdout for their own
    protocol, so the logger is sent to stderr at WARNING (unless ``NIXL_LOG_LEVEL`` is set) and
    ``logging.raiseExceptions`` is restored.

    Raises:
        LLMException: LLM_PARAM_INVALID when NIXL is not installed, naming the install line.
    """
    global _api
    with _api_lock:
        if _api is not None:
            return _api
        errors = []
        saved = logging.raiseExceptions
        try:
            for name in _MODULES:
                try:
                    _api = importlib.import_module(name)
                    break
                except ImportError as exc:
                    errors.append(f"{name}: {exc}")
        finally:
            logging.raiseExceptions = saved
        if _api is None:
            raise LLMException(
                "llm.Transport=nixl needs NIXL, which is not importable here "
                f"({'; '.join(errors)}); install it with: {INSTALL_HINT}",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        nixl_log = logging.getLogger("nixl")
        if not os.environ.get("NIXL_LOG_LEVEL"):
            nixl_log.setLevel(logging.WARNING)
        for h in nixl_log.handlers:
            if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout:
                h.setStream(sys.stderr)
        return _api


def skip_unusable_ib() -> bool:
    """On a host without InfiniBand devices, keep UCX from loading its ``ib`` module: NIXL's
    wheels bundle a libnl-route whose destructor crashes the process at exit (SIGSEGV in
    ``rtnl_tc_unregister``) once that module was loaded, and without devices it drives nothing.
    Sets ``UCX_MODULES=^ib`` only when ``UCX_MODULES`` is unset; returns True if it did."""
    if "UCX_MODULES" in os.environ:
        return False
    with contextlib.suppress(OSError):
        if os.listdir("/sys/class/infiniband"):
            return False
    os.environ["UCX_MODULES"] = "^ib"
    return True


def _loop_caller() -> Callable[[Callable[[], None]], None]:
    """A function any thread may call to run a callback soon on the current event loop,
    without waiting for it (asyncio's ``call_soon_threadsafe``, trio's ``run_sync_soon``)."""
    current_token = getattr(anyio.lowlevel, "current_token", None)
    if current_token is not None:  # anyio >= 4.11
        native: Any = current_token().native_token
    else:  # older anyio: the running loop's own handle
        import sniffio

        if sniffio.current_async_library() == "trio":
            import trio

            native = trio.lowlevel.current_trio_token()
        else:
            import asyncio

            native = asyncio.get_running_loop()
    call = getattr(native, "call_soon_threadsafe", None) or native.run_sync_soon

    def soon(fn: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            call(fn)

    return soon


def _expand(first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """``[first[i], first[i] + count[i])`` for every i, concatenated (int32 indices)."""
    total = int(count.sum())
    base = np.repeat(first - (np.cumsum(count) - count), count)
    return (base + np.arange(total, dtype=np.int64)).astype(np.int32)


class Layout:
    """Where the tensors of one cache lie, and its prepared descriptor list (made lazily)."""

    def __init__(
        self, cache_id: int, addrs: np.ndarray, tensor_bytes: int, count: int, mem: str, dev: int
    ) -> None:
        self.cache_id = cache_id
        self.addrs = np.asarray(addrs, dtype=U64)
        self.tensor_bytes = int(tensor_bytes)
        self.count = max(1, int(count))
        self.unit = self.tensor_bytes // self.count
        self.mem = mem
        self.dev = int(dev)
        order = np.argsort(self.addrs, kind="stable")
        self.starts = self.addrs[order]
        self.tensor_of = order.astype(np.int64)
        self.starts_list = [int(a) for a in self.starts]
        self.tensor_list = [int(t) for t in self.tensor_of]
        self.prepped: Any = None
        self.reg: Any = None  # our own caches: the registration descriptor list

    def rows(self) -> np.ndarray:
        """One ``(addr, unit, dev)`` row per unit of every tensor, tensor-major."""
        n, c = len(self.addrs), self.count
        out = np.empty((n * c, 3), dtype=U64)
        out[:, 0] = (
            self.addrs[:, None] + np.arange(c, dtype=U64)[None, :] * U64(self.unit)
        ).reshape(-1)
        out[:, 1] = self.unit
        out[:, 2] = self.dev
        return out

    def indices(self, addrs: np.ndarray, nbytes: np.ndarray) -> np.ndarray | None:
        """Unit indices covering these ranges (all inside this cache), or None when some
        range is not made of whole units."""
        if self.unit <= 0:
            return None
        a = np.asarray(addrs, dtype=U64)
        n = np.asarray(nbytes, dtype=np.int64)
        j = np.searchsorted(self.starts, a, side="right").astype(np.int64) - 1
        if len(j) == 0 or int(j.min()) < 0:
            return None
        off = (a - self.starts[j]).astype(np.int64)
        unit = self.unit
        if (
            np.any(off % unit)
            or np.any(n % unit)
            or np.any(n <= 0)
            or np.any(off + n > unit * self.count)
        ):
            return None
        return _expand(self.tensor_of[j] * self.count + off // unit, n // unit)


def index1(lay: Layout, addr: int, nbytes: int) -> int | None:
    """:meth:`Layout.indices` of one range, in plain integers: the first unit, or None."""
    j = bisect.bisect_right(lay.starts_list, addr) - 1
    unit = lay.unit
    if j < 0 or unit <= 0 or nbytes <= 0:
        return None
    off = addr - lay.starts_list[j]
    if off % unit or nbytes % unit or off + nbytes > unit * lay.count:
        return None
    return lay.tensor_list[j] * lay.count + off // unit


def find1(starts: list[int], ends: list[int], ids: list[int], addr: int, nbytes: int) -> int:
    """The id of the region holding ``[addr, addr + nbytes)``, or -1."""
    j = bisect.bisect_right(starts, addr) - 1
    if j < 0 or nbytes <= 0 or addr + nbytes > ends[j]:
        return -1
    return ids[j]


class _Wait:
    __slots__ = ("event", "handle", "state", "token")

    def __init__(self, handle: Any, token: CancelToken | None) -> None:
        self.handle = handle
        self.token = token
        self.event = anyio.Event()
        self.state = "PROC"


class Poller:
    """One thread per agent that checks in-flight requests with backoff and wakes the loop
    when one finished (or its token tripped): the loop never spins on NIXL."""

    def __init__(self, check: Callable[[Any], str], progress: Callable[[], None]) -> None:
        self._check = check
        self._progress = progress
        self._cv = threading.Condition()
        self._items: list[tuple[_Wait, Callable[[Callable[[], None]], None]]] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        self._busy_until = 0.0

    def start(self) -> None:
        with self._cv:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._run, name="llmdd-nixl-poll", daemon=True
                )
                self._thread.start()

    def busy(self) -> None:
        """This side granted a NIXL request: progress the agent quickly for a while."""
        until = time.monotonic() + _BUSY_S
        if until - self._busy_until > 0.1:  # not on every grant: the lock is not free
            with self._cv:
                self._busy_until = until
                self._cv.notify()

    async def wait(self, handle: Any, token: CancelToken | None) -> str:
        """Wait (on the loop) until ``handle`` is no longer in progress, or ``token`` tripped
        (then ``"CANCELLED"``, the request still in flight). Returns NIXL's final state."""
        w = _Wait(handle, token)
        soon = _loop_caller()
        with self._cv:
            if self._closed:
                return "ERR"
            self._items.append((w, soon))
            self._cv.notify()
        try:
            await w.event.wait()
        finally:
            with self._cv:
                self._items = [(x, s) for x, s in self._items if x is not w]
        return w.state

    def _run(self) -> None:
        delay = 0.0
        while True:
            with self._cv:
                while not self._items and not self._closed:
                    busy = time.monotonic() < self._busy_until
                    with contextlib.suppress(Exception):
                        self._progress()
                    if busy:
                        delay = min(max(delay * 2, BACKOFF_MIN), BACKOFF_MAX)
                        self._cv.wait(delay)
                    else:
                        self._cv.wait(_IDLE_S)
                        delay = 0.0
                if self._closed:
                    items, self._items = self._items, []
                    for w, soon in items:
                        w.state = "ERR"
                        soon(w.event.set)
                    return
                items = list(self._items)
            finished = []
            for w, soon in items:
                state = self._check(w.handle)
                if state == "PROC" and w.token is not None and w.token.cancelled:
                    state = "CANCELLED"
                if state != "PROC":
                    w.state = state
                    finished.append((w, soon))
            if finished:
                gone = {id(w) for w, _ in finished}
                with self._cv:
                    self._items = [(x, s) for x, s in self._items if id(x) not in gone]
                for w, soon in finished:
                    soon(w.event.set)
                delay = 0.0
                continue
            delay = min(max(delay * 2, BACKOFF_MIN), BACKOFF_MAX)
            with self._cv:
                if not self._closed:
                    self._cv.wait(delay)

    def close(self) -> None:
        """Stop the thread and wait for it (it must not call into an agent being dropped)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)


class Chunk:
    """One NIXL request to make: prepared (unit indices) or from explicit descriptors."""

    __slots__ = ("args", "nbytes", "prepped")

    def __init__(self, prepped: bool, args: tuple[Any, ...], nbytes: int) -> None:
        self.prepped = prepped
        self.args = args
        self.nbytes = nbytes

    def make(self, agent: Any, op: str) -> Any:
        if self.prepped:
            lh, li, rh, ri = self.args
            return agent.make_prepped_xfer(op, lh, li, rh, ri)
        lrows, lmem, rrows, rmem, peer = self.args
        return agent.initialize_xfer(
            op, agent.get_xfer_descs(lrows, lmem), agent.get_xfer_descs(rrows, rmem), peer
        )
