"""One transfer over a link, seen from the side whose API call it is (the *initiator*).

It sends one request (:class:`~.grants.TransferRequest` as an XFER_REQ): how to address the
target's cache, the selection (slots, blocks, layer ranges, offsets) and its own cache layout.
The target answers with a GRANT, which this side checks against what it asked for before any
byte lands (:func:`~.grant_checks.grant_fault`: inside the selection, and all of it); then:

* ``local`` mode: this side copies straight from/to the target's memory (same host or same
  process) and then sends DONE;
* ``stream`` mode: the bytes travel as DATA frames on the link (TCP).

The exchange itself, from the XFER_REQ to the end, is an :class:`~.exchange.Exchange` that
the link's reader drives; :func:`initiate` runs one for a task that awaits it.

In remote-accessible mode a pull by cache id that this side can run alone is planned here
from the peer's table and copied one-sidedly (:func:`_pull_direct`), with no round trip. A
pull of a few blocks is planned from the pair of caches prepared by the first such pull
(:func:`~.prepared.plan_prepared`): what does not depend on the block indices is checked once.
Keys are consumed by the target only after DONE reports success, so a failed pull leaves the
key pullable (reference §8.1, §9.4).
"""

from __future__ import annotations

import time

import anyio
import numpy as np

from .._checks import check_same_dtype
from .._enums import LLMStatusCode
from .._errors import CopyCancelled, LLMException
from .._memory import INLINE_RANGES, CancelToken
from .._messages import By, Op
from .._planner import Plan, check_within
from .exchange import Exchange
from .feed import LayerFeed
from .grants import TransferRequest, plan_selection, selection_bound
from .host import LinkHost
from .link import Link
from .prepared import plan_prepared
from .requests import Pending

__all__ = ["initiate", "may_pull_directly", "pull_direct_now"]

_U64 = np.uint64


async def initiate(
    engine: LinkHost,
    link: Link,
    spec: TransferRequest,
    token: CancelToken,
    deadline: float | None,
    feed: LayerFeed | None = None,
) -> tuple[int, int]:
    """Run one request to completion; returns ``(bytes, descriptors)``. The caller holds the
    link's transfer lock (a layer-wise push: its ``feed`` takes it per layer) and a pin on
    ``spec.local`` (and awaited its population); ``token`` stops the workers (its own
    deadline included) and ``deadline`` (monotonic) is sent to the target.

    Raises:
        LLMException: the target refused (its status code), the link failed
            (LLM_LINK_FAILED / LLM_NOT_YET_LINK), or the transfer was stopped.
    """
    if feed is not None:
        return await _initiate(engine, link, spec, token, deadline, None, feed)
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
    feed: LayerFeed | None = None,
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
    exchange = Exchange(engine, link, spec, req, key_reads, lambda _: ended.set(), feed)
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
    if not 0 <= slot < (1 if tgt.is_blocks else tgt.count):
        raise LLMException(
            f"batch index {slot} is outside cache {target.cache_id}",
            status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
        )
    theirs = link.view.dtype(target.cache_id)
    if theirs != spec.local.dtype:  # (the message costs microseconds)
        check_same_dtype(
            theirs,
            spec.local.dtype,
            f"pull from cache {target.cache_id} of cluster {link.peer_cluster_id} into cache "
            f"{spec.local.cache_id} of cluster {engine.cluster_id}",
        )
    plan = plan_prepared(link.view.pairs, spec, tgt, link.view.regions)
    if plan is not None:  # (inside what the peer published: the pair was checked for it)
        return plan if access.reaches(plan.src, plan.nbytes) else None
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
    return _recorded(link, spec, t_start, total, len(plan))


def pull_direct_now(engine: LinkHost, link: Link, spec: TransferRequest) -> tuple[int, int] | None:
    """:func:`_pull_direct` from the loop, with no task, when its copy runs inline there (a
    one-sided pull of at most about a MiB of host memory, :meth:`PeerAccess.copy_now`) and
    nothing has to be awaited: returns ``(bytes, descriptors)``, or None when :func:`initiate`
    must run it (it then decides again: refreshes a changed table, or asks the target). The
    caller holds the link's phase lock, a pin on ``spec.local`` and its population.

    Raises:
        LLMException: as :func:`_direct_plan`.
    """
    nbytes, ranges = selection_bound(spec)
    if nbytes > NOW_BYTES or ranges > INLINE_RANGES:
        return None  # not planned twice: the task plans it
    plan = _direct_plan(engine, link, spec)
    access, epoch = link.access, link.view.epoch
    if plan is None or access is None or epoch is None or not link.alive:
        return None
    if access.read_word(epoch[0]) != epoch[1]:
        return None
    t_start = time.monotonic()
    try:
        # A token nobody else holds: a synchronous copy cannot be cancelled part-way.
        total = access.copy_now(plan.src, plan.dst, plan.nbytes, CancelToken(), True)
    except (CopyCancelled, OSError):
        return None  # initiate copies again, and tells an unmapped peer from a down link
    if total is None or access.read_word(epoch[0]) != epoch[1]:
        return None  # not inline; or a cache was released under the copy
    return _recorded(link, spec, t_start, total, len(plan))


#: one-sided pulls of at most this much may be copied from the loop (the accesses' own
#: bound on a copy there)
NOW_BYTES = 1 << 20


def _recorded(
    link: Link, spec: TransferRequest, t_start: float, total: int, descriptors: int
) -> tuple[int, int]:
    link.stats_transfers += 1
    link.stats_bytes += total
    link.history.append((spec.op.value, t_start, time.monotonic(), total, "direct"))
    return total, descriptors
