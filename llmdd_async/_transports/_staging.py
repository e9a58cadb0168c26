"""Staging buffers: where a stream's frames pass through host memory on their way between
the socket and memory the socket cannot reach directly (device memory, :class:`StagedStream`)
or efficiently (host memory over many ranges, ``_net.streams.ManyRangesStream``), and the
bound on them one link shares (:class:`LinkStaging`)."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from .._memory import CancelToken
from .tcp import CHUNK_BYTES, StreamPlan

__all__ = ["LinkStaging", "StagedFrames", "StagedStream"]


class LinkStaging:
    """The staging of one link's frames: the send units of its staged streams (device memory,
    host memory over many ranges), the buffers of those over many ranges, and the worker
    threads (``threads``, the link's) that gather and scatter them.

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
        # (fast_acquire: a free unit costs no trip through the scheduler, once a frame)
        self._sends = anyio.Semaphore(self.SENDS, max_value=self.SENDS, fast_acquire=True)
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

    async def acquire_send(self) -> None:
        """A send unit for one frame; waits while :attr:`SENDS` frames of the link hold one.
        Each call is matched by one :meth:`sent`."""
        await self._sends.acquire()

    async def take_for_send(self, n: int) -> np.ndarray:
        """A send unit (:meth:`acquire_send`) and a buffer of at least ``n`` bytes."""
        await self.acquire_send()
        try:
            return self.take(n)
        except BaseException:  # (MemoryError): the unit must not be lost with it
            self._sends.release()
            raise

    def sent(self) -> None:
        """A frame that took a send unit is out (or never will be)."""
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


class StagedFrames(StreamPlan):
    """A stream whose frames pass through a staging buffer, held for one frame only: from
    :meth:`prepare` (under one of the link's send units, ``staging``) to :meth:`sent`, or
    from :meth:`receive_staged` to a successful :meth:`commit`."""

    def __init__(self, addrs: np.ndarray, nbytes: np.ndarray, staging: LinkStaging | None) -> None:
        super().__init__(addrs, nbytes)
        self._staging = LinkStaging() if staging is None else staging
        #: the frame's buffer, and whether it was taken for a send
        self._buf: Any = None
        self._sending = False

    def _reuse(self, buf: Any) -> None:
        """Keep ``buf`` for a later frame (nothing touches it any more)."""
        raise NotImplementedError

    def _drop(self, reuse: bool) -> None:
        """Let go of the frame's buffer; ``reuse`` only where no worker can still touch it
        (else it goes with its last view)."""
        buf, self._buf = self._buf, None
        if buf is None:
            return
        if self._sending:
            self._staging.sent()
        if reuse:
            self._reuse(buf)

    def sent(self) -> None:
        self._drop(True)

    def views(self, offset: int, n: int) -> list[memoryview]:
        raise TypeError("a staged stream is reached through prepare/receive_staged/commit")

    def close(self) -> None:
        # Not reused: a frame's worker may still hold it (a request ended by a broken link).
        # (A stream closed in a worker thread, a pull's replaced by its GRANT's, receives:
        # no send unit to release off the loop.)
        self._drop(False)


class StagedStream(StagedFrames):
    """A stream over device memory: each frame passes through a host staging buffer of the
    adapter's (pinned on CUDA), held for that frame only and, sending, under the link's send
    units (``staging``): a peer's requests make a link hold three, whatever their number."""

    def __init__(
        self, addrs: np.ndarray, nbytes: np.ndarray, adapter: Any, staging: LinkStaging | None
    ) -> None:
        super().__init__(addrs, nbytes, staging)
        self._adapter = adapter
        #: one size for all of the stream's frames (the adapter keeps a few for reuse)
        self._size = max(1, min(self.total, CHUNK_BYTES))

    def _reuse(self, buf: Any) -> None:
        self._adapter.unstage(buf)

    async def prepare(self, offset: int, n: int, token: CancelToken) -> list[memoryview]:
        self._drop(False)  # (a frame with no sent() after it: not reused)
        staging = self._staging
        await staging.acquire_send()
        try:
            buf = self._adapter.staging(self._size, allocate=False)
            if buf is None:  # (allocating pinned memory takes milliseconds: not on the loop)
                buf = await anyio.to_thread.run_sync(
                    self._adapter.staging, self._size, limiter=staging.threads
                )
            addrs, lens = self.ranges(offset, n)
            await self._adapter.gather(addrs, lens, buf, token)
        except BaseException:
            staging.sent()
            raise
        self._buf, self._sending = buf, True
        return [memoryview(buf.numpy()).cast("B")[:n]]

    async def receive_staged(self, offset: int, n: int) -> list[memoryview]:
        self._drop(False)  # (a frame not scattered: cancelled)
        # (the reader takes one frame at a time: a link receives into one such buffer)
        buf = self._adapter.staging(self._size, allocate=False)
        if buf is None:  # (as in prepare: a pinned allocation takes milliseconds)
            buf = await anyio.to_thread.run_sync(
                self._adapter.staging, self._size, limiter=self._staging.threads
            )
        self._buf, self._sending = buf, False
        return [memoryview(buf.numpy()).cast("B")[:n]]

    async def commit(self, offset: int, n: int, token: CancelToken) -> None:
        buf = self._buf
        if buf is None:
            return
        addrs, lens = self.ranges(offset, n)
        await self._adapter.scatter(buf, addrs, lens, token)
        self._drop(True)
