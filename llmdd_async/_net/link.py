"""A link to one peer endpoint: one TCP connection, its health, its reader and its writer.

A link is usable in both directions. Requests this side starts live in ``pending``; requests
the peer starts live in ``serving`` (records: ``requests``). The reader task is the only reader
of the socket; bulk payload is received straight into destination memory by worker threads
(see ``tcp``); control frames go to the link's ``router``, which hands the peer's requests to
the ``server`` the link was made with. What this side knows of the peer's memory is the link's
``view``; which direct access each side may use, its ``caps``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from .._errors import (
    LinkBroken,
    LinkClosed,
    LLMException,
    ProtocolError,
    link_failure,
    map_link_errors,
    status_from_exception,
)
from .._log import get_logger
from .._memory import CancelToken
from .._messages import FLAG_TO_INITIATOR, Abort, Bye, Data, Identity, Ping, TableRequest
from .._phase_lock import PhaseLock
from .._protocol import (
    MT,
    PAYLOAD_TAG,
    Decoder,
    FrameAuth,
    Message,
    encode,
)
from .._transports import PeerAccess
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
from .peer_view import CapsPolicy, PeerView
from .reader import LinkReader
from .requests import (
    LinkStatistics,
    Pending,
    Request,
    Serving,
    TransferRecord,
)
from .router import FrameRouter

if TYPE_CHECKING:
    from .host import LinkHost, RequestServer
    from .link_manager import LinkManager

__all__ = ["Link"]

#: how often a cancelled request checks that its worker let go
_FENCE_POLL_S = 0.002


#: frames for :meth:`Link.send_soon`: the messages, the last one's payload, what to run after
_Outgoing = tuple[list[Message], list[memoryview], Callable[[], None]]


class Link:
    """One established link. Made by its ``manager`` after a successful handshake; the
    requests the peer starts are served by ``server``."""

    def __init__(
        self,
        host: LinkHost,
        sock: socket.socket,
        decoder: Decoder,
        peer: Identity,
        access: PeerAccess | None,
        auth: tuple[FrameAuth, FrameAuth] | None = None,
        outbound: bool = False,
        *,
        server: RequestServer,
        manager: LinkManager,
    ) -> None:
        self.host = host
        self.server = server
        self.manager = manager
        self.sock = sock
        self.decoder = decoder
        # The endpoint's meta budget may evict this link's stalled partial frame: then the
        # link breaks at once (its reader would otherwise wait for bytes that never count).
        decoder.on_evict = lambda reason: self.fail(ProtocolError(reason))
        self.peer = peer  # what it said about itself in the handshake
        self.peer_cluster_id: int = peer.cluster_id
        self.access = access  # None: a plain TCP link (the stream only)
        #: which direct-access caps our requests carry and the peer's may use
        self.caps = CapsPolicy(access)
        self._send_auth = auth[0] if auth is not None else None
        #: what checks the peer's frames (a keyed link), its DATA payloads' MACs included
        self.recv_auth = auth[1] if auth is not None else None
        decoder.set_auth(self.recv_auth)
        #: llm.PayloadAuth (both ends agreed in the handshake): DATA payloads end with a MAC
        self.payload_auth = auth is not None and host.options.payload_auth
        #: this side's link_clusters made or adopted the link (a second call: ALREADY_LINK)
        self.claimed = outbound
        limits = host.options.limits
        self.log = get_logger(
            "link", cluster_id=host.cluster_id, peer_cluster_id=self.peer_cluster_id
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
        #: the peer's cache table as this side knows it
        self.view = PeerView(self._table_of_peer)
        #: what the peer's control frames do here
        self.router = FrameRouter(self)
        #: the only reader of the socket, run by the event loop's I/O driver
        self.reader = LinkReader(self)
        #: requests of the peer served at once; more wait (bounds staging memory and threads)
        self.serving_limiter = anyio.CapacityLimiter(limits.serving)
        #: worker threads this link may hold (never the whole process's pool: one stalled
        #: peer must not starve the others)
        self.threads = anyio.CapacityLimiter(limits.threads)
        #: frames the reader handed to :meth:`send_soon` while the send lock was taken
        self._outbox: collections.deque[_Outgoing] = collections.deque()
        self._writing = False
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
    def peer_host(self) -> str:
        """The address the link's socket is connected to ("" once it is closed)."""
        try:
            return str(self.sock.getpeername()[0])
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.broken is None and not self.closed

    def down_error(self) -> LLMException:
        """The one error of work on a link that is down: LLM_NOT_YET_LINK once this side or
        the peer unlinked or finalized, LLM_LINK_FAILED (with the reason) when it broke."""
        if self.closed:
            return LinkClosed(
                f"link to cluster {self.peer_cluster_id} was closed (unlink_clusters)"
            )
        broken = self.broken
        if isinstance(broken, LLMException):
            return LinkBroken(str(broken), status_code=broken.status_code)
        return LinkBroken(f"link to cluster {self.peer_cluster_id} is down: {broken}")

    @property
    def outbox_frames(self) -> int:
        """Items :meth:`send_soon` queued that the writer has not sent yet."""
        return len(self._outbox)

    def check_alive(self) -> None:
        """Raises :meth:`down_error` when the link is down."""
        if not self.alive:
            raise self.down_error()

    @property
    def transport_name(self) -> str:
        """The link's transport as statistics and logs name it (``tcp`` without an access)."""
        return self.access.name if self.access is not None else "tcp"

    def statistics(self) -> LinkStatistics:
        return LinkStatistics(
            self.peer_cluster_id,
            self.transport_name,
            self.stats_transfers,
            self.stats_bytes,
            self.up_since,
            tuple(self.history),
        )

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
        self.broken, reason = link_failure(exc, self.peer_cluster_id)
        (self.log.info if expected else self.log.warning)("link.down", reason=reason)
        self.manager.note_failure(self.peer_cluster_id, reason)
        self._teardown()

    def _teardown(self) -> None:
        exc = self.down_error()
        self.host.observers.link_changed(self.peer_cluster_id, self.transport_name, False)
        self.reader.stop()  # before the socket may be closed
        for req in [*self.pending.values(), *self.serving.values(), *self.router.waiters()]:
            req.fail(exc)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
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
            self.host.spawn(self._release_when_idle)
            return
        self._release()

    async def _release_when_idle(self) -> None:
        """Close the socket and drop same-host mappings once no request uses them any more
        (workers return promptly from a shut-down socket or a cancelled token). Mappings are
        never dropped under a copy: a request that lingers keeps them, not the socket."""
        try:
            with anyio.move_on_after(self.host.stall_timeout_s):
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
                await self.send(Bye().encode())
        self.closed = True
        self.log.info("link.down", reason="closed")
        self._teardown()

    # ------------------------------------------------------------------ sending
    async def abort(self, req_id: int, exc: BaseException, flags: int = 0) -> None:
        """Tell the peer to stop ``req_id`` because of ``exc``: best effort, for at most a
        second, and only while the link is up. Never raises."""
        if not self.alive:
            return
        abort = Abort(
            req_id,
            status_from_exception(exc),
            str(exc),
            to_initiator=bool(flags & FLAG_TO_INITIATOR),
        )
        with contextlib.suppress(Exception), anyio.move_on_after(1):
            await self.send(abort.encode())

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
            with map_link_errors(self.fail, f"send to cluster {self.peer_cluster_id} failed"):
                # Most frames go out whole at once: then no scope or loop turn is needed.
                try:
                    sent = self.sock.send(data, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                if sent < len(data):
                    await self._send_rest(data[sent:])
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
                self.host.spawn(self._write_outbox)
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
            with map_link_errors(self.fail):  # a failed send breaks the link, nothing raises
                idx = send_nowait(self.sock, bufs)
                if idx < len(bufs):
                    try:
                        self.host.spawn(self._finish_now, bufs, idx, done)
                    except RuntimeError as exc:  # the engine stopped: the frame can't finish
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
            with map_link_errors(self.fail):  # a failed send breaks the link, nothing raises
                await self._inline(send_views_inline(self.sock, bufs, idx, CancelToken()))
        finally:
            self.send_lock.release()
            done()

    async def _write_outbox(self) -> None:
        """The writer of :meth:`send_soon`'s queue: batches of up to ``INLINE_BYTES`` of
        payload per turn of the send lock, each in as few syscalls as the socket allows."""
        batch: list[_Outgoing] = []
        drained = False
        try:
            with map_link_errors(self.fail):  # a failed send breaks the link, nothing raises
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
                            await self._inline(
                                send_views_inline(self.sock, bufs, idx, CancelToken())
                            )
                    for _, _, done in batch:
                        done()
                    batch = []
                drained = True
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
            with anyio.move_on_after(self.host.stall_timeout_s) as stall:
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
        req: Request,
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
            fence = Fence(token, self.host.stall_timeout_s, req.deadline)
            async with self.send_lock:
                if not self.alive:
                    raise self.down_error()
                # In order under the lock: each frame's tag counts frames on a keyed link.
                first = b"" if lead is None else encode(lead, self._send_auth)
                lead = None
                trailer = PAYLOAD_TAG if self.payload_auth else 0
                data = Data(req.req_id, off, n + trailer, bool(flags & FLAG_TO_INITIATOR))
                header = first + encode(data.encode(), self._send_auth)
                tagger = None
                if trailer:
                    assert self._send_auth is not None  # payload_auth implies a keyed link
                    mac = self._send_auth.payload_mac(self._send_auth.seq - 1)
                    tagger = PayloadMac(mac, len(header), n)
                try:
                    with map_link_errors(self.fail, f"sending to cluster {self.peer_cluster_id}"):
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
                            # Shielded: the header's tag is spent, so the frame must go out
                            # (the worker itself stops at the fence's token or stall).
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
            with anyio.move_on_after(self.host.stall_timeout_s) as stall:
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

    async def release(self, req: Request) -> None:
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
        with anyio.move_on_after(self.host.stall_timeout_s):
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
        with self.router.expecting(reply) as waiter:
            await self.send(msg)
            with anyio.move_on_after(timeout_s):
                return await waiter.wait_result()
            return None

    async def responsive(self, timeout_s: float) -> bool:
        """True if the peer answers a PING within ``timeout_s`` (a half-open link does not)."""
        with anyio.move_on_after(timeout_s):
            try:
                return await self.roundtrip(Ping().encode(), MT.PONG, timeout_s) is not None
            except LLMException:
                return False
        return False

    async def _table_of_peer(self, timeout_s: float) -> dict[str, Any] | None:
        """Ask the peer for its cache table (for :attr:`view`); None if no answer came in
        ``timeout_s``.

        Raises:
            LinkBroken: the link failed meanwhile.
        """
        msg = await self.roundtrip(TableRequest().encode(), MT.TABLE, timeout_s)
        return None if msg is None else msg.fields

    # ------------------------------------------------------------------ reading
    async def run_reader(self, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """The link's only socket reader (:class:`~.reader.LinkReader`); ends when the link
        breaks or closes."""
        await self.reader.run(task_status)
