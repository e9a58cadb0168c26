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

import anyio
import numpy as np

from .._checks import check_same_dtype
from .._enums import LLMStatusCode
from .._errors import CopyCancelled, LinkBroken, LLMException, ProtocolError, raise_if_false
from .._memory import CancelToken
from .._messages import By, Cap, Done, Grant, Mode, Op, Result
from .._planner import Plan, check_within, u64_sum
from .._protocol import Message
from .grants import TransferRequest, grant_within_selection, plan_selection
from .host import LinkHost
from .link import Link
from .requests import Pending, TransferRecord

__all__ = ["initiate"]

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
    granted: list[Grant] = []

    def on_grant(msg: Message) -> None:
        # Runs in the reader before any DATA of this request can be read: set up where the
        # stream lands, after checking that every range lies inside our own cache.
        grant = Grant.decode(msg)
        if not grant.ok:
            granted.append(grant)
            return
        # Grant.decode: a successful grant has a plan
        assert grant.local is not None
        assert grant.nbytes is not None
        if not grant_within_selection(spec, grant.local, grant.nbytes):
            raise ProtocolError("GRANT points outside what this request selected of our cache")
        granted.append(grant)  # only a checked grant is ever acted on
        if grant.mode is Mode.STREAM and spec.op == Op.PULL:
            # The reader cannot await here; a staging buffer comes from the adapter's cache
            # after the first transfers.
            req.stream = engine.make_stream(grant.local, grant.nbytes, link.threads)

    req.on_grant = on_grant
    caps = engine.request_caps(link, spec.local)
    # (see grants._reads_itself; the retry after a failed such copy asks for the stream)
    key_reads = key_reads and spec.op == Op.PULL and spec.target.by in _KEYS
    if key_reads and caps.get(Cap.PVR) and link.access is not None and link.access.one_sided:
        caps = {**caps, Cap.KEY_READS: True}
    else:
        key_reads = False
    t_start = time.monotonic()
    timeout_ms = max(1, int((deadline - time.monotonic()) * 1000)) if deadline else 0
    try:
        await link.send(spec.to_wire(req.req_id, caps, timeout_ms).encode())
        await req.wait_grant()
        grant = granted[-1]  # a peer that granted twice: the last one, as the stream's
        _raise_unless_ok(grant, "refused by peer")
        local, nbytes = grant.local, grant.nbytes
        assert local is not None
        assert nbytes is not None
        total = u64_sum(nbytes)
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
            except OSError as exc:
                if key_reads and failed_read is not None and link.alive:
                    failed_read.append(exc)
                raise
            await link.send(Done(req.req_id).encode())
        elif spec.op == Op.PULL:
            await req.wait_data()
            if grant.done:
                await link.send(Done(req.req_id).encode())
        else:
            stream = await engine.open_stream(local, nbytes, link.threads)
            try:
                if not await link.send_stream(req, stream, to_initiator=False, token=req.token):
                    raise req.error or CopyCancelled()
            finally:
                stream.close()
            await req.wait_result()
            assert req.result is not None
            _raise_unless_ok(Result.decode(req.result), "peer failed")
        link.stats_transfers += 1
        mode = "" if grant.mode is None else grant.mode.value
        link.history.append(TransferRecord(spec.op.value, t_start, time.monotonic(), total, mode))
        return total, len(nbytes)
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            await link.release(req)  # fence: no worker touches our memory after this
            if not isinstance(exc, LinkBroken):
                await link.abort(req.req_id, exc)
        if isinstance(exc, ProtocolError):
            link.fail(exc)
            raise LinkBroken(f"peer sent an invalid answer: {exc}") from exc
        if not link.alive and isinstance(exc, (LLMException, OSError)):
            # Whatever this request tripped over first, the link going down is the reason.
            raise link.down_error() from exc
        raise
    finally:
        link.close_pending(req)
        if req.stream is not None:
            req.stream.close()


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
