"""Streams of host memory over many ranges (a plan's bytes as DATA frames, through a staging
buffer of the link's): what :meth:`Engine.make_stream` hands a link for plans of more than
:data:`VIEWS_INLINE` ranges."""

from __future__ import annotations

import anyio
import anyio.to_thread
import numpy as np

from .._memory import CancelToken
from .._transports._staging import LinkStaging, StagedFrames

__all__ = ["VIEWS_INLINE", "ManyRangesStream"]

_U64 = np.uint64


class ManyRangesStream(StagedFrames):
    """A stream of host memory over more than ``VIEWS_INLINE`` ranges: each frame's bytes pass
    through a staging buffer of the link's (``staging``), gathered (sending) or scattered
    (receiving) with numpy in a worker thread of the link's. A view per range would cost
    about a microsecond of the loop each, and holding the GIL as long in a thread starves
    the loop as well; the receive views are the staging buffer alone."""

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

    def _reuse(self, buf: np.ndarray) -> None:
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
