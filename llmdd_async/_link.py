"""A link to one peer endpoint: one TCP connection, its reader, framed sends, request routing.

A link is usable in both directions. Requests this side starts live in ``pending``; requests
the peer starts live in ``serving``. The reader task is the only reader of the socket; bulk
payload is received straight into destination memory by worker threads (see ``tcp``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
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

from ._enums import LLMStatusCode
from ._errors import LLMException, status_from_exception
from ._log import get_logger
from ._memory import CancelToken, CopyCancelled
from ._protocol import MT, NEED_DATA, Decoder, Message, PayloadBytes, ProtocolError, encode
from ._transports.tcp import (
    CHUNK_BYTES,
    Fence,
    StreamPlan,
    recv_views,
    scratch_views,
    send_views,
)

__all__ = [
    "FLAG_TO_INITIATOR",
    "Link",
    "LinkBroken",
    "Pending",
    "Serving",
    "auth_mac",
    "wire_status",
]

#: DATA/ABORT flag: the frame concerns a request that the *receiver* of the frame started.
FLAG_TO_INITIATOR = 1
_READ_AHEAD = 64 << 10
MAX_SERVING = 16
_SCRATCH = 4 << 20


def wire_status(msg: Message) -> LLMStatusCode:
    """The ``status`` field of a peer's frame; missing, malformed or unknown is LLM_FAILED."""
    raw = msg.fields.get("status")
    return LLMStatusCode.from_wire(raw) if type(raw) is int else LLMStatusCode.LLM_FAILED


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


def auth_mac(key: bytes, role: bytes, *parts: str) -> str:
    """HMAC-SHA256 over the handshake transcript, labelled by who proves it."""
    return hmac.new(key, role + b"|" + "|".join(parts).encode(), hashlib.sha256).hexdigest()


class _Request:
    """State shared by both kinds of request."""

    def __init__(self, req_id: int, deadline: float | None) -> None:
        self.req_id = req_id
        self.deadline = deadline
        self.token = CancelToken()
        self.stream: StreamPlan | None = None
        self.received = 0
        self.data_event = anyio.Event()
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
        self.grant_event = anyio.Event()
        #: run by the reader when the GRANT arrives, before any DATA of this request is read
        self.on_grant: Callable[[Message], None] | None = None
        self.result: Message | None = None
        self.result_event = anyio.Event()

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
        self.done_event = anyio.Event()
        #: run by the reader when DONE arrives, so its effect (consuming a key) happens before
        #: any later request on the link is looked at
        self.on_done: Callable[[Message], None] | None = None

    def wake(self) -> None:
        super().wake()
        self.done_event.set()


class Link:
    """One established link. Created by the engine after a successful handshake."""

    def __init__(
        self,
        engine: Any,
        sock: socket.socket,
        decoder: Decoder,
        peer: dict[str, Any],
        access: Any,
    ) -> None:
        self.engine = engine
        self.sock = sock
        self.decoder = decoder
        self.peer = peer
        self.peer_cluster_id: int = int(peer["cluster_id"])
        self.access = access  # PeerAccess or None (stream only)
        self.log = get_logger(
            "link", cluster_id=engine.cluster_id, peer_cluster_id=self.peer_cluster_id
        )
        # fast_acquire: an uncontended lock costs no trip through the event loop.
        self.send_lock = anyio.Lock(fast_acquire=True)
        #: FIFO lock that keeps this side's transfers on the link from interleaving.
        self.transfer_lock = anyio.Lock(fast_acquire=True)
        self.pending: dict[int, Pending] = {}
        self.serving: dict[int, Serving] = {}
        self._ids = itertools.count(1)
        self.broken: BaseException | None = None
        self.closed = False
        self.table: dict[str, Any] | None = None
        #: requests waiting for a reply of a given type (TABLE, UNLINK_ACK, PONG)
        self._waiters: dict[MT, list[Pending]] = {MT.TABLE: [], MT.UNLINK_ACK: [], MT.PONG: []}
        self._scratch = memoryview(bytearray(_SCRATCH))
        self._reader_scope: anyio.CancelScope | None = None
        #: requests of the peer served at once; more wait (bounds staging memory and threads)
        self.serving_limiter = anyio.CapacityLimiter(MAX_SERVING)
        self.stats_bytes = 0
        self.stats_transfers = 0
        self.up_since = time.time()
        #: the last transfers this side started on the link: (op, started, finished, bytes)
        self.history: collections.deque[TransferRecord] = collections.deque(maxlen=256)

    # ------------------------------------------------------------------ state
    @property
    def alive(self) -> bool:
        return self.broken is None and not self.closed

    def check_alive(self) -> None:
        """Raises LLMException(LLM_NOT_YET_LINK) when the link is gone."""
        if not self.alive:
            raise LLMException(
                f"link to cluster {self.peer_cluster_id} is down ({self.broken or 'closed'})",
                status_code=LLMStatusCode.LLM_NOT_YET_LINK,
            )

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

    def fail(self, exc: BaseException, expected: bool = False) -> None:
        """Mark the link broken, fail every request on it, close the socket."""
        if self.broken is not None or self.closed:
            return
        self.broken = (
            exc
            if isinstance(exc, LLMException)
            else LinkBroken(f"link to cluster {self.peer_cluster_id} failed: {exc!r}")
        )
        (self.log.info if expected else self.log.warning)("link.down", reason=str(exc))
        self._teardown(self.broken)

    def _teardown(self, exc: BaseException) -> None:
        waiters = [w for ws in self._waiters.values() for w in ws]
        for req in [*self.pending.values(), *self.serving.values(), *waiters]:
            req.fail(exc)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        if self._reader_scope is not None:
            self._reader_scope.cancel()
        self._scratch = memoryview(b"")  # a down link keeps no buffers

    async def close(self, notify: bool) -> None:
        """Drop the link (unlink/finalize). In-flight transfers fail with LLM_NOT_YET_LINK."""
        if self.closed:
            return
        if notify and self.broken is None:
            with anyio.move_on_after(0.5), contextlib.suppress(Exception):
                await self.send(Message(MT.BYE))
        self.closed = True
        self.log.info("link.down", reason="closed")
        self._teardown(
            LLMException(
                f"link to cluster {self.peer_cluster_id} was closed",
                status_code=LLMStatusCode.LLM_NOT_YET_LINK,
            )
        )
        if self.access is not None:
            self.access.close()

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
        data = memoryview(encode(msg))
        async with self.send_lock:
            if not self.alive:
                raise LinkBroken(f"link to cluster {self.peer_cluster_id} is down")
            try:
                # Once the first byte is out the frame must be finished, whoever cancels us:
                # a half-sent frame would desynchronise the stream. A peer that stops reading
                # for the whole stall timeout breaks the link instead.
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
            except (OSError, TimeoutError) as exc:
                self.fail(exc)
                raise LinkBroken(f"send to cluster {self.peer_cluster_id} failed: {exc}") from exc
        await anyio.lowlevel.checkpoint()  # a shielded send still lets cancellation in here

    async def send_stream(
        self, req: _Request, stream: StreamPlan, to_initiator: bool, token: CancelToken
    ) -> bool:
        """Send a plan's bytes as DATA frames. Returns False if stopped by ``token``.

        Each frame goes out from a worker thread straight from the source memory. When the
        token trips, the worker stops reading source memory at once (the current frame is
        finished with zeros) and no further frame is sent.

        Raises:
            LinkBroken: the link failed (the link is then broken).
        """
        off = 0
        flags = FLAG_TO_INITIATOR if to_initiator else 0
        while off < stream.total:
            if token.cancelled or not self.alive:
                return False
            n = min(CHUNK_BYTES, stream.total - off)
            header = encode(Message(MT.DATA, req.req_id, {"off": off}, payload_len=n, flags=flags))
            views = await stream.prepare(off, n, token)
            deadline = req.deadline or (time.monotonic() + self.engine.stall_timeout_s)
            fence = Fence(token, deadline)
            async with self.send_lock:
                if not self.alive:
                    raise self.broken or LinkBroken("link closed")
                try:
                    # Set only now, next to the worker that will release it.
                    req.fence = fence
                    await anyio.to_thread.run_sync(send_views, self.sock, header, views, fence)
                except (OSError, TimeoutError) as exc:
                    self.fail(exc)
                    raise LinkBroken(f"sending to cluster {self.peer_cluster_id}: {exc}") from exc
                finally:
                    req.fence = None
            off += n
            self.stats_bytes += n
        return not token.cancelled

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
        done = await anyio.to_thread.run_sync(fence.released.wait, self.engine.stall_timeout_s)
        if not done:
            self.fail(TimeoutError("a worker did not let go of a cancelled transfer"))
            await anyio.to_thread.run_sync(fence.released.wait)

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
        return self.table

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
                            self._dispatch(ev)
                    else:  # payload bytes outside a DATA frame cannot happen
                        raise ProtocolError("unexpected payload bytes")
            except (OSError, EOFError, ProtocolError, TimeoutError, LLMException) as exc:
                self.fail(exc)
            except Exception as exc:  # a bug must break this link, not the whole engine
                self.log.exception("link.reader_crashed")
                self.fail(exc)

    async def _fill(self, mv: memoryview) -> None:
        while True:
            try:
                n = self.sock.recv_into(mv, len(mv), socket.MSG_DONTWAIT)
            except BlockingIOError:
                await anyio.wait_readable(self.sock)
                continue
            if n == 0:
                raise EOFError(f"cluster {self.peer_cluster_id} closed the connection")
            self.decoder.receive_data(mv[:n])
            return

    async def _receive_payload(self, msg: Message) -> None:
        if msg.type != MT.DATA:
            raise ProtocolError(f"{msg.type.name} frames carry no payload")
        n = msg.payload_len
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
        # Bytes the read-ahead already pulled in go first (at most 64 KiB, copied here).
        pos = 0
        while self.decoder.buffered and self.decoder.payload_remaining:
            ev = self.decoder.next_event()
            assert isinstance(ev, PayloadBytes)
            chunk = ev.data
            if req is not None and not req.token.cancelled:
                _copy_into(views, pos, chunk)
            pos += chunk.nbytes
        rest = self.decoder.payload_remaining
        token = req.token if req is not None else _CANCELLED
        deadline = (req.deadline if req is not None else None) or (
            time.monotonic() + self.engine.stall_timeout_s
        )
        if rest:
            target = _slice_views(views, pos, rest) if views else scratch_views(rest, self._scratch)
            fence = Fence(token, deadline)
            if req is not None:
                req.fence = fence
            try:
                await anyio.to_thread.run_sync(recv_views, self.sock, target, fence, self._scratch)
            finally:
                if req is not None:
                    req.fence = None
            self.decoder.payload_consumed(rest)
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

    def _dispatch(self, msg: Message) -> None:
        t = msg.type
        if t == MT.XFER_REQ:
            if msg.req_id in self.serving:
                raise ProtocolError(f"request id {msg.req_id} reused")
            deadline_ms = msg.fields.get("timeout_ms")
            deadline = time.monotonic() + (
                deadline_ms / 1000 if isinstance(deadline_ms, int) and deadline_ms > 0 else 1800
            )
            req = Serving(msg.req_id, deadline)
            self.serving[msg.req_id] = req
            self.engine.spawn(self.engine.serve_request, self, req, msg)
        elif t == MT.GRANT:
            p = self.pending.get(msg.req_id)
            if p is not None:
                if p.on_grant is not None:
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
            text = str(msg.fields.get("message", "aborted by peer"))
            table: Mapping[int, _Request] = (
                self.pending if msg.flags & FLAG_TO_INITIATOR else self.serving
            )
            aborted = table.get(msg.req_id)
            if aborted is not None:
                aborted.fail(LLMException(text, status_code=code))
        elif t == MT.TABLE_REQ:
            self.engine.spawn(self._reply, Message(MT.TABLE, 0, self.engine.published_table()))
        elif t == MT.PING:
            self.engine.spawn(self._reply, Message(MT.PONG))
        elif t == MT.UNLINK:
            self.engine.spawn(self._peer_unlinked)
        elif t in self._waiters:
            for w in self._waiters[t]:
                w.result = msg
                w.result_event.set()
        elif t == MT.BYE:
            self.fail(
                LinkBroken(
                    f"cluster {self.peer_cluster_id} finalized",
                    status_code=LLMStatusCode.LLM_NOT_YET_LINK,
                ),
                expected=True,
            )
        else:
            raise ProtocolError(f"unexpected {t.name} on an established link")

    async def _reply(self, msg: Message) -> None:
        with contextlib.suppress(LinkBroken):
            await self.send(msg)

    async def _peer_unlinked(self) -> None:
        with contextlib.suppress(LinkBroken):
            await self.send(Message(MT.UNLINK_ACK))
        self.engine.drop_link(self)
        await self.close(notify=False)


_CANCELLED = CancelToken()
_CANCELLED.cancel()


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
