"""One transfer over a link, seen from the side that holds the cache (the *target*).

A peer's XFER_REQ is decoded (:class:`~.._messages.Request`), resolved against our registry,
planned with the shared planner, every range checked (:mod:`.grants`), and granted: in
``local`` mode the initiator copies straight from/to our memory and sends DONE; in ``stream``
mode the bytes travel as DATA frames. A small streamed pull is served by the link's reader
itself (:func:`serve_now`); anything else by a task (:func:`serve_request`), within the
link's serving slots, large requests within limiters of their own.

Keys are consumed only after DONE reports success, so a failed pull leaves the key pullable
(reference §8.1, §9.4).
"""

from __future__ import annotations

import time
import weakref

import anyio
import anyio.to_thread
import numpy as np

from .._enums import LLMStatusCode
from .._errors import LinkBroken, is_caller_facing
from .._messages import FLAG_TO_INITIATOR, Abort, Data, Done, Grant, Mode, Op, Request, Result
from .._planner import Plan
from .._protocol import Framed, Message
from .._registry import CacheEntry
from .._timers import Timer
from .._transports.tcp import INLINE_BYTES, StreamPlan, host_views
from .eager import stream_digest
from .grants import INLINE_PIECES, finish, plan_checked, resolve
from .host import LinkHost, Served
from .link import Link
from .prepared import plan_on_loop
from .requests import Serving, nothing, past_budget
from .streams import VIEWS_INLINE

__all__ = ["Target", "resolve_and_plan", "serve_now", "serve_request"]

#: what a planned and checked request comes to: (caches touched, plan, (slot, tensor
#: indices) for key consumption, mode, tensors)
Granted = tuple[list[CacheEntry], Plan, "tuple[int, np.ndarray] | None", Mode, int]


def resolve_and_plan(engine: LinkHost, link: Link, req: Request) -> Granted:
    """Find the target's cache, plan the request, and check every range, all at once (a
    request of at most ``INLINE_PIECES`` ranges; larger ones: :func:`_resolve_and_plan_async`).

    A peer reaches a cache that is not remote accessible only through a key bound to it
    (request/response mode, where this side moves the bytes); never by id or address.

    Raises:
        LLMException: LLM_KV_CACHE_NOT_EXIST for a missing cache/key, LLM_PARAM_INVALID for
            anything that does not fit (counts over MAX_TENSORS / MAX_PIECES /
            MAX_DESCRIPTORS included).
        ProtocolError: a shape without the block lists it needs.
    """
    res = resolve(engine, req)
    return finish(engine, req, res, plan_on_loop(req, res), link.caps.trusted(req.caps_claimed()))


async def _resolve_and_plan_async(engine: LinkHost, link: Link, req: Request) -> Granted:
    """:func:`resolve_and_plan` for any request: one that may select more than
    ``INLINE_PIECES`` ranges is planned and checked in one of the link's worker threads, so
    that it never holds the event loop (the registry is only read on the loop).

    Raises:
        As :func:`resolve_and_plan`.
    """
    res = resolve(engine, req)
    if res.pieces <= INLINE_PIECES:
        planned = plan_on_loop(req, res)
    else:
        planned = await anyio.to_thread.run_sync(plan_checked, req, res, limiter=link.threads)
    return finish(engine, req, res, planned, link.caps.trusted(req.caps_claimed()))


async def serve_request(engine: LinkHost, link: Link, req: Serving, request: Request) -> None:
    """Handle one request from the peer: resolve, check, plan, grant, move, finish. It holds
    the serving slot the link's router took for ``req``, and gives it back at the end.

    Never raises: failures go back to the initiator (in the GRANT, or as an ABORT later).
    """
    try:
        if pieces_bound(request) <= INLINE_PIECES:
            await _serve(engine, link, req, request)
            return
        async with _large_limiters(link)[1]:
            await _serve(engine, link, req, request)
    finally:
        link.router.give_slot(req)


#: large requests of one link in flight at once (each holds its plan; their frames share the
#: link's staging buffers, Link.staging): one can be planned while another moves its bytes;
#: more wait, counted against llm.LinkQueue. Their bytes share one socket anyway, so
#: more at once would not move them faster, and a peer's flood of them holds two plans'
#: memory, not llm.LinkServing of them.
_LARGE_IN_FLIGHT = 2


def _large_limiters(link: Link) -> tuple[anyio.CapacityLimiter, anyio.CapacityLimiter]:
    """``(planning, in flight)`` limiters of a link's large requests: one is planned at a
    time (planning is what costs CPU, the GIL included, and temporaries: a peer's flood of
    large requests costs no more than one plan at a time), and at most ``_LARGE_IN_FLIGHT``
    hold their plans and staging buffers at once."""
    limiters = _LARGE.get(link)
    if limiters is None:
        limiters = _LARGE[link] = (
            anyio.CapacityLimiter(1),
            anyio.CapacityLimiter(_LARGE_IN_FLIGHT),
        )
    return limiters


#: per link: see _large_limiters
_LARGE: weakref.WeakKeyDictionary[Link, tuple[anyio.CapacityLimiter, anyio.CapacityLimiter]] = (
    weakref.WeakKeyDictionary()
)


async def _serve(engine: LinkHost, link: Link, req: Serving, request: Request) -> None:
    registry = engine.registry
    pinned: list[CacheEntry] = []
    granted = False
    t0 = time.monotonic()
    try:
        try:
            if pieces_bound(request) <= INLINE_PIECES:
                entries, plan, slot_info, mode, ntensors = resolve_and_plan(engine, link, request)
            else:
                async with _large_limiters(link)[0]:
                    entries, plan, slot_info, mode, ntensors = await _resolve_and_plan_async(
                        engine, link, request
                    )
        except Exception as exc:  # any malformed or unfulfillable request gets an answer
            code = exc.status_code if is_caller_facing(exc) else LLMStatusCode.LLM_PARAM_INVALID
            await link.send(Grant.refusal(req.req_id, code, str(exc)).encode())
            return
        for e in entries:
            registry.pin(e)
            pinned.append(e)
        if req.deadline is not None:
            req.deadline = min(req.deadline, t0 + engine.serve_budget_s(ntensors))
        pull = request.op == Op.PULL
        local_side, target_side = (plan.dst, plan.src) if pull else (plan.src, plan.dst)
        if mode is Mode.STREAM and not pull:
            req.stream = await engine.open_stream(plan.dst, plan.nbytes, link.staging)
        if pull:
            _consume_on_done(engine, req, entries, slot_info)
        streamed_pull = mode is Mode.STREAM and pull
        # A streamed pull is done here once its bytes are sent: nothing of ours is touched
        # after that, so unless the initiator's DONE has an effect (consuming a key) it sends
        # none and the request is one round trip.
        wants_done = not streamed_pull or req.on_done is not None
        grant = Grant(
            req.req_id,
            mode=mode,
            total=plan.total_bytes,
            done=wants_done,
            local=local_side,
            nbytes=plan.nbytes,
            remote=target_side if mode is Mode.LOCAL else None,
        ).encode()
        # (with the GRANTs of the loop turn in one syscall: requests in flight are granted
        # together; a link found down ends the request, as a failed send would)
        if not streamed_pull and not link.send_soon([grant], [], nothing):
            return
        granted = True
        remaining = max(0.0, (req.deadline or 0) - time.monotonic())
        with anyio.move_on_after(remaining) as budget:
            if streamed_pull:
                out = await engine.open_stream(plan.src, plan.nbytes, link.staging)
                try:
                    # The GRANT leads the data: a small pull is one syscall and one wake-up.
                    sent = await link.send_stream(
                        req, out, to_initiator=True, token=req.token, lead=grant
                    )
                finally:
                    out.close()
                if not sent:
                    return
                if wants_done:
                    await req.done_event.wait()
            elif mode is Mode.STREAM:
                await req.data_event.wait()
                if req.error is None:
                    link.send_soon([Result(req.req_id).encode()], [], nothing)
                return
            else:
                await req.done_event.wait()
        if budget.cancelled_caught:
            await _out_of_budget(engine, link, req, mode)
    except LinkBroken:
        pass
    except Exception as exc:
        # Tell the initiator at once rather than letting it wait for its deadline.
        if granted:
            await link.abort(req.req_id, exc, flags=FLAG_TO_INITIATOR)
        engine.log.info("transfer.failed", side="target", error=repr(exc))
    finally:
        # Fence before unpinning: no worker may touch these caches after they are released.
        with anyio.CancelScope(shield=True):
            await link.release(req)
        link.serving.pop(req.req_id, None)
        link.queued_bytes -= req.meta_bytes
        if req.charged and link.decoder.budget is not None:
            link.decoder.budget.release(req.charged)
            req.charged = 0
        if req.stream is not None:
            req.stream.close()
        for e in pinned:
            registry.unpin(e)


def _consume_on_done(
    engine: LinkHost,
    req: Serving,
    entries: list[CacheEntry],
    slot_info: tuple[int, np.ndarray] | None,
) -> None:
    """A pull by key outside remote-accessible mode consumes what it pulled once the
    initiator's DONE reports success (reference §8.1, §9.4): run where the DONE is read, before
    any later request on the link is looked at."""
    if not entries or slot_info is None or engine.options.remote_accessible:
        return
    registry, consumed_entry, (slot, tensors) = engine.registry, entries[0], slot_info

    def consume(done: Message) -> None:
        if Done.decode(done).ok:
            registry.note_pulled(consumed_entry, slot, tensors)

    req.on_done = consume


def serve_now(engine: LinkHost, link: Link, request: Request) -> Served:
    """Serve a small request from the link's reader itself, with no task or thread. A streamed
    pull is planned, granted and sent in one non-blocking ``sendmsg``; a streamed push is
    granted and its DATA lands from the reader; a local grant (the initiator copies itself)
    waits for the DONE there (:func:`_grant_now`). Returns ``Served.TASK`` when a task must
    serve the request instead: anything else (streamed pulls that consume a key, device
    memory, more than ``INLINE_BYTES`` over the stream, more than ``INLINE_PIECES`` ranges), or
    any failure (the task answers it with its status); ``Served.NO_SLOT`` (nothing done) when
    it would hold a serving slot and none is free, or earlier requests already wait for one
    (the router parks it: :meth:`~.router.FrameRouter.serve_parked`). While the send lock is
    taken the frames queue for the link's writer (:meth:`Link.send_soon`).

    Nothing of ours is touched once a streamed pull's bytes are in the socket, so it ends
    there (its GRANT says no DONE is expected).
    """
    direct = any(link.caps.trusted(request.caps_claimed()).values())
    if pieces_bound(request) > INLINE_PIECES or (
        not direct and bound_bytes(request) > INLINE_BYTES
    ):
        return Served.TASK
    if (direct or request.op is Op.PUSH) and not link.router.slot_free():
        # A local grant or a push holds a serving slot: planned once one is free.
        return Served.NO_SLOT
    try:
        entries, plan, slot_info, mode, ntensors = resolve_and_plan(engine, link, request)
    except Exception:
        return Served.TASK  # the task answers with the status
    pull = request.op is Op.PULL
    if mode is Mode.LOCAL:
        return _grant_now(engine, link, request, entries, plan, ntensors, mode, slot_info)
    total = plan.total_bytes
    if (
        not 0 < total <= INLINE_BYTES
        or (pull and slot_info is not None and not engine.options.remote_accessible)
        or not engine.host_reachable(plan.src if pull else plan.dst)
        or len(plan.nbytes) > VIEWS_INLINE
    ):
        return Served.TASK
    # A request the initiator planned as we did (.eager: the digest of its own ranges) is a
    # push taken as sent, or a pull whose DATA goes alone, flagged so.
    theirs = plan.dst if pull else plan.src
    eager = request.eager is not None and request.eager == (
        total,
        stream_digest(theirs, plan.nbytes),
    )
    if not pull:
        return _grant_now(engine, link, request, entries, plan, ntensors, mode, None, eager)
    data = Data(request.req_id, 0, total, to_initiator=True, eager=eager).encode()
    frames: list[Message | Framed] = [data]
    if not eager:
        grant = Grant(
            request.req_id, mode=mode, total=total, done=False, local=theirs, nbytes=plan.nbytes
        )
        frames = [grant, data]
    registry = engine.registry
    for e in entries:
        registry.pin(e)

    def unpin() -> None:
        for e in entries:
            registry.unpin(e)

    views = host_views(plan.src, plan.nbytes)
    if not link.send_soon(frames, views, unpin):
        unpin()
        return Served.TASK
    link.stats_bytes += total
    return Served.NOW


def _grant_now(
    engine: LinkHost,
    link: Link,
    request: Request,
    entries: list[CacheEntry],
    plan: Plan,
    ntensors: int,
    mode: Mode,
    slot_info: tuple[int, np.ndarray] | None,
    eager: bool = False,
) -> Served:
    """Grant a request from the reader and finish it there: a streamed push ends where its
    DATA lands (straight into our checked ranges; then the RESULT), a local grant where the
    initiator's DONE arrives (its effect, consuming a key, happens there too). It holds one of
    the link's serving slots (``llm.LinkServing``), as a task would: ``Served.NO_SLOT`` when
    none is free; the slot freed, the next request parked for one is served.
    ``eager``: a push whose bytes follow its request is taken as sent, with no GRANT (its
    DATA, flagged so, lands; see :mod:`.eager`).

    A timer of the engine bounds it by this side's budget: then the initiator is told (an
    ABORT). A push then ends at once (the reader diverts what still comes to scratch); a local
    grant keeps its caches pinned until the initiator says it stopped copying, or for the
    stall timeout, after which the link breaks (as :func:`_out_of_budget`).
    """
    budget_s = engine.serve_budget_s(ntensors)
    if request.timeout_ms > 0:
        budget_s = min(budget_s, request.timeout_ms / 1000)
    req = Serving(request.req_id, time.monotonic() + budget_s)
    if not link.router.take_slot(req):
        return Served.NO_SLOT
    pull = request.op is Op.PULL
    registry = engine.registry
    for e in entries:
        registry.pin(e)
    timers = engine.timers
    local = mode is Mode.LOCAL
    timer: list[Timer] = []  # the budget's, then the stall's

    def end() -> None:
        req.data_event.callback = req.done_event.callback = None
        timers.cancel(timer[0])
        req.token.cancel()  # what still comes of it goes to scratch: nothing lands after this
        if link.serving.get(req.req_id) is req:
            del link.serving[req.req_id]
            for e in entries:
                registry.unpin(e)
            link.router.give_slot(req)

    def landed() -> None:
        if req.error is None and not req.token.cancelled:
            link.send_soon([Result(req.req_id).encode()], [], nothing)
        end()

    def expired() -> None:
        exc = past_budget(engine)
        abort = Abort(req.req_id, exc.status_code, str(exc), to_initiator=True)
        link.send_soon([abort.encode()], [], nothing)
        if not local:
            end()
            return
        if link.serving.get(req.req_id) is not req:
            return  # (the link went down meanwhile: it ended)
        # The initiator copies straight from/into our memory: pinned until it says it stopped.
        timer[0] = timers.call_later(engine.stall_timeout_s, stuck)

    def stuck() -> None:
        link.fail(TimeoutError("the peer did not stop a timed-out direct copy"))

    if local:
        if pull:
            _consume_on_done(engine, req, entries, slot_info)
        req.done_event.callback = end
    else:
        req.stream = StreamPlan(plan.dst, plan.nbytes)
        req.data_event.callback = landed
        req.eager = eager
    link.serving[req.req_id] = req
    timer.append(timers.call_later(budget_s, expired))
    if req.eager:
        return Served.NOW
    local_side, target_side = (plan.dst, plan.src) if pull else (plan.src, plan.dst)
    grant = Grant(
        request.req_id,
        mode=mode,
        total=plan.total_bytes,
        done=True,
        local=local_side,
        nbytes=plan.nbytes,
        remote=target_side if local else None,
    )
    if not link.send_soon([grant], [], nothing):
        end()
    return Served.NOW


def pieces_bound(req: Request) -> int:
    """An upper bound of the ranges a request selects, from its arrays' sizes alone: at most
    the tensors of the initiator's layer window times its longest block list."""
    src, dst = req.src_blocks, req.dst_blocks
    return _window_tensors(req) * max(
        0 if src is None else len(src), 0 if dst is None else len(dst), 1
    )


def _window_tensors(req: Request) -> int:
    """The initiator's tensors the request selects: its layer window's, else all."""
    tensors = len(req.local_addrs)
    window = req.dst_range if req.op is Op.PULL else req.src_range
    if window is not None:
        # (stop - start, not len(): a peer's range may be longer than len() can say)
        tensors = min(
            tensors, max(0, window.stop - window.start) * max(1, req.tensor_num_per_layer)
        )
    return tensors


def bound_bytes(req: Request) -> int:
    """About how many bytes a request moves, from itself alone: the selected units of the
    initiator's cache in the tensors its layer window selects. Only a shortcut before
    planning: a request it underestimates (destination blocks of another size) is planned,
    found larger than the inline limit and served by a task."""
    tb, count, _ = req.layout
    ours = req.dst_blocks if req.op is Op.PULL else req.src_blocks  # the initiator's units
    units = 1 if ours is None else len(ours)
    return units * (tb // max(1, count)) * _window_tensors(req)


async def _out_of_budget(engine: LinkHost, link: Link, req: Serving, mode: Mode) -> None:
    """The request ran past what this side grants a peer: tell the initiator now (it would
    otherwise wait for its own deadline). In local mode it copies straight into our memory,
    so the caches stay pinned until it says it stopped, or the link goes."""
    await link.abort(req.req_id, past_budget(engine), flags=FLAG_TO_INITIATOR)
    if mode is Mode.LOCAL:
        with anyio.move_on_after(engine.stall_timeout_s):
            await req.done_event.wait()
        if not req.done_event.is_set():
            link.fail(TimeoutError("the peer did not stop a timed-out direct copy"))


class Target:
    """This endpoint's side of the transfers its peers start: the ``server`` each link is
    given (``host.RequestServer``)."""

    def __init__(self, host: LinkHost) -> None:
        self.host = host

    def serve_now(self, link: Link, request: Request) -> Served:
        """See :func:`serve_now`."""
        return serve_now(self.host, link, request)

    async def serve_request(self, link: Link, req: Serving, request: Request) -> None:
        """See :func:`serve_request`."""
        await serve_request(self.host, link, req, request)
