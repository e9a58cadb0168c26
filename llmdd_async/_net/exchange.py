"""One request this side initiates on a link, from its XFER_REQ to its end, driven by the link's
reader (:class:`Exchange`): see :mod:`.initiator` for the transfer as a whole.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Awaitable, Callable

import anyio
import numpy as np

from .._errors import CopyCancelled, LinkBroken, LLMException, ProtocolError, status_from_exception
from .._messages import Abort, By, Cap, Data, Done, Grant, Mode, Op, Result
from .._planner import Plan, check_within, u64_sum
from .._protocol import Message
from .._timers import Timer
from .._transports.tcp import INLINE_BYTES, StreamPlan, host_views
from .eager import as_planned, eager_field, eager_plan, eager_pull_plan
from .feed import LayerFeed, send_layers
from .grant_checks import checks_in_worker, grant_fault, layer_spans, raise_unless_ok, refusal_of
from .grants import TransferRequest
from .host import LinkHost
from .link import Link
from .requests import Pending, nothing
from .streams import VIEWS_INLINE

__all__ = ["KEYS", "Exchange"]

#: taken to hand a request's stream over to whoever closes it (the loop, or the worker that
#: checks a big grant): it is closed exactly once
_STREAM_HANDOVER = threading.Lock()

#: how a pull names a cache by the key that grants it
KEYS = (By.REQ_KEY, By.PREFIX_KEY, By.BLOCKS_KEY)


class Exchange:
    """One request this side initiates on a link, from its XFER_REQ to its end, driven by the
    link's reader: it is sent at once (:meth:`start`), the GRANT is checked where it is read
    (before any DATA of it), a streamed pull ends where its last DATA frame lands, and
    ``on_end(self)`` then reports :attr:`result` or :attr:`error`, with no task of its own.
    Only what must await gets a task: a copy through the link's access (local grants), a push
    (its DATA frames and RESULT), and a fence that waits for a worker thread.

    :meth:`stop` ends it early (a cancel, a deadline, the caller's scope): once ``on_end`` has
    run nothing of this request touches its memory (a worker still holding it is waited for
    first), and the peer is told (an ABORT) while the link is up.
    """

    def __init__(
        self,
        engine: LinkHost,
        link: Link,
        spec: TransferRequest,
        req: Pending,
        key_reads: bool,
        on_end: Callable[[Exchange], None],
        feed: LayerFeed | None = None,
    ) -> None:
        self.engine = engine
        self.link = link
        self.spec = spec
        self.req = req
        #: ask for a local grant of what a key grants (same host), retried over the stream
        #: by the caller if the copy fails (:attr:`read_failed`)
        self.key_reads = key_reads
        self._on_end = on_end
        self._grant: Grant | None = None
        self._direct = False
        #: why it is being stopped (the first reason)
        self._stopping: BaseException | None = None
        #: a task runs the rest (and ends it); its scope, once it started
        self._running = False
        self._scope: anyio.CancelScope | None = None
        #: a DATA frame of this push is queued or being sent (its memory is read)
        self._sending = False
        self._t_start = 0.0
        self.ended = False
        self.result: tuple[int, int] | None = None
        self.error: BaseException | None = None
        #: the copy of a local grant by key failed (OSError): the stream may still work
        self.read_failed = False
        #: a layer-wise push: its layers, and where each starts in the grant (layer_spans)
        self.feed = feed
        self._spans: list[int] | None = None
        self._grant_timer: Timer | None = None
        #: a push whose bytes followed its request (:mod:`.eager`): what they were, as a
        #: grant; and a GRANT that came while they were still being sent (acted on after)
        self._eager: Grant | None = None
        self._grant_waits = False
        self._result_waits = False

    # ------------------------------------------------------------------ on the loop
    def start(self) -> None:
        """Send the request; everything after happens in the reader's callbacks (or the end
        comes at once, with the link's error, if it is down)."""
        engine, link, spec, req = self.engine, self.link, self.spec, self.req
        req.on_grant = self._check_grant
        req.check_in_worker = checks_in_worker(spec)
        req.grant_event.callback = self._granted
        req.data_event.callback = self._landed
        caps = engine.request_caps(link, spec.local)
        # (see grants._reads_itself; the retry after a failed such copy asks for the stream)
        key_reads = self.key_reads and spec.op == Op.PULL and spec.target.by in KEYS
        if key_reads and caps.get(Cap.PVR) and link.access is not None and link.access.one_sided:
            caps = {**caps, Cap.KEY_READS: True}
        else:
            key_reads = False
        self.key_reads = key_reads
        #: the request let the target grant a local copy (an honest one never does otherwise)
        self._direct = any(caps.values())
        self._t_start = time.monotonic()
        deadline = req.deadline
        # Rounded up: the target must not give up before we do (its ABORT would then end the
        # request with its words instead of our deadline's).
        timeout_ms = max(1, math.ceil((deadline - time.monotonic()) * 1000)) if deadline else 0
        plan = pulled = eager = None
        if self.feed is None and not self._direct:
            if spec.op == Op.PUSH:
                plan = eager_plan(engine, link, spec)
            else:
                pulled = eager_pull_plan(engine, link, spec)
                eager = None if pulled is None else eager_field(pulled.dst, pulled.nbytes)
        if plan is not None:
            sent = self._send_eager(plan, caps, timeout_ms)
        else:
            sent = link.send_soon([spec.to_wire(req.req_id, caps, timeout_ms, eager)], [], nothing)
        if not sent:
            self._end(link.down_error())
            return
        if pulled is not None and eager is not None and not self.ended:
            # Ready for its DATA with no GRANT before it (.eager), where we planned it: set up
            # after the request left, while the peer plans it (the reader acts on that DATA
            # once the loop runs again).
            self._eager = as_planned(req.req_id, pulled.dst, pulled.nbytes, eager)
            req.stream, req.eager = StreamPlan(pulled.dst, pulled.nbytes), True
            req.stream.make_views()
        if self.feed is not None:
            when = engine.timers.now() + self.feed.grant_timeout_s
            self._grant_timer = engine.timers.call_at(when, self._grant_late)

    def _send_eager(self, plan: Plan, caps: dict[str, bool], timeout_ms: int) -> bool:
        """Send a push's bytes right behind its request (:mod:`.eager`): the RESULT alone
        answers one the target took as sent, a GRANT one it did not (they are sent again
        under it, once these are out: :meth:`_sent`). False if the link is down."""
        req = self.req
        eager = eager_field(plan.src, plan.nbytes)
        self._eager = as_planned(req.req_id, plan.src, plan.nbytes, eager)
        total = eager[0]
        wire = self.spec.to_wire(req.req_id, caps, timeout_ms, eager)
        req.result_event.callback = self._answered
        self._sending = True
        data = Data(req.req_id, 0, total, eager=True).encode()
        views = host_views(plan.src, plan.nbytes)
        if not self.link.send_soon([wire, data], views, self._sent):
            self._sending = False
            return False
        return True

    def _grant_late(self) -> None:
        """A layer-wise push's GRANT did not come in time (its deadline is the feed's)."""
        self._grant_timer = None
        if not self.ended and self._grant is None:
            bound = self.feed.grant_timeout_s if self.feed is not None else 0.0
            self.stop(TimeoutError(f"the peer did not grant the request within {bound:.3f} s"))

    def _check_grant(self, msg: Message) -> None:
        """The reader's look at the GRANT, before any DATA of this request is read (in a
        worker thread for a grant of many descriptors): set up where the stream lands, after
        checking that it moves what this request selected of our cache, and only that.

        Raises:
            ProtocolError: the grant points outside what this request selected, or moves less
                or more (the reader then breaks the link).
        """
        if self._grant is not None:
            # An honest target grants once. A second GRANT would replace the checked one
            # under a task that already acts on it (a local copy turned into a stream).
            raise ProtocolError("a second GRANT for the same request")
        grant = Grant.decode(msg)
        if grant.mode is Mode.LOCAL and not self._direct:
            raise ProtocolError("local-mode GRANT for a request that asked for the stream")
        if grant.ok:
            # Grant.decode: a successful grant has a plan
            assert grant.local is not None
            assert grant.nbytes is not None
            fault = grant_fault(self.spec, grant.local, grant.nbytes)
            if fault is not None:
                raise ProtocolError(fault)
            if self.feed is not None:
                self._spans = layer_spans(self.spec, grant.local, grant.nbytes)
                if self._spans is None:
                    raise ProtocolError("GRANT of a layer-wise push is not in layer order")
            if grant.mode is Mode.STREAM and self.spec.op == Op.PULL:
                # The reader cannot await here; a staging buffer comes from the adapter's cache
                # after the first transfers.
                stream: StreamPlan | None = self.engine.make_stream(
                    grant.local, grant.nbytes, self.link.staging
                )
                # Checked in a worker for a big grant: the request may have ended meanwhile
                # (then _end closed what it found, and this one is closed here). A stream we
                # planned for DATA with no GRANT (.eager) is replaced: only this one lands.
                req = self.req
                with _STREAM_HANDOVER:
                    if not self.ended:
                        req.stream, stream = stream, req.stream
                        req.eager, req.received = False, 0
                if stream is not None:
                    stream.close()
        self._grant = grant  # (only a checked grant is ever acted on)

    def _granted(self) -> None:
        """The GRANT arrived (or the request failed: then there is none)."""
        self._cancel_grant_timer()
        if self.ended or self._running:
            return
        if self._eager is not None and self._sending:
            # Not taken as sent: the GRANT's turn comes once our early bytes are out (one
            # frame of this request in the writer at a time, withdrawn as a whole).
            self._grant_waits = True
            return
        req, grant = self.req, self._grant
        if req.grant is None or grant is None:
            self.stop(req.error or LinkBroken("link closed before the peer answered"))
            return
        refusal = refusal_of(grant, "refused by peer")
        if refusal is not None:
            self.stop(refusal)
            return
        if self.feed is None:  # (a layer-wise push always waits for its layers in a task)
            if grant.mode is Mode.STREAM and self.spec.op == Op.PUSH and self._push_now(grant):
                return
            if grant.mode is Mode.LOCAL and self._copy_now(grant):
                return
        if grant.mode is Mode.LOCAL or self.spec.op != Op.PULL:
            self._running = True
            try:
                self.engine.spawn(self._finish)
            except RuntimeError as exc:  # the engine stopped
                self._running = False
                self.stop(exc)
        # A streamed pull ends where its bytes land (_landed).

    def _push_now(self, grant: Grant) -> bool:
        """Send a small push's bytes from here, in one DATA frame (the link's writer finishes
        it if the socket takes only part); False when a task must send them (more than
        ``INLINE_BYTES``, many ranges, device memory). The RESULT then ends it."""
        engine, link, req = self.engine, self.link, self.req
        local, nbytes = grant.local, grant.nbytes
        assert local is not None
        assert nbytes is not None
        total = u64_sum(nbytes)
        if (
            not 0 < total <= INLINE_BYTES
            or len(nbytes) > VIEWS_INLINE
            or not engine.host_reachable(local)
            or req.token.cancelled
        ):
            return False
        if req.result_event.is_set():  # a RESULT before anything was sent: not an honest peer
            self.stop(ProtocolError("RESULT before the push's DATA was sent"))
            return True
        views = host_views(local, nbytes)
        req.result_event.callback = self._answered
        self._sending = True
        data = Data(req.req_id, 0, total, to_initiator=False).encode()
        if not link.send_soon([data], views, self._sent):
            self._sending = False
            self.stop(link.down_error())
        return True

    def _copy_now(self, grant: Grant) -> bool:
        """Copy a small local grant from here (same host: one ``process_vm_*`` on the loop)
        and send DONE; False when a task must (a copy the access does not run inline, or
        ranges to check against a table that must be fetched first)."""
        link, spec, req = self.link, self.spec, self.req
        access, remote = link.access, grant.remote
        local, nbytes = grant.local, grant.nbytes
        if access is None or remote is None or local is None or nbytes is None:
            return False  # the task says why (a ProtocolError)
        if not self.engine.host_reachable(local):
            return False  # device memory: the access copies it through the device adapter
        # The peer's word is not enough to touch its memory (as _move checks).
        by_key = spec.op == Op.PULL and spec.target.by in KEYS
        if not (by_key and access.reaches(remote, nbytes)) and not check_within(
            remote, nbytes, *link.view.regions
        ):
            return False  # the task refreshes the peer's table, then decides
        try:
            done = access.copy_now(remote, local, nbytes, req.token, spec.op == Op.PULL)
        except CopyCancelled:
            self.stop(req.error or CopyCancelled())
            return True
        except OSError as exc:
            if self.key_reads and link.alive:
                self.read_failed = True
            self.stop(exc)
            return True
        if done is None:
            return False
        if not link.send_soon([Done(req.req_id).encode()], [], nothing):
            self.stop(link.down_error())
            return True
        self._succeed(grant)
        return True

    def _sent(self) -> None:
        """Nothing reads the push's memory any more: a stop that waited for it ends now."""
        self._sending = False
        if self._stopping is not None and not self.ended:
            self.stop(self._stopping)
        elif self._grant_waits and not self.ended:
            self._grant_waits = False
            self._granted()
        elif self._result_waits and not self.ended:
            self._result_waits = False
            self._answered()

    def _answered(self) -> None:
        """The RESULT of a push this side sent from the reader (or the request failed)."""
        if self.ended or self._running:
            return
        req, grant = self.req, self._grant
        if grant is None and req.grant is None:
            grant = self._eager  # the target took the push as sent (no GRANT came)
        if req.result is None or grant is None:
            self.stop(req.error or LinkBroken("link closed before the peer answered"))
            return
        refusal = refusal_of(Result.decode(req.result), "peer failed")
        if refusal is not None:
            self.stop(refusal)
            return
        if self._sending:
            # The bytes are out but the writer has not run our done yet (it runs a batch's
            # callbacks after the whole batch): act on the RESULT once it has.
            self._result_waits = True
            return
        self._succeed(grant)

    def _landed(self) -> None:
        """Every byte of a streamed pull is in (or the request failed)."""
        if self.ended or self._running:
            return
        req, grant = self.req, self._grant
        if grant is None and req.grant is None:
            grant = self._eager  # the target sent it as we planned it (no GRANT came)
        if req.error is not None or grant is None:
            self.stop(req.error or LinkBroken("link closed before the peer answered"))
            return
        if req.token.cancelled:
            # Its deadline passed (or a cancel) while the last bytes came: they went to
            # scratch, and a DONE now would let the target consume a key for bytes not kept.
            self.stop(CopyCancelled())
            return
        if grant.done and not self.link.send_soon([Done(req.req_id).encode()], [], nothing):
            self.stop(self.link.down_error())
            return
        self._succeed(grant)

    def stop(self, exc: BaseException) -> None:
        """End the request early because of ``exc``: at once when nothing of it runs in a
        worker, else once the worker let go (a task waits for it). Never raises."""
        if self.ended:
            return
        if self._stopping is None:
            self._stopping = exc
        req = self.req
        req.token.cancel()  # the reader diverts what still arrives; workers stop
        if self._sending:
            # The push's DATA is queued (taken back now: then _sent runs at once) or being
            # sent (its memory is read until _sent runs): _sent ends it either way.
            self.link.writer.withdraw(self._sent)
            return
        if self._running:  # the task ends it, after its own fence
            if self._scope is not None:
                self._scope.cancel()
            return
        fence = req.fence
        if fence is not None and not fence.released.is_set():
            # A worker thread still receives a DATA frame into our memory: wait for it.
            self._running = True
            try:
                self.engine.spawn(self._fence_and_end)
                return
            except RuntimeError:
                self._running = False  # the engine stopped: its threads are done with us
        if self.link.alive and not isinstance(exc, LinkBroken):
            abort = Abort(req.req_id, status_from_exception(exc), str(exc))
            self.link.send_soon([abort.encode()], [], nothing)
        self._end(self._reason(exc))

    def _succeed(self, grant: Grant) -> None:
        link = self.link
        assert grant.nbytes is not None
        total = u64_sum(grant.nbytes)
        link.stats_transfers += 1
        mode = "" if grant.mode is None else grant.mode.value
        if grant is self._eager:
            mode = "eager"
        if self.feed is None:  # (a layer-wise push recorded each layer)
            link.history.append((self.spec.op.value, self._t_start, time.monotonic(), total, mode))
        self.result = (total, len(grant.nbytes))
        self._end(None)

    def _reason(self, exc: BaseException) -> BaseException:
        """What the request fails with: a peer's invalid answer breaks the link; whatever the
        request tripped over first, the link going down is the reason."""
        link = self.link
        reason: LLMException
        if isinstance(exc, ProtocolError):
            link.fail(exc)
            reason = LinkBroken(f"peer sent an invalid answer: {exc}")
        elif not link.alive and isinstance(exc, (LLMException, OSError)):
            reason = link.down_error()
        else:
            return exc
        reason.__cause__ = exc
        return reason

    def _cancel_grant_timer(self) -> None:
        if self._grant_timer is not None:
            self.engine.timers.cancel(self._grant_timer)
            self._grant_timer = None

    def _end(self, error: BaseException | None) -> None:
        if self.ended:
            return
        self._cancel_grant_timer()
        self.ended = True
        self.error = error
        req = self.req
        req.grant_event.callback = req.data_event.callback = req.result_event.callback = None
        req.on_grant = None  # (a cycle through us: freed at once, not by the collector)
        self.link.close_pending(req)
        self._close_stream()
        self._on_end(self)

    def _close_stream(self) -> None:
        with _STREAM_HANDOVER:
            stream, self.req.stream = self.req.stream, None
        if stream is not None:
            stream.close()

    # ------------------------------------------------------------------ in a task
    async def _fence_and_end(self) -> None:
        exc = self._stopping or CopyCancelled()
        try:
            with anyio.CancelScope(shield=True):
                await self.link.release(self.req)
                if not isinstance(exc, LinkBroken):
                    await self.link.abort(self.req.req_id, exc)
        finally:
            self._end(self._reason(exc))

    async def _finish(self) -> None:
        """The rest of a request whose GRANT asks this side to move the bytes: a copy through
        the link's access (local mode), or the DATA frames of a push and its RESULT."""
        grant = self._grant
        assert grant is not None
        error: BaseException | None = None
        completed = False
        try:
            with anyio.CancelScope() as self._scope:
                if self._stopping is not None:
                    self._scope.cancel()
                if self.feed is not None:
                    # A layer-wise push waits for its layers: a failure of the request (the
                    # peer's ABORT, the link) must stop it now, not at the next layer.
                    self.req.result_event.callback = self._failed_meanwhile
                    self._failed_meanwhile()
                await self._move(grant)
                completed = True
        except BaseException as exc:
            error = exc
        finally:
            self._scope = None
            if completed and self._stopping is None:
                self._succeed(grant)
            else:
                await self._unwind(error if error is not None else self._stopping)
        if error is not None and not isinstance(error, Exception):
            raise error  # the engine's own cancellation

    def _failed_meanwhile(self) -> None:
        error = self.req.error
        if error is not None and not self.ended:
            self.stop(error)

    async def _unwind(self, exc: BaseException | None) -> None:
        exc = exc or CopyCancelled()
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            exc = self._stopping or CopyCancelled()
        try:
            with anyio.CancelScope(shield=True):
                await self.link.release(self.req)  # fence: no worker touches our memory
                if not isinstance(exc, LinkBroken):
                    await self.link.abort(self.req.req_id, exc)
        finally:
            self._end(self._reason(exc))

    async def _move(self, grant: Grant) -> None:
        """Raises: LLMException (the peer's answer, the link), CopyCancelled, OSError."""
        engine, link, spec, req = self.engine, self.link, self.spec, self.req
        local, nbytes = grant.local, grant.nbytes
        assert local is not None
        assert nbytes is not None
        if grant.mode is Mode.LOCAL:
            remote = grant.remote
            if remote is None or link.access is None:
                raise ProtocolError("local-mode GRANT without remote ranges")
            # The peer's word is not enough to touch its memory: only what it published, or,
            # for a pull by key, what our access reads in its process without its help (its
            # own memory, proven its own: a key may grant a cache it does not publish).
            by_key = spec.op == Op.PULL and spec.target.by in KEYS
            if not (by_key and link.access.reaches(remote, nbytes)):
                await link.view.check_remote(remote, nbytes, engine.sync_kv_timeout_s)
            access = link.access
            try:
                if spec.op == Op.PULL:
                    await access.read(remote, local, nbytes, req.token)
                elif self.feed is not None:

                    async def write(a: int, b: int) -> None:
                        await access.write(local[a:b], remote[a:b], nbytes[a:b], req.token)

                    await self._send_layers(write)
                else:
                    await access.write(local, remote, nbytes, req.token)
            except CopyCancelled:
                raise req.error or CopyCancelled() from None
            except OSError:
                if self.key_reads and link.alive:
                    self.read_failed = True
                raise
            await link.send(Done(req.req_id).encode())
            return
        if spec.op != Op.PUSH:  # (a pull's streamed bytes land from the reader, never here)
            raise ProtocolError("a stream-mode GRANT of a pull in the push's path")
        stream = await engine.open_stream(local, nbytes, link.staging)
        try:
            if self.feed is None:
                if not await link.send_stream(req, stream, to_initiator=False, token=req.token):
                    raise req.error or CopyCancelled()
            else:
                ends: list[int] = np.cumsum(nbytes.astype(np.int64)).tolist()

                async def send(a: int, b: int) -> None:
                    span = (ends[a - 1] if a else 0, ends[b - 1])
                    if not await link.send_stream(req, stream, False, req.token, span=span):
                        raise req.error or CopyCancelled()

                def send_now(a: int, b: int, then: Callable[[bool], None]) -> bool:
                    span = (ends[a - 1] if a else 0, ends[b - 1])
                    return link.send_frame_now(req, stream, False, span, then)

                await self._send_layers(send, send_now)
        finally:
            stream.close()
        if self.feed is None:
            await req.wait_result()
        else:
            with anyio.fail_after(self.feed.timeout_s):
                await req.wait_result()
        assert req.result is not None
        raise_unless_ok(Result.decode(req.result), "peer failed")

    async def _send_layers(
        self,
        send: Callable[[int, int], Awaitable[None]],
        send_now: Callable[[int, int, Callable[[bool], None]], bool] | None = None,
    ) -> None:
        """:func:`.feed.send_layers` of this request's grant, each run recorded on the link
        (its bytes hold the link alone: a pull may go between two runs of the request);
        ``send_now`` sends a layer from the loop if that needs no wait (else False).

        Raises:
            As :func:`.feed.send_layers`.
        """
        grant, spans = self._grant, self._spans
        assert self.feed is not None
        assert spans is not None  # set with the grant
        assert grant is not None
        assert grant.nbytes is not None
        per = u64_sum(grant.nbytes) // (len(spans) - 1)  # layers are alike (layer_spans)
        op, mode = self.spec.op.value, "" if grant.mode is None else grant.mode.value

        def record(started: float, layers: int) -> None:
            self.link.history.append((op, started, time.monotonic(), per * layers, mode))

        if per > INLINE_BYTES:
            send_now = None  # a worker thread's frames: a layer never goes out at once
        await send_layers(self.feed, spans, per, self.engine.timers, send, record, send_now)
