"""The only reader of a link's socket, run by the event loop's I/O driver (``_drivers``).

Each time the socket is readable the driver calls :meth:`LinkReader.readable` on the loop
thread, which reads what is there and acts on every frame it completes, without a task switch:
control frames go to the link's router (:meth:`~.router.FrameRouter.dispatch_now`); a DATA
frame's payload of up to ``INLINE_BYTES`` is received straight into its destination views, as
many readiness calls as it takes (:class:`_Inflow`), a cancel diverting the rest to scratch at
once (the loop thread is the only writer, so a cancel is an immediate fence). What must wait
for something (a payload for worker threads, device staging, a peer owed too many replies, a
grant checked in a thread) pauses the driver and runs in a task, which resumes it when done.

A peer that stops in the middle of a frame for the stall timeout breaks the link (a partial
frame holds memory, and part of ``llm.MetaBudget``): the driver's deadline.
"""

from __future__ import annotations

import bisect
import contextlib
import hmac
import itertools
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from .._drivers import Driver, driver_for
from .._errors import (
    LINK_IO_ERRORS,
    CopyCancelled,
    LinkBroken,
    LLMException,
    ProtocolError,
    map_link_errors,
)
from .._memory import CancelToken
from .._messages import FLAG_EAGER, FLAG_TO_INITIATOR, Abort, Data
from .._protocol import MT, NEED_DATA, PAYLOAD_TAG, Decoder, Message
from .._transports._bufs import FEW_VIEWS, IOV_MAX, batch, moved
from .._transports.tcp import (
    CHUNK_BYTES,
    INLINE_BYTES,
    Fence,
    PayloadMac,
    recv_views,
    scratch_views,
)
from .requests import Request
from .router import DEFER, YIELD

if TYPE_CHECKING:
    from .link import Link

__all__ = ["LinkReader"]

_READ_AHEAD = 16 << 10
#: the reader lets other tasks run after this much read in one go, payloads included (a peer
#: that streams big metas or many inline payloads as fast as the socket allows would
#: otherwise hold the loop for as long as it keeps sending)
_YIELD_BYTES = 2 << 20
#: ... and after this many frames (each small request it serves costs tens of microseconds:
#: a 2 MiB burst of them is thousands)
YIELD_FRAMES = 64
#: ... and after a frame of more meta than this (parsing a table, or a request of many
#: ranges, costs milliseconds)
_HEAVY_META = 64 << 10


class _Landing:
    """Where one DATA frame's payload goes: its request (None: nobody receives it), its views
    (empty: discarded), and its MAC check (``llm.PayloadAuth``)."""

    __slots__ = ("msg", "n", "off", "pmac", "req", "stream", "tag", "token", "views")

    def __init__(self, link: Link, msg: Message) -> None:
        if msg.type != MT.DATA:
            raise ProtocolError(f"{msg.type.name} frames carry no payload")
        n = msg.payload_len
        # llm.PayloadAuth: the payload ends with its MAC, received with it and checked after.
        auth = link.recv_auth if link.payload_auth else None
        seq = 0
        if auth is not None:
            if n <= PAYLOAD_TAG:
                raise ProtocolError("DATA frame without its payload MAC (llm.PayloadAuth)")
            n -= PAYLOAD_TAG
            seq = auth.seq - 1  # the DATA frame's own number: nothing was decoded since
        if n > CHUNK_BYTES:
            raise ProtocolError(f"DATA frame of {n} bytes exceeds {CHUNK_BYTES}")
        table = link.pending if msg.flags & FLAG_TO_INITIATOR else link.serving
        req: Request | None = table.get(msg.req_id)
        off = Data.offset_of(msg)
        stream = req.stream if req is not None else None
        if req is not None and bool(msg.flags & FLAG_EAGER) is not req.eager:
            # Early bytes of a push the target did not take as sent (it granted the push, and
            # they come again under the grant), or late ones for one it did: discarded.
            stream = None
        if req is None or stream is None:
            req = None  # nothing of ours receives this frame: discard it, touching no request
        elif off + n > stream.total:
            raise ProtocolError(f"DATA frame [{off}, +{n}) outside its plan")
        elif off != req.received:
            # A request's bytes come in order (its sender sends one frame after another): it
            # ends once ``total`` bytes landed, which then cover its plan exactly.
            what = "pull" if msg.flags & FLAG_TO_INITIATOR else "push"
            raise ProtocolError(
                f"DATA frame at {off} of a {what} whose bytes so far end at {req.received}"
            )
        self.msg = msg
        self.n = n
        self.off = off
        self.req = req
        self.stream = stream
        self.token = req.token if req is not None else _CANCELLED
        self.views: list[memoryview] = []  # (a staged stream's: taken in _receive_big)
        if stream is not None and not stream.staged:
            self.views = stream.receive_views(off, n)
        self.pmac: PayloadMac | None = None
        self.tag: bytearray | None = None
        if auth is not None:
            self.tag = bytearray(PAYLOAD_TAG)
            if req is not None:
                # Hashed where each batch lands; the trailer lands in ``tag``.
                self.pmac = PayloadMac(auth.payload_mac(seq), 0, n)
                self.views = [*self.views, memoryview(self.tag)]

    @property
    def inline(self) -> bool:
        """Received on the loop (small, and nothing to move after it lands)."""
        return self.n <= INLINE_BYTES and not (self.stream is not None and self.stream.staged)

    def take_buffered(self, link: Link) -> int:
        """Copy the bytes the read-ahead already pulled in (at most 64 KiB); returns how many."""
        dec = link.decoder
        if not (dec.buffered and dec.payload_remaining):
            return 0
        with dec.take_payload() as chunk:
            if self.req is not None and not self.token.cancelled:
                _copy_into(self.views, 0, chunk)
                if self.pmac is not None:
                    self.pmac.passed(self.views, 0, chunk.nbytes)
            return chunk.nbytes

    def authentic(self) -> bool:
        """Every byte landed where it belongs and matches its trailer (or needs none)."""
        if self.pmac is None or self.tag is None or self.req is None or self.token.cancelled:
            return True
        return hmac.compare_digest(self.pmac.digest(), self.tag)


class _Inflow:
    """The rest of an inline payload, received into its views over as many readiness calls as
    it takes; a tripped token diverts what is left to scratch (the stream stays in step)."""

    __slots__ = (
        "after",
        "bufs",
        "diverted",
        "drained",
        "idx",
        "landing",
        "left",
        "rest",
        "scratch",
        "tail",
    )

    def __init__(
        self,
        landing: _Landing,
        pos: int,
        rest: int,
        scratch: memoryview,
        tail: memoryview | None = None,
    ) -> None:
        self.landing = landing
        self.scratch = scratch
        views = landing.views
        self.bufs = _slice_views(views, pos, rest) if views else scratch_views(rest, scratch)
        self.diverted = not views
        self.idx = 0
        self.rest = self.left = rest
        #: the last call also reads what follows the payload into ``tail`` (the reader's
        #: read-ahead buffer): ``after`` bytes of it, and whether that left the socket empty
        self.tail = tail
        self.after = 0
        self.drained = False

    def pump(self, sock: socket.socket) -> bool:
        """Receive what the socket has; True once every byte is in.

        Raises:
            EOFError: the peer closed mid-frame. OSError: the connection failed.
        """
        bufs = self.bufs
        pmac = self.landing.pmac
        while self.idx < len(bufs):
            if not self.diverted and self.landing.token.cancelled:
                bufs = self.bufs = scratch_views(self.left, self.scratch)
                self.idx = 0
                self.diverted = True
            chunk = batch(bufs, self.idx)
            views = chunk[0]
            last = (  # (the tail must not make it one buffer more than a call takes)
                self.tail is not None and len(views) < IOV_MAX and chunk[1] == self.left
            )
            if last:  # the payload's last call: what follows it lands in the tail
                assert self.tail is not None
                views = [*views, self.tail]
            try:
                n = sock.recvmsg_into(views, 0, socket.MSG_DONTWAIT)[0]
            except (BlockingIOError, InterruptedError):
                return False
            if n == 0:
                raise EOFError("peer closed the connection in the middle of a frame")
            if last:
                self.drained = n < self.left + len(views[-1])
                if n > self.left:
                    self.after, n = n - self.left, self.left
            if pmac is not None and not self.diverted:
                pmac.passed(bufs, self.idx, n)
            self.idx = moved(bufs, self.idx, n, chunk)
            self.left -= n
        return True


class LinkReader:
    """Reads one link's socket from its driver; see the module docstring."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._buf = memoryview(bytearray(_READ_AHEAD))
        self._driver: Driver | None = None
        self._scope: anyio.CancelScope | None = None
        #: the task doing what the reader had to await (the driver is paused meanwhile)
        self._work: anyio.CancelScope | None = None
        self._inflow: _Inflow | None = None
        self._stopped = False
        #: bytes read so far, and their count when the stall deadline was set
        self._moved = 0
        self._stall_mark = -1

    @property
    def reading(self) -> bool:
        """The driver watches the socket (not paused for a task, not stopped)."""
        return self._driver is not None and not self._driver.paused and not self._stopped

    async def run(self, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Drive the socket until the link breaks or closes."""
        link = self.link
        with anyio.CancelScope() as scope:
            self._scope = scope
            driver = self._driver = driver_for(link.sock, self.readable, self._stalled)
            task_status.started()
            if link.alive and not self._stopped:
                await driver.run()

    def stop(self) -> None:
        """The link is down: no read after this (called before its socket is closed)."""
        self._stopped = True
        if self._driver is not None:
            self._driver.stop()
        if self._scope is not None:
            self._scope.cancel()
        if self._work is not None:
            self._work.cancel()
        inflow, self._inflow = self._inflow, None
        if inflow is not None:
            self.link.host.scratch.release(inflow.scratch)

    # ------------------------------------------------------------------ on the loop
    def readable(self) -> bool:
        """The driver's callback: read and act on what is there; True when work is left."""
        link = self.link
        writer = link.writer
        link.host.busy_poll.kick()
        # What the frames of this read answer leaves together, once they are all read.
        writer.cork()
        try:
            # The socket's failures, the peer's garbage (ProtocolError) and the link's own
            # verdicts (LinkBroken) break the link; the reader then just ends.
            with map_link_errors(link.fail, catch=(*LINK_IO_ERRORS, LLMException)):
                return self._read()
        except Exception as exc:  # a bug must break this link, not the whole engine
            link.log.exception("link.reader_crashed")
            link.fail(exc)
        finally:
            try:
                with map_link_errors(link.fail):
                    writer.uncork()
            except Exception as exc:  # (a loop callback must never raise)
                link.log.exception("link.reader_crashed")
                link.fail(exc)
        return False

    def _read(self) -> bool:
        link = self.link
        dec = link.decoder
        sock = link.sock
        driver = self._driver
        assert driver is not None
        budget, frames = _YIELD_BYTES, YIELD_FRAMES
        # The last read took less than it asked for: the socket had no more then, and the
        # driver (level-triggered) calls again once it has (a read that would fail is a
        # syscall per request on each side).
        drained = False
        while link.alive and not driver.paused:
            inflow = self._inflow
            if inflow is not None:
                left = inflow.left
                done = inflow.pump(sock)
                self._moved += left - inflow.left
                budget -= left - inflow.left
                if not done:
                    self._arm_stall()
                    return False
                self._inflow = None
                self._landed(inflow.landing, inflow.scratch, inflow.rest)
                drained = inflow.drained
                if inflow.after:  # (after the payload is consumed: they follow it)
                    dec.receive_data(self._buf[: inflow.after])
                    self._moved += inflow.after
                    budget -= inflow.after
                continue
            ev = dec.next_event()
            if ev is NEED_DATA:
                if budget <= 0:
                    return True
                try:
                    if drained:
                        return self._idle(dec, driver)
                    n = sock.recv_into(self._buf, _READ_AHEAD, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    return self._idle(dec, driver)
                if n == 0:
                    raise EOFError(f"cluster {link.peer_cluster_id} closed the connection")
                drained = n < _READ_AHEAD
                dec.receive_data(self._buf[:n])
                self._moved += n
                budget -= n
            elif isinstance(ev, Message):
                frames -= 1
                if ev.payload_len:
                    if not self._payload(ev):
                        return False
                else:
                    verdict = link.router.dispatch_now(ev)
                    if verdict == DEFER:
                        self._defer(link.router.dispatch, ev)
                        return False
                    if verdict == YIELD:
                        return True
                if frames <= 0 or dec.last_meta > _HEAVY_META:
                    return True
            else:  # payload bytes outside a DATA frame cannot happen
                raise ProtocolError("unexpected payload bytes")
        return False

    def _idle(self, dec: Decoder, driver: Driver) -> bool:
        """Nothing more to read now: False (the driver waits for the socket), the stall
        deadline armed while a frame is half in."""
        if dec.buffered:
            # A legit peer sends a frame's meta without pausing; one that stops half-way must
            # not keep its share of the budget for ever.
            self._arm_stall()
        elif self._stall_mark >= 0:
            self._stall_mark = -1
            driver.set_deadline(None)
        return False

    def _payload(self, msg: Message) -> bool:
        """Start receiving a DATA frame; False when the reader must stop (a task receives it,
        or it is not all here yet)."""
        landing = _Landing(self.link, msg)
        if not landing.inline:
            self._defer(self._receive_big, landing)
            return False
        pos = landing.take_buffered(self.link)
        rest = self.link.decoder.payload_remaining
        if not rest:
            self._landed(landing, None, 0)
            return True
        # Scratch (to discard what nobody receives) is borrowed only for this frame: an idle
        # link holds no buffers.
        self._inflow = _Inflow(landing, pos, rest, self.link.host.scratch.acquire(), self._buf)
        return True

    def _landed(self, landing: _Landing, scratch: memoryview | None, rest: int) -> None:
        """Every byte of an inline payload is in."""
        link = self.link
        if scratch is not None:
            link.host.scratch.release(scratch)
        link.decoder.payload_consumed(rest)
        if not landing.authentic():
            self._defer(self._refuse_payload, landing)
            return
        _count(link, landing)

    def _arm_stall(self) -> None:
        if self._stall_mark < 0 and self._driver is not None:
            self._stall_mark = self._moved
            self._driver.set_deadline(self.link.host.timers.now() + self.link.host.stall_timeout_s)

    def _stalled(self) -> None:
        """The driver's deadline: the peer stopped mid-frame, unless bytes came meanwhile."""
        link = self.link
        if not link.alive or self._stall_mark < 0:
            return
        if self._moved != self._stall_mark:  # progress: watch the next stretch
            self._stall_mark = -1
            self._arm_stall()
            return
        link.fail(_stopped_mid_frame(link))

    # ------------------------------------------------------------------ in a task
    def _defer(self, work: Callable[[Any], Awaitable[None]], arg: Any) -> None:
        """Pause the driver and run ``work(arg)`` in a task; the driver resumes after it."""
        assert self._driver is not None
        self._driver.pause()
        if self._stall_mark >= 0:  # the task bounds its own waits (fences, stall timeouts)
            self._stall_mark = -1
            self._driver.set_deadline(None)
        try:
            self.link.host.spawn(self._deferred, work, arg)
        except RuntimeError as exc:  # the engine stopped: nothing more is read
            self.link.fail(exc)

    async def _deferred(self, work: Callable[[Any], Awaitable[None]], arg: Any) -> None:
        link = self.link
        try:
            with anyio.CancelScope() as self._work:
                if self._stopped:
                    return
                with map_link_errors(link.fail, catch=(*LINK_IO_ERRORS, LLMException)):
                    await work(arg)
        except Exception as exc:  # a bug must break this link, not the whole engine
            link.log.exception("link.reader_crashed")
            link.fail(exc)
        finally:
            self._work = None
            if link.alive and not self._stopped and self._driver is not None:
                self._driver.resume()

    async def _receive_big(self, landing: _Landing) -> None:
        """A payload over ``INLINE_BYTES`` (worker threads), or into device memory (staged)."""
        link = self.link
        stream = landing.stream
        if stream is not None and stream.staged:  # (before the MAC's tag, if any)
            landing.views[:0] = await stream.receive_staged(landing.off, landing.n)
        pos = landing.take_buffered(link)
        rest = link.decoder.payload_remaining
        req, token, views = landing.req, landing.token, landing.views
        stall_s = link.host.stall_timeout_s
        if rest:
            scratch = link.host.scratch.acquire()
            target = _slice_views(views, pos, rest) if views else scratch_views(rest, scratch)
            fence = None
            try:
                if rest <= INLINE_BYTES:  # staged, small: on the loop, bounded by the stall
                    inflow = _Inflow(landing, pos, rest, scratch)
                    with anyio.move_on_after(stall_s) as stalled:
                        while not inflow.pump(link.sock):
                            await anyio.wait_readable(link.sock)
                    if stalled.cancelled_caught:
                        raise _stopped_mid_frame(link)
                else:
                    fence = Fence(token, stall_s, req.deadline if req is not None else None)
                    if req is not None:
                        req.fence = fence
                    await anyio.to_thread.run_sync(
                        recv_views,
                        link.sock,
                        target,
                        fence,
                        scratch,
                        landing.pmac,
                        limiter=link.threads,
                    )
            finally:
                if fence is not None:
                    # The worker has finished here (the call is not abandoned on cancel), or
                    # it never started: cancelled while waiting for a thread. Either way
                    # nothing touches the buffers any more; a fence left unset would hold
                    # release() forever.
                    fence.released.set()
                if req is not None:
                    req.fence = None
                link.host.scratch.release(scratch)
            link.decoder.payload_consumed(rest)
        if not landing.authentic():
            await self._refuse_payload(landing)
        if req is not None and stream is not None and stream.staged and not token.cancelled:
            # Staged (device) streams scatter now; that worker is fenced like the receive.
            fence = Fence(token, stall_s)
            req.fence = fence
            try:
                await stream.commit(landing.off, landing.n, token)
            except CopyCancelled:
                pass  # cancelled meanwhile: the bytes are dropped, the link is fine
            finally:
                fence.released.set()
                req.fence = None
        _count(link, landing)

    async def _refuse_payload(self, landing: _Landing) -> None:
        """A payload that does not match its MAC: tell the peer, then break the link.

        Raises:
            LinkBroken: always (the bytes are not the peer's: a relay changed them).
        """
        link = self.link
        exc = LinkBroken(
            f"payload failed authentication (llm.PayloadAuth): DATA from cluster "
            f"{link.peer_cluster_id} to cluster {link.host.cluster_id} does not match its MAC "
            "(changed on the way, or the memory was written during the transfer); the link is "
            "broken"
        )
        # Tell the peer why first (its link then breaks with these words, not as a hang-up):
        # best effort, as a relay that changes bytes may drop frames too.
        req_id = landing.msg.req_id
        to_initiator = not landing.msg.flags & FLAG_TO_INITIATOR
        abort = Abort(req_id, exc.status_code, str(exc), broken=True, to_initiator=to_initiator)
        with contextlib.suppress(Exception), anyio.move_on_after(1):
            await link.send(abort.encode())
        raise exc


def _stopped_mid_frame(link: Link) -> TimeoutError:
    """Why a link breaks whose peer stopped in a frame for the stall timeout."""
    stall_s, peer = link.host.stall_timeout_s, link.peer_cluster_id
    return TimeoutError(f"cluster {peer} stopped in the middle of a frame for {stall_s:g} s")


def _count(link: Link, landing: _Landing) -> None:
    """A payload landed: count it, and tell its request when all of its bytes are in (one
    nobody receives, discarded, is not counted)."""
    req, stream = landing.req, landing.stream
    if req is not None and stream is not None:
        link.stats_bytes += landing.n
        req.received += landing.n
        if req.received >= stream.total:
            req.data_event.set()


_CANCELLED = CancelToken()
_CANCELLED.cancel()


def _copy_into(views: list[memoryview], pos: int, data: memoryview) -> None:
    """Copy ``data`` into the concatenation of ``views`` starting at byte ``pos``."""
    for v in _slice_views(views, pos, data.nbytes):
        v[:] = data[: v.nbytes]
        data = data[v.nbytes :]


def _slice_views(views: list[memoryview], pos: int, n: int) -> list[memoryview]:
    """The parts of ``views`` (1-D byte views) that hold bytes ``[pos, pos + n)`` of their
    concatenation (most views whole: no new view)."""
    if len(views) > FEW_VIEWS:
        return _slice_many(views, pos, n)
    out: list[memoryview] = []
    for v in views:
        if n <= 0:
            break
        size = v.nbytes
        if pos >= size:
            pos -= size
        elif not pos and size <= n:  # (most views are taken whole: no new view)
            out.append(v)
            n -= size
        else:
            take = min(size - pos, n)
            out.append(v[pos : pos + take])
            n -= take
            pos = 0
    return out


def _slice_many(views: list[memoryview], pos: int, n: int) -> list[memoryview]:
    """:func:`_slice_views` by bisecting the views' running sizes (a many-tensor plan)."""
    ends = list(itertools.accumulate(map(len, views)))
    first = bisect.bisect_right(ends, pos)
    if n <= 0 or first == len(views):
        return []
    last = min(bisect.bisect_left(ends, pos + n), len(views) - 1)
    out = views[first : last + 1]
    lo = pos - (ends[first] - len(views[first]))  # skipped of the first view
    hi = max(ends[last] - (pos + n), 0)  # left off the end of the last
    if first == last:
        if lo or hi:
            out[0] = out[0][lo : len(out[0]) - hi]
        return out
    if lo:
        out[0] = out[0][lo:]
    if hi:
        out[-1] = out[-1][: len(out[-1]) - hi]
    return out
