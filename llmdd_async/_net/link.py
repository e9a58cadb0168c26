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
import itertools
import socket
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from .._collector import collector_paused
from .._enums import LLMStatusCode
from .._errors import (
    LinkBroken,
    LinkClosed,
    LLMException,
    ProtocolError,
    link_failure,
    status_from_exception,
)
from .._log import get_logger
from .._memory import CancelToken
from .._messages import FLAG_TO_INITIATOR, Abort, Bye, Identity, Ping, TableRequest, TableSnapshot
from .._phase_lock import PhaseLock
from .._protocol import (
    MT,
    Decoder,
    FrameAuth,
    Framed,
    Message,
)
from .._transports import PeerAccess
from .._transports._staging import LinkStaging
from .._transports.tcp import (
    StreamPlan,
)
from .peer_view import BuildTurns, CapsPolicy, PeerView
from .reader import LinkReader
from .requests import (
    LinkStatistics,
    Pending,
    Request,
    Serving,
    TransferRecord,
    nothing,
)
from .router import FrameRouter
from .writer import LinkWriter

if TYPE_CHECKING:
    from .host import LinkHost, RequestServer
    from .link_manager import LinkManager

__all__ = ["Link"]

#: how often a cancelled request checks that its worker let go
_FENCE_POLL_S = 0.002


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
        #: what writes to the socket (encoding each frame under the send lock)
        self.writer = LinkWriter(self, auth[0] if auth is not None else None)
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
        #: pulls and pushes share the link (exclusive=False); each layer of a layer-wise
        #: transfer has it alone (exclusive=True); FIFO between the two
        self.transfer_lock = PhaseLock()
        self.pending: dict[int, Pending] = {}
        self.serving: dict[int, Serving] = {}
        self._ids = itertools.count(1)
        self.broken: BaseException | None = None
        self.closed = False
        #: the peer's cache table as this side knows it
        self.view = PeerView(self.peer_table, f"cluster {self.peer_cluster_id}")
        #: what the peer's control frames do here
        self.router = FrameRouter(self)
        decoder.unwanted = self.router.unwanted
        #: the only reader of the socket, run by the event loop's I/O driver
        self.reader = LinkReader(self)
        #: requests of the peer served at once; more wait (bounds staging memory and threads)
        self.serving_limiter = anyio.CapacityLimiter(limits.serving)
        #: worker threads this link may hold (never the whole process's pool: one stalled
        #: peer must not starve the others)
        self.threads = anyio.CapacityLimiter(limits.threads)
        #: the staging of its frames (device memory, host memory over many ranges): at most
        #: three buffers held at once, gathered and scattered in those threads
        self.staging = LinkStaging(self.threads)
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
        #: the last transfers this side started on the link, as the fields of a
        #: TransferRecord (made only when statistics are asked for: a frozen dataclass costs
        #: a microsecond and more, on every request)
        self.history: collections.deque[tuple[str, float, float, int, str]] = collections.deque(
            maxlen=256
        )

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
        return self.writer.outbox_frames

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
            tuple(TransferRecord(*fields) for fields in self.history),
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
            try:
                req.fail(exc)  # (runs what waits on it: an Exchange ends, a serving lets go)
            except Exception:  # one request's bug must not stop the teardown
                self.log.exception("link.teardown_failed", req_id=req.req_id)
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
        """Send one control frame (:meth:`~.writer.LinkWriter.send`).

        Raises:
            LinkBroken: the link is down or the socket failed.
        """
        await self.writer.send(msg)

    def send_soon(
        self, frames: list[Message | Framed], views: list[memoryview], done: Callable[[], None]
    ) -> bool:
        """Frames for the reader, which must never wait on a send
        (:meth:`~.writer.LinkWriter.send_soon`); False when the link is down."""
        return self.writer.send_soon(frames, views, done)

    async def send_stream(
        self,
        req: Request,
        stream: StreamPlan,
        to_initiator: bool,
        token: CancelToken,
        lead: Message | None = None,
        span: tuple[int, int] | None = None,
    ) -> bool:
        """A plan's bytes (those of ``span``, default all) as DATA frames
        (:meth:`~.writer.LinkWriter.send_stream`); False if stopped by ``token``.

        Raises:
            LinkBroken: the link failed (the link is then broken).
        """
        return await self.writer.send_stream(req, stream, to_initiator, token, lead, span)

    def send_frame_now(
        self,
        req: Request,
        stream: StreamPlan,
        to_initiator: bool,
        span: tuple[int, int],
        then: Callable[[bool], None],
    ) -> bool:
        """Bytes ``span`` of a plan as one DATA frame at once, from the loop, if that needs no
        wait, ``then`` run once it is all out (:meth:`~.writer.LinkWriter.send_frame_now`);
        False with nothing sent."""
        return self.writer.send_frame_now(req, stream, to_initiator, span, then)

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

    async def peer_table(
        self,
        timeout_s: float,
        turns: BuildTurns | None = None,
        answered: Callable[[], None] = nothing,
    ) -> TableSnapshot | None:
        """Ask the peer for its cache table; None if no answer came in ``timeout_s``
        (``answered()`` is called when it came). The answer is parsed in a worker thread: a
        peer's table may hold ~100k values, some 200 ms of Python (its JSON was parsed on the
        loop, bounded by the decoder). ``turns``: the tables fetched with this one, built one
        after another (:class:`BuildTurns`).

        Raises:
            LinkBroken: the link failed meanwhile. LLMException: the peer's table is too big
                to be sent (it says so); LLM_TIMEOUT: once here (and its turn came), it waited
                for the endpoint's build slot (other links' tables were being built) until
                ``timeout_s`` had passed since its arrival, less what ``turns`` waited.
        """
        msg = await self.roundtrip(TableRequest().encode(), MT.TABLE, timeout_s)
        if msg is None:
            return None
        answered()
        refused = msg.fields.get("refused")
        if refused is not None:
            why = refused[:500] if isinstance(refused, str) else "(no reason given)"
            raise LLMException(
                f"cluster {self.peer_cluster_id} could not send its cache table: {why}",
                status_code=LLMStatusCode.LLM_FAILED,
            )
        builds, borrower = self.manager.table_builds, object()
        waited = f"then waited {timeout_s:g} s"
        async with turns.lock if turns is not None else contextlib.nullcontext():
            # The wait for the slot is bounded, from the table's arrival or its turn: neither
            # what the roundtrip took nor the builds of the tables fetched with it are the
            # slot's doing; the tables fetched together share one timeout for their waits.
            budget = timeout_s - (turns.waited_s if turns is not None else 0.0)
            start = anyio.current_time()
            got = False
            with anyio.move_on_after(budget):
                await builds.acquire_on_behalf_of(borrower)
                got = True
            if turns is not None:
                turns.waited_s += anyio.current_time() - start
                if budget <= 0:
                    waited = f"but the tables fetched with it had waited {timeout_s:g} s"
            if got:  # (the turn is kept until the build is done: a fellow waits from then)
                try:  # (a build that has begun is not cancelled: a worker runs it to its end)
                    return await anyio.to_thread.run_sync(_snapshot, msg.fields)
                finally:
                    builds.release_on_behalf_of(borrower)
        raise LLMException(
            f"the cache table of cluster {self.peer_cluster_id} came, {waited} for this "
            "endpoint's build slot (other links' tables were being built)",
            status_code=LLMStatusCode.LLM_TIMEOUT,
        )

    # ------------------------------------------------------------------ reading
    async def run_reader(self, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """The link's only socket reader (:class:`~.reader.LinkReader`); ends when the link
        breaks or closes."""
        await self.reader.run(task_status)


def _snapshot(fields: Mapping[str, Any]) -> TableSnapshot:
    """A peer's table as a snapshot, built with the garbage collector paused (``_collector``:
    its records would set off full collections that hold the GIL, and so the loop, for tens
    of ms)."""
    with collector_paused():
        return TableSnapshot(fields)
