"""Streams of host memory over many ranges (a plan's bytes as DATA frames, through a staging
buffer): what :meth:`Engine.make_stream` hands a link for plans of more than
:data:`VIEWS_INLINE` ranges."""

from __future__ import annotations

import anyio
import anyio.to_thread
import numpy as np

from .._memory import CancelToken
from .._transports.tcp import CHUNK_BYTES, StreamPlan

__all__ = ["VIEWS_INLINE", "ManyRangesStream"]

_U64 = np.uint64


class ManyRangesStream(StreamPlan):
    """A stream of host memory over more than ``VIEWS_INLINE`` ranges: each frame's bytes pass
    through a staging buffer, gathered (sending) or scattered (receiving) with numpy in a
    worker thread of ``limiter`` (the link's). A view per range would cost about a microsecond
    of the loop each, and holding the GIL as long in a thread starves the loop as well; the
    receive views are the staging buffer alone."""

    def __init__(
        self, addrs: np.ndarray, nbytes: np.ndarray, limiter: anyio.CapacityLimiter | None = None
    ) -> None:
        super().__init__(addrs, nbytes)
        self._limiter = limiter
        self._buf: np.ndarray | None = None

    def _staging(self) -> np.ndarray:
        if self._buf is None:
            self._buf = np.empty(max(1, min(self.total, CHUNK_BYTES)), dtype=np.uint8)
        return self._buf

    def _move(self, offset: int, n: int, gather: bool) -> None:
        """Copy stream bytes ``[offset, offset + n)`` between memory and the staging buffer."""
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
        buf = self._staging()[:n]
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

    async def prepare(self, offset: int, n: int, token: CancelToken) -> list[memoryview]:
        await anyio.to_thread.run_sync(self._move, offset, n, True, limiter=self._limiter)
        return [self._staging()[:n].data.cast("B")]

    def receive_views(self, offset: int, n: int) -> list[memoryview]:
        return [self._staging()[:n].data.cast("B")]

    async def commit(self, offset: int, n: int, token: CancelToken) -> None:
        if not token.cancelled:
            await anyio.to_thread.run_sync(self._move, offset, n, False, limiter=self._limiter)

    def views(self, offset: int, n: int) -> list[memoryview]:
        raise TypeError("a stream over many ranges is reached through prepare/receive/commit")

    def close(self) -> None:
        self._buf = None


#: streams over more ranges than this build their views in a worker thread
VIEWS_INLINE = 4096
