"""NIXL: one-sided READ/WRITE through NVIDIA's transfer engine (UCX underneath: RDMA verbs,
cma, shm, tcp, cuda_ipc), selected with ``llm.Transport=nixl`` on both endpoints.

Our control plane stays as it is: the peer resolves, plans, checks and grants every request
(``local`` mode), this side checks the grant against the peer's published table, and only then
posts NIXL transfers between the granted ranges. Deadlines, cancel fencing, per-link ordering
and layer-wise scheduling are the link's and the task's, exactly as for the other transports.

* **Registration.** One NIXL agent per endpoint (UCX backend, no listener, no etcd, and no NIXL
  progress thread: it polls UCX without pause, a core per agent; see ``_Poller``). Caches that
  are remote accessible, and only those, are registered with it when they are registered or
  allocated, and deregistered when their memory goes (unregister, deallocate, finalize). Host
  memory is ``DRAM``; CUDA tensors of the torch adapter are ``VRAM``. Other memory is not
  registered, and requests touching it move over the link's stream.
* **Metadata.** The agent's metadata (connection info and the registered regions, with their
  remote keys) is part of the cache table a linked peer fetches over the link (``TABLE``), so
  on a link keyed with ``llm.AuthKey`` it is covered by the link's frame MACs; it is never in
  the handshake (sent before the server proved the key). Peers learn newly registered caches
  by fetching the table again when a grant names memory they do not know.
* **Prepared lists.** Each cache (ours and each peer's) gets one prepared descriptor list of
  its units (blocks of a blocks cache, batch slots of a contiguous one) per tensor, made on
  first use; a request picks unit indices from them (``make_prepped_xfer``). Grants that are
  not unit-aligned (byte offsets, caches of different unit sizes) use descriptors made for the
  request (``initialize_xfer``).
* **Completion.** Small requests are posted on the loop and, unless already done, awaited
  through one poller thread per agent that checks ``check_xfer_state`` with backoff and wakes
  the loop (it also progresses UCX for the peer's one-sided requests, which UCX tcp needs).
  Large ones run in a worker thread, posted in chunks of at most ``_CHUNK_BYTES`` (``_WINDOW``
  in flight), so a cancel stops after the chunks in flight. Every request is granted by the
  owner of the cache, which pins it while NIXL moves its bytes.
* **Fencing.** Releasing a NIXL request that is still in flight does not stop UCX from moving
  its bytes (measured with UCX tcp: the whole transfer landed after ``release()`` returned).
  So a cancelled request stops posting and waits until every posted chunk is done before it
  returns; only then are handles released.
"""

from __future__ import annotations

import base64
import bisect
import collections
import contextlib
import importlib
import importlib.util
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np

from .._enums import LLMStatusCode
from .._errors import LLMException
from .._memory import CancelToken, CopyCancelled
from .._planner import check_within
from . import INSTALL_HINTS, installed

__all__ = ["INSTALL_HINT", "NixlAccess", "NixlEndpoint", "available", "load_api"]

INSTALL_HINT = INSTALL_HINTS["nixl"]
#: NIXL's Python API: the meta package (``nixl``, picks the build for the CUDA it finds) or a
#: build installed on its own
_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
#: requests up to this many bytes are posted on the event loop (cma copies inline in the post)
_SMALL_BYTES = 1 << 20
#: bulk requests are posted in chunks of at most this many bytes, this many in flight
_CHUNK_BYTES = 8 << 20
_WINDOW = 4
#: prepared lists with more descriptors than this are made in a worker thread
_PREP_INLINE = 4096
#: poller backoff bounds (seconds)
_BACKOFF_MIN = 10e-6
_BACKOFF_MAX = 1e-3
#: without NIXL's progress thread (it spins a core per agent) the poller progresses the agent:
#: every ``_IDLE_S`` when idle (connection setup, keepalive, one-sided pulls of the peer over
#: UCX tcp), as fast as the backoff allows
#: for ``_BUSY_S`` after this side granted a NIXL request (UCX tcp needs the target to progress)
_IDLE_S = 1e-3
_BUSY_S = 2.0
_U64 = np.uint64

_api: Any = None
_api_lock = threading.Lock()


def available() -> bool:
    """True if some NIXL Python package is installed (not imported; cheap)."""
    return installed("nixl")


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


def _skip_unusable_ib() -> bool:
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


class _Layout:
    """Where the tensors of one cache lie, and its prepared descriptor list (made lazily)."""

    def __init__(
        self, cache_id: int, addrs: np.ndarray, tensor_bytes: int, count: int, mem: str, dev: int
    ) -> None:
        self.cache_id = cache_id
        self.addrs = np.asarray(addrs, dtype=_U64)
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
        out = np.empty((n * c, 3), dtype=_U64)
        out[:, 0] = (
            self.addrs[:, None] + np.arange(c, dtype=_U64)[None, :] * _U64(self.unit)
        ).reshape(-1)
        out[:, 1] = self.unit
        out[:, 2] = self.dev
        return out

    def indices(self, addrs: np.ndarray, nbytes: np.ndarray) -> np.ndarray | None:
        """Unit indices covering these ranges (all inside this cache), or None when some
        range is not made of whole units."""
        if self.unit <= 0:
            return None
        a = np.asarray(addrs, dtype=_U64)
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


def _index1(lay: _Layout, addr: int, nbytes: int) -> int | None:
    """:meth:`_Layout.indices` of one range, in plain integers: the first unit, or None."""
    j = bisect.bisect_right(lay.starts_list, addr) - 1
    unit = lay.unit
    if j < 0 or unit <= 0 or nbytes <= 0:
        return None
    off = addr - lay.starts_list[j]
    if off % unit or nbytes % unit or off + nbytes > unit * lay.count:
        return None
    return lay.tensor_list[j] * lay.count + off // unit


def _find1(starts: list[int], ends: list[int], ids: list[int], addr: int, nbytes: int) -> int:
    """The id of the region holding ``[addr, addr + nbytes)``, or -1."""
    j = bisect.bisect_right(starts, addr) - 1
    if j < 0 or nbytes <= 0 or addr + nbytes > ends[j]:
        return -1
    return ids[j]


def _merged_runs(addrs: np.ndarray, size: int) -> np.ndarray:
    """``(start, len)`` rows of the tensors at ``addrs`` (``size`` bytes each), adjacent ones
    merged: what one cache registers."""
    s = np.sort(np.asarray(addrs, dtype=_U64))
    e = s + _U64(size)
    brk = np.flatnonzero(s[1:] != e[:-1]) + 1
    lo = s[np.concatenate(([0], brk))]
    hi = e[np.concatenate((brk - 1, [len(s) - 1]))]
    return np.stack([lo, hi - lo], axis=1)


class FenceLost(OSError):
    """Posted NIXL transfers did not finish within the stall timeout after a cancel or a
    failure: bytes may still land, so the link is failed (its UCX endpoints are dropped)."""


class _Wait:
    __slots__ = ("event", "handle", "state", "token")

    def __init__(self, handle: Any, token: CancelToken | None) -> None:
        self.handle = handle
        self.token = token
        self.event = anyio.Event()
        self.state = "PROC"


class _Poller:
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
                        delay = min(max(delay * 2, _BACKOFF_MIN), _BACKOFF_MAX)
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
            delay = min(max(delay * 2, _BACKOFF_MIN), _BACKOFF_MAX)
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


class NixlEndpoint:
    """The NIXL agent of one endpoint and the caches registered with it."""

    def __init__(self, api: Any, agent: Any, name: str, adapter: Any) -> None:
        self.api = api
        self.agent = agent
        self.name = name
        self.adapter = adapter
        self.caches: dict[int, _Layout] = {}
        #: bumped by every (de)registration: peers reload our metadata when it changed
        self.gen = 0
        self._md: tuple[int, str] | None = None
        self._starts = np.zeros(0, dtype=_U64)
        self._ends = np.zeros(0, dtype=_U64)
        self._ids = np.zeros(0, dtype=np.int64)
        #: the same three as Python lists, for one-range requests
        self.lists: tuple[list[int], list[int], list[int]] = ([], [], [])
        self.poller = _Poller(self.check, self._progress)
        self.poller.start()
        self.accesses: weakref.WeakSet[NixlAccess] = weakref.WeakSet()
        #: requests whose fence could not complete: never released (NIXL would free them while
        #: UCX may still move their bytes)
        self._leaked: list[Any] = []
        #: peers whose metadata is being dropped (a disconnect can block: never on the loop)
        self._removing: dict[str, threading.Thread] = {}
        #: accesses (links) that loaded each peer agent's metadata
        self._peer_refs: dict[str, int] = {}
        self.log: Any = None

    @classmethod
    async def start(cls, engine: Any) -> NixlEndpoint:
        """Create the agent (UCX backend; a worker thread: UCX takes ~0.5 s to start).

        Raises:
            LLMException: LLM_PARAM_INVALID without NIXL; LLM_FAILED when no UCX agent starts.
        """
        api = load_api()
        if _skip_unusable_ib():
            engine.log.info("nixl.ucx_modules", set="UCX_MODULES=^ib", reason="no InfiniBand here")
        name = (
            f"llmdd-{engine.cluster_id}-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
        )

        def make() -> Any:
            sync = getattr(api, "nixl_thread_sync_t", None)
            # No NIXL progress thread: it polls UCX without pause, a core per agent. Our
            # poller and transfer workers progress the agent instead (see ``_Poller``).
            kwargs: dict[str, Any] = {"enable_prog_thread": False, "backends": ["UCX"]}
            if sync is not None:
                # Worker threads, the poller and the loop all call into the agent.
                kwargs["sync_mode"] = sync.NIXL_THREAD_SYNC_STRICT
            return api.nixl_agent(name, api.nixl_agent_config(**kwargs))

        try:
            agent = await anyio.to_thread.run_sync(make)
        except Exception as exc:
            raise LLMException(
                f"cannot start a NIXL agent: {exc}", status_code=LLMStatusCode.LLM_FAILED
            ) from exc
        if "UCX" not in getattr(agent, "backends", {}):
            raise LLMException(
                "NIXL started without its UCX backend (plugin missing?)",
                status_code=LLMStatusCode.LLM_FAILED,
            )
        ep = cls(api, agent, name, engine.adapter)
        ep.log = engine.log
        return ep

    # ---------------------------------------------------------------- registration
    def _mem_of(self, addrs: np.ndarray) -> tuple[str, int] | None:
        """NIXL memory type and device of a cache's memory; None when NIXL cannot take it."""
        if self.adapter.host_addressable or not self.adapter.owns(addrs):
            return "DRAM", 0
        dev = getattr(self.adapter, "device", None)
        kind = getattr(dev, "type", None)
        if kind == "cpu":
            return "DRAM", 0
        if kind == "cuda":
            return "VRAM", int(getattr(dev, "index", None) or 0)
        return None

    def register(self, entry: Any) -> None:
        """Register a remote-accessible cache's memory with the agent (others: nothing).

        Raises:
            LLMException: LLM_FAILED when NIXL refuses the memory.
        """
        if not entry.remote_accessible or entry.cache_id in self.caches:
            return
        mem = self._mem_of(entry.addrs)
        if mem is None:
            return  # NIXL does not reach this memory: its requests move over the stream
        runs = _merged_runs(entry.addrs, entry.tensor_bytes)
        rows = np.empty((len(runs), 3), dtype=_U64)
        rows[:, :2] = runs
        rows[:, 2] = mem[1]
        try:
            reg = self.agent.register_memory(rows, mem[0])
        except Exception as exc:
            raise LLMException(
                f"NIXL could not register cache {entry.cache_id} ({mem[0]}): {exc}",
                status_code=LLMStatusCode.LLM_FAILED,
            ) from exc
        lay = _Layout(entry.cache_id, entry.addrs, entry.tensor_bytes, entry.count, *mem)
        lay.reg = reg
        self.caches[entry.cache_id] = lay
        self._changed()

    def deregister(self, entry: Any) -> None:
        """Deregister a cache whose memory goes (no request of ours uses it: it was pinned
        while any did). Never raises."""
        lay = self.caches.pop(entry.cache_id, None)
        if lay is None:
            return
        try:
            if lay.prepped is not None:
                lay.prepped.release()
            self.agent.deregister_memory(lay.reg)
        except Exception as exc:
            if self.log is not None:
                self.log.warning("nixl.deregister_failed", cache_id=entry.cache_id, error=str(exc))
        self._changed()

    def _changed(self) -> None:
        self.gen += 1
        self._md = None
        lays = list(self.caches.values())
        if not lays:
            self._starts = self._ends = np.zeros(0, dtype=_U64)
            self._ids = np.zeros(0, dtype=np.int64)
        else:
            starts = np.concatenate([lay.addrs for lay in lays])
            sizes = np.concatenate(
                [np.full(len(lay.addrs), lay.tensor_bytes, _U64) for lay in lays]
            )
            ids = np.concatenate([np.full(len(lay.addrs), lay.cache_id, np.int64) for lay in lays])
            order = np.argsort(starts, kind="stable")
            self._starts, self._ends, self._ids = starts[order], (starts + sizes)[order], ids[order]
        self.lists = (
            [int(a) for a in self._starts],
            [int(a) for a in self._ends],
            [int(c) for c in self._ids],
        )

    def covers(self, ranges: np.ndarray, nbytes: np.ndarray) -> bool:
        """True if every range lies in a tensor of a cache registered with the agent."""
        return check_within(ranges, nbytes, self._starts, self._ends)

    def layout_of(self, ranges: np.ndarray, nbytes: np.ndarray) -> _Layout | None:
        """The one registered cache holding all these ranges, or None."""
        if not len(ranges) or not self.covers(ranges, nbytes):
            return None
        j = np.searchsorted(self._starts, np.asarray(ranges, _U64), side="right") - 1
        ids = np.unique(self._ids[j])
        return self.caches.get(int(ids[0])) if len(ids) == 1 else None

    def registered(self, entry: Any) -> bool:
        return entry.cache_id in self.caches

    def table_entry(self) -> dict[str, Any]:
        """What peers need to reach our registered caches: agent name, metadata (regions and
        their remote keys; base64) and each cache's memory type."""
        if self._md is None or self._md[0] != self.gen:
            md = self.agent.get_agent_metadata()
            self._md = (self.gen, base64.b64encode(md).decode())
        return {
            "agent": self.name,
            "gen": self.gen,
            "md": self._md[1],
            "mem": {str(c): [lay.mem, lay.dev] for c, lay in self.caches.items()},
        }

    async def prepare(self, lay: _Layout, agent_name: str) -> Any:
        """The prepared descriptor list of ``lay`` (ours: ``agent_name=""``), made once.

        Raises:
            OSError: NIXL refused to prepare it.
        """
        if lay.prepped is None:
            rows = lay.rows()
            try:
                if len(rows) > _PREP_INLINE:
                    handle = await anyio.to_thread.run_sync(
                        self.agent.prep_xfer_dlist, agent_name, rows, lay.mem
                    )
                else:
                    handle = self.agent.prep_xfer_dlist(agent_name, rows, lay.mem)
            except Exception as exc:
                raise OSError(f"NIXL could not prepare cache {lay.cache_id}: {exc}") from exc
            if lay.prepped is None:
                lay.prepped = handle
            else:
                handle.release()
        return lay.prepped

    # ---------------------------------------------------------------- requests
    def _progress(self) -> None:
        """Let UCX make progress (this agent runs no progress thread of its own)."""
        self.agent.get_new_notifs()

    def check(self, handle: Any) -> str:
        """NIXL's state of a request: DONE, PROC or ERR (a disconnected peer is ERR)."""
        try:
            return str(self.agent.check_xfer_state(handle))
        except Exception:
            return "ERR"

    def make(self, chunk: _Chunk, op: str) -> Any:
        """A NIXL request for ``chunk``, or None when NIXL refuses to make one (its errors,
        e.g. a disconnected peer, are not ``OSError``s)."""
        try:
            return chunk.make(self.agent, op)
        except Exception:
            return None

    def post(self, handle: Any) -> str:
        try:
            return str(self.agent.transfer(handle))
        except Exception:
            return "ERR"

    def release(self, handle: Any) -> None:
        with contextlib.suppress(Exception):
            handle.release()

    def leak(self, handle: Any) -> None:
        self._leaked.append(handle)

    def pump(self, op: str, chunks: list[_Chunk], token: CancelToken, stall_s: float) -> int:
        """Post ``chunks`` (at most ``_WINDOW`` in flight) and wait for them, in a worker
        thread; returns bytes moved.

        Raises:
            CopyCancelled: ``token`` tripped; every chunk posted before is done (fenced).
            OSError: NIXL failed a chunk (peer gone, memory refused).
        """
        flight: collections.deque[tuple[Any, int]] = collections.deque()
        done = 0
        failed: str | None = None
        i = 0
        delay = 0.0
        stop_at: float | None = None
        try:
            while True:
                while (
                    i < len(chunks)
                    and len(flight) < _WINDOW
                    and failed is None
                    and not token.cancelled
                ):
                    c = chunks[i]
                    i += 1
                    handle = self.make(c, op)
                    if handle is None:
                        failed = "NIXL could not make a transfer (peer gone or memory refused)"
                        break
                    state = self.post(handle)
                    if state == "PROC":
                        flight.append((handle, c.nbytes))
                        continue
                    self.release(handle)
                    if state == "DONE":
                        done += c.nbytes
                    else:
                        failed = "NIXL could not post a transfer"
                if not flight:
                    break
                progressed = False
                for _ in range(len(flight)):
                    handle, n = flight.popleft()
                    state = self.check(handle)
                    if state == "PROC":
                        flight.append((handle, n))
                        continue
                    progressed = True
                    self.release(handle)
                    if state == "DONE":
                        done += n
                    elif failed is None:
                        failed = "NIXL failed a transfer (peer gone or memory refused)"
                if progressed:
                    delay = 0.0
                    continue
                if token.cancelled or failed is not None:
                    # Fencing: what is in flight must finish before we return; bounded.
                    now = time.monotonic()
                    stop_at = stop_at or now + stall_s
                    if now > stop_at:
                        for handle, _ in flight:
                            self.leak(handle)
                        flight.clear()
                        raise FenceLost(
                            "NIXL transfers did not finish after a cancel or failure; their "
                            "handles are kept (bytes may still land)"
                        )
                delay = min(max(delay * 2, _BACKOFF_MIN), _BACKOFF_MAX)
                time.sleep(delay)
        finally:
            for handle, _ in flight:  # only reached by an unexpected exception
                self.leak(handle)
        if failed is not None:
            raise OSError(failed)
        if token.cancelled and done < sum(c.nbytes for c in chunks):
            raise CopyCancelled
        return done

    async def run_small(self, op: str, chunk: _Chunk, token: CancelToken, stall_s: float) -> int:
        """Post one small request on the loop; await it through the poller unless it is done
        at once. Cancellation (token or scope) waits for the request to finish (fence).

        Raises:
            CopyCancelled: the token tripped. OSError: NIXL failed it.
        """
        if token.cancelled:
            raise CopyCancelled
        handle = self.make(chunk, op)
        if handle is None:
            raise OSError("NIXL could not make a transfer (peer gone or memory refused)")
        state = self.post(handle)
        try:
            if state == "PROC":
                state = await self.poller.wait(handle, token)
        finally:
            if state in ("PROC", "CANCELLED"):
                # Until the poller says otherwise the request is still in flight: a wait that
                # runs out must keep the handle (bytes may still land), never release it.
                state = "PROC"
                with anyio.CancelScope(shield=True):
                    with anyio.move_on_after(stall_s):
                        state = await self.poller.wait(handle, None)
                    if state == "PROC":
                        self.leak(handle)
                        raise FenceLost("a cancelled NIXL transfer did not finish (handle kept)")
                    if token.cancelled:
                        state = "CANCELLED"
            if state != "PROC":
                self.release(handle)
        if state == "DONE":
            return chunk.nbytes
        if state == "CANCELLED":
            raise CopyCancelled
        raise OSError("NIXL failed a transfer (peer gone or memory refused)")

    def forget_peer(self, name: str) -> None:
        """Give back one reference to a peer's metadata (:meth:`load_peer`); the last one
        drops it and disconnects, in a thread of its own (UCX may wait for the peer while it
        closes its endpoints). An old link closing after a new link to the same peer loaded
        it again therefore leaves the new one working. Never raises."""
        left = self._peer_refs.get(name, 0) - 1
        if left > 0:
            self._peer_refs[name] = left
            return
        self._peer_refs.pop(name, None)
        before = self._removing.get(name)

        def remove() -> None:
            if before is not None:
                before.join()
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(name)

        t = threading.Thread(target=remove, name="llmdd-nixl-forget", daemon=True)
        self._removing[name] = t
        t.start()

    async def load_peer(self, name: str, md: bytes, acquire: bool = True) -> str:
        """Load (or, ``acquire=False``, reload) a peer's metadata, after any pending drop of
        the same agent; returns the agent name NIXL knows it by. Each acquiring load is one
        reference, given back with :meth:`forget_peer`.

        Raises:
            OSError: NIXL refused the metadata.
        """
        if not self._peer_refs.get(name):
            pending = self._removing.pop(name, None)
            if pending is not None:
                await anyio.to_thread.run_sync(pending.join)
        if acquire:
            # The reference is taken before the load, not after it: an old link that gives
            # back its own reference meanwhile must not drop the agent this load brings back
            # (it would be the last one otherwise, and remove what we just added).
            self._peer_refs[name] = self._peer_refs.get(name, 0) + 1
        try:
            got = await anyio.to_thread.run_sync(self.agent.add_remote_agent, md)
        except BaseException as exc:
            if acquire:
                self.forget_peer(name)
            if isinstance(exc, Exception):
                raise OSError(f"NIXL refused the peer's metadata: {exc}") from exc
            raise
        agent = got.decode() if isinstance(got, bytes) else str(got)
        if acquire and agent != name:  # NIXL knows it by another name: move the reference
            left = self._peer_refs.get(name, 0) - 1
            if left > 0:
                self._peer_refs[name] = left
            else:
                self._peer_refs.pop(name, None)
            self._peer_refs[agent] = self._peer_refs.get(agent, 0) + 1
        return agent

    def new_access(self) -> NixlAccess:
        access = NixlAccess(self)
        self.accesses.add(access)
        return access

    def close(self) -> None:
        """Close every link's NIXL state, stop the poller and drop the agent (its caches were
        deregistered by the registry closing first). Never raises."""
        for access in list(self.accesses):
            access.close()
        self.poller.close()
        for t in list(self._removing.values()):
            t.join(5.0)  # disconnects must not outlive the agent (a crash at exit otherwise)
        self._removing.clear()
        for lay in list(self.caches.values()):
            with contextlib.suppress(Exception):
                if lay.prepped is not None:
                    lay.prepped.release()
                self.agent.deregister_memory(lay.reg)
        self.caches.clear()
        self._changed()


class _Chunk:
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


def _cuts(nbytes: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` descriptor ranges of at most ``limit`` bytes each (a bigger descriptor is
    a range of its own)."""
    csum = np.cumsum(nbytes, dtype=np.int64)
    out = []
    lo, base = 0, 0
    n = len(nbytes)
    while lo < n:
        hi = int(np.searchsorted(csum, base + limit, side="right"))
        hi = max(hi, lo + 1)
        out.append((lo, hi))
        base = int(csum[hi - 1])
        lo = hi
    return out


class NixlAccess:
    """Initiator-side access to a linked peer through NIXL (the :class:`PeerAccess` shape)."""

    name = "nixl"

    def __init__(self, ep: NixlEndpoint) -> None:
        self.ep = ep
        self.link: Any = None
        #: the peer's reachable regions (``Link.peer_regions``) once its table was fetched
        self.regions: tuple[np.ndarray, np.ndarray] = (
            np.zeros(0, dtype=_U64),
            np.zeros(0, dtype=_U64),
        )
        self.peer_agent: str | None = None
        self.peer_gen = -1
        self._remote: dict[int, _Layout] = {}
        self._starts = np.zeros(0, dtype=_U64)
        self._ends = np.zeros(0, dtype=_U64)
        self._ids = np.zeros(0, dtype=np.int64)
        self._lists: tuple[list[int], list[int], list[int]] = ([], [], [])
        self._refresh_lock = anyio.Lock()
        self._primed: anyio.Event | None = None
        #: prepared lists of the peer's caches that changed, kept until the link closes
        self._retired: list[Any] = []
        self.closed = False

    def attach(self, link: Any) -> None:
        """Bind to the link and start fetching the peer's metadata and connecting to it in
        the background (the first transfer then does not pay for it within its deadline)."""
        self.link = link
        self._primed = anyio.Event()
        link.engine.spawn(self._prime)

    async def _prime(self) -> None:
        assert self._primed is not None
        try:
            await self.refresh(max(10.0, self.link.engine.sync_kv_timeout_s))
            if self.peer_agent is not None:
                await anyio.to_thread.run_sync(self.ep.agent.make_connection, self.peer_agent)
        except Exception as exc:  # transfers fetch the metadata again and report failures
            self.link.log.info("nixl.prime_failed", reason=str(exc) or repr(exc))
        finally:
            self._primed.set()

    async def ready(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the background metadata fetch has finished."""
        if self._primed is not None:
            with anyio.move_on_after(timeout_s):
                await self._primed.wait()

    def caps(self) -> dict[str, bool]:
        return {"inproc": False, "pools": False, "pvr": False, "nixl": True}

    def caps_for(self, entry: Any) -> dict[str, bool]:
        """Caps of a request from ``entry``: NIXL only when that cache is registered with our
        agent (remote accessible); otherwise the request moves over the stream."""
        if self.ep.registered(entry):
            return self.caps()
        return {"inproc": False, "pools": False, "pvr": False}

    # ---------------------------------------------------------------- peer metadata
    async def refresh(self, timeout_s: float) -> None:
        """Fetch the peer's table over the link and load its NIXL metadata if it changed.

        Raises:
            OSError: no answer, or a table without usable NIXL metadata.
            LLMException: the link failed meanwhile.
        """
        from .._messages import regions_of_table
        from .._protocol import MT, Message

        async with self._refresh_lock:
            msg = await self.link.roundtrip(Message(MT.TABLE_REQ), MT.TABLE, timeout_s)
            if msg is None:
                raise OSError("the peer did not send its cache table in time")
            table = msg.fields
            nx = table.get("nixl")
            if not isinstance(nx, dict) or not isinstance(nx.get("md"), str):
                raise OSError("the peer publishes no NIXL metadata (is it llm.Transport=nixl?)")
            gen = nx.get("gen")
            if gen != self.peer_gen:
                try:
                    md = base64.b64decode(nx["md"], validate=True)
                except ValueError as exc:
                    raise OSError(f"malformed NIXL metadata: {exc}") from exc
                held = self.peer_agent is not None
                name = await self.ep.load_peer(str(nx.get("agent")), md, acquire=not held)
                if self.closed:
                    if not held:
                        self.ep.forget_peer(name)
                    raise OSError("the link closed")
                self.peer_agent = name
                self._load(table, nx.get("mem"))
                self.peer_gen = gen if isinstance(gen, int) else -1
            self.regions = regions_of_table(table)
            self.link.peer_regions = self.regions

    def _load(self, table: dict[str, Any], mem: Any) -> None:
        """The peer's NIXL-registered caches from its table; prepared lists of caches that
        changed are dropped."""
        mem = mem if isinstance(mem, dict) else {}
        fresh: dict[int, _Layout] = {}
        for c in table.get("caches") or []:
            try:
                cid = int(c["cache_id"])
                m = mem.get(str(cid))
                if not c.get("remote_accessible") or not isinstance(m, list) or len(m) != 2:
                    continue
                if m[0] not in ("DRAM", "VRAM"):
                    continue
                addrs = np.array([int(a) for a in c["addrs"]], dtype=_U64)
                tb, count = int(c["tensor_bytes"]), int(c["count"])
                if not len(addrs) or tb <= 0 or count <= 0:
                    continue
            except (KeyError, TypeError, ValueError, OverflowError):
                continue
            old = self._remote.get(cid)
            if (
                old is not None
                and old.tensor_bytes == tb
                and old.count == count
                and np.array_equal(old.addrs, addrs)
                and old.mem == m[0]
            ):
                fresh[cid] = old
                continue
            fresh[cid] = _Layout(cid, addrs, tb, count, str(m[0]), int(m[1]))
        for cid, old in self._remote.items():
            if fresh.get(cid) is not old and old.prepped is not None:
                # A request of this link may still use it: released when the link closes
                # (no request runs then).
                self._retired.append(old.prepped)
                old.prepped = None
        self._remote = fresh
        lays = list(fresh.values())
        if lays:
            starts = np.concatenate([lay.addrs for lay in lays])
            ends = starts + np.concatenate(
                [np.full(len(lay.addrs), lay.tensor_bytes, _U64) for lay in lays]
            )
            ids = np.concatenate([np.full(len(lay.addrs), lay.cache_id, np.int64) for lay in lays])
            order = np.argsort(starts, kind="stable")
            self._starts, self._ends, self._ids = starts[order], ends[order], ids[order]
        else:
            self._starts = self._ends = np.zeros(0, dtype=_U64)
            self._ids = np.zeros(0, dtype=np.int64)
        self._lists = (
            [int(a) for a in self._starts],
            [int(a) for a in self._ends],
            [int(c) for c in self._ids],
        )

    def _remote_groups(self, remote: np.ndarray) -> np.ndarray:
        j = np.searchsorted(self._starts, np.asarray(remote, _U64), side="right") - 1
        return self._ids[j]

    # ---------------------------------------------------------------- transfers
    async def read(
        self, remote: np.ndarray, local: np.ndarray, nbytes: np.ndarray, token: CancelToken
    ) -> int:
        """NIXL READ of granted peer ranges into local ranges; returns bytes.

        Raises:
            CopyCancelled: the token tripped (every posted request finished first).
            OSError: NIXL failed, or its metadata does not cover the ranges.
        """
        return await self._move("READ", local, remote, nbytes, token)

    async def write(
        self, local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray, token: CancelToken
    ) -> int:
        """NIXL WRITE of local ranges into granted peer ranges; returns bytes.

        Raises:
            CopyCancelled: the token tripped (every posted request finished first).
            OSError: NIXL failed, or its metadata does not cover the ranges.
        """
        return await self._move("WRITE", local, remote, nbytes, token)

    async def _move(
        self,
        op: str,
        local: np.ndarray,
        remote: np.ndarray,
        nbytes: np.ndarray,
        token: CancelToken,
    ) -> int:
        if self.closed or self.link is None:
            raise OSError("the link's NIXL access is closed")
        if not len(nbytes):
            return 0
        engine = self.link.engine
        stall = engine.stall_timeout_s
        if self._primed is not None and not self._primed.is_set():
            await self._primed.wait()  # bounded by the task's deadline
        if len(nbytes) == 1:
            chunk = await self._plan1(int(local[0]), int(remote[0]), int(nbytes[0]))
            if chunk is not None:
                try:
                    return await self.ep.run_small(op, chunk, token, stall)
                except FenceLost as exc:
                    self.link.fail(exc)
                    raise
                except OSError:
                    await self._settle()
                    raise
        if not check_within(remote, nbytes, self._starts, self._ends):
            await self.refresh(engine.sync_kv_timeout_s)
            if not check_within(remote, nbytes, self._starts, self._ends):
                raise OSError("the peer's NIXL metadata does not cover the granted ranges")
        llay = self.ep.layout_of(local, nbytes)
        if llay is None:
            raise OSError("local ranges are not in one cache registered with NIXL")
        chunks = await self._plan(llay, local, remote, nbytes)
        total = sum(c.nbytes for c in chunks)
        try:
            return await self._run(op, chunks, total, token, stall)
        except FenceLost as exc:
            # Never report a stopped transfer while NIXL may still write: the link goes down,
            # which disconnects the peer's UCX endpoints once no request runs on it.
            self.link.fail(exc)
            raise
        except OSError:
            await self._settle()
            raise

    async def _run(
        self, op: str, chunks: list[_Chunk], total: int, token: CancelToken, stall: float
    ) -> int:
        """Run planned chunks: one small one on the loop, the rest in a worker thread.

        Raises:
            CopyCancelled, FenceLost, OSError: as :meth:`NixlEndpoint.pump`.
        """
        if len(chunks) == 1 and total <= _SMALL_BYTES:
            return await self.ep.run_small(op, chunks[0], token, stall)
        return int(
            await anyio.to_thread.run_sync(
                self.ep.pump, op, chunks, token, stall, limiter=self.link.threads
            )
        )

    async def _settle(self) -> None:
        """A NIXL failure is most often the peer dying: give the link a moment to notice, so
        the task fails with the link's reason (LLM_LINK_FAILED), not a bare NIXL error."""
        with anyio.move_on_after(1.0):
            while self.link.alive:  # noqa: ASYNC110 (the link has no event for this)
                await anyio.sleep(0.01)

    async def _plan1(self, local: int, remote: int, nbytes: int) -> _Chunk | None:
        """One range of whole units, both sides in known prepared caches: the request, made
        with plain integers (most small requests); None otherwise."""
        if nbytes > _SMALL_BYTES or self.peer_agent is None:
            return None
        rid = _find1(*self._lists, remote, nbytes)
        lid = _find1(*self.ep.lists, local, nbytes)
        rlay, llay = self._remote.get(rid), self.ep.caches.get(lid)
        if rlay is None or llay is None or rlay.unit != llay.unit:
            return None
        ri, li = _index1(rlay, remote, nbytes), _index1(llay, local, nbytes)
        if ri is None or li is None:
            return None
        k = nbytes // rlay.unit
        lh = llay.prepped if llay.prepped is not None else await self.ep.prepare(llay, "")
        rh = rlay.prepped
        if rh is None:
            rh = await self.ep.prepare(rlay, self.peer_agent)
        return _Chunk(True, (lh, list(range(li, li + k)), rh, list(range(ri, ri + k))), nbytes)

    async def _plan(
        self, llay: _Layout, local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray
    ) -> list[_Chunk]:
        """Chunks of NIXL requests for one grant: prepared-list indices when both sides are
        whole units of one cache each, explicit descriptors otherwise."""
        assert self.peer_agent is not None
        groups = self._remote_groups(remote)
        ids = np.unique(groups)
        n = np.asarray(nbytes, dtype=np.int64)
        if len(ids) == 1:
            rlay = self._remote[int(ids[0])]
            if rlay.unit == llay.unit and rlay.unit > 0:
                li = llay.indices(local, n)
                ri = rlay.indices(remote, n) if li is not None else None
                if li is not None and ri is not None:
                    lh = await self.ep.prepare(llay, "")
                    rh = await self.ep.prepare(rlay, self.peer_agent)
                    per = max(1, _CHUNK_BYTES // rlay.unit)
                    return [
                        _Chunk(
                            True,
                            (lh, li[s : s + per], rh, ri[s : s + per]),
                            min(per, len(li) - s) * rlay.unit,
                        )
                        for s in range(0, len(li), per)
                    ]
        chunks = []
        for cid in ids:
            sel = np.flatnonzero(groups == cid)
            rlay = self._remote[int(cid)]
            for lo, hi in _cuts(n[sel], _CHUNK_BYTES):
                s = sel[lo:hi]
                lrows = np.stack(
                    [
                        np.asarray(local, _U64)[s],
                        n[s].astype(_U64),
                        np.full(len(s), llay.dev, _U64),
                    ],
                    axis=1,
                )
                rrows = np.stack(
                    [
                        np.asarray(remote, _U64)[s],
                        n[s].astype(_U64),
                        np.full(len(s), rlay.dev, _U64),
                    ],
                    axis=1,
                )
                chunks.append(
                    _Chunk(
                        False, (lrows, llay.mem, rrows, rlay.mem, self.peer_agent), int(n[s].sum())
                    )
                )
        return chunks

    def close(self) -> None:
        """Drop the peer's prepared lists and metadata (disconnects its UCX endpoints). Called
        once no request of the link runs any more. Never raises."""
        if self.closed:
            return
        self.closed = True
        for lay in self._remote.values():
            if lay.prepped is not None:
                self.ep.release(lay.prepped)
                lay.prepped = None
        self._remote = {}
        for prepped in self._retired:
            self.ep.release(prepped)
        self._retired = []
        if self.peer_agent is not None:
            self.ep.forget_peer(self.peer_agent)
            self.peer_agent = None
        self.ep.accesses.discard(self)
