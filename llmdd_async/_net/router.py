"""What an established link does with each control frame its peer sends.

:class:`FrameRouter` admits the peer's requests (or refuses them, LLM_LINK_BUSY, past the
link's queue limits) and hands them to the link's server (one that waits for a serving slot
waits here, parked, and is served from the reader once a slot is freed); routes GRANT,
RESULT, DONE and ABORT to the requests they concern; and answers the peer's PING, TABLE_REQ
and UNLINK from tasks of their own, at most ``_MAX_REPLIES`` owed at once (the reader waits
beyond that, so a peer that sends but never reads floods its own socket buffers, not our
memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import deque
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import anyio.to_thread

from .._enums import LLMStatusCode
from .._errors import LinkBroken, LLMException, ProtocolError, is_caller_facing
from .._messages import Abort, Grant, Pong, UnlinkAck
from .._messages import Request as XferRequest
from .._protocol import MT, UNCHARGED_META, Message
from .host import Served
from .requests import Pending, Request, Serving, nothing, past_budget

if TYPE_CHECKING:
    from .link import Link

__all__ = ["DEFER", "HANDLED", "YIELD", "FrameRouter"]

#: replies (PONG, TABLE, ...) owed to a peer before its link stops reading from it
_MAX_REPLIES = 64
#: bytes of a GRANT's descriptor sizes (8 per descriptor) checked on the loop; larger grants
#: are checked in a worker thread
_GRANT_INLINE = 8 << 14
#: the frames that owe the peer a reply (or may: a refused request)
_OWE_REPLIES = frozenset({MT.XFER_REQ, MT.PING, MT.TABLE_REQ, MT.UNLINK})
#: what :meth:`FrameRouter.dispatch_now` did with a frame
HANDLED, YIELD, DEFER = 0, 1, 2


def _checked_off_loop(pending: Pending, msg: Message) -> bool:
    """A GRANT whose check costs too much for the loop: of many descriptors, or against many
    blocks of ours."""
    nbytes = memoryview(msg.arrays.get("nbytes", b"")).nbytes
    return nbytes > _GRANT_INLINE or pending.check_in_worker


class FrameRouter:
    """The control frames of one link: called by its reader, one frame at a time."""

    def __init__(self, link: Link) -> None:
        self.link = link
        #: this side's requests waiting for a reply of a given type (TABLE, UNLINK_ACK, PONG)
        self._waiters: dict[MT, list[Pending]] = {MT.TABLE: [], MT.UNLINK_ACK: [], MT.PONG: []}
        self._replies = anyio.Semaphore(_MAX_REPLIES)
        #: requests served from the reader once a serving slot is free, in order (each also
        #: in ``link.serving``: counted in the link's queue, failed with the link)
        self._parked: deque[Serving] = deque()
        #: ... those of them still waiting (an aborted one leaves its place in the queue
        #: behind, skipped, until the queue is compacted), with what they asked
        self._waiting: dict[Serving, XferRequest] = {}
        self._unparking = False

    @property
    def parked(self) -> bool:
        """Requests wait for a serving slot (apart from one being served now)."""
        return bool(self._waiting) and not self._unparking

    def unwanted(self, kind: MT) -> bool:
        """A reply nobody waits for now (the decoder then leaves its fields unparsed)."""
        waiters = self._waiters.get(kind)
        return waiters is not None and not waiters

    @contextlib.contextmanager
    def expecting(self, reply: MT) -> Iterator[Pending]:
        """A waiter that gets the next ``reply`` frame (as its result) while in the block."""
        waiter = Pending(0, None)
        self._waiters[reply].append(waiter)
        try:
            yield waiter
        finally:
            with contextlib.suppress(ValueError):
                self._waiters[reply].remove(waiter)

    def waiters(self) -> list[Pending]:
        """Every waiter of :meth:`expecting` (failed with the link)."""
        return [w for ws in self._waiters.values() for w in ws]

    async def dispatch(self, msg: Message) -> None:
        """Act on a control frame that :meth:`dispatch_now` deferred: a grant of many
        descriptors is checked in a worker thread; a frame that owes the peer a reply waits
        until fewer than ``_MAX_REPLIES`` are owed (the reader is paused meanwhile, so a peer
        that sends but never reads floods its own socket buffers, not our memory).

        Raises:
            ProtocolError: as :meth:`dispatch_now`.
        """
        link = self.link
        pending = link.pending.get(msg.req_id) if msg.type == MT.GRANT else None
        if pending is not None and _checked_off_loop(pending, msg):
            if pending.on_grant is not None:
                # (tens of ms of numpy: off the loop. The reader waits, so no DATA comes
                # first.)
                await anyio.to_thread.run_sync(pending.on_grant, msg, limiter=link.threads)
            pending.grant = msg
            pending.grant_event.set()
            return
        if msg.type in _OWE_REPLIES and not self._replies.value:
            await self._replies.acquire()
            self._replies.release()  # free now, and nothing else runs before it is taken
        self.dispatch_now(msg)

    def dispatch_now(self, msg: Message) -> int:
        """Act on one control frame (no payload) of the peer, from the reader, without
        awaiting: returns HANDLED, YIELD (handled; let other tasks run before the next
        frame) or DEFER (nothing was done: the reader awaits :meth:`dispatch` instead).

        Raises:
            ProtocolError: the frame makes no sense on an established link (the reader then
                breaks the link).
        """
        link = self.link
        kind = msg.type
        if kind in _OWE_REPLIES and not self._replies.value:
            return DEFER
        if kind == MT.XFER_REQ:
            self._admit(msg)
        elif kind == MT.GRANT:
            pending = link.pending.get(msg.req_id)
            if pending is not None:
                if pending.on_grant is not None:
                    if _checked_off_loop(pending, msg):
                        return DEFER
                    pending.on_grant(msg)
                pending.grant = msg
                pending.grant_event.set()
        elif kind == MT.RESULT:
            pending = link.pending.get(msg.req_id)
            if pending is not None:
                pending.result = msg
                pending.result_event.set()
        elif kind == MT.DONE:
            serving = link.serving.get(msg.req_id)
            if serving is not None:
                if serving.on_done is not None:
                    serving.on_done(msg)
                serving.done_event.set()
        elif kind == MT.ABORT:
            self._aborted(msg)
        elif kind == MT.TABLE_REQ:
            table = link.host.published_table()
            if link.access is not None:
                # What the link's transport adds for its peer only (NIXL: keys to our memory).
                table.update(link.access.table_fields())
            self._owe_reply(Message(MT.TABLE, 0, table))
            # Each reply encodes the whole table (milliseconds for thousands of caches): a
            # burst of requests is answered one per loop turn, not all in one turn.
            return YIELD
        elif kind == MT.PING:
            self._owe_reply(Pong().encode())
        elif kind == MT.UNLINK:
            self._replies.acquire_nowait()
            link.host.spawn(self._peer_unlinked)
        elif kind in self._waiters:
            # Each waiter takes one reply, and leaves at once: until its task ran, a peer's
            # burst of tables would each be parsed (the decoder parses only wanted ones).
            waiters = self._waiters[kind]
            for w in waiters:
                w.result = msg
                w.result_event.set()
            waiters.clear()
        elif kind == MT.BYE:
            link.peer_left = True
            link.fail(
                LinkBroken(
                    f"cluster {link.peer_cluster_id} finalized",
                    status_code=LLMStatusCode.LLM_NOT_YET_LINK,
                ),
                expected=True,
            )
        else:
            raise ProtocolError(f"unexpected {kind.name} on an established link")
        return HANDLED

    def _admit(self, msg: Message) -> None:
        """A request of the peer: refused when the link's queue is full, else served from
        the reader (:meth:`RequestServer.serve_now`) or queued for a serving task.

        Raises:
            ProtocolError: the request id is in use.
        """
        link = self.link
        if msg.req_id in link.serving:
            raise ProtocolError(f"request id {msg.req_id} reused")
        meta_bytes = sum(memoryview(a).nbytes for a in msg.arrays.values())
        limits = link.host.options.limits
        # What a queued request keeps of its frame counts against the endpoint's budget
        # too: many links' queues must not add up past it.
        budget = link.decoder.budget
        charged = meta_bytes if meta_bytes > UNCHARGED_META and budget is not None else 0
        if (
            len(link.serving) + link.outbox_frames >= limits.queued
            or link.queued_bytes + meta_bytes > 4 * limits.meta_bytes
            or (charged and budget is not None and not budget.reserve(charged))
        ):
            busy = (
                f"cluster {link.host.cluster_id} already has {len(link.serving)} requests "
                f"({link.queued_bytes} bytes) of this link queued"
            )
            self._owe_reply(Grant.refusal(msg.req_id, LLMStatusCode.LLM_LINK_BUSY, busy).encode())
            return
        try:
            request = XferRequest.decode(msg)  # the one read of the peer's request
        except ProtocolError as exc:
            if charged and budget is not None:
                budget.release(charged)
            code = exc.status_code if is_caller_facing(exc) else LLMStatusCode.LLM_PARAM_INVALID
            self._owe_reply(Grant.refusal(msg.req_id, code, str(exc)).encode())
            return
        try:
            served = link.server.serve_now(link, request)
        except BaseException:
            if charged and budget is not None:
                budget.release(charged)
            raise
        if served is Served.NOW:
            if charged and budget is not None:
                budget.release(charged)
            return
        if served is Served.TASK and not self.slot_free():
            # Its task would wait for a slot, ahead of requests parked for one before it.
            served = Served.NO_SLOT
        # The peer's deadline, but never more than this side would give itself: one
        # stalled peer must not hold our workers for longer (upstream: 1800 s).
        deadline_s = link.host.serve_budget_s(1024)
        if request.timeout_ms > 0:
            deadline_s = min(deadline_s, request.timeout_ms / 1000)
        req = Serving(msg.req_id, time.monotonic() + deadline_s)
        req.meta_bytes = meta_bytes
        req.charged = charged
        link.queued_bytes += meta_bytes
        link.serving[msg.req_id] = req
        if served is Served.TASK:
            self._spawn(req, request)
        else:
            # Parked: a task each would cost more than serving them (many small requests in
            # flight to one target).
            self._park(req, request)

    def slot_free(self) -> bool:
        """A serving slot is free, and no earlier request waits for one (requests keep their
        order)."""
        return self.link.serving_limiter.available_tokens >= 1 and not self.parked

    def take_slot(self, req: Serving) -> bool:
        """Take a serving slot for ``req`` if :meth:`slot_free`; False if not."""
        if not self.slot_free():
            return False
        self.link.serving_limiter.acquire_on_behalf_of_nowait(req)
        return True

    def give_slot(self, req: Serving) -> None:
        """Give back the slot taken for ``req``, and let parked requests in."""
        try:
            self.link.serving_limiter.release_on_behalf_of(req)
        finally:
            self.serve_parked()

    def _spawn(self, req: Serving, request: XferRequest) -> None:
        """Hand a request to a task of its own, with a serving slot taken for it now (so that
        a request the reader serves next cannot take it first; the task gives it back)."""
        link = self.link
        if not self.take_slot(req):  # (its caller found one free: a bug)
            raise RuntimeError("a request handed to a task found no serving slot free")
        try:
            link.host.spawn(link.server.serve_request, link, req, request)
        except BaseException:
            link.serving_limiter.release_on_behalf_of(req)
            raise

    def _park(self, req: Serving, request: XferRequest) -> None:
        """Queue a request (recorded in ``link.serving``) until a serving slot is free."""
        self._parked.append(req)
        self._waiting[req] = request
        # Aborted, or the link failed: it leaves the queue unserved.
        req.done_event.callback = lambda: self._unpark(req)

    def _unpark(self, req: Serving) -> None:
        """A parked request was aborted, or its link failed: it leaves the queue unserved, and
        lets go of what it asked (its place in the queue is skipped, and dropped when the
        queue is compacted)."""
        serving = self.link.serving
        if serving.get(req.req_id) is req:
            del serving[req.req_id]
        self._release_queued(req)
        self._waiting.pop(req, None)
        waiting = self._waiting
        if not waiting:
            self._parked.clear()
        elif len(self._parked) > 2 * len(waiting) + 16:
            self._parked = deque(r for r in self._parked if r in waiting)

    def _release_queued(self, req: Serving) -> None:
        """What a queued request held of the link's and the endpoint's budgets."""
        link = self.link
        link.queued_bytes -= req.meta_bytes
        req.meta_bytes = 0
        budget = link.decoder.budget
        if req.charged and budget is not None:
            budget.release(req.charged)
        req.charged = 0

    def serve_parked(self) -> None:
        """Serve parked requests, in order, while serving slots are free (call it when one is
        freed). A failure breaks the link, as one in the reader would."""
        if self._unparking:
            return  # (one ended while another is served: the loop below goes on)
        link = self.link
        self._unparking = True
        try:
            while self._parked and link.alive and link.serving_limiter.available_tokens >= 1:
                req = self._parked.popleft()
                request = self._waiting.pop(req, None)
                if request is None:
                    continue  # (aborted while parked)
                req.done_event.callback = None
                del link.serving[req.req_id]
                served = self._serve_unparked(req, request)
                if served is Served.NO_SLOT:  # (a bug: parked again, nothing would drain it)
                    self._release_queued(req)
                    raise RuntimeError("a request let in found no serving slot free")
                if served is Served.TASK:  # (it keeps what it holds until the task ends)
                    link.serving[req.req_id] = req
                    self._spawn(req, request)
        except Exception as exc:
            link.fail(exc)
        finally:
            self._unparking = False

    def _serve_unparked(self, req: Serving, request: XferRequest) -> Served:
        """Serve a request that waited parked, within what is left of its deadline (out of
        time: the initiator is told, as for any request past its budget). Its early bytes
        (an eager push's) were discarded meanwhile (nothing received them: see ``eager``),
        so it is granted, never taken as sent. Served now, or on failure, what it held of
        the budgets is released.

        Raises:
            Exception: only a bug's (the caller then breaks the link).
        """
        link = self.link
        served = Served.NOW
        try:
            left_ms = math.ceil(((req.deadline or 0) - time.monotonic()) * 1000)
            if left_ms <= 0:
                exc = past_budget(link.host)
                abort = Abort(req.req_id, exc.status_code, str(exc), to_initiator=True)
                link.send_soon([abort.encode()], [], nothing)
                return served
            request = dataclasses.replace(request, eager=None, timeout_ms=left_ms)
            served = link.server.serve_now(link, request)
            return served
        finally:
            if served is Served.NOW:
                self._release_queued(req)

    def _aborted(self, msg: Message) -> None:
        """The peer stopped a request (and, with ``broken``, the link)."""
        link = self.link
        abort = Abort.decode(msg)
        # The peer's words, bounded (and, as a link's reason, marked as theirs).
        text = "aborted by peer" if abort.message is None else abort.message
        table: Mapping[int, Request] = link.pending if abort.to_initiator else link.serving
        aborted = table.get(msg.req_id)
        if aborted is not None:
            aborted.fail(LLMException(text, status_code=abort.status))
        if abort.broken:  # the peer breaks the link, and says why
            link.fail(LinkBroken(f"cluster {link.peer_cluster_id} broke the link: {text}"))

    def _owe_reply(self, msg: Message) -> None:
        """Answer the peer from a task of its own. The caller made sure a reply slot is free
        (:meth:`dispatch_now` defers frames that owe one while ``_MAX_REPLIES`` are owed)."""
        self._replies.acquire_nowait()
        self.link.host.spawn(self._reply, msg)

    async def _reply(self, msg: Message) -> None:
        try:
            with contextlib.suppress(LLMException):
                try:
                    await self.link.send(msg)
                except ProtocolError as exc:  # (our encoder's: nothing was sent)
                    if msg.type is not MT.TABLE:
                        raise
                    # A table too big for any peer: said here, and to the peer, whose fetch
                    # then fails at once with why (an older peer sees an empty table).
                    self.link.log.error("link.table_refused", reason=str(exc))
                    await self.link.send(Message(MT.TABLE, 0, {"refused": str(exc)}))
        finally:
            self._replies.release()

    async def _peer_unlinked(self) -> None:
        link = self.link
        try:
            with contextlib.suppress(LLMException):
                await link.send(UnlinkAck().encode())
        finally:
            self._replies.release()
        # Gone from our list too, as upstream does when the peer unlinks (a prompt may then
        # switch_role without unlinking); our own unlink_clusters of it still succeeds.
        link.peer_left = True
        link.manager.peer_unlinked(link)
        link.fail(
            LinkBroken(
                f"cluster {link.peer_cluster_id} unlinked",
                status_code=LLMStatusCode.LLM_NOT_YET_LINK,
            ),
            expected=True,
        )
