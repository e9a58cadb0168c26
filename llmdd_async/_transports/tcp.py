"""TCP: sockets, and zero-copy blocking send/receive of plan bytes for worker threads.

The link's socket is put in blocking mode. The event loop only uses it with ``MSG_DONTWAIT``
(headers and control frames); bulk payload moves in worker threads with blocking
``sendmsg`` / ``recvmsg_into`` over many buffers at once. ``SO_SNDTIMEO``/``SO_RCVTIMEO`` make
those calls return every few tens of milliseconds, so a worker notices cancellation and
deadlines even when the peer stalls. uvloop puts every descriptor it watches in non-blocking
mode (libuv's poll handles do), so a worker also waits in ``poll`` when a call would block
(:func:`_wait_ready`) rather than trying again at once.

With ``llm.PayloadAuth`` a :class:`PayloadMac` hashes a DATA frame's payload as each
syscall takes it (then the MAC goes out as the frame's trailer, see ``_protocol``) or as it
lands, in the same thread, while the kernel already moves the next bytes.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import hmac
import itertools
import operator
import os
import select
import socket

import anyio
import numpy as np

from .._memory import CancelToken, memory_view
from ._bufs import Chunk, batch, moved
from ._fence import TRIPPED_GRACE_S, Fence, FrameClock, bytes_left, grace_s

__all__ = [
    "INLINE_BYTES",
    "PayloadMac",
    "mac_update",
    "send_nowait",
    "send_views_inline",
    "CHUNK_BYTES",
    "Fence",
    "TRIPPED_GRACE_S",
    "grace_s",
    "host_views",
    "StreamPlan",
    "configure_socket",
    "recv_views",
    "scratch_views",
    "send_views",
]

#: Payload bytes per DATA frame: big enough to amortise a thread hop, small enough that a
#: cancel or an abort takes effect quickly.
CHUNK_BYTES = 32 << 20
_SLICE_S = 0.05
_SCRATCH = 4 << 20
#: plans of up to this many ranges are kept as Python ints (numpy's fixed cost per call is
#: more than a Python loop over as many)
_FEW = 64
#: plans of up to this many ranges also keep Python lists (built on first use): a frame of a
#: few of their ranges (one layer of a layer-wise stream) is found by bisect, not numpy
_LISTED = 4096
#: a frame of up to this many ranges of a listed plan is cut in Python ints
_FEW_IN_FRAME = 64
#: up to this many ranges get a view each; more are slices of one view over their span
#: (a view costs about a microsecond, a slice a fifth of that)
_OWN_VIEWS = 4


def configure_socket(sock: socket.socket, heartbeat_s: float = 10.0) -> None:
    """Blocking mode with short kernel timeouts, no Nagle delay, and a heartbeat: the kernel
    breaks the connection (the reader then sees ``ETIMEDOUT``) once the peer's host has
    acknowledged nothing for about ``heartbeat_s`` (a partition, a host gone without FIN or
    RST): keepalive probes from half of it on an idle link, ``TCP_USER_TIMEOUT`` for data
    (probes included) that waits for acknowledgement."""
    sock.setblocking(True)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    whole = max(2, int(heartbeat_s))
    idle = max(1, whole // 2)
    interval = max(1, whole // 10)
    for name, value in (
        ("TCP_KEEPIDLE", idle),
        ("TCP_KEEPINTVL", interval),
        ("TCP_KEEPCNT", max(1, (whole - idle) // interval)),
        ("TCP_USER_TIMEOUT", int(heartbeat_s * 1000)),
    ):
        opt = getattr(socket, name, None)
        # Linux has all four; elsewhere (or refused) the kernel's defaults stay.
        if opt is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
    tv = np.array([0, int(_SLICE_S * 1e6)], dtype=np.int64).tobytes()  # struct timeval
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class StreamPlan:
    """One side of a plan as an ordered byte stream: stream offsets -> local memory ranges."""

    @property
    def staged(self) -> bool:
        """Received bytes still have to be moved (a subclass's :meth:`commit` does work):
        the link then fences that work like the receive."""
        return type(self).commit is not StreamPlan.commit

    def __init__(self, addrs: np.ndarray, nbytes: np.ndarray) -> None:
        self._whole: list[memoryview] | None = None
        if len(nbytes) <= _FEW:
            self._init_few(np.asarray(addrs).tolist(), np.asarray(nbytes).tolist())
            return
        self._few: tuple[list[int], list[int], list[int]] | None = None
        addrs = np.asarray(addrs, dtype=np.uint64)
        nbytes = np.asarray(nbytes, dtype=np.uint64)
        if len(addrs) > 1:
            # This side alone decides how its bytes are cut into buffers: ranges adjacent in
            # local memory merge even where the other side's do not (a shuffled pull lands in
            # one contiguous run here, received with a single buffer).
            brk = np.concatenate(([True], addrs[1:] != addrs[:-1] + nbytes[:-1]))
            starts = np.flatnonzero(brk)
            addrs, nbytes = addrs[starts], np.add.reduceat(nbytes, starts).astype(np.uint64)
        self.addrs = addrs
        self.nbytes = nbytes
        self.ends = np.cumsum(self.nbytes, dtype=np.uint64)
        self.starts = self.ends - self.nbytes
        self.total = int(self.ends[-1]) if len(self.ends) else 0

    def _init_few(self, addrs: list[int], nbytes: list[int]) -> None:
        # A few ranges (most requests): Python ints, as numpy costs microseconds per call.
        if len(addrs) != len(nbytes):
            raise ValueError("addresses and lengths differ in number")
        if 0 in nbytes:  # (no empty view: a send of one never advances)
            addrs = [a for a, n in zip(addrs, nbytes, strict=True) if n]
            nbytes = [n for n in nbytes if n]
        if any(map(operator.eq, map(operator.add, addrs, nbytes), addrs[1:])):
            a_out, n_out = addrs[:1], nbytes[:1]
            for a, n in zip(addrs[1:], nbytes[1:], strict=True):
                if a_out[-1] + n_out[-1] == a:
                    n_out[-1] += n
                else:
                    a_out.append(a)
                    n_out.append(n)
            addrs, nbytes = a_out, n_out
        ends = list(itertools.accumulate(nbytes))
        self._few = (addrs, nbytes, ends)
        self.total = ends[-1] if ends else 0

    @functools.cached_property
    def _listed(self) -> tuple[list[int], list[int], list[int]] | None:
        # (a plan of few ranges has its lists already: _few)
        if self._few is not None or len(self.addrs) > _LISTED:
            return None
        return self.addrs.tolist(), self.nbytes.tolist(), self.ends.tolist()

    @functools.cached_property
    def _span(self) -> tuple[int, memoryview]:
        # One view over the whole span; descriptors become cheap slices of it (a view of its
        # own costs a microsecond). Gaps in the span are never touched: every range was
        # validated against registered memory.
        if self._few is not None:
            addrs, nbytes, _ = self._few
            lo = min(addrs)
            hi = max(map(operator.add, addrs, nbytes))
        else:
            lo = int(self.addrs.min())
            hi = int((self.addrs + self.nbytes).max())
        return lo, memory_view(lo, hi - lo)

    def ranges(self, offset: int, n: int) -> tuple[list[int], list[int]]:
        """Local ``(addresses, lengths)`` holding stream bytes ``[offset, offset + n)``."""
        if n <= 0 or not self.total:
            return [], []
        listed = self._few if self._few is not None else self._listed
        if listed is not None:
            addrs_l, nbytes_l, ends_l = listed
            hi = offset + n
            i0 = bisect.bisect_right(ends_l, offset)
            i1 = min(bisect.bisect_left(ends_l, hi) + 1, len(ends_l))
            if i0 < i1 and ends_l[i1 - 1] == hi and ends_l[i0] - nbytes_l[i0] == offset:
                # Whole ranges (a layer's, a request's): the lists' own slices.
                lens = nbytes_l[i0:i1]
                if 0 not in lens:
                    return addrs_l[i0:i1], lens
            if self._few is not None or i1 - i0 <= _FEW_IN_FRAME:
                out_a: list[int] = []
                out_n: list[int] = []
                for i in range(i0, i1):
                    end = ends_l[i]
                    start = end - nbytes_l[i]
                    lo_, hi_ = max(start, offset), min(end, hi)
                    if hi_ > lo_:
                        out_a.append(addrs_l[i] + lo_ - start)
                        out_n.append(hi_ - lo_)
                return out_a, out_n
        lo, hi = np.uint64(offset), np.uint64(offset + n)
        i0 = int(np.searchsorted(self.ends, lo, side="right"))
        i1 = int(np.searchsorted(self.ends, hi, side="left")) + 1
        st = self.starts[i0:i1]
        a0 = np.maximum(st, lo)
        a1 = np.minimum(self.ends[i0:i1], hi)
        keep = a1 > a0
        addrs = self.addrs[i0:i1][keep] + (a0 - st)[keep]
        return addrs.tolist(), (a1 - a0)[keep].tolist()

    def views(self, offset: int, n: int) -> list[memoryview]:
        """Memory views covering stream bytes ``[offset, offset + n)`` in order."""
        if offset == 0 and n >= self.total:  # the whole plan (most frames): made once
            whole = self._whole
            if whole is None:
                whole = self._whole = self._whole_views()
            return list(whole)
        addrs, lens = self.ranges(offset, n)
        if not addrs:
            return []
        # Part of a plan sent in several frames (a layer's, a chunk's).
        return self._slices(addrs, lens)

    def make_views(self) -> None:
        """Make the whole plan's views now, while nothing waits for them, where they cost more
        than a view each (a plan of many ranges: slices of one view over their span)."""
        ranges = len(self._few[0]) if self._few is not None else len(self.addrs)
        if self._whole is None and ranges > _OWN_VIEWS and self.total:
            self._whole = self._whole_views()

    def _slices(self, addrs: list[int], lens: list[int]) -> list[memoryview]:
        """Views of local ranges as slices of the span's one view, made once for the stream
        (a view of its own costs a microsecond, a slice a fifth of that)."""
        base, span = self._span
        return [span[a - base : a - base + ln] for a, ln in zip(addrs, lens, strict=True)]

    def _whole_views(self) -> list[memoryview]:
        if not self.total:
            return []
        few = self._few
        return host_views(self.addrs, self.nbytes) if few is None else _views_of(few[0], few[1])

    # The link calls these three, so host and device memory look the same to it.
    async def prepare(self, offset: int, n: int, token: CancelToken) -> list[memoryview]:
        """Views holding stream bytes ``[offset, offset + n)`` ready to send."""
        return self.views(offset, n)

    def receive_views(self, offset: int, n: int) -> list[memoryview]:
        """Where stream bytes ``[offset, offset + n)`` are to be received."""
        return self.views(offset, n)

    async def receive_staged(self, offset: int, n: int) -> list[memoryview]:
        """:meth:`receive_views` of a :attr:`staged` stream, which may have to wait for its
        buffer (allocated off the loop); the link's reader takes them in a task of its own."""
        return self.receive_views(offset, n)

    async def commit(self, offset: int, n: int, token: CancelToken) -> None:
        """Received bytes ``[offset, offset + n)`` are in place (nothing to do for host
        memory)."""

    def sent(self) -> None:
        """The frame :meth:`prepare` made is out, or never will be (its buffer is free)."""

    def close(self) -> None:
        """Release any staging memory."""


def host_views(addrs: np.ndarray, nbytes: np.ndarray) -> list[memoryview]:
    """Views of host ranges of ours (a plan's side, sent whole), in order, with no stream set
    up over them: as :meth:`StreamPlan.views` of the whole plan, not merged."""
    a, n = addrs.tolist(), nbytes.tolist()
    if 0 in n:  # (no empty view: a send of one never advances)
        a, n = [x for x, k in zip(a, n, strict=True) if k], [k for k in n if k]
    return _views_of(a, n)


def _views_of(addrs: list[int], lens: list[int]) -> list[memoryview]:
    """Views of non-empty ranges in order: a view each for a few, else slices of one view
    over their span (a view costs about a microsecond, a slice a fifth of that; the gaps
    are never touched)."""
    if len(addrs) <= _OWN_VIEWS:
        return [memory_view(a, n) for a, n in zip(addrs, lens, strict=True)]
    lo = min(addrs)
    span = memory_view(lo, max(map(operator.add, addrs, lens)) - lo)
    return [span[a - lo : a - lo + n] for a, n in zip(addrs, lens, strict=True)]


class PayloadMac:
    """The MAC of one DATA frame's payload, fed what each syscall moved: the first ``skip``
    bytes (the frame's header) are not hashed, nor anything after ``payload`` bytes (the
    trailer). Sending, it hashes the payload exactly as it went out, the zeros that finish a
    frame cut short by a cancel included (so the peer never mistakes a cancel for tampering),
    and once every payload byte is out appends the trailer to the buffers; source memory is
    hashed right after the kernel copied it, before the sender looks at the cancel token
    again. Receiving, it hashes each batch right where it landed."""

    __slots__ = ("_left", "_mac", "_skip", "done")

    def __init__(self, mac: hmac.HMAC, skip: int, payload: int) -> None:
        self._mac = mac
        self._skip = skip
        self._left = payload
        #: the trailer is among the buffers (nothing of the payload is left to send)
        self.done = False

    def passed(self, bufs: list[memoryview], idx: int, n: int) -> None:
        """``n`` bytes starting at ``bufs[idx]`` went out or landed (call before trimming
        ``bufs``)."""
        while n > 0 and self._left > 0 and idx < len(bufs):  # no slice: plans of many views
            b = bufs[idx]
            idx += 1
            k = min(n, b.nbytes)
            n -= k
            if self._skip >= k:
                self._skip -= k
                continue
            piece = b[self._skip : self._skip + min(k - self._skip, self._left)]
            self._skip = 0
            self._mac.update(piece)
            self._left -= piece.nbytes

    def finish(self, bufs: list[memoryview]) -> None:
        """Append the trailer once every payload byte is out."""
        if not self.done and self._left <= 0:
            bufs.append(memoryview(self._mac.digest()))
            self.done = True

    def digest(self) -> bytes:
        """The MAC of what passed (call once every payload byte did)."""
        return self._mac.digest()


def mac_update(mac: hmac.HMAC, views: list[memoryview]) -> None:
    """Feed ``views`` to ``mac`` (small payloads, on the loop: large ones are fed by the
    worker that sends or receives them)."""
    for v in views:
        mac.update(v)


def _step(bufs: list[memoryview], idx: int, n: int, tagger: PayloadMac | None, chunk: Chunk) -> int:
    """:func:`moved` past ``n`` bytes sent of ``chunk``, hashing them first; with every
    payload byte out the trailer joins ``bufs`` (so a loop over ``bufs`` sends it next)."""
    if tagger is None:
        return moved(bufs, idx, n, chunk)
    tagger.passed(bufs, idx, n)
    idx = moved(bufs, idx, n, chunk)
    if idx == len(bufs):
        tagger.finish(bufs)
    return idx


def scratch_views(n: int, scratch: memoryview) -> list[memoryview]:
    """Slices of ``scratch`` that together are ``n`` bytes long (to discard or pad with)."""
    out = []
    while n > 0:
        k = min(n, scratch.nbytes)
        out.append(scratch[:k])
        n -= k
    return out


def _scratch_like(bufs: list[memoryview], idx: int, scratch: memoryview) -> list[memoryview]:
    """Replace the remaining buffers by scratch slices of the same total length."""
    return scratch_views(bytes_left(bufs, idx), scratch)


@functools.cache
def _zeros() -> memoryview:
    """Read-only zeros that pad a cancelled frame (shared by every sending thread)."""
    return memoryview(bytes(_SCRATCH))


#: frames up to this size move from the event loop itself: a thread hop and its GIL hand-offs
#: cost more than the copy (measured here: 64 requests of 1 MiB in flight went from 560 to
#: about 1000 req/s when they stopped hopping; one 1 MiB copy to or from the kernel holds the
#: loop for 0.1-0.3 ms, less than one GIL switch interval of a worker thread)
INLINE_BYTES = 1 << 20


def send_nowait(
    sock: socket.socket, bufs: list[memoryview], tagger: PayloadMac | None = None
) -> int:
    """One non-blocking ``sendmsg`` of ``bufs`` (small frames): returns the index of the first
    buffer not fully sent (``len(bufs)`` when all went out; ``bufs`` is trimmed in place).
    Most small frames go out whole, and then need no cancel scope or loop turn. With a
    ``tagger`` (``bufs`` is one DATA frame) a second ``sendmsg`` sends the trailer.

    Raises:
        OSError: the connection failed.
    """
    idx = 0
    for _ in range(1 if tagger is None else 2):
        chunk = batch(bufs, idx)
        try:
            n = sock.sendmsg(chunk[0], [], socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            break
        idx = _step(bufs, idx, n, tagger, chunk)
        if idx == len(bufs):
            break
    return idx


async def send_views_inline(
    sock: socket.socket,
    bufs: list[memoryview],
    idx: int,
    token: CancelToken,
    tagger: PayloadMac | None = None,
) -> None:
    """Send ``bufs[idx:]`` (a frame's header and views, ``bufs[:idx]`` already sent) from the
    event loop (small frames; no worker thread), then the ``tagger``'s trailer if any.

    The caller shields it and bounds it with a stall timeout: a frame, once started, must be
    finished. If ``token`` trips meanwhile, the rest goes out as zeros and source memory is
    not read again.

    Raises:
        OSError: the connection failed.
    """
    padded = False
    if tagger is not None and idx == len(bufs):
        tagger.finish(bufs)
    while idx < len(bufs):
        if not padded and token.cancelled and not (tagger is not None and tagger.done):
            keep = max(idx, 1)
            bufs = bufs[:keep] + _scratch_like(bufs, keep, _zeros())
            padded = True
        chunk = batch(bufs, idx)
        try:
            n = sock.sendmsg(chunk[0], [], socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            await anyio.wait_writable(sock)
            continue
        idx = _step(bufs, idx, n, tagger, chunk)


def _wait_ready(sock: socket.socket, event: int) -> None:
    """After a worker's call would block: wait until ``sock`` is ready for ``event`` (at
    most a slice). A blocking socket already waited a slice in the call (its kernel
    timeout); a non-blocking one (uvloop watches the link's descriptor, which makes it
    so) came back at once, and trying again at once would spin, holding the GIL that the
    event loop and the other workers need."""
    fd = sock.fileno()
    if fd >= 0 and not os.get_blocking(fd):
        poller = select.poll()
        poller.register(fd, event)
        poller.poll(_SLICE_S * 1000)


def send_views(
    sock: socket.socket,
    header: bytes,
    views: list[memoryview],
    fence: Fence,
    tagger: PayloadMac | None = None,
) -> None:
    """Send ``header`` then every view, then the ``tagger``'s trailer if any, blocking. Runs
    in a worker thread.

    If the fence's token trips mid-frame, the rest of the frame is sent as zeros (so the
    stream stays in step) and the source memory is not read again; ``released`` is set.

    Raises:
        TimeoutError: the frame ran past its bound (:class:`Fence`).
        OSError: the connection failed.
    """
    bufs: list[memoryview] = [memoryview(header), *views]
    idx = 0
    padded = False
    clock = FrameClock(fence, "a send")
    try:
        while idx < len(bufs):
            if not padded and fence.token.cancelled and not (tagger is not None and tagger.done):
                keep = max(idx, 1)  # the header always goes out as it is
                bufs = bufs[:keep] + _scratch_like(bufs, keep, _zeros())
                padded = True
                fence.released.set()
                clock.tripped(bytes_left(bufs, idx))
            clock.late(bufs, idx)
            chunk = batch(bufs, idx)
            try:
                n = sock.sendmsg(chunk[0])
            except (BlockingIOError, InterruptedError):
                clock.check(0)
                _wait_ready(sock, select.POLLOUT)
                continue
            clock.check(n)
            idx = _step(bufs, idx, n, tagger, chunk)
    finally:
        fence.released.set()


def recv_views(
    sock: socket.socket,
    views: list[memoryview],
    fence: Fence,
    scratch: memoryview,
    mac: PayloadMac | None = None,
) -> bool:
    """Receive exactly the views' bytes into them, blocking, feeding ``mac`` each batch where
    it landed (cache-hot, while the kernel receives the next). Runs in a worker thread.

    If the fence's token trips, the rest goes to ``scratch`` instead (the stream stays in step)
    and ``released`` is set at once. Returns True when every byte landed in ``views``.

    Raises:
        EOFError: the peer closed the connection mid-frame.
        TimeoutError: the frame ran past its bound (:class:`Fence`).
        OSError: the connection failed.
    """
    bufs = list(views)
    idx = 0
    diverted = False
    clock = FrameClock(fence, "a receive")
    try:
        while idx < len(bufs):
            if not diverted and fence.token.cancelled:
                bufs = bufs[:idx] + _scratch_like(bufs, idx, scratch)
                diverted = True
                fence.released.set()
                clock.tripped(bytes_left(bufs, idx))
            clock.late(bufs, idx)
            chunk = batch(bufs, idx)
            try:
                n = sock.recvmsg_into(chunk[0], 0, socket.MSG_WAITALL)[0]
            except (BlockingIOError, InterruptedError):
                clock.check(0)
                _wait_ready(sock, select.POLLIN)
                continue
            if n == 0:
                raise EOFError("peer closed the connection in the middle of a frame")
            clock.check(n)
            if mac is not None and not diverted:
                mac.passed(bufs, idx, n)
            idx = moved(bufs, idx, n, chunk)
    finally:
        fence.released.set()
    return not diverted
