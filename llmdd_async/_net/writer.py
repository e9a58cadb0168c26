"""The writer of a link's socket: control frames from tasks (:meth:`LinkWriter.send`), the
reader's frames that must never wait (:meth:`LinkWriter.send_soon`, queued for a writer task
while the socket or the send lock is busy), and a plan's bytes as DATA frames
(:meth:`LinkWriter.send_stream`: small frames from the loop, big ones from worker threads
straight from the source memory).

The send lock is held from a frame's first byte to its last: frames never interleave, and on
a keyed link each frame's tag counts frames in order, so frames are encoded under it.
"""

from __future__ import annotations

import collections
import dataclasses
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from .._errors import map_link_errors
from .._log import get_logger
from .._memory import CancelToken
from .._messages import FLAG_TO_INITIATOR, Data
from .._protocol import PAYLOAD_TAG, FrameAuth, Framed, Message, encode
from .._transports.tcp import (
    CHUNK_BYTES,
    INLINE_BYTES,
    Fence,
    PayloadMac,
    StreamPlan,
    mac_update,
    send_nowait,
    send_views,
    send_views_inline,
)
from .requests import Request

if TYPE_CHECKING:
    from .link import Link

__all__ = ["LinkWriter"]

_log = get_logger("link")

#: frames for :meth:`LinkWriter.send_soon`: the messages, the last one's payload, what to run
#: after
_Outgoing = tuple[list[Message | Framed], list[memoryview], Callable[[], None]]

#: what send_soon is handed in the rest of a loop turn, after the frames it sent at once, is held
#: and sent together, at most this many items at a time: the peer starts on the first of a
#: burst of requests while the rest are being issued
_TURN_BATCH = 8


def _frame_of(m: Message | Framed, auth: FrameAuth | None) -> bytes:
    return encode(m, auth) if isinstance(m, Message) else m.frame(auth)


class LinkWriter:
    """Everything that writes to one link's socket."""

    def __init__(self, link: Link, auth: FrameAuth | None) -> None:
        self.link = link
        self._send_auth = auth
        # fast_acquire: an uncontended lock costs no trip through the event loop. A semaphore,
        # not a lock: a frame the reader started (send_soon) may be finished by another task.
        self.send_lock = anyio.Semaphore(1, fast_acquire=True)
        #: frames the reader handed to :meth:`send_soon` while the send lock was taken
        self._outbox: collections.deque[_Outgoing] = collections.deque()
        self._writing = False
        #: while corked (the reader acts on what one read brought, or the rest of a loop turn
        #: after a frame sent at once: _hold_turn), send_soon holds its frames here: the
        #: replies to a burst of requests, or a burst of requests, leave in one sendmsg
        self._corked = 0
        self._held: list[_Outgoing] = []
        self._held_bytes = 0
        #: corked until the end of this loop turn (:meth:`_hold_turn`)
        self._turn_held = False

    @property
    def outbox_frames(self) -> int:
        """Items :meth:`send_soon` queued and not sent yet: the writer task's queue, and what
        is held while corked when it will join that queue (the send path is busy). What is
        held while the path is free leaves in one go when the read or the loop turn is done,
        at most about ``INLINE_BYTES`` (in a turn, ``_TURN_BATCH`` items) at a time: that is
        no queue."""
        held = len(self._held) if (self._outbox or not self.send_lock.value) else 0
        return len(self._outbox) + held

    def cork(self) -> None:
        """Hold what :meth:`send_soon` is given until :meth:`uncork` (nestable)."""
        self._corked += 1

    def uncork(self) -> None:
        """Send what was held, together: at once when the send lock is free, else through
        the link's writer task."""
        self._corked -= 1
        if not self._corked:
            self._flush()

    def _hold_turn(self) -> None:
        """After frames sent at once (not for the reader): hold what else this loop turn
        hands to :meth:`send_soon` until the turn ends, then send it together. A burst of
        requests leaves in a few ``sendmsg`` instead of one each (each wakes the peer); a lone
        request pays one loop callback. Not on trio (no cheap one) or once the endpoint
        stopped: frames then go out as they come."""
        if self._turn_held or not self.link.host.soon(self._end_turn):
            return  # (held already: a frame's done callback sent another at once)
        self._turn_held = True
        self._corked += 1

    def _end_turn(self) -> None:
        self._turn_held = False
        try:
            self.uncork()
        except Exception as exc:  # (a loop callback must never raise)
            _log.exception("link.writer_crashed")
            self.link.fail(exc)

    def _send_held(self) -> None:
        """What this turn holds leaves before a frame sent any other way: at once when the
        send lock is free, else it joins the writer task's queue, as any :meth:`send_soon`
        frame that finds the lock taken (whose order with a task's frame is that of the
        lock's waiters)."""
        if self._held:
            self._flush()

    def _flush(self) -> None:
        items, self._held = self._held, []
        self._held_bytes = 0
        if not items:
            return
        if not self.link.alive:
            _run_all([done for _, _, done in items])
            return
        if self.send_lock.value and not self._outbox:
            self._send_at_once(items)
            return
        self._outbox.extend(items)
        self._start_writer()

    def withdraw(self, done: Callable[[], None]) -> bool:
        """Take back the frames queued (or held) with ``done``, if none of their bytes went
        out yet, and run ``done``: a cancelled push then reads no more of its memory. False
        when they are being sent (``done`` runs once they are)."""
        for queue in (self._held, self._outbox):
            for item in queue:
                if item[2] == done:  # (a bound method is a new object at each access)
                    queue.remove(item)
                    done()
                    return True
        return False

    def _start_writer(self) -> bool:
        """Start the task that sends the outbox (if none runs); False when the engine
        stopped (the outbox was dropped, the link failed)."""
        if self._writing:
            return True
        try:
            self.link.host.spawn(self._write_outbox)
        except RuntimeError as exc:  # the engine stopped: nothing more goes out
            dropped = list(self._outbox)
            self._outbox.clear()
            self.link.fail(exc)
            _run_all([done for _, _, done in dropped])
            return False
        self._writing = True
        return True

    async def send(self, msg: Message) -> None:
        """Send one control frame (no payload) without blocking the loop.

        Raises:
            LinkBroken: the link is down or the socket failed.
        """
        self._send_held()
        self.link.host.busy_poll.kick()
        async with self.send_lock:
            if not self.link.alive:
                raise self.link.down_error()
            # Encoded under the lock: on a keyed link each frame's tag counts frames in order.
            data = memoryview(encode(msg, self._send_auth))
            failed = f"send to cluster {self.link.peer_cluster_id} failed"
            with map_link_errors(self.link.fail, failed):
                # Most frames go out whole at once: then no scope or loop turn is needed.
                try:
                    sent = self.link.sock.send(data, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                if sent < len(data):
                    await self._send_rest(data[sent:])
        # A send that went out at once still lets cancellation in here (without a loop turn).
        await anyio.lowlevel.checkpoint_if_cancelled()

    def send_soon(
        self, frames: list[Message | Framed], views: list[memoryview], done: Callable[[], None]
    ) -> bool:
        """Send control frames and the payload ``views`` of the last one (a small DATA frame)
        for the reader, which must never wait on a send.

        With the send lock free and nothing queued they go out at once, in one non-blocking
        ``sendmsg`` (a task finishes what the socket did not take), and what the rest of the
        loop turn hands over is sent together at its end (:meth:`_hold_turn`); otherwise they
        queue for the link's writer task, which sends what queued up together, a syscall for
        many. Either way the lock is held from a frame's first byte to its last. ``done`` runs
        once nothing reads ``views`` any more. Returns False, with nothing sent or queued and
        ``done`` not run, when the link is down. A socket error breaks the link.
        """
        if not self.link.alive:
            return False
        self.link.host.busy_poll.kick()
        if self._corked:
            self._held.append((frames, views, done))
            self._held_bytes += sum(map(len, views))  # (1-D byte views)
            # One flush carries at most about INLINE_BYTES (and a turn's, _TURN_BATCH items).
            if self._held_bytes >= INLINE_BYTES or (
                self._turn_held and len(self._held) >= _TURN_BATCH
            ):
                self._flush()
            return True
        if self.send_lock.value and not self._outbox:
            self._send_at_once([(frames, views, done)])
            self._hold_turn()
            return True
        self._outbox.append((frames, views, done))
        self._start_writer()  # (if the engine stopped: done has run, the link failed)
        return True

    def _send_at_once(self, items: list[_Outgoing]) -> None:
        """``items`` in as few non-blocking ``sendmsg`` as the socket takes; a task finishes
        what it did not take, under the send lock taken here."""
        self.send_lock.acquire_nowait()
        finishing = False

        def done() -> None:
            _run_all([item_done for _, _, item_done in items])

        try:
            bufs = self._bufs_of(items)
            with map_link_errors(self.link.fail):  # a failed send breaks the link, nothing raises
                idx = send_nowait(self.link.sock, bufs)
                if idx < len(bufs):
                    try:
                        self.link.host.spawn(self._finish_now, bufs, idx, done)
                    except RuntimeError as exc:  # the engine stopped: the frame can't finish
                        self.link.fail(exc)
                        return
                    finishing = True
        finally:
            if not finishing:
                self.send_lock.release()
                done()

    def _bufs_of(self, items: list[_Outgoing]) -> list[memoryview]:
        """The buffers of :meth:`send_soon` items, in order: each item's encoded frames, then
        its payload. Encoded under the send lock: each frame's tag counts frames on a keyed
        link."""
        bufs: list[memoryview] = []
        auth = self._send_auth
        for frames, views, _ in items:
            if not (self.link.payload_auth and views):
                bufs.append(memoryview(b"".join([_frame_of(m, auth) for m in frames])))
                bufs.extend(views)
                continue
            # The last frame is the DATA frame of ``views``: its payload ends with the MAC,
            # computed here over the views (at most INLINE_BYTES: cheap on the loop). Exact:
            # these frames are never cut short, nothing cancels them.
            data = frames[-1]
            if not isinstance(data, Message):  # (a bug: a payload follows a DATA Message)
                raise TypeError(f"the frame before a payload is {type(data).__name__}")
            frames = [
                *frames[:-1],
                dataclasses.replace(data, payload_len=data.payload_len + PAYLOAD_TAG),
            ]
            bufs.append(memoryview(b"".join([_frame_of(m, auth) for m in frames])))
            bufs.extend(views)
            bufs.append(memoryview(self._payload_mac_of(views)))
        return bufs

    def _payload_mac_of(self, views: list[memoryview]) -> bytes:
        """The trailer of the DATA frame just encoded, over ``views``."""
        assert self._send_auth is not None  # payload_auth implies a keyed link
        mac = self._send_auth.payload_mac(self._send_auth.seq - 1)
        mac_update(mac, views)
        return mac.digest()

    async def _finish_now(self, bufs: list[memoryview], idx: int, done: Callable[[], None]) -> None:
        """The rest of :meth:`_send_at_once`'s frames, under the send lock it took."""
        try:
            with map_link_errors(self.link.fail):  # a failed send breaks the link, nothing raises
                await self._inline(send_views_inline(self.link.sock, bufs, idx, CancelToken()))
        finally:
            self.send_lock.release()
            done()

    async def _write_outbox(self) -> None:
        """The writer of :meth:`send_soon`'s queue: batches of up to ``INLINE_BYTES`` of
        payload per turn of the send lock, each in as few syscalls as the socket allows."""
        batch: list[_Outgoing] = []
        drained = False
        try:
            with map_link_errors(self.link.fail):  # a failed send breaks the link, nothing raises
                while self._outbox and self.link.alive:
                    async with self.send_lock:
                        if not self.link.alive:
                            break
                        size = 0
                        while self._outbox and (not batch or size < INLINE_BYTES):
                            item = self._outbox.popleft()
                            batch.append(item)
                            size += sum(map(len, item[1]))
                        bufs = self._bufs_of(batch)
                        idx = send_nowait(self.link.sock, bufs)
                        if idx < len(bufs):
                            await self._inline(
                                send_views_inline(self.link.sock, bufs, idx, CancelToken())
                            )
                    sent, batch = batch, []
                    _run_all([done for _, _, done in sent])
                drained = True
        finally:
            self._writing = False
            if not drained or not self.link.alive:  # what is still queued never goes out
                batch.extend(self._outbox)
                self._outbox.clear()
            _run_all([done for _, _, done in batch])

    async def _send_rest(self, data: memoryview) -> None:
        """Finish a frame the socket took only part of.

        Raises:
            TimeoutError: the peer stopped reading for the stall timeout. OSError: send failed.
        """
        # Once the first byte is out the frame must be finished, whoever cancels us: a
        # half-sent frame would desynchronise the stream. A peer that stops reading for the
        # whole stall timeout breaks the link instead.
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.link.host.stall_timeout_s) as stall:
                while data:
                    try:
                        n = self.link.sock.send(data, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        await anyio.wait_writable(self.link.sock)
                        continue
                    data = data[n:]
            if stall.cancelled_caught:
                raise TimeoutError("the peer stopped reading")

    async def send_stream(
        self,
        req: Request,
        stream: StreamPlan,
        to_initiator: bool,
        token: CancelToken,
        lead: Message | None = None,
        span: tuple[int, int] | None = None,
    ) -> bool:
        """Send a plan's bytes as DATA frames: stream bytes ``[start, stop)`` of ``span``, by
        default all. Returns False if stopped by ``token``.

        Each frame goes out from a worker thread straight from the source memory. When the
        token trips, the worker stops reading source memory at once (the current frame is
        finished with zeros) and no further frame is sent. ``lead`` (a control frame, e.g. the
        GRANT) goes out first, in the same syscall as a small first frame.

        Raises:
            LinkBroken: the link failed (the link is then broken).
        """
        self._send_held()
        self.link.host.busy_poll.kick()
        off, end = (0, stream.total) if span is None else span
        flags = FLAG_TO_INITIATOR if to_initiator else 0
        if lead is not None and (end - off > INLINE_BYTES or end <= off):
            await self.send(lead)
            lead = None
        start = off
        while off < end:
            if token.cancelled or not self.link.alive:
                if lead is not None and self.link.alive:
                    await self.send(lead)
                return False
            if off != start:
                # Between frames a cancelled scope stops the stream (a send's own bound, a
                # serving budget: they trip no token); nothing checks before the first frame,
                # which for a layer is the only one.
                await anyio.lowlevel.checkpoint_if_cancelled()
            n = min(CHUNK_BYTES, end - off)
            if type(stream).prepare is _PLAIN_PREPARE:  # host memory: no coroutine, no await
                views = stream.views(off, n)
            else:
                views = await stream.prepare(off, n, token)
            try:
                await self._send_frame(req, off, n, views, flags, token, lead)
            finally:
                stream.sent()  # (its staging buffer, if any, is free for the next frame)
            lead = None
            off += n
            self.link.stats_bytes += n
        return not token.cancelled

    async def _send_frame(
        self,
        req: Request,
        off: int,
        n: int,
        views: list[memoryview],
        flags: int,
        token: CancelToken,
        lead: Message | None,
    ) -> None:
        """One DATA frame of :meth:`send_stream` (stream bytes ``[off, off + n)`` in
        ``views``), behind ``lead`` if any, under the send lock: from the loop up to
        ``INLINE_BYTES``, else from a fenced worker thread.

        Raises:
            LinkBroken: the link failed (the link is then broken).
        """
        fence: Fence | None = None  # (only a frame a worker thread sends has one)
        # A free lock is taken with no checkpoint: a layer's frame then goes out with no trip
        # through the scheduler (the caller looked at the token just before).
        if self.send_lock.value:  # (0 while anyone waits: a release hands it over)
            self.send_lock.acquire_nowait()
        else:
            await self.send_lock.acquire()
        try:
            if not self.link.alive:
                raise self.link.down_error()
            # In order under the lock: each frame's tag counts frames on a keyed link.
            first = b"" if lead is None else encode(lead, self._send_auth)
            header, tagger = self._data_header(req, off, n, bool(flags & FLAG_TO_INITIATOR), first)
            failed = f"sending to cluster {self.link.peer_cluster_id}"
            with map_link_errors(self.link.fail, failed):
                if n <= INLINE_BYTES:
                    bufs = [memoryview(header), *views]
                    idx = send_nowait(self.link.sock, bufs, tagger)
                    if idx < len(bufs):
                        await self._inline(
                            send_views_inline(self.link.sock, bufs, idx, token, tagger)
                        )
                    return
                # Set only now, next to the worker that will release it.
                fence = Fence(token, self.link.host.stall_timeout_s, req.deadline)
                req.fence = fence
                # Shielded: the header's tag is spent, so the frame must go out (the worker
                # itself stops at the fence's token or stall).
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(
                        send_views,
                        self.link.sock,
                        header,
                        views,
                        fence,
                        tagger,
                        limiter=self.link.threads,
                    )
        finally:
            if fence is not None:
                fence.released.set()  # the worker has returned (or never started)
                req.fence = None
            self.send_lock.release()

    def send_frame_now(
        self,
        req: Request,
        stream: StreamPlan,
        to_initiator: bool,
        span: tuple[int, int],
        then: Callable[[bool], None],
    ) -> bool:
        """Send stream bytes ``span`` of host memory as one DATA frame from the loop, with no
        await, when that costs no wait: the send lock free, at most ``INLINE_BYTES``, the
        request's token untripped. What the socket does not take at once a task finishes
        under the send lock, fenced as :meth:`send_stream`'s worker frames are (``req.fence``:
        a cancel pads the rest with zeros, and :meth:`Link.release` waits for it). ``then``
        runs once the frame's last byte is out (True; before this returns if it went out
        whole) or it could not be (False: the link failed, or the token tripped under it).
        False, with nothing sent and ``then`` not run, otherwise, and if the send broke the
        link.
        """
        self._send_held()
        self.link.host.busy_poll.kick()
        off, end = span
        n = end - off
        if (
            not 0 < n <= INLINE_BYTES
            or type(stream).prepare is not _PLAIN_PREPARE
            or not self.send_lock.value
            or req.token.cancelled
            or req.fence is not None
            or not self.link.alive
        ):
            return False
        views = stream.views(off, n)
        self.send_lock.acquire_nowait()
        finishing = False
        try:
            header, tagger = self._data_header(req, off, n, to_initiator)
            bufs = [memoryview(header), *views]
            with map_link_errors(self.link.fail):  # a failed send breaks the link
                idx = send_nowait(self.link.sock, bufs, tagger)
                if idx < len(bufs) and self.link.alive:
                    fence = Fence(req.token, self.link.host.stall_timeout_s, req.deadline)
                    req.fence = fence
                    try:
                        self.link.host.spawn(
                            self._finish_frame, req, fence, bufs, idx, tagger, then
                        )
                    except RuntimeError as exc:  # the engine stopped: the frame can't finish
                        req.fence = None
                        fence.released.set()
                        self.link.fail(exc)
                        return False
                    finishing = True
        finally:
            if not finishing:
                self.send_lock.release()
        if not self.link.alive:
            return False
        self.link.stats_bytes += n
        if not finishing:
            then(True)
        return True

    def _data_header(
        self, req: Request, off: int, n: int, to_initiator: bool, first: bytes = b""
    ) -> tuple[bytes, PayloadMac | None]:
        """The header of a DATA frame of ``n`` payload bytes at stream offset ``off`` (after
        ``first``, a control frame sent with it), and with ``llm.PayloadAuth`` what computes
        its payload's trailer. Call under the send lock: each frame's tag counts frames on a
        keyed link."""
        trailer = PAYLOAD_TAG if self.link.payload_auth else 0
        header = first + Data.frame(req.req_id, off, n + trailer, to_initiator, self._send_auth)
        if not trailer:
            return header, None
        assert self._send_auth is not None  # payload_auth implies a keyed link
        mac = self._send_auth.payload_mac(self._send_auth.seq - 1)
        return header, PayloadMac(mac, len(header), n)

    async def _finish_frame(
        self,
        req: Request,
        fence: Fence,
        bufs: list[memoryview],
        idx: int,
        tagger: PayloadMac | None,
        then: Callable[[bool], None],
    ) -> None:
        """The rest of :meth:`send_frame_now`'s frame, under the send lock it took."""
        try:
            # A failed send breaks the link, nothing raises: the request fails with it.
            with map_link_errors(self.link.fail):
                rest = send_views_inline(self.link.sock, bufs, idx, fence.token, tagger)
                await self._inline(rest)
        finally:
            fence.released.set()
            if req.fence is fence:
                req.fence = None
            self.send_lock.release()
            then(self.link.alive and not fence.token.cancelled)  # (cancelled: zeros went)

    async def _inline(self, io: Any) -> Any:
        """Run a small frame's I/O on the loop: shielded (a frame, once started, must be
        finished) and bounded by the stall timeout (then the link breaks).

        Raises:
            TimeoutError: the peer made no progress. OSError / EOFError: the socket failed.
        """
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.link.host.stall_timeout_s) as stall:
                return await io
            if stall.cancelled_caught:
                io.close()
                raise TimeoutError("the peer made no progress within the stall timeout")


#: a stream of host memory prepares its frames with :meth:`StreamPlan.views` alone
_PLAIN_PREPARE = StreamPlan.prepare


def _run_all(callbacks: list[Callable[[], None]]) -> None:
    """Run every callback (what lets go of each frame's memory), even if one raises: a
    failure is logged, never allowed to keep the others' pins or ends from happening."""
    for callback in callbacks:
        try:
            callback()
        except Exception:
            _log.exception("link.callback_failed")
