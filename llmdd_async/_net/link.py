"""A link to one peer endpoint: one TCP connection, its reader, framed sends, request routing.

A link is usable in both directions. Requests this side starts live in ``pending``; requests
the peer starts live in ``serving``. The reader task is the only reader of the socket; bulk
payload is received straight into destination memory by worker threads (see ``tcp``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hmac
import itertools
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from .._enums import LLMStatusCode
from .._errors import LLMException, status_from_exception
from .._log import get_logger
from .._memory import CancelToken, CopyCancelled
from .._messages import regions_of_table, wire_status
from .._phase_lock import PhaseLock
from .._planner import Layout, check_within
from .._protocol import (
    MT,
    NEED_DATA,
    PAYLOAD_TAG,
    UNCHARGED_META,
    Decoder,
    FrameAuth,
    Message,
    ProtocolError,
    encode,
)
from .._transports.tcp import (
    CHUNK_BYTES,
    INLINE_BYTES,
    Fence,
    PayloadMac,
    StreamPlan,
    mac_update,
    recv_nowait,
    recv_views,
    recv_views_inline,
    scratch_views,
    send_nowait,
    send_views,
    send_views_inline,
)

__all__ = [
    "FLAG_TO_INITIATOR",
    "Link",
    "LinkBroken",
    "Pending",
    "Serving",
]

#: DATA/ABORT flag: the frame concerns a request that the *receiver* of the frame started.
FLAG_TO_INITIATOR = 1
_READ_AHEAD = 64 << 10
#: the reader lets other tasks run after this much read without waiting (a peer that streams a
#: big frame's meta as fast as the socket allows would otherwise hold the loop until it ends)
_YIELD_BYTES = 2 << 20
#: replies (PONG, TABLE, ...) owed to a peer before its link stops reading from it
_MAX_REPLIES = 64
#: how often a cancelled request checks that its worker let go
_FENCE_POLL_S = 0.002


@dataclasses.dataclass(frozen=True)
class TransferRecord:
    """One transfer this side ran on a link (``time.monotonic()`` seconds)."""

    op: str
    started: float
    finished: float
    nbytes: int
    mode: str


@dataclasses.dataclass(frozen=True)
class LinkStatistics:
    """What a link has carried so far."""

    peer_cluster_id: int
    transport: str
    transfers: int
    bytes: int
    up_since: float
    recent: tuple[TransferRecord, ...]


class LinkBroken(LLMException):
    """The link failed (peer died, reset, protocol error); in-flight transfers fail with it."""

    def __init__(self, message: str, status_code: LLMStatusCode = LLMStatusCode.LLM_LINK_FAILED):
        super().__init__(message, status_code=status_code)


class Signal:
    """A one-shot event whose ``anyio.Event`` is made only if someone waits before it is set
    (most of a request's signals never are), and whose wait on a set signal takes no loop
    turn."""

    __slots__ = ("_event", "_set")

    def __init__(self) -> None:
        self._set = False
        self._event: anyio.Event | None = None

    def set(self) -> None:
        self._set = True
        if self._event is not None:
            self._event.set()

    def is_set(self) -> bool:
        return self._set

    async def wait(self) -> None:
        if self._set:
            await anyio.lowlevel.checkpoint_if_cancelled()
            return
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()


class _Request:
    """State shared by both kinds of request."""

    def __init__(self, req_id: int, deadline: float | None) -> None:
        self.req_id = req_id
        self.deadline = deadline
        self.token = CancelToken()
        self.stream: StreamPlan | None = None
        self.received = 0
        self.data_event = Signal()
        self.fence: Fence | None = None
        self.error: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.token.cancel(exc)
        self.wake()

    def wake(self) -> None:
        self.data_event.set()


class Pending(_Request):
    """A request this side started (this side is the initiator)."""

    def __init__(self, req_id: int, deadline: float | None) -> None:
        super().__init__(req_id, deadline)
        self.grant: Message | None = None
        self.grant_event = Signal()
        #: run by the reader when the GRANT arrives, before any DATA of this request is read
        self.on_grant: Callable[[Message], None] | None = None
        self.result: Message | None = None
        self.result_event = Signal()

    def wake(self) -> None:
        super().wake()
        self.grant_event.set()
        self.result_event.set()

    async def wait_grant(self) -> Message:
        """Raises the link's or the peer's failure."""
        await self.grant_event.wait()
        if self.grant is None:
            raise self.error or LinkBroken("link closed before the peer answered")
        return self.grant

    async def wait_result(self) -> Message:
        await self.result_event.wait()
        if self.result is None:
            raise self.error or LinkBroken("link closed before the peer answered")
        return self.result

    async def wait_data(self) -> None:
        await self.data_event.wait()
        if self.error is not None:
            raise self.error


class Serving(_Request):
    """A request the peer started (this side is the target)."""

    def __init__(self, req_id: int, deadline: float | None) -> None:
        super().__init__(req_id, deadline)
        self.done_event = Signal()
        #: bytes of the request's arrays, held while it is queued or served, and how many of
        #: them are charged to the endpoint's meta budget (``llm.MetaBudget``)
        self.meta_bytes = 0
        self.charged = 0
        #: run by the reader when DONE arrives, so its effect (consuming a key) happens before
        #: any later request on the link is looked at
        self.on_done: Callable[[Message], None] | None = None

    def wake(self) -> None:
        super().wake()
        self.done_event.set()


#: frames for :meth:`Link.send_soon`: the messages, the last one's payload, what to run after
_Outgoing = tuple[list[Message], list[memoryview], Callable[[], None]]


class Link:
    """One established link. Created by the engine after a successful handshake."""

    def __init__(
        self,
        engine: Any,
        sock: socket.socket,
        decoder: Decoder,
        peer: dict[str, Any],
        access: Any,
        auth: tuple[FrameAuth, FrameAuth] | None = None,
        outbound: bool = False,
    ) -> None:
        self.engine = engine
        self.sock = sock
        self.decoder = decoder
        # The endpoint's meta budget may evict this link's stalled partial frame: then the
        # link breaks at once (its reader would otherwise wait for bytes that never count).
        decoder.on_evict = lambda reason: self.fail(ProtocolError(reason))
        self.peer = peer
        self.peer_cluster_id: int = int(peer["cluster_id"])
        self.access = access  # PeerAccess or None (stream only)
        self._send_auth = auth[0] if auth is not None else None
        self._recv_auth = auth[1] if auth is not None else None
        decoder.set_auth(self._recv_auth)
        #: llm.PayloadAuth (both ends agreed in the handshake): DATA payloads end with a MAC
        self.payload_auth = auth is not None and engine.options.payload_auth
        #: this side's link_clusters made or adopted the link (a second call: ALREADY_LINK)
        self.claimed = outbound
        limits = engine.options.limits
        self.log = get_logger(
            "link", cluster_id=engine.cluster_id, peer_cluster_id=self.peer_cluster_id
        )
        # fast_acquire: an uncontended lock costs no trip through the event loop. A semaphore,
        # not a lock: a frame the reader started (send_soon) may be finished by another task.
        self.send_lock = anyio.Semaphore(1, fast_acquire=True)
        #: pulls and pushes share the link (exclusive=False); each layer of a layer-wise
        #: transfer has it alone (exclusive=True); FIFO between the two
        self.transfer_lock = PhaseLock()
        self.pending: dict[int, Pending] = {}
        self.serving: dict[int, Serving] = {}
        self._ids = itertools.count(1)
        self.broken: BaseException | None = None
        self.closed = False
        self.table: dict[str, Any] | None = None
        #: the table's caches by id (as the peer described them; checked before any use)
        self.peer_caches: dict[int, dict[str, Any]] = {}
        #: cache id -> (its table entry, the layout parsed from that entry)
        self._peer_layouts: dict[int, tuple[dict[str, Any], Layout | None]] = {}
        #: (address, value) of the peer's epoch counter as of that view (one-sided pulls)
        self.peer_epoch: tuple[int, int] | None = None
        #: requests waiting for a reply of a given type (TABLE, UNLINK_ACK, PONG)
        self._waiters: dict[MT, list[Pending]] = {MT.TABLE: [], MT.UNLINK_ACK: [], MT.PONG: []}
        self._reader_scope: anyio.CancelScope | None = None
        self._unyielded = 0
        #: requests of the peer served at once; more wait (bounds staging memory and threads)
        self.serving_limiter = anyio.CapacityLimiter(limits.serving)
        #: worker threads this link may hold (never the whole process's pool: one stalled
        #: peer must not starve the others)
        self.threads = anyio.CapacityLimiter(limits.threads)
        self._replies = anyio.Semaphore(_MAX_REPLIES)
        #: frames the reader handed to :meth:`send_soon` while the send lock was taken
        self._outbox: collections.deque[_Outgoing] = collections.deque()
        self._writing = False
        #: (starts, ends) of the peer's memory that it let us reach directly, refreshed from
        #: its table when a grant names memory outside it
        self.peer_regions: tuple[np.ndarray, np.ndarray] = regions_of_table(None)
        self._released = False
        #: bytes of the peer's requests held here (``llm.LinkQueue`` caps them too)
        self.queued_bytes = 0
        #: the peer unlinked or finalized (it knows the link is gone)
        self.peer_left = False
        #: this side is unlinking: the peer hanging up now is expected, not a fault
        self.unlinking = False
        self.stats_bytes = 0
        self.stats_transfers = 0
        self.up_since = time.time()
        #: the last transfers this side started on the link: (op, started, finished, bytes)
        self.history: collections.deque[TransferRecord] = collections.deque(maxlen=256)

    # ------------------------------------------------------------------ state
    @property
    def alive(self) -> bool:
        return self.broken is None and not self.closed

    def down_error(self) -> LLMException:
        """The one error of work on a link that is down: LLM_NOT_YET_LINK once this side or
        the peer unlinked or finalized, LLM_LINK_FAILED (with the reason) when it broke."""
        if self.closed:
            return LLMException(
                f"link to cluster {self.peer_cluster_id} was closed (unlink_clusters)",
                status_code=LLMStatusCode.LLM_NOT_YET_LINK,
            )
        broken = self.broken
        if isinstance(broken, LLMException):
            return LinkBroken(str(broken), status_code=broken.status_code)
        return LinkBroken(f"link to cluster {self.peer_cluster_id} is down: {broken}")

    def check_alive(self) -> None:
        """Raises :meth:`down_error` when the link is down."""
        if not self.alive:
            raise self.down_error()

    def statistics(self) -> LinkStatistics:
        return LinkStatistics(
            self.peer_cluster_id,
            self.access.name if self.access is not None else "tcp",
            self.stats_transfers,
            self.stats_bytes,
            self.up_since,
            tuple(self.history),
        )

    @staticmethod
    def no_caps() -> dict[str, bool]:
        """Caps of a request whose local memory only the stream can reach (device memory)."""
        return {"inproc": False, "pools": False, "pvr": False}

    def caps(self) -> dict[str, bool]:
        """How this side can reach the peer's memory directly (sent with each request)."""
        return self.access.caps() if self.access is not None else self.no_caps()

    def trusted_caps(self, claimed: Any) -> dict[str, bool]:
        """The caps a peer sent with its request, limited to what this link's kind lets it
        use: a peer on a TCP link that claims direct access gets stream grants (and never
        learns our addresses), one on a NIXL link only NIXL grants."""
        if not isinstance(claimed, dict):
            return {}
        allowed = _CAPS_OF_KIND.get(self.access.name if self.access is not None else "tcp", ())
        return {k: True for k in allowed if claimed.get(k) is True}

    def fail(self, exc: BaseException, expected: bool = False) -> None:
        """Mark the link broken, fail every request on it, release what it holds."""
        if self.broken is not None or self.closed:
            return
        if self.unlinking:
            # This side is unlinking and the peer, told so, hung up: that is the unlink, not
            # a fault; work still in flight fails as for any unlink (LLM_NOT_YET_LINK).
            self.closed = True
            self.log.info("link.down", reason="unlinked")
            self._teardown()
            return
        reason = str(exc) if isinstance(exc, LLMException) else _reason(exc)
        self.broken = (
            exc
            if isinstance(exc, LLMException)
            else LinkBroken(f"link to cluster {self.peer_cluster_id} is down: {reason}")
        )
        (self.log.info if expected else self.log.warning)("link.down", reason=reason)
        self.engine.links.note_failure(self.peer_cluster_id, reason)
        self._teardown()

    def _teardown(self) -> None:
        exc = self.down_error()
        waiters = [w for ws in self._waiters.values() for w in ws]
        for req in [*self.pending.values(), *self.serving.values(), *waiters]:
            req.fail(exc)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        if self._reader_scope is not None:
            self._reader_scope.cancel()
        # What the peer sent and nobody will read (a partial frame: up to llm.LinkMaxMeta)
        # goes now, not when the application unlinks (it may never learn of the cluster id);
        # so do the budget charges of its queued requests (a request that never started
        # serving would keep them otherwise).
        budget = self.decoder.budget
        for s in self.serving.values():
            if s.charged and budget is not None:
                budget.release(s.charged)
            s.charged = 0
        self.decoder.close(str(exc))
        with contextlib.suppress(RuntimeError):  # the engine has stopped: release now
            self.engine.spawn(self._release_when_idle)
            return
        self._release()

    async def _release_when_idle(self) -> None:
        """Close the socket and drop same-host mappings once no request uses them any more
        (workers return promptly from a shut-down socket or a cancelled token). Mappings are
        never dropped under a copy: a request that lingers keeps them, not the socket."""
        try:
            with anyio.move_on_after(self.engine.stall_timeout_s):
                while self.pending or self.serving:  # noqa: ASYNC110 (dicts, no event)
                    await anyio.sleep(_FENCE_POLL_S * 5)
            self.sock.close()
            while self.pending or self.serving:  # noqa: ASYNC110 (dicts, no event)
                await anyio.sleep(0.1)
            self._release()
        finally:
            self.sock.close()  # the engine is stopping: mappings go with the link object

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        self.sock.close()
        if self.access is not None:
            self.access.close()

    async def close(self, notify: bool) -> None:
        """Drop the link (unlink/finalize). In-flight transfers fail with LLM_NOT_YET_LINK."""
        if self.closed:
            return
        if notify and self.broken is None:
            with anyio.move_on_after(0.5), contextlib.suppress(Exception):
                await self.send(Message(MT.BYE))
        self.closed = True
        self.log.info("link.down", reason="closed")
        self._teardown()

    # ------------------------------------------------------------------ sending
    async def abort(self, req_id: int, exc: BaseException, flags: int = 0) -> None:
        """Tell the peer to stop ``req_id`` because of ``exc``: best effort, for at most a
        second, and only while the link is up. Never raises."""
        if not self.alive:
            return
        fields = {"status": int(status_from_exception(exc)), "message": str(exc)}
        with contextlib.suppress(Exception), anyio.move_on_after(1):
            await self.send(Message(MT.ABORT, req_id, fields, flags=flags))

    async def send(self, msg: Message) -> None:
        """Send one control frame (no payload) without blocking the loop.

        Raises:
            LinkBroken: the link is down or the socket failed.
        """
        async with self.send_lock:
            if not self.alive:
                raise self.down_error()
            # Encoded under the lock: on a keyed link each frame's tag counts frames in order.
            data = memoryview(encode(msg, self._send_auth))
            try:
                # Most frames go out whole at once: then no scope or loop turn is needed.
                try:
                    sent = self.sock.send(data, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                if sent < len(data):
                    await self._send_rest(data[sent:])
            except (OSError, TimeoutError) as exc:
                self.fail(exc)
                raise LinkBroken(f"send to cluster {self.peer_cluster_id} failed: {exc}") from exc
        # A send that went out at once still lets cancellation in here (without a loop turn).
        await anyio.lowlevel.checkpoint_if_cancelled()

    def send_soon(
        self, frames: list[Message], views: list[memoryview], done: Callable[[], None]
    ) -> bool:
        """Send control frames and the payload ``views`` of the last one (a small DATA frame)
        for the reader, which must never wait on a send.

        With the send lock free and nothing queued they go out at once, in one non-blocking
        ``sendmsg`` (a task finishes what the socket did not take); otherwise they queue for
        the link's writer task, which sends what queued up together, a syscall for many. Either
        way the lock is held from a frame's first byte to its last. ``done`` runs once nothing
        reads ``views`` any more. Returns False, with nothing sent or queued and ``done`` not
        run, when the link is down. A socket error breaks the link.
        """
        if not self.alive:
            return False
        if self.send_lock.value and not self._outbox:
            self._send_at_once(frames, views, done)
            return True
        self._outbox.append((frames, views, done))
        if not self._writing:
            try:
                self.engine.spawn(self._write_outbox)
            except RuntimeError as exc:  # the engine stopped: nothing more goes out
                self._outbox.pop()
                self.fail(exc)
                return False
            self._writing = True
        return True

    def _send_at_once(
        self, frames: list[Message], views: list[memoryview], done: Callable[[], None]
    ) -> None:
        self.send_lock.acquire_nowait()
        finishing = False
        try:
            bufs = self._bufs_of([(frames, views, done)])
            try:
                idx = send_nowait(self.sock, bufs)
            except OSError as exc:
                self.fail(exc)
                return
            if idx < len(bufs):
                try:
                    self.engine.spawn(self._finish_now, bufs, idx, done)
                except RuntimeError as exc:  # the engine stopped: the frame cannot be finished
                    self.fail(exc)
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
        for frames, views, _ in items:
            if not (self.payload_auth and views):
                bufs.append(memoryview(b"".join(encode(m, self._send_auth) for m in frames)))
                bufs.extend(views)
                continue
            # The last frame is the DATA frame of ``views``: its payload ends with the MAC,
            # computed here over the views (at most INLINE_BYTES: cheap on the loop). Exact:
            # these frames are never cut short, nothing cancels them.
            data = frames[-1]
            frames = [
                *frames[:-1],
                dataclasses.replace(data, payload_len=data.payload_len + PAYLOAD_TAG),
            ]
            bufs.append(memoryview(b"".join(encode(m, self._send_auth) for m in frames)))
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
            await self._inline(send_views_inline(self.sock, bufs, idx, CancelToken()))
        except (OSError, TimeoutError) as exc:
            self.fail(exc)
        finally:
            self.send_lock.release()
            done()

    async def _write_outbox(self) -> None:
        """The writer of :meth:`send_soon`'s queue: batches of up to ``INLINE_BYTES`` of
        payload per turn of the send lock, each in as few syscalls as the socket allows."""
        batch: list[_Outgoing] = []
        drained = False
        try:
            while self._outbox and self.alive:
                async with self.send_lock:
                    if not self.alive:
                        break
                    size = 0
                    while self._outbox and (not batch or size < INLINE_BYTES):
                        item = self._outbox.popleft()
                        batch.append(item)
                        size += sum(v.nbytes for v in item[1])
                    bufs = self._bufs_of(batch)
                    idx = send_nowait(self.sock, bufs)
                    if idx < len(bufs):
                        await self._inline(send_views_inline(self.sock, bufs, idx, CancelToken()))
                for _, _, done in batch:
                    done()
                batch = []
            drained = True
        except (OSError, TimeoutError) as exc:
            self.fail(exc)
        finally:
            self._writing = False
            if not drained or not self.alive:  # what is still queued never goes out
                batch.extend(self._outbox)
                self._outbox.clear()
            for _, _, done in batch:
                done()

    async def _send_rest(self, data: memoryview) -> None:
        """Finish a frame the socket took only part of.

        Raises:
            TimeoutError: the peer stopped reading for the stall timeout. OSError: send failed.
        """
        # Once the first byte is out the frame must be finished, whoever cancels us: a
        # half-sent frame would desynchronise the stream. A peer that stops reading for the
        # whole stall timeout breaks the link instead.
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.engine.stall_timeout_s) as stall:
                while data:
                    try:
                        n = self.sock.send(data, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        await anyio.wait_writable(self.sock)
                        continue
                    data = data[n:]
            if stall.cancelled_caught:
                raise TimeoutError("the peer stopped reading")

    async def send_stream(
        self,
        req: _Request,
        stream: StreamPlan,
        to_initiator: bool,
        token: CancelToken,
        lead: Message | None = None,
    ) -> bool:
        """Send a plan's bytes as DATA frames. Returns False if stopped by ``token``.

        Each frame goes out from a worker thread straight from the source memory. When the
        token trips, the worker stops reading source memory at once (the current frame is
        finished with zeros) and no further frame is sent. ``lead`` (a control frame, e.g. the
        GRANT) goes out first, in the same syscall as a small first frame.

        Raises:
            LinkBroken: the link failed (the link is then broken).
        """
        off = 0
        flags = FLAG_TO_INITIATOR if to_initiator else 0
        if lead is not None and (stream.total > INLINE_BYTES or not stream.total):
            await self.send(lead)
            lead = None
        while off < stream.total:
            if token.cancelled or not self.alive:
                if lead is not None and self.alive:
                    await self.send(lead)
                return False
            n = min(CHUNK_BYTES, stream.total - off)
            views = await stream.prepare(off, n, token)
            deadline = req.deadline or (time.monotonic() + self.engine.stall_timeout_s)
            fence = Fence(token, deadline)
            async with self.send_lock:
                if not self.alive:
                    raise self.down_error()
                # In order under the lock: each frame's tag counts frames on a keyed link.
                first = b"" if lead is None else encode(lead, self._send_auth)
                lead = None
                trailer = PAYLOAD_TAG if self.payload_auth else 0
                header = first + encode(
                    Message(
                        MT.DATA, req.req_id, {"off": off}, payload_len=n + trailer, flags=flags
                    ),
                    self._send_auth,
                )
                tagger = None
                if trailer:
                    assert self._send_auth is not None  # payload_auth implies a keyed link
                    mac = self._send_auth.payload_mac(self._send_auth.seq - 1)
                    tagger = PayloadMac(mac, len(header), n)
                try:
                    if n <= INLINE_BYTES:
                        bufs = [memoryview(header), *views]
                        idx = send_nowait(self.sock, bufs, tagger)
                        if idx < len(bufs):
                            await self._inline(
                                send_views_inline(self.sock, bufs, idx, token, tagger)
                            )
                    else:
                        # Set only now, next to the worker that will release it.
                        req.fence = fence
                        # Shielded: the header's tag is spent, so the frame must go out (the
                        # worker itself stops at the fence's token or deadline).
                        with anyio.CancelScope(shield=True):
                            await anyio.to_thread.run_sync(
                                send_views,
                                self.sock,
                                header,
                                views,
                                fence,
                                tagger,
                                limiter=self.threads,
                            )
                except (OSError, TimeoutError) as exc:
                    self.fail(exc)
                    raise LinkBroken(f"sending to cluster {self.peer_cluster_id}: {exc}") from exc
                finally:
                    fence.released.set()  # the worker has returned (or never started)
                    req.fence = None
            off += n
            self.stats_bytes += n
        return not token.cancelled

    async def _inline(self, io: Any) -> Any:
        """Run a small frame's I/O on the loop: shielded (a frame, once started, must be
        finished) and bounded by the stall timeout (then the link breaks).

        Raises:
            TimeoutError: the peer made no progress. OSError / EOFError: the socket failed.
        """
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.engine.stall_timeout_s) as stall:
                return await io
            if stall.cancelled_caught:
                io.close()
                raise TimeoutError("the peer made no progress within the stall timeout")

    # ------------------------------------------------------------------ requests
    def open_pending(self, deadline: float | None) -> Pending:
        self.check_alive()
        req = Pending(next(self._ids), deadline)
        self.pending[req.req_id] = req
        return req

    def close_pending(self, req: Pending) -> None:
        self.pending.pop(req.req_id, None)

    async def release(self, req: _Request) -> None:
        """Fence: stop any worker writing or reading ``req``'s memory, and wait until it has.

        Called when a transfer is cancelled or times out; never blocks on a stalled peer
        (workers check the token every few tens of milliseconds).
        """
        req.token.cancel()
        fence = req.fence
        if fence is None or fence.released.is_set():
            return
        # Workers notice the token within tens of milliseconds; if one does not release even
        # so (stuck in the kernel), the link is shut down, which returns it from any syscall.
        # Polled, not waited for in a thread: a stalled peer must not hold worker threads.
        with anyio.move_on_after(self.engine.stall_timeout_s):
            while not fence.released.is_set():  # noqa: ASYNC110 (set by a thread)
                await anyio.sleep(_FENCE_POLL_S)
        if not fence.released.is_set():
            self.fail(TimeoutError("a worker did not let go of a cancelled transfer"))
            while not fence.released.is_set():  # noqa: ASYNC110 (set by a thread)
                await anyio.sleep(_FENCE_POLL_S)

    async def roundtrip(self, msg: Message, reply: MT, timeout_s: float) -> Message | None:
        """Send ``msg`` and wait for the next ``reply`` frame; None if none came in time.

        Raises:
            LinkBroken: the link failed meanwhile.
        """
        waiter = Pending(0, None)
        self._waiters[reply].append(waiter)
        try:
            await self.send(msg)
            with anyio.move_on_after(timeout_s):
                return await waiter.wait_result()
            return None
        finally:
            with contextlib.suppress(ValueError):
                self._waiters[reply].remove(waiter)

    async def responsive(self, timeout_s: float) -> bool:
        """True if the peer answers a PING within ``timeout_s`` (a half-open link does not)."""
        with anyio.move_on_after(timeout_s):
            try:
                return await self.roundtrip(Message(MT.PING), MT.PONG, timeout_s) is not None
            except LLMException:
                return False
        return False

    async def fetch_table(self, timeout_s: float) -> dict[str, Any]:
        """The peer's published cache table, snapshotted on first use for the link's life.

        Raises:
            LinkBroken: the link failed. LLMException(LLM_TIMEOUT): no answer in time.
        """
        if self.table is None:
            msg = await self.roundtrip(Message(MT.TABLE_REQ), MT.TABLE, timeout_s)
            if msg is None:
                raise LLMException(
                    "peer did not send its cache table in time",
                    status_code=LLMStatusCode.LLM_TIMEOUT,
                )
            if self.table is None:
                self.table = msg.fields
                self._adopt_view(msg.fields)
        return self.table

    def peer_layout(self, cache_id: int) -> Layout | None:
        """The layout of the peer's remote-accessible cache ``cache_id`` as this view of its
        table describes it, parsed once per view; None when it is not published as reachable
        or its entry is malformed."""
        desc = self.peer_caches.get(cache_id)
        cached = self._peer_layouts.get(cache_id)
        if cached is not None and cached[0] is desc:
            return cached[1]
        layout: Layout | None = None
        if desc is not None and desc.get("remote_accessible") is True:
            try:
                layout = Layout.of(
                    desc["addrs"], desc["tensor_bytes"], desc["count"], desc["is_blocks"]
                )
                if layout.num_tensors == 0 or layout.count <= 0 or layout.tensor_bytes <= 0:
                    layout = None
            except (KeyError, TypeError, ValueError, OverflowError):
                layout = None
        if desc is not None:
            self._peer_layouts[cache_id] = (desc, layout)
        return layout

    def _adopt_view(self, table: dict[str, Any]) -> None:
        """What this side knows of the peer's memory, from a copy of its table: the reachable
        regions, the caches by id and the epoch (one-sided pulls), all from the same copy."""
        self.peer_regions = regions_of_table(table)
        caches = table.get("caches")
        self._peer_layouts = {}
        self.peer_caches = {
            c["cache_id"]: c
            for c in (caches if isinstance(caches, list) else [])
            if isinstance(c, dict) and isinstance(c.get("cache_id"), int)
        }
        epoch = table.get("epoch")
        words: list[Any] = epoch if isinstance(epoch, list) else []
        valid = (
            len(words) == 2
            and all(type(v) is int for v in words)
            and 0 < words[0] < 2**64
            and 0 <= words[1] < 2**64
        )
        self.peer_epoch = (words[0], words[1]) if valid else None

    async def refresh_view(self, timeout_s: float) -> bool:
        """Fetch the peer's table again for :meth:`_adopt_view` (the snapshot that resolves
        keys and ids stays as it was). Returns False if the peer did not answer in time.

        Raises:
            LinkBroken: the link failed meanwhile.
        """
        msg = await self.roundtrip(Message(MT.TABLE_REQ), MT.TABLE, timeout_s)
        if msg is None:
            return False
        self._adopt_view(msg.fields)
        return True

    async def check_remote(self, remote: np.ndarray, nbytes: np.ndarray, timeout_s: float) -> None:
        """Every range a grant names in the peer's memory must lie in what the peer published
        as reachable (its remote-accessible caches); a miss refreshes that once.

        Raises:
            ProtocolError: the grant points elsewhere. LinkBroken / LLMException: the table
                could not be fetched.
        """
        if check_within(remote, nbytes, *self.peer_regions):
            return
        if await self.refresh_view(timeout_s) and check_within(remote, nbytes, *self.peer_regions):
            return
        raise ProtocolError("GRANT points outside the peer's published caches")

    # ------------------------------------------------------------------ reading
    async def run_reader(self, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """The link's only socket reader; ends when the link breaks or closes."""
        buf = bytearray(_READ_AHEAD)
        mv = memoryview(buf)
        with anyio.CancelScope() as scope:
            self._reader_scope = scope
            task_status.started()
            try:
                while self.alive:
                    ev = self.decoder.next_event()
                    if ev is NEED_DATA:
                        await self._fill(mv)
                    elif isinstance(ev, Message):
                        if ev.payload_len:
                            await self._receive_payload(ev)
                        else:
                            await self._dispatch(ev)
                    else:  # payload bytes outside a DATA frame cannot happen
                        raise ProtocolError("unexpected payload bytes")
            except (OSError, EOFError, ProtocolError, TimeoutError, LLMException) as exc:
                self.fail(exc)
            except Exception as exc:  # a bug must break this link, not the whole engine
                self.log.exception("link.reader_crashed")
                self.fail(exc)

    async def _fill(self, mv: memoryview) -> None:
        """Receive what the socket has into the decoder.

        Raises:
            EOFError: the peer closed. TimeoutError: it stopped in the middle of a frame for
                the stall timeout (a partial frame holds memory, and ``llm.MetaBudget``).
        """
        while True:
            try:
                n = self.sock.recv_into(mv, len(mv), socket.MSG_DONTWAIT)
            except BlockingIOError:
                self._unyielded = 0  # the wait below lets others run
                if not self.decoder.buffered:
                    await anyio.wait_readable(self.sock)
                    continue
                # A legit peer sends a frame's meta without pausing; one that stops half-way
                # must not keep its share of the budget for ever.
                with anyio.move_on_after(self.engine.stall_timeout_s) as stalled:
                    await anyio.wait_readable(self.sock)
                if stalled.cancelled_caught:
                    raise TimeoutError(
                        f"cluster {self.peer_cluster_id} stopped in the middle of a frame for "
                        f"{self.engine.stall_timeout_s:g} s"
                    ) from None
                continue
            if n == 0:
                raise EOFError(f"cluster {self.peer_cluster_id} closed the connection")
            self.decoder.receive_data(mv[:n])
            self._unyielded += n
            if self._unyielded >= _YIELD_BYTES:
                self._unyielded = 0
                await anyio.lowlevel.checkpoint()
            return

    async def _receive_payload(self, msg: Message) -> None:
        if msg.type != MT.DATA:
            raise ProtocolError(f"{msg.type.name} frames carry no payload")
        n = msg.payload_len
        # llm.PayloadAuth: the payload ends with its MAC, received with it and checked below.
        auth = self._recv_auth if self.payload_auth else None
        seq = 0
        if auth is not None:
            if n <= PAYLOAD_TAG:
                raise ProtocolError("DATA frame without its payload MAC (llm.PayloadAuth)")
            n -= PAYLOAD_TAG
            seq = auth.seq - 1  # the DATA frame's own number: nothing was decoded since
        tag = bytearray(PAYLOAD_TAG) if auth is not None else None
        if n > CHUNK_BYTES:
            raise ProtocolError(f"DATA frame of {n} bytes exceeds {CHUNK_BYTES}")
        table = self.pending if msg.flags & FLAG_TO_INITIATOR else self.serving
        req = table.get(msg.req_id)
        off = msg.fields.get("off")
        stream = req.stream if req is not None else None
        if stream is None:
            req = None  # nothing of ours receives this frame: discard it, touching no request
        elif not isinstance(off, int) or off < 0 or off + n > stream.total:
            raise ProtocolError(f"DATA frame [{off}, +{n}) outside its plan")
        off = int(off or 0)
        views = stream.receive_views(off, n) if stream is not None else []
        pmac = None
        if auth is not None and tag is not None and req is not None:
            # Hashed where each batch lands; the trailer lands in ``tag``.
            pmac = PayloadMac(auth.payload_mac(seq), 0, n)
            views = [*views, memoryview(tag)]
        # Bytes the read-ahead already pulled in go first (at most 64 KiB, copied here).
        pos = 0
        if self.decoder.buffered and self.decoder.payload_remaining:
            with self.decoder.take_payload() as chunk:
                if req is not None and not req.token.cancelled:
                    _copy_into(views, 0, chunk)
                    if pmac is not None:
                        pmac.passed(views, 0, chunk.nbytes)
                pos = chunk.nbytes
        rest = self.decoder.payload_remaining
        token = req.token if req is not None else _CANCELLED
        deadline = (req.deadline if req is not None else None) or (
            time.monotonic() + self.engine.stall_timeout_s
        )
        if rest:
            # Scratch (to discard what nobody receives) is borrowed only for this frame: an
            # idle link holds no buffers.
            scratch = self.engine.scratch.acquire()
            target = _slice_views(views, pos, rest) if views else scratch_views(rest, scratch)
            fence = None
            try:
                if rest <= INLINE_BYTES:
                    bufs = list(target)
                    idx = 0 if token.cancelled else recv_nowait(self.sock, bufs, pmac)
                    if idx < len(bufs):
                        await self._inline(
                            recv_views_inline(self.sock, bufs, idx, token, scratch, pmac)
                        )
                else:
                    fence = Fence(token, deadline)
                    if req is not None:
                        req.fence = fence
                    await anyio.to_thread.run_sync(
                        recv_views, self.sock, target, fence, scratch, pmac, limiter=self.threads
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
                self.engine.scratch.release(scratch)
            self.decoder.payload_consumed(rest)
        if pmac is not None and tag is not None and req is not None and not token.cancelled:
            # Every byte landed where it belongs (a cancel diverts the rest to scratch, and
            # those bytes nobody accepts): check them before anyone may use them.
            await self._verify_payload(req, msg, pmac, tag)
        if req is not None and stream is not None and not token.cancelled:
            # Staged (device) streams scatter now; that worker is fenced like the receive.
            fence = Fence(token, deadline)
            req.fence = fence
            try:
                await stream.commit(off, n, token)
            except CopyCancelled:
                pass  # cancelled meanwhile: the bytes are dropped, the link is fine
            finally:
                fence.released.set()
                req.fence = None
        self.stats_bytes += n
        if req is not None and stream is not None:
            req.received += n
            if req.received >= stream.total:
                req.data_event.set()

    async def _verify_payload(
        self, req: _Request, msg: Message, pmac: PayloadMac, tag: bytearray
    ) -> None:
        """Check a received DATA payload (``pmac`` was fed it where it landed) against its
        trailer (``llm.PayloadAuth``).

        Raises:
            LinkBroken: the bytes are not the peer's (a relay changed them); the peer is told
                first (an ABORT of that request), then the reader breaks the link.
        """
        if hmac.compare_digest(pmac.digest(), tag):
            return
        exc = LinkBroken(
            f"payload failed authentication (llm.PayloadAuth): DATA from cluster "
            f"{self.peer_cluster_id} to cluster {self.engine.cluster_id} does not match its MAC "
            "(changed on the way, or the memory was written during the transfer); the link is "
            "broken"
        )
        # Tell the peer why first (its link then breaks with these words, not as a hang-up):
        # best effort, as a relay that changes bytes may drop frames too.
        fields = {"status": int(exc.status_code), "message": str(exc), "broken": True}
        flags = 0 if msg.flags & FLAG_TO_INITIATOR else FLAG_TO_INITIATOR
        with contextlib.suppress(Exception), anyio.move_on_after(1):
            await self.send(Message(MT.ABORT, req.req_id, fields, flags=flags))
        raise exc

    async def _dispatch(self, msg: Message) -> None:
        t = msg.type
        if t == MT.XFER_REQ:
            if msg.req_id in self.serving:
                raise ProtocolError(f"request id {msg.req_id} reused")
            meta_bytes = sum(memoryview(a).nbytes for a in msg.arrays.values())
            limits = self.engine.options.limits
            # What a queued request keeps of its frame counts against the endpoint's budget
            # too: many links' queues must not add up past it.
            budget = self.decoder.budget
            charged = meta_bytes if meta_bytes > UNCHARGED_META and budget is not None else 0
            if (
                len(self.serving) + len(self._outbox) >= limits.queued
                or self.queued_bytes + meta_bytes > 4 * limits.meta_bytes
                or (charged and budget is not None and not budget.reserve(charged))
            ):
                await self._owe_reply(
                    Message(
                        MT.GRANT,
                        msg.req_id,
                        {
                            "status": int(LLMStatusCode.LLM_LINK_BUSY),
                            "message": f"cluster {self.engine.cluster_id} already has "
                            f"{len(self.serving)} requests ({self.queued_bytes} bytes) of this "
                            "link queued",
                        },
                    )
                )
                return
            # The peer's deadline, but never more than this side would give itself: one
            # stalled peer must not hold our workers for longer (upstream: 1800 s).
            deadline_ms = msg.fields.get("timeout_ms")
            deadline_s = self.engine.serve_budget_s(1024)
            if isinstance(deadline_ms, int) and deadline_ms > 0:
                deadline_s = min(deadline_s, deadline_ms / 1000)
            try:
                served = self.engine.serve_now(self, msg)
            except BaseException:
                if charged and self.decoder.budget is not None:
                    self.decoder.budget.release(charged)
                raise
            if served:
                if charged and self.decoder.budget is not None:
                    self.decoder.budget.release(charged)
                return
            req = Serving(msg.req_id, time.monotonic() + deadline_s)
            req.meta_bytes = meta_bytes
            req.charged = charged
            self.queued_bytes += meta_bytes
            self.serving[msg.req_id] = req
            self.engine.spawn(self.engine.serve_request, self, req, msg)
        elif t == MT.GRANT:
            p = self.pending.get(msg.req_id)
            if p is not None:
                if p.on_grant is not None:
                    if memoryview(msg.arrays.get("nbytes", b"")).nbytes > _GRANT_INLINE:
                        # Checking (and mapping) a grant of many descriptors takes numpy
                        # tens of ms: off the loop. The reader waits, so no DATA comes first.
                        await anyio.to_thread.run_sync(p.on_grant, msg, limiter=self.threads)
                    else:
                        p.on_grant(msg)
                p.grant = msg
                p.grant_event.set()
        elif t == MT.RESULT:
            p = self.pending.get(msg.req_id)
            if p is not None:
                p.result = msg
                p.result_event.set()
        elif t == MT.DONE:
            s = self.serving.get(msg.req_id)
            if s is not None:
                if s.on_done is not None:
                    s.on_done(msg)
                s.done_event.set()
        elif t == MT.ABORT:
            code = wire_status(msg)
            # The peer's words, bounded (and, as a link's reason, marked as theirs).
            text = str(msg.fields.get("message", "aborted by peer"))[:512]
            table: Mapping[int, _Request] = (
                self.pending if msg.flags & FLAG_TO_INITIATOR else self.serving
            )
            aborted = table.get(msg.req_id)
            if aborted is not None:
                aborted.fail(LLMException(text, status_code=code))
            if msg.fields.get("broken") is True:  # the peer breaks the link, and says why
                self.fail(LinkBroken(f"cluster {self.peer_cluster_id} broke the link: {text}"))
        elif t == MT.TABLE_REQ:
            # NIXL metadata (keys to our registered memory) only to a peer linked over NIXL.
            over_nixl = getattr(self.access, "name", None) == "nixl"
            await self._owe_reply(Message(MT.TABLE, 0, self.engine.published_table(over_nixl)))
            # Each reply encodes the whole table (milliseconds for thousands of caches): a
            # burst of requests is answered one per loop turn, not all in one turn.
            await anyio.lowlevel.checkpoint()
        elif t == MT.PING:
            await self._owe_reply(Message(MT.PONG))
        elif t == MT.UNLINK:
            await self._replies.acquire()
            self.engine.spawn(self._peer_unlinked)
        elif t in self._waiters:
            for w in self._waiters[t]:
                w.result = msg
                w.result_event.set()
        elif t == MT.BYE:
            self.peer_left = True
            self.fail(
                LinkBroken(
                    f"cluster {self.peer_cluster_id} finalized",
                    status_code=LLMStatusCode.LLM_NOT_YET_LINK,
                ),
                expected=True,
            )
        else:
            raise ProtocolError(f"unexpected {t.name} on an established link")

    async def _owe_reply(self, msg: Message) -> None:
        """Answer the peer from a task of its own; once ``_MAX_REPLIES`` answers are still
        unsent (a peer that sends but never reads), the reader waits here, so the peer's
        flood stays in its own socket buffers instead of our memory."""
        await self._replies.acquire()
        self.engine.spawn(self._reply, msg)

    async def _reply(self, msg: Message) -> None:
        try:
            with contextlib.suppress(LLMException):
                await self.send(msg)
        finally:
            self._replies.release()

    async def _peer_unlinked(self) -> None:
        try:
            with contextlib.suppress(LLMException):
                await self.send(Message(MT.UNLINK_ACK))
        finally:
            self._replies.release()
        # Gone from our list too, as upstream does when the peer unlinks (a prompt may then
        # switch_role without unlinking); our own unlink_clusters of it still succeeds.
        self.peer_left = True
        self.engine.links.peer_unlinked(self)
        self.fail(
            LinkBroken(
                f"cluster {self.peer_cluster_id} unlinked",
                status_code=LLMStatusCode.LLM_NOT_YET_LINK,
            ),
            expected=True,
        )


_CANCELLED = CancelToken()
_CANCELLED.cancel()

#: bytes of a GRANT's descriptor sizes (8 per descriptor) checked on the loop; larger grants
#: are checked in a worker thread
_GRANT_INLINE = 8 << 14


#: the direct-access caps a peer may use, by the kind of link it is on
_CAPS_OF_KIND: dict[str, tuple[str, ...]] = {
    "in-process": ("inproc", "pools", "pvr"),
    "same-host": ("pools", "pvr"),
    "nixl": ("nixl",),
}


def _reason(exc: BaseException) -> str:
    """Why a link broke, in words a user can act on."""
    if isinstance(exc, EOFError):
        return "peer closed the connection"
    if isinstance(exc, ConnectionResetError):
        return "connection reset by peer"
    if isinstance(exc, ProtocolError):
        return f"protocol error: {exc}"
    return str(exc) or repr(exc)


def _copy_into(views: list[memoryview], pos: int, data: memoryview) -> None:
    """Copy ``data`` into the concatenation of ``views`` starting at byte ``pos``."""
    for v in _slice_views(views, pos, data.nbytes):
        v[:] = data[: v.nbytes]
        data = data[v.nbytes :]


def _slice_views(views: list[memoryview], pos: int, n: int) -> list[memoryview]:
    out = []
    for v in views:
        if n <= 0:
            break
        if pos >= v.nbytes:
            pos -= v.nbytes
            continue
        take = min(v.nbytes - pos, n)
        out.append(v[pos : pos + take])
        n -= take
        pos = 0
    return out


def new_nonce() -> str:
    return os.urandom(16).hex()


def probe_token() -> np.ndarray:
    """Random bytes a peer reads with process_vm_readv to prove it may reach our memory."""
    return np.frombuffer(os.urandom(16), dtype=np.uint8).copy()
