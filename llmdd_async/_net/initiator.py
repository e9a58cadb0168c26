"""One transfer over a link, seen from the side whose API call it is (the *initiator*).

It sends one request (:class:`~.grants.TransferRequest` as an XFER_REQ): how to address the
target's cache, the selection (slots, blocks, layer ranges, offsets) and its own cache layout.
The target answers with a GRANT, which this side checks against what it asked for before any
byte lands (:func:`~.grants.grant_within_selection`); then:

* ``local`` mode: this side copies straight from/to the target's memory (same host or same
  process) and then sends DONE;
* ``stream`` mode: the bytes travel as DATA frames on the link (TCP).

In remote-accessible mode a pull by cache id that this side can run alone is planned here
from the peer's table and copied one-sidedly (:func:`_pull_direct`), with no round trip.
Keys are consumed by the target only after DONE reports success, so a failed pull leaves the
key pullable (reference §8.1, §9.4).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import numpy as np

from .._checks import check_same_dtype
from .._enums import LLMStatusCode
from .._errors import (
    CopyCancelled,
    LinkBroken,
    LLMException,
    ProtocolError,
    raise_if_false,
    status_from_exception,
)
from .._memory import CancelToken
from .._messages import Abort, By, Cap, Data, Done, Grant, Mode, Op, Result
from .._planner import Plan, check_within, u64_sum
from .._protocol import Message
from .._transports.tcp import INLINE_BYTES, StreamPlan
from .grants import TransferRequest, grant_within_selection, plan_selection
from .host import LinkHost
from .link import Link
from .requests import Pending, TransferRecord
from .streams import VIEWS_INLINE

__all__ = ["Exchange", "initiate", "may_pull_directly"]

_U64 = np.uint64
#: how a pull names a cache by the key that grants it
_KEYS = (By.REQ_KEY, By.PREFIX_KEY, By.BLOCKS_KEY)


def _raise_unless_ok(answer: Grant | Result, default: str) -> None:
    """Raises LLMException with the peer's status code unless ``answer`` reports success."""
    if not answer.ok:
        text = default if answer.message is None else answer.message
        raise LLMException(text, status_code=answer.status)


async def initiate(
    engine: LinkHost, link: Link, spec: TransferRequest, token: CancelToken, deadline: float | None
) -> tuple[int, int]:
    """Run one request to completion; returns ``(bytes, descriptors)``. The caller holds the
    link's transfer lock and a pin on ``spec.local`` (and awaited its population); ``token``
    stops the workers (its own deadline included) and ``deadline`` (monotonic) is sent to the
    target.

    Raises:
        LLMException: the target refused (its status code), the link failed
            (LLM_LINK_FAILED / LLM_NOT_YET_LINK), or the transfer was stopped.
    """
    failed_read: list[OSError] = []
    try:
        return await _initiate(engine, link, spec, token, deadline, failed_read)
    except OSError as exc:
        if not failed_read or failed_read[0] is not exc:
            raise
        engine.log.info("transfer.fallback", reason=f"reading the peer failed: {exc}")
    # A copy of what a key grants failed where the stream did not use to (memory the kernel
    # cannot pin for process_vm_readv): the request was aborted there, unconsumed; stream it.
    return await _initiate(engine, link, spec, token, deadline, None)


async def _initiate(
    engine: LinkHost,
    link: Link,
    spec: TransferRequest,
    token: CancelToken,
    deadline: float | None,
    failed_read: list[OSError] | None,
) -> tuple[int, int]:
    """:func:`initiate`, once; a failed copy of a local grant by key is put in
    ``failed_read`` (None: ask for no such grant) before it is raised."""
    key_reads = failed_read is not None
    req = link.open_pending(deadline)
    # Its own token on a first try: a failed try is stopped (its token cancelled) without
    # stopping the retry; the caller's cancel and deadline still reach both.
    req.token = token.child() if key_reads else token
    try:
        # Tracked like any request: a link going down cancels the copy, and its mappings stay
        # until the copy has stopped.
        done = await _pull_direct(engine, link, spec, req)
    except BaseException:
        link.close_pending(req)
        raise
    if done is not None:
        link.close_pending(req)
        return done
    ended = anyio.Event()
    exchange = Exchange(engine, link, spec, req, key_reads, lambda _: ended.set())
    exchange.start()
    try:
        await ended.wait()
    except BaseException:
        with anyio.CancelScope(shield=True):
            exchange.stop(CopyCancelled())
            await ended.wait()  # fenced: nothing touches our memory any more
        raise
    if exchange.error is not None:
        if exchange.read_failed and failed_read is not None:
            failed_read.append(exchange.error)  # type: ignore[arg-type]  # an OSError
        raise exchange.error
    assert exchange.result is not None
    return exchange.result


def may_pull_directly(engine: LinkHost, link: Link, spec: TransferRequest) -> bool:
    """True when :func:`_pull_direct` might run the request one-sidedly (a cheap look, no
    planning): then only :func:`initiate` runs it."""
    access = link.access
    return (
        spec.op == Op.PULL
        and engine.options.remote_accessible
        and access is not None
        and access.one_sided
        and spec.target.by is By.CACHE_ID
    )


def _nothing() -> None:
    return None


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

    # ------------------------------------------------------------------ on the loop
    def start(self) -> None:
        """Send the request; everything after happens in the reader's callbacks (or the end
        comes at once, with the link's error, if it is down)."""
        engine, link, spec, req = self.engine, self.link, self.spec, self.req
        req.on_grant = self._check_grant
        req.grant_event.callback = self._granted
        req.data_event.callback = self._landed
        caps = engine.request_caps(link, spec.local)
        # (see grants._reads_itself; the retry after a failed such copy asks for the stream)
        key_reads = self.key_reads and spec.op == Op.PULL and spec.target.by in _KEYS
        if key_reads and caps.get(Cap.PVR) and link.access is not None and link.access.one_sided:
            caps = {**caps, Cap.KEY_READS: True}
        else:
            key_reads = False
        self.key_reads = key_reads
        self._t_start = time.monotonic()
        deadline = req.deadline
        timeout_ms = max(1, int((deadline - time.monotonic()) * 1000)) if deadline else 0
        wire = spec.to_wire(req.req_id, caps, timeout_ms).encode()
        if not link.send_soon([wire], [], _nothing):
            self._end(link.down_error())

    def _check_grant(self, msg: Message) -> None:
        """The reader's look at the GRANT, before any DATA of this request is read (in a
        worker thread for a grant of many descriptors): set up where the stream lands, after
        checking that every range lies inside our own cache.

        Raises:
            ProtocolError: the grant points outside what this request selected (the reader
                then breaks the link).
        """
        grant = Grant.decode(msg)
        if grant.ok:
            # Grant.decode: a successful grant has a plan
            assert grant.local is not None
            assert grant.nbytes is not None
            if not grant_within_selection(self.spec, grant.local, grant.nbytes):
                raise ProtocolError("GRANT points outside what this request selected of our cache")
            if grant.mode is Mode.STREAM and self.spec.op == Op.PULL:
                # The reader cannot await here; a staging buffer comes from the adapter's cache
                # after the first transfers.
                self.req.stream = self.engine.make_stream(
                    grant.local, grant.nbytes, self.link.threads
                )
        # Only a checked grant is ever acted on; a peer that granted twice: the last one, as
        # the stream's.
        self._grant = grant

    def _granted(self) -> None:
        """The GRANT arrived (or the request failed: then there is none)."""
        if self.ended or self._running:
            return
        req, grant = self.req, self._grant
        if req.grant is None or grant is None:
            self.stop(req.error or LinkBroken("link closed before the peer answered"))
            return
        if not grant.ok:
            text = "refused by peer" if grant.message is None else grant.message
            self.stop(LLMException(text, status_code=grant.status))
            return
        if grant.mode is Mode.STREAM and self.spec.op == Op.PUSH and self._push_now(grant):
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
        views = StreamPlan(local, nbytes).views(0, total)
        req.result_event.callback = self._answered
        self._sending = True
        data = Data(req.req_id, 0, total, to_initiator=False).encode()
        if not link.send_soon([data], views, self._sent):
            self._sending = False
            self.stop(link.down_error())
        return True

    def _sent(self) -> None:
        """Nothing reads the push's memory any more: a stop that waited for it ends now."""
        self._sending = False
        if self._stopping is not None and not self.ended:
            self.stop(self._stopping)

    def _answered(self) -> None:
        """The RESULT of a push this side sent from the reader (or the request failed)."""
        if self.ended or self._running:
            return
        req, grant = self.req, self._grant
        if req.result is None or grant is None:
            self.stop(req.error or LinkBroken("link closed before the peer answered"))
            return
        result = Result.decode(req.result)
        if not result.ok:
            text = "peer failed" if result.message is None else result.message
            self.stop(LLMException(text, status_code=result.status))
            return
        if self._sending:  # a RESULT for bytes not yet sent: not from an honest peer
            self.stop(ProtocolError("RESULT before the push's DATA was sent"))
            return
        self._succeed(grant)

    def _landed(self) -> None:
        """Every byte of a streamed pull is in (or the request failed)."""
        if self.ended or self._running:
            return
        req, grant = self.req, self._grant
        if req.error is not None or grant is None or req.grant is None:
            self.stop(req.error or LinkBroken("link closed before the peer answered"))
            return
        if grant.done and not self.link.send_soon([Done(req.req_id).encode()], [], _nothing):
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
        if self._sending:  # the link's writer still reads the push's memory: _sent ends it
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
            self.link.send_soon([abort.encode()], [], _nothing)
        self._end(self._reason(exc))

    def _succeed(self, grant: Grant) -> None:
        link = self.link
        assert grant.nbytes is not None
        total = u64_sum(grant.nbytes)
        link.stats_transfers += 1
        mode = "" if grant.mode is None else grant.mode.value
        link.history.append(
            TransferRecord(self.spec.op.value, self._t_start, time.monotonic(), total, mode)
        )
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

    def _end(self, error: BaseException | None) -> None:
        if self.ended:
            return
        self.ended = True
        self.error = error
        req = self.req
        req.grant_event.callback = req.data_event.callback = req.result_event.callback = None
        self.link.close_pending(req)
        if req.stream is not None:
            req.stream.close()
        self._on_end(self)

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
            by_key = spec.op == Op.PULL and spec.target.by in _KEYS
            if not (by_key and link.access.reaches(remote, nbytes)):
                await link.view.check_remote(remote, nbytes, engine.sync_kv_timeout_s)
            try:
                if spec.op == Op.PULL:
                    await link.access.read(remote, local, nbytes, req.token)
                else:
                    await link.access.write(local, remote, nbytes, req.token)
            except CopyCancelled:
                raise req.error or CopyCancelled() from None
            except OSError:
                if self.key_reads and link.alive:
                    self.read_failed = True
                raise
            await link.send(Done(req.req_id).encode())
            return
        stream = await engine.open_stream(local, nbytes, link.threads)
        try:
            if not await link.send_stream(req, stream, to_initiator=False, token=req.token):
                raise req.error or CopyCancelled()
        finally:
            stream.close()
        await req.wait_result()
        assert req.result is not None
        _raise_unless_ok(Result.decode(req.result), "peer failed")


def _direct_plan(engine: LinkHost, link: Link, spec: TransferRequest) -> Plan | None:
    """The plan of a pull this side can run alone, or None (then the target serves it).

    In remote-accessible mode a peer publishes its caches' layouts and lets linked peers reach
    them, as an RDMA engine does: when our access to its memory needs no help from it (a
    mapped pool, ``process_vm_readv``) and we can read its epoch (see :func:`_pull_direct`), a
    pull by cache id is planned here from its table and copied one-sidedly, with no round
    trip. Only pulls: a push writes into the peer's memory, which only the peer can pin.

    Raises:
        LLMException: LLM_PARAM_INVALID / LLM_KV_CACHE_NOT_EXIST for a selection that does not
            fit the peer's published cache, as the peer would answer.
    """
    access = link.access
    if (
        spec.op != Op.PULL
        or not engine.options.remote_accessible
        or access is None
        or not access.one_sided
        or link.view.epoch is None
    ):
        return None
    target = spec.target
    if target.by is not By.CACHE_ID or not engine.host_reachable(spec.local.addrs):
        return None
    tgt = link.view.layout(target.cache_id)
    if tgt is None:  # not published as reachable, or malformed: the peer answers for it
        return None
    slot = target.index
    raise_if_false(
        0 <= slot < (1 if tgt.is_blocks else tgt.count),
        f"batch index {slot} is outside cache {target.cache_id}",
        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
    )
    check_same_dtype(
        link.view.dtype(target.cache_id),
        spec.local.dtype,
        f"pull from cache {target.cache_id} of cluster {link.peer_cluster_id} into cache "
        f"{spec.local.cache_id} of cluster {engine.cluster_id}",
    )
    plan, _, _ = plan_selection(
        Op.PULL,
        spec.shape,
        spec.local.layout,
        tgt,
        slot,
        local_slot=spec.local_slot,
        src_range=spec.src_range,
        dst_range=spec.dst_range,
        tnpl=spec.tensor_num_per_layer,
        size=spec.size,
        src_offset=spec.src_offset,
        dst_offset=spec.dst_offset,
        src_blocks=spec.src_blocks,
        dst_blocks=spec.dst_blocks,
        dst_block_bytes=spec.dst_block_bytes,
    )
    # Only what the peer published as reachable, and only what our access reaches alone.
    if not check_within(plan.src, plan.nbytes, *link.view.regions) or not access.reaches(
        plan.src, plan.nbytes
    ):
        return None
    return plan


async def _pull_direct(
    engine: LinkHost, link: Link, spec: TransferRequest, req: Pending
) -> tuple[int, int] | None:
    """Run a pull one-sidedly if :func:`_direct_plan` allows; returns ``(bytes, descriptors)``,
    or None when the target must serve it.

    The peer bumps its epoch whenever it releases a cache id, before any memory goes. The epoch
    is read before and after the copy: unchanged, every cache of our view of its table was
    registered for the whole copy, so the bytes are that cache's. Changed, our view is
    refreshed and the pull goes to the peer, which answers for its caches (and pins them).

    Raises:
        CopyCancelled: the request's token tripped (the copy has stopped). LLMException: the
            link is down, or the selection does not fit (as the peer would answer).
    """
    plan = _direct_plan(engine, link, spec)
    access, epoch = link.access, link.view.epoch
    if plan is None or access is None or epoch is None:
        return None
    if access.read_word(epoch[0]) != epoch[1]:
        await link.view.refresh(engine.sync_kv_timeout_s)
        return None
    t_start = time.monotonic()
    try:
        total = await access.read(plan.src, plan.dst, plan.nbytes, req.token)
    except CopyCancelled:
        raise req.error or CopyCancelled() from None
    except OSError:
        if not link.alive:
            raise link.down_error() from None
        return None  # e.g. the peer unmapped memory: it answers for its caches
    if req.error is not None:  # the link went down (or the peer aborted) under the copy
        raise req.error
    if access.read_word(epoch[0]) != epoch[1]:
        # A cache was released while we copied: the bytes may not be what was asked for.
        await link.view.refresh(engine.sync_kv_timeout_s)
        return None
    link.stats_transfers += 1
    link.stats_bytes += total
    link.history.append(TransferRecord(spec.op.value, t_start, time.monotonic(), total, "direct"))
    return total, len(plan)
