"""Streams of host memory over many ranges (a plan's bytes as DATA frames, through a staging
buffer): what :meth:`Engine.make_stream` hands a link for plans of more than
:data:`VIEWS_INLINE` ranges; and the link's staging buffers they share."""

from __future__ import annotations

import threading

import anyio
import anyio.to_thread
import numpy as np

from .._memory import CancelToken
from .._transports.tcp import StreamPlan

__all__ = ["VIEWS_INLINE", "LinkStaging", "ManyRangesStream"]

_U64 = np.uint64


class LinkStaging:
    """The staging buffers of one link's streams over many ranges, and the worker threads
    (``threads``, the link's) that gather and scatter them.

    A stream holds a buffer for one frame only: from gathering it until it is sent, at most
    :attr:`SENDS` frames of the link at once (one on the wire, one being gathered: more
    would not fill the socket faster), or from receiving it until it is scattered (the reader
    takes one frame at a time). A peer's requests thus make the link hold three buffers of
    up to 32 MiB (a frame), whatever ``llm.LinkServing``. Nothing is held across a wait for
    anything but the socket (a layer, a GRANT, a lock), so no wait here can close a cycle.
    Buffers are kept for the next frame while a stream is open on the link, and go with the
    last one."""

    SENDS = 2

    def __init__(self, threads: anyio.CapacityLimiter | None = None) -> None:
        self.threads = threads
        # (max_value: a release too many raises rather than widening the bound)
        self._sends = anyio.Semaphore(self.SENDS, max_value=self.SENDS)
        # (streams open and close in worker threads too: a big grant is checked in one)
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []
        self._open = 0

    def opened(self) -> None:
        with self._lock:
            self._open += 1

    def closed(self) -> None:
        with self._lock:
            self._open -= 1
            if not self._open:
                self._free.clear()

    async def take_for_send(self, n: int) -> np.ndarray:
        """A buffer of at least ``n`` bytes for a frame to send; waits while :attr:`SENDS`
        frames of the link hold one. Each call is matched by one :meth:`sent`."""
        await self._sends.acquire()
        try:
            return self.take(n)
        except BaseException:  # (MemoryError): the unit must not be lost with it
            self._sends.release()
            raise

    def sent(self) -> None:
        """A frame taken with :meth:`take_for_send` is out (or never will be)."""
        self._sends.release()

    def take(self, n: int) -> np.ndarray:
        """A buffer of at least ``n`` bytes (for a frame being received: no wait)."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= n:
                    return self._free.pop(i)
            if self._free:  # too small: replaced, so no more than the frames' are held
                self._free.pop()
        return np.empty(max(1, n), dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """``buf`` is free again, for the next frame: nothing reads or writes it any more."""
        with self._lock:
            if self._open and len(self._free) <= self.SENDS:
                self._free.append(buf)


class ManyRangesStream(StreamPlan):
    """A stream of host memory over more than ``VIEWS_INLINE`` ranges: each frame's bytes pass
    through a staging buffer of the link's (``staging``), gathered (sending) or scattered
    (receiving) with numpy in a worker thread of the link's. A view per range would cost
    about a microsecond of the loop each, and holding the GIL as long in a thread starves
    the loop as well; the receive views are the staging buffer alone."""

    def __init__(
        self, addrs: np.ndarray, nbytes: np.ndarray, staging: LinkStaging | None = None
    ) -> None:
        super().__init__(addrs, nbytes)
        self._staging = LinkStaging() if staging is None else staging
        self._staging.opened()
        self._closed = False
        #: the frame's buffer, and whether it was taken for a send
        self._buf: np.ndarray | None = None
        self._sending = False

    def _move(self, buf: np.ndarray, offset: int, n: int, gather: bool) -> None:
        """Copy stream bytes ``[offset, offset + n)`` between memory and ``buf``."""
        lo_, hi_ = _U64(offset), _U64(offset + n)
        i0 = int(np.searchsorted(self.ends, lo_, side="right"))
        i1 = int(np.searchsorted(self.ends, hi_, side="left")) + 1
        st = self.starts[i0:i1]
        a0, a1 = np.maximum(st, lo_), np.minimum(self.ends[i0:i1], hi_)
        keep = a1 > a0
        addrs = (self.addrs[i0:i1][keep] + (a0 - st)[keep]).astype(np.int64)
        lens = (a1 - a0)[keep].astype(np.int64)
        base, span = self._span
        mem = np.frombuffer(span, dtype=np.uint8)
        buf = buf[:n]
        offs = addrs - base
        if not (lens % 8).any() and not (offs % 8).any() and base % 8 == 0 and n % 8 == 0:
            # Whole words: an eighth of the indices (these ranges all end on a word).
            mem = mem[: len(mem) // 8 * 8].view(np.uint64)
            buf, offs, lens = buf.view(np.uint64), offs // 8, lens // 8
        pos = 0
        # A few MiB of indices at a time: temporaries stay small whatever the frame.
        group = 1 << 19
        ends = np.cumsum(lens)
        i = 0
        while i < len(lens):
            j = int(np.searchsorted(ends, (int(ends[i - 1]) if i else 0) + group, "right"))
            j = max(j, i + 1)
            ln, of = lens[i:j], offs[i:j]
            count = int(ln.sum())
            idx = np.repeat(of - (np.cumsum(ln) - ln), ln) + np.arange(count, dtype=np.int64)
            if gather:
                np.take(mem, idx, out=buf[pos : pos + count])
            else:
                mem[idx] = buf[pos : pos + count]
            pos += count
            i = j

    def _drop(self, reuse: bool) -> None:
        """Let go of the frame's buffer; ``reuse`` only where no worker can still touch it
        (else it goes with its last view)."""
        buf, self._buf = self._buf, None
        if buf is None:
            return
        if self._sending:
            self._staging.sent()
        if reuse:
            self._staging.give(buf)

    async def prepare(self, offset: int, n: int, token: CancelToken) -> list[memoryview]:
        self._drop(False)  # (a frame with no sent() after it: not reused)
        staging = self._staging
        buf = await staging.take_for_send(n)
        try:
            await anyio.to_thread.run_sync(
                self._move, buf, offset, n, True, limiter=staging.threads
            )
        except BaseException:
            staging.sent()
            raise
        self._buf, self._sending = buf, True
        return [buf[:n].data.cast("B")]

    def sent(self) -> None:
        self._drop(True)

    def receive_views(self, offset: int, n: int) -> list[memoryview]:
        self._drop(False)  # (a frame not scattered: cancelled)
        self._buf, self._sending = self._staging.take(n), False
        return [self._buf[:n].data.cast("B")]

    async def commit(self, offset: int, n: int, token: CancelToken) -> None:
        buf = self._buf
        if buf is None or token.cancelled:
            return
        threads = self._staging.threads
        await anyio.to_thread.run_sync(self._move, buf, offset, n, False, limiter=threads)
        self._drop(True)

    def views(self, offset: int, n: int) -> list[memoryview]:
        raise TypeError("a stream over many ranges is reached through prepare/receive/commit")

    def close(self) -> None:
        # Not reused: a frame's worker may still hold it (a request ended by a broken link).
        # (A stream closed in a worker thread, a pull's replaced by its GRANT's, receives:
        # no send unit to release off the loop.)
        self._drop(False)
        if not self._closed:
            self._closed = True
            self._staging.closed()


#: streams over more ranges than this build their views in a worker thread
VIEWS_INLINE = 4096
