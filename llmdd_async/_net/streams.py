"""Streams of host memory over many ranges (a plan's bytes as DATA frames, straight between
the socket and memory or through a staging buffer of the link's): what
:meth:`Engine.make_stream` hands a link for plans of more than :data:`VIEWS_INLINE` ranges."""

from __future__ import annotations

import anyio
import anyio.to_thread
import numpy as np

from .._memory import CancelToken
from .._transports._staging import LinkStaging, StagedFrames

__all__ = ["VIEWS_INLINE", "ManyRangesStream"]

_U64 = np.uint64
#: a frame whose ranges average at least this many bytes goes straight between the socket
#: and memory, a view per range (made in a worker thread, about 0.2 us each): one copy of
#: its bytes instead of two. Smaller ranges cost less gathered or scattered by numpy (a
#: 256-MiB shuffled pull over TCP here: 8-KiB ranges 1.6 GB/s staged, 1.3 straight;
#: 32-KiB ranges 2.0 staged, 2.6 straight; 16 KiB about even)
DIRECT_BYTES = 16 << 10
#: the buffer of a frame sent straight from memory (the send unit is held all the same)
_STRAIGHT = np.empty(0, dtype=np.uint8)


class ManyRangesStream(StagedFrames):
    """A stream of host memory over more than ``VIEWS_INLINE`` ranges, made a frame at a time
    in a worker thread of the link's (views of every range at once would hold the loop, or
    the GIL, for milliseconds). A frame of big ranges (:data:`DIRECT_BYTES`) is views of
    them; one of small ranges passes through a staging buffer of the link's (``staging``),
    gathered (sending) or scattered (receiving) with numpy. A sent frame holds one of the
    link's send units either way."""

    def __init__(
        self, addrs: np.ndarray, nbytes: np.ndarray, staging: LinkStaging | None = None
    ) -> None:
        super().__init__(addrs, nbytes, staging)
        self._staging.opened()
        self._closed = False

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
        offs = addrs - base
        # Rows of the largest size dividing every offset and length (so the frame too): an
        # index per row, each row one memmove. A cache's ranges are blocks of a tensor, so
        # rows of a page or more: a few indices per range, not one per byte or word (1.3 GB/s
        # gathering 8-KiB ranges by words here, 7 by rows).
        row = int(np.gcd.reduce(np.concatenate((offs, lens)))) if len(lens) else 1
        mem = np.frombuffer(span, dtype=np.uint8)
        mem = mem[: len(mem) // row * row].reshape(-1, row)
        buf = buf[:n].reshape(-1, row)
        offs, lens = offs // row, lens // row
        if len(lens) and (int(offs.min()) < 0 or int((offs + lens).max()) > len(mem)):
            # (never, for a plan inside the span; np.take below clips instead of raising)
            raise RuntimeError("a stream range outside the memory it was planned in")
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
                # (mode="raise" would copy ``out`` through a buffer: twice the bytes moved)
                np.take(mem, idx, axis=0, out=buf[pos : pos + count], mode="clip")
            else:
                mem[idx] = buf[pos : pos + count]
            pos += count
            i = j

    def _straight(self, offset: int, n: int) -> bool:
        """Stream bytes ``[offset, offset + n)`` go straight to or from memory."""
        i0 = int(np.searchsorted(self.ends, _U64(offset), side="right"))
        i1 = int(np.searchsorted(self.ends, _U64(offset + n), side="left")) + 1
        return (i1 - i0) * DIRECT_BYTES <= n

    def _views(self, offset: int, n: int) -> list[memoryview]:
        addrs, lens = self.ranges(offset, n)
        return self._slices(addrs, lens)

    def _reuse(self, buf: np.ndarray) -> None:
        if buf is not _STRAIGHT:
            self._staging.give(buf)

    async def prepare(self, offset: int, n: int, token: CancelToken) -> list[memoryview]:
        self._drop(False)  # (a frame with no sent() after it: not reused)
        staging = self._staging
        if self._straight(offset, n):
            await staging.acquire_send()
            try:
                views = await anyio.to_thread.run_sync(
                    self._views, offset, n, limiter=staging.threads
                )
            except BaseException:
                staging.sent()
                raise
            self._buf, self._sending = _STRAIGHT, True
            return views
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

    async def receive_staged(self, offset: int, n: int) -> list[memoryview]:
        if not self._straight(offset, n):
            return self.receive_views(offset, n)
        self._drop(False)  # (a frame not scattered: cancelled)
        # (no buffer: commit has nothing to scatter)
        return await anyio.to_thread.run_sync(self._views, offset, n, limiter=self._staging.threads)

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

    def close(self) -> None:
        super().close()
        if not self._closed:
            self._closed = True
            self._staging.closed()


#: streams over more ranges than this build their views in a worker thread
VIEWS_INLINE = 4096
