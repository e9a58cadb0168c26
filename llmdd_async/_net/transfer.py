"""One transfer over a link, seen from both ends.

The *initiator* (the side whose API call it is) sends one request: how to address the target's
cache, the selection (slots, blocks, layer ranges, offsets) and its own cache layout. The
*target* resolves the request against its own registry, plans it with the shared planner,
checks every range, and grants it:

* ``local`` mode: the initiator copies straight from/to the target's memory (same host or same
  process) and then sends DONE;
* ``stream`` mode: the bytes travel as DATA frames on the link (TCP).

Keys are consumed by the target only after DONE reports success, so a failed pull leaves the
key pullable (reference §8.1, §9.4).
"""

from __future__ import annotations

import bisect
import dataclasses
import time
import weakref
from typing import Any

import anyio
import numpy as np

from .._enums import LLMStatusCode
from .._errors import LLMException, raise_if_false
from .._memory import CancelToken, CopyCancelled
from .._messages import wire_status
from .._planner import (
    MAX_DESCRIPTORS,
    MAX_PIECES,
    MAX_TENSORS,
    Layout,
    Plan,
    check_within,
    plan_blocks,
    plan_slot_to_blocks,
    plan_slots,
    tensor_windows,
)
from .._protocol import MT, Message, ProtocolError
from .._registry import CacheEntry
from .._transports.tcp import CHUNK_BYTES, INLINE_BYTES, StreamPlan
from .link import (
    FLAG_TO_INITIATOR,
    Link,
    LinkBroken,
    Pending,
    Serving,
    TransferRecord,
)

__all__ = ["ManyRangesStream", "XferSpec", "initiate", "serve_request"]

_U64 = np.uint64


class ManyRangesStream(StreamPlan):
    """A stream of host memory over more than ``VIEWS_INLINE`` ranges: each frame's bytes pass
    through a staging buffer, gathered (sending) or scattered (receiving) with numpy in a
    worker thread of ``limiter`` (the link's). A view per range would cost about a microsecond
    of the loop each, and holding the GIL as long in a thread starves the loop as well; the
    receive views are the staging buffer alone."""

    def __init__(self, addrs: np.ndarray, nbytes: np.ndarray, limiter: Any = None) -> None:
        super().__init__(addrs, nbytes)
        self._limiter = limiter
        self._buf: np.ndarray | None = None

    def _staging(self) -> np.ndarray:
        if self._buf is None:
            self._buf = np.empty(max(1, min(self.total, CHUNK_BYTES)), dtype=np.uint8)
        return self._buf

    def _move(self, offset: int, n: int, gather: bool) -> None:
        """Copy stream bytes ``[offset, offset + n)`` between memory and the staging buffer."""
        lo_, hi_ = _U64(offset), _U64(offset + n)
        i0 = int(np.searchsorted(self.ends, lo_, side="right"))
        i1 = int(np.searchsorted(self.ends, hi_, side="left")) + 1
        st = self.starts[i0:i1]
        a0, a1 = np.maximum(st, lo_), np.minimum(self.ends[i0:i1], hi_)
        keep = a1 > a0
        addrs = (self.addrs[i0:i1][keep] + (a0 - st)[keep]).astype(np.int64)
        lens = (a1 - a0)[keep].astype(np.int64)
        base, span = self._span
        mem = np.frombuffer(span, dtype=np.uint8)
        buf = self._staging()[:n]
        offs = addrs - base
        if not (lens % 8).any() and not (offs % 8).any() and base % 8 == 0 and n % 8 == 0:
            # Whole words: an eighth of the indices (these ranges all end on a word).
            mem = mem[: len(mem) // 8 * 8].view(np.uint64)
            buf, offs, lens = buf.view(np.uint64), offs // 8, lens // 8
        pos = 0
        # A few MiB of indices at a time: temporaries stay small whatever the frame.
        group = 1 << 19
        ends = np.cumsum(lens)
        i = 0
        while i < len(lens):
            j = int(np.searchsorted(ends, (int(ends[i - 1]) if i else 0) + group, "right"))
            j = max(j, i + 1)
            ln, of = lens[i:j], offs[i:j]
            count = int(ln.sum())
            idx = np.repeat(of - (np.cumsum(ln) - ln), ln) + np.arange(count, dtype=np.int64)
            if gather:
                np.take(mem, idx, out=buf[pos : pos + count])
            else:
                mem[idx] = buf[pos : pos + count]
            pos += count
            i = j

    async def prepare(self, offset: int, n: int, token: CancelToken) -> list[memoryview]:
        await anyio.to_thread.run_sync(self._move, offset, n, True, limiter=self._limiter)
        return [self._staging()[:n].data.cast("B")]

    def receive_views(self, offset: int, n: int) -> list[memoryview]:
        return [self._staging()[:n].data.cast("B")]

    async def commit(self, offset: int, n: int, token: CancelToken) -> None:
        if not token.cancelled:
            await anyio.to_thread.run_sync(self._move, offset, n, False, limiter=self._limiter)

    def views(self, offset: int, n: int) -> list[memoryview]:
        raise TypeError("a stream over many ranges is reached through prepare/receive/commit")

    def close(self) -> None:
        self._buf = None


#: streams over more ranges than this build their views in a worker thread
VIEWS_INLINE = 4096


@dataclasses.dataclass
class XferSpec:
    """What the initiator asks for, in source/destination terms."""

    op: str  # "pull" (target is the source) or "push" (target is the destination)
    target: dict[str, Any]  # how to find the target's cache
    shape: str  # "slot", "blocks" or "slot_to_blocks"
    local: CacheEntry
    local_slot: int = 0
    size: int = -1
    src_offset: int = 0
    dst_offset: int = 0
    src_range: range | None = None
    dst_range: range | None = None
    tensor_num_per_layer: int = 2
    src_blocks: np.ndarray | None = None
    dst_blocks: np.ndarray | None = None
    dst_block_bytes: int | None = None
    raw_addrs: np.ndarray | None = None  # the target's tensor addresses (TransferConfig)
    raw_tensor_bytes: int = 0
    raw_count: int = 1
    raw_is_blocks: bool = False

    def encode(self, req_id: int, caps: dict[str, bool], timeout_ms: int) -> Message:
        e = self.local
        fields: dict[str, Any] = {
            "op": self.op,
            "target": self.target,
            "shape": self.shape,
            "layout": [e.tensor_bytes, e.count, e.is_blocks],
            "caps": {k: True for k, v in caps.items() if v is True},
            "timeout_ms": timeout_ms,
        }
        # Fields at their defaults are left out: JSON costs microseconds per field, on both
        # ends of every request (the target reads them with the same defaults).
        for name, value in (
            ("local_slot", self.local_slot),
            ("size", self.size),
            ("src_offset", self.src_offset),
            ("dst_offset", self.dst_offset),
            ("src_range", _r(self.src_range)),
            ("dst_range", _r(self.dst_range)),
            ("tnpl", self.tensor_num_per_layer),
            ("dst_block_bytes", self.dst_block_bytes),
        ):
            if value != _REQ_DEFAULTS[name]:
                fields[name] = value
        if self.raw_addrs is not None:
            fields["raw"] = [self.raw_tensor_bytes, self.raw_count, self.raw_is_blocks]
        arrays: dict[str, bytes | memoryview] = {"local_addrs": _u64(e.addrs)}
        for name, arr in (
            ("src_blocks", self.src_blocks),
            ("dst_blocks", self.dst_blocks),
            ("raw_addrs", self.raw_addrs),
        ):
            if arr is not None:
                arrays[name] = _u64(arr)
        return Message(MT.XFER_REQ, req_id, fields, arrays)


#: request fields a request leaves out when they hold these values
_REQ_DEFAULTS: dict[str, Any] = {
    "local_slot": 0,
    "size": -1,
    "src_offset": 0,
    "dst_offset": 0,
    "src_range": None,
    "dst_range": None,
    "tnpl": 2,
    "dst_block_bytes": None,
}


def _req_field(fields: dict[str, Any], name: str) -> Any:
    return fields.get(name, _REQ_DEFAULTS[name])


def _r(r: range | None) -> list[int] | None:
    return None if r is None else [r.start, r.stop]


def _u64(arr: np.ndarray) -> memoryview:
    return np.ascontiguousarray(arr, dtype="<u8").data.cast("B")


def _arr(msg: Message, name: str) -> np.ndarray | None:
    raw = msg.arrays.get(name)
    # A view, not a copy: the decoded frame's bytes are immutable and live as long as it.
    return None if raw is None else np.frombuffer(raw, dtype="<u8").astype(_U64, copy=False)


def _raise_for_status(msg: Message, default: str) -> None:
    """Raises LLMException with the peer's status code unless ``msg`` reports success."""
    status = wire_status(msg)
    if status != LLMStatusCode.LLM_SUCCESS:
        raise LLMException(str(msg.fields.get("message", default)), status_code=status)


def _grant_within_selection(spec: XferSpec, local: np.ndarray, nbytes: np.ndarray) -> bool:
    """True if every range a grant names in our own cache lies in what the request selected:
    the blocks (or the batch slot) it named, in any tensor of the cache. A grant naming other
    blocks of ours is refused. Vectorised over descriptors: O(descriptors x log(runs)).
    """
    e = spec.local
    local_is_dst = spec.op == "pull"
    blocks = spec.dst_blocks if local_is_dst else spec.src_blocks
    local_blocks = spec.shape == "blocks" or (spec.shape == "slot_to_blocks" and local_is_dst)
    if local_blocks and blocks is None:
        return check_within(local, nbytes, *e.regions)  # every block was asked for
    if local_blocks:
        unit = spec.dst_block_bytes if (local_is_dst and spec.dst_block_bytes) else e.stride
        assert blocks is not None
        if len(local) <= 32 and len(blocks) <= 64:
            return _within_units_small(e, unit, set(blocks.tolist()), local, nbytes)
        units = np.unique(np.asarray(blocks, dtype=np.int64))
    else:
        unit, units = e.stride, np.array([spec.local_slot], dtype=np.int64)
    if len(units) == 0:
        return False
    if len(local) <= 32:
        return _within_units_small(e, unit, set(units.tolist()), local, nbytes)
    if not check_within(local, nbytes, *e.regions):
        return False
    # Runs of consecutive selected units, inclusive: descriptors may span several blocks.
    brk = np.flatnonzero(np.diff(units) != 1)
    run_lo = units[np.concatenate(([0], brk + 1))]
    run_hi = units[np.concatenate((brk, [len(units) - 1]))]
    tstarts = np.sort(e.addrs.astype(_U64))
    a = np.asarray(local, dtype=_U64)
    n = np.asarray(nbytes, dtype=_U64)
    t = np.searchsorted(tstarts, a, side="right").astype(np.int64) - 1
    off = (a - tstarts[t]).astype(np.int64)
    last = off + n.astype(np.int64) - 1  # inside tensor t: checked above
    b0, b1 = off // unit, last // unit
    r = np.searchsorted(run_lo, b0, side="right") - 1
    return bool(np.all((r >= 0) & (b1 <= run_hi[np.maximum(r, 0)])))


def _within_units_small(
    e: CacheEntry, unit: int, selected: set[int], local: np.ndarray, nbytes: np.ndarray
) -> bool:
    """:func:`_grant_within_selection` for a few descriptors, in plain Python (numpy costs
    microseconds per call on arrays this small)."""
    if not selected:
        return False
    starts = e.sorted_addrs
    size = e.tensor_bytes
    for a, n in zip(local.tolist(), nbytes.tolist(), strict=True):
        t = bisect.bisect_right(starts, a) - 1
        if t < 0 or n <= 0:
            return False
        off = a - starts[t]
        last = off + n - 1
        if last >= size:
            return False
        b0, b1 = off // unit, last // unit
        if b1 - b0 > len(selected) or any(b not in selected for b in range(b0, b1 + 1)):
            return False
    return True


# ====================================================================== initiator
async def initiate(
    engine: Any, link: Link, spec: XferSpec, token: CancelToken, deadline: float | None
) -> tuple[int, int]:
    """Run one request to completion; returns ``(bytes, descriptors)``. The caller holds the
    link's transfer lock and a pin on ``spec.local``; ``token`` stops the workers (its own
    deadline included) and ``deadline`` (monotonic) is sent to the target.

    Raises:
        LLMException: the target refused (its status code), the link failed
            (LLM_LINK_FAILED / LLM_NOT_YET_LINK), or the transfer was stopped.
    """
    await engine.populated(spec.local.addrs)
    req = link.open_pending(deadline)
    req.token = token
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
    grant_info: dict[str, Any] = {}

    def on_grant(msg: Message) -> None:
        # Runs in the reader before any DATA of this request can be read: set up where the
        # stream lands, after checking that every range lies inside our own cache.
        if wire_status(msg) != LLMStatusCode.LLM_SUCCESS:
            return
        local, nbytes = _arr(msg, "local"), _arr(msg, "nbytes")
        if local is None or nbytes is None or len(local) != len(nbytes):
            raise ProtocolError("GRANT without a plan")
        if len(local) > MAX_DESCRIPTORS:  # no honest target plans more
            raise ProtocolError(f"GRANT of {len(local)} descriptors")
        if not _grant_within_selection(spec, local, nbytes):
            raise ProtocolError("GRANT points outside what this request selected of our cache")
        grant_info["local"], grant_info["nbytes"] = local, nbytes
        if msg.fields.get("mode") == "stream" and spec.op == "pull":
            # The reader cannot await here; a staging buffer comes from the adapter's cache
            # after the first transfers.
            req.stream = engine.make_stream(local, nbytes, link.threads)

    req.on_grant = on_grant
    caps = engine.request_caps(link, spec.local)
    t_start = time.monotonic()
    timeout_ms = max(1, int((deadline - time.monotonic()) * 1000)) if deadline else 0
    try:
        await link.send(spec.encode(req.req_id, caps, timeout_ms))
        grant = await req.wait_grant()
        _raise_for_status(grant, "refused by peer")
        local, nbytes = grant_info["local"], grant_info["nbytes"]
        total = int(nbytes.sum(dtype=_U64))
        mode = grant.fields.get("mode")
        if mode == "local":
            remote = _arr(grant, "remote")
            if remote is None or len(remote) != len(nbytes) or link.access is None:
                raise ProtocolError("local-mode GRANT without remote ranges")
            # The peer's word is not enough to touch its memory: only what it published.
            await link.check_remote(remote, nbytes, engine.sync_kv_timeout_s)
            try:
                if spec.op == "pull":
                    await link.access.read(remote, local, nbytes, token)
                else:
                    await link.access.write(local, remote, nbytes, token)
            except CopyCancelled:
                raise req.error or CopyCancelled() from None
            await link.send(Message(MT.DONE, req.req_id, {"status": 0}))
        elif spec.op == "pull":
            await req.wait_data()
            if grant.fields.get("done", True) is not False:
                await link.send(Message(MT.DONE, req.req_id, {"status": 0}))
        else:
            stream = await engine.open_stream(local, nbytes, link.threads)
            try:
                if not await link.send_stream(req, stream, to_initiator=False, token=token):
                    raise req.error or CopyCancelled()
            finally:
                stream.close()
            result = await req.wait_result()
            _raise_for_status(result, "peer failed")
        link.stats_transfers += 1
        link.history.append(TransferRecord(spec.op, t_start, time.monotonic(), total, str(mode)))
        return total, len(nbytes)
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            await link.release(req)  # fence: no worker touches our memory after this
            if not isinstance(exc, LinkBroken):
                await link.abort(req.req_id, exc)
        if isinstance(exc, ProtocolError):
            link.fail(exc)
            raise LinkBroken(f"peer sent an invalid answer: {exc}") from exc
        if not link.alive and isinstance(exc, (LLMException, OSError, CopyCancelled)):
            # Whatever this request tripped over first, the link going down is the reason.
            raise link.down_error() from exc
        raise
    finally:
        link.close_pending(req)
        if req.stream is not None:
            req.stream.close()


def _direct_plan(engine: Any, link: Link, spec: XferSpec) -> Plan | None:
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
        spec.op != "pull"
        or not engine.options.remote_accessible
        or spec.target.get("by") != "cache_id"
        or access is None
        or getattr(access, "read_word", None) is None
        or link.peer_epoch is None
        or not engine.host_reachable(spec.local.addrs)
    ):
        return None
    tgt = link.peer_layout(spec.target["cache_id"])
    if tgt is None:  # not published as reachable, or malformed: the peer answers for it
        return None
    slot = int(spec.target.get("index", 0))
    raise_if_false(
        0 <= slot < (1 if tgt.is_blocks else tgt.count),
        f"batch index {slot} is outside cache {spec.target['cache_id']}",
        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
    )
    plan, _, _ = plan_selection(
        "pull",
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
    if not check_within(plan.src, plan.nbytes, *link.peer_regions) or not access.reaches(
        plan.src, plan.nbytes
    ):
        return None
    return plan


async def _pull_direct(
    engine: Any, link: Link, spec: XferSpec, req: Pending
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
    access, epoch = link.access, link.peer_epoch
    if plan is None or access is None or epoch is None:
        return None
    if access.read_word(epoch[0]) != epoch[1]:
        await link.refresh_view(engine.sync_kv_timeout_s)
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
        await link.refresh_view(engine.sync_kv_timeout_s)
        return None
    link.stats_transfers += 1
    link.stats_bytes += total
    link.history.append(TransferRecord(spec.op, t_start, time.monotonic(), total, "direct"))
    return total, len(plan)


# ====================================================================== target
async def serve_request(engine: Any, link: Link, req: Serving, msg: Message) -> None:
    """Handle one request from the peer: resolve, check, plan, grant, move, finish.

    Never raises: failures go back to the initiator (in the GRANT, or as an ABORT later).
    """
    async with link.serving_limiter:
        if _pieces_bound(msg) <= _INLINE_PIECES:
            await _serve(engine, link, req, msg)
            return
        async with _large_limiters(link)[1]:
            await _serve(engine, link, req, msg)


#: large requests of one link in flight at once (each holds its plan and, streamed over many
#: ranges, a staging buffer of up to 32 MiB): one can be planned while another moves its
#: bytes; more wait, counted against llm.LinkQueue. Their bytes share one socket anyway, so
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
_LARGE: weakref.WeakKeyDictionary[
    Link, tuple[anyio.CapacityLimiter, anyio.CapacityLimiter]
] = weakref.WeakKeyDictionary()


async def _serve(engine: Any, link: Link, req: Serving, msg: Message) -> None:
    registry = engine.registry
    pinned: list[CacheEntry] = []
    granted = False
    t0 = time.monotonic()
    try:
        try:
            if _pieces_bound(msg) <= _INLINE_PIECES:
                entries, plan, slot_info, mode, ntensors = _resolve_and_plan(engine, link, msg)
            else:
                async with _large_limiters(link)[0]:
                    entries, plan, slot_info, mode, ntensors = await _resolve_and_plan_async(
                        engine, link, msg
                    )
        except Exception as exc:  # any malformed or unfulfillable request gets an answer
            code = (
                exc.status_code
                if isinstance(exc, LLMException)
                else LLMStatusCode.LLM_PARAM_INVALID
            )
            await link.send(
                Message(MT.GRANT, req.req_id, {"status": int(code), "message": str(exc)})
            )
            return
        for e in entries:
            registry.pin(e)
            pinned.append(e)
        if req.deadline is not None:
            req.deadline = min(req.deadline, t0 + engine.serve_budget_s(ntensors))
        op = msg.fields["op"]
        local_side, target_side = (plan.dst, plan.src) if op == "pull" else (plan.src, plan.dst)
        arrays: dict[str, bytes | memoryview] = {
            "local": _u64(local_side),
            "nbytes": _u64(plan.nbytes),
        }
        if mode == "local":
            arrays["remote"] = _u64(target_side)
        elif op == "push":
            req.stream = await engine.open_stream(plan.dst, plan.nbytes, link.threads)
        if (
            op == "pull"
            and entries
            and slot_info is not None
            and not engine.options.remote_accessible
        ):
            consumed_entry, (slot, tensors) = entries[0], slot_info

            def consume(done: Message) -> None:
                if wire_status(done) == LLMStatusCode.LLM_SUCCESS:
                    registry.note_pulled(consumed_entry, slot, tensors)

            req.on_done = consume
        streamed_pull = mode == "stream" and op == "pull"
        # A streamed pull is done here once its bytes are sent: nothing of ours is touched
        # after that, so unless the initiator's DONE has an effect (consuming a key) it sends
        # none and the request is one round trip.
        wants_done = not streamed_pull or req.on_done is not None
        grant_fields: dict[str, Any] = {"status": 0, "mode": mode, "total": plan.total_bytes}
        if not wants_done:
            grant_fields["done"] = False
        grant = Message(MT.GRANT, req.req_id, grant_fields, arrays)
        if not streamed_pull:
            await link.send(grant)
        granted = True
        remaining = max(0.0, (req.deadline or 0) - time.monotonic())
        with anyio.move_on_after(remaining) as budget:
            if streamed_pull:
                out = await engine.open_stream(plan.src, plan.nbytes, link.threads)
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
            elif mode == "stream":
                await req.data_event.wait()
                if req.error is None:
                    await link.send(Message(MT.RESULT, req.req_id, {"status": 0}))
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


def serve_now(engine: Any, link: Link, msg: Message) -> bool:
    """Serve a small streamed pull from the link's reader itself: planned, granted and sent in
    one non-blocking ``sendmsg``, with no task, thread or serving slot. Returns False when a
    task must serve the request instead: anything else (pushes, direct-access grants, pulls
    that consume a key, device memory, more than ``INLINE_BYTES``), or any failure (the task
    answers it with its status). While the send lock is taken the frames queue for the
    link's writer (:meth:`Link.send_soon`).

    Nothing of ours is touched once the bytes are in the socket, so the request ends there
    (its GRANT says no DONE is expected).
    """
    f = msg.fields
    if (
        f.get("op") != "pull"
        or any(link.trusted_caps(f.get("caps")).values())
        or _bound_bytes(msg) > INLINE_BYTES
        or _pieces_bound(msg) > _INLINE_PIECES
    ):
        return False
    try:
        entries, plan, slot_info, mode, _ = _resolve_and_plan(engine, link, msg)
    except Exception:
        return False  # the task answers with the status
    total = plan.total_bytes
    if (
        mode != "stream"
        or not 0 < total <= INLINE_BYTES
        or (slot_info is not None and not engine.options.remote_accessible)
        or not engine.host_reachable(plan.src)
    ):
        return False
    grant = Message(
        MT.GRANT,
        msg.req_id,
        {"status": 0, "mode": mode, "total": total, "done": False},
        {"local": _u64(plan.dst), "nbytes": _u64(plan.nbytes)},
    )
    data = Message(MT.DATA, msg.req_id, {"off": 0}, payload_len=total, flags=FLAG_TO_INITIATOR)
    registry = engine.registry
    for e in entries:
        registry.pin(e)

    def unpin() -> None:
        for e in entries:
            registry.unpin(e)

    views = StreamPlan(plan.src, plan.nbytes).views(0, total)
    if not link.send_soon([grant, data], views, unpin):
        unpin()
        return False
    link.stats_bytes += total
    return True


def _bound_bytes(msg: Message) -> int:
    """About how many bytes a pull moves, from its request alone: the selected units of the
    initiator's cache in every tensor of it. Only a shortcut before planning: a request it
    underestimates (destination blocks of another size) is planned, found larger than
    ``INLINE_BYTES`` and served by a task."""
    try:
        tb, count, _ = msg.fields["layout"]
        ntensors = memoryview(msg.arrays["local_addrs"]).nbytes // 8
        blocks = msg.arrays.get("dst_blocks")
        units = 1 if blocks is None else memoryview(blocks).nbytes // 8
        return int(units) * (int(tb) // max(1, int(count))) * ntensors
    except (KeyError, TypeError, ValueError):
        return 1 << 62


async def _out_of_budget(engine: Any, link: Link, req: Serving, mode: str) -> None:
    """The request ran past what this side grants a peer: tell the initiator now (it would
    otherwise wait for its own deadline). In local mode it copies straight into our memory,
    so the caches stay pinned until it says it stopped, or the link goes."""
    exc = LLMException(
        f"cluster {engine.cluster_id} stopped serving the request: it ran past its budget",
        status_code=engine.timeout_code,
    )
    await link.abort(req.req_id, exc, flags=FLAG_TO_INITIATOR)
    if mode == "local":
        with anyio.move_on_after(engine.stall_timeout_s):
            await req.done_event.wait()
        if not req.done_event.is_set():
            link.fail(TimeoutError("the peer did not stop a timed-out direct copy"))


def plan_request(
    msg: Message, init_layout: Layout, tgt_layout: Layout, slot: int, max_bytes: int | None = None
) -> tuple[Plan, int, np.ndarray]:
    """Plan a request the peer sent, between its cache and ours (our batch ``slot``).
    Returns ``(plan, source slot, source tensor indices)``.

    Raises:
        LLMException: LLM_PARAM_INVALID for a selection that does not fit the two layouts.
        ProtocolError / KeyError / TypeError / ValueError: a malformed request.
    """
    f = msg.fields
    rng = [
        None if r is None else range(int(r[0]), int(r[1]))
        for r in (_req_field(f, "src_range"), _req_field(f, "dst_range"))
    ]
    dbb = _req_field(f, "dst_block_bytes")
    return plan_selection(
        f["op"],
        f["shape"],
        init_layout,
        tgt_layout,
        slot,
        local_slot=int(_req_field(f, "local_slot")),
        src_range=rng[0],
        dst_range=rng[1],
        tnpl=int(_req_field(f, "tnpl")),
        size=int(_req_field(f, "size")),
        src_offset=int(_req_field(f, "src_offset")),
        dst_offset=int(_req_field(f, "dst_offset")),
        src_blocks=_arr(msg, "src_blocks"),
        dst_blocks=_arr(msg, "dst_blocks"),
        dst_block_bytes=None if dbb is None else int(dbb),
        max_bytes=max_bytes,
    )


def plan_selection(
    op: str,
    shape: str,
    init_layout: Layout,
    tgt_layout: Layout,
    slot: int,
    *,
    local_slot: int,
    src_range: range | None,
    dst_range: range | None,
    tnpl: int,
    size: int,
    src_offset: int,
    dst_offset: int,
    src_blocks: np.ndarray | None,
    dst_blocks: np.ndarray | None,
    dst_block_bytes: int | None,
    max_bytes: int | None = None,
) -> tuple[Plan, int, np.ndarray]:
    """Plan a selection between the initiator's cache and the target's (its batch ``slot``).

    The target plans every request it serves with this; an initiator that reaches the target's
    memory on its own (a pull in remote-accessible mode) plans with it from the target's table.
    Returns ``(plan, source slot, source tensor indices)``. With ``max_bytes``, a selection
    of blocks that would move more is refused before it is planned.

    Raises:
        LLMException: LLM_PARAM_INVALID for a selection that does not fit the two layouts, or
            over ``max_bytes``, ``MAX_PIECES`` ranges or ``MAX_DESCRIPTORS`` descriptors.
        ProtocolError: a shape without the block lists it needs, or an unknown shape.
    """
    src, dst = (tgt_layout, init_layout) if op == "pull" else (init_layout, tgt_layout)
    src_slot, dst_slot = (slot, local_slot) if op == "pull" else (local_slot, slot)
    src_idx, dst_idx = tensor_windows(src.num_tensors, dst.num_tensors, src_range, dst_range, tnpl)
    if shape == "blocks" and src_blocks is not None:
        # Every descriptor of a blocks plan is one source block: its size is known now.
        pieces = len(src_idx) * len(src_blocks)
        raise_if_false(
            pieces <= MAX_PIECES, f"the request selects {pieces} ranges, more than {MAX_PIECES}"
        )
        raise_if_false(
            max_bytes is None or pieces * src.stride <= max_bytes,
            f"the request would move {pieces * src.stride} bytes, more than the {max_bytes} "
            "bytes of the caches it touches",
        )
    if shape == "slot":
        raise_if_false(
            not src.is_blocks and not dst.is_blocks, "slot transfers need contiguous caches"
        )
        plan = plan_slots(
            src, dst, src_idx, dst_idx, src_slot, dst_slot, size, src_offset, dst_offset
        )
    elif shape == "blocks":
        if src_blocks is None or dst_blocks is None:
            raise ProtocolError("blocks request without block lists")
        plan = plan_blocks(
            src,
            dst,
            src_idx,
            dst_idx,
            src_blocks.astype(np.int64),
            dst_blocks.astype(np.int64),
            dst_block_bytes,
        )
    elif shape == "slot_to_blocks":
        raise_if_false(not src.is_blocks, "source must be a contiguous cache")
        if dst_blocks is None:
            raise ProtocolError("slot_to_blocks request without dst_blocks")
        plan = plan_slot_to_blocks(
            src, dst, src_idx, dst_idx, src_slot, dst_blocks.astype(np.int64), dst_block_bytes
        )
    else:
        raise ProtocolError(f"bad shape {shape!r}")
    return plan, src_slot, src_idx


@dataclasses.dataclass
class _Resolved:
    """A peer's request resolved against our registry, before it is planned: all that
    :func:`_plan_checked` needs, so that a large request can be planned in a worker thread
    while the registry changes on the loop."""

    op: str
    by: str
    entry: CacheEntry | None
    slot: int
    init_layout: Layout
    tgt_layout: Layout
    #: bytes the request may move at most (the named cache's, or every registered byte)
    held: int
    #: (starts, ends, cache ids) of our registered memory, for requests by raw address
    regions: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    #: an upper bound of the ranges the request selects (tensors x blocks), from its sizes
    pieces: int
    #: this endpoint's cluster id (for messages)
    cluster_id: int


def _count(msg: Message, name: str, limit: int, what: str) -> int:
    """How many u64 the request's array ``name`` holds (0 when absent).

    Raises:
        LLMException: LLM_PARAM_INVALID for more than ``limit``.
    """
    raw = msg.arrays.get(name)
    n = 0 if raw is None else memoryview(raw).nbytes // 8
    raise_if_false(n <= limit, f"the request names {n} {what}, more than {limit}")
    return n


def _resolve(engine: Any, msg: Message) -> _Resolved:
    """Find the target's cache and parse the request's layouts, after checking the counts it
    claims (tensors, blocks) against fixed caps and the target cache, before any array is
    built. Runs on the loop (the registry is not thread-safe); costs O(tensors).

    Raises:
        LLMException: LLM_KV_CACHE_NOT_EXIST for a missing cache/key, LLM_PARAM_INVALID for
            counts over the caps or anything that does not fit.
        ProtocolError / KeyError / TypeError / ValueError: a malformed request.
    """
    f = msg.fields
    registry = engine.registry
    op = f["op"]
    if op not in ("pull", "push"):
        raise ProtocolError(f"bad op {op!r}")
    target = f["target"]
    by = target["by"]
    entry: CacheEntry | None = None
    slot = 0
    if by in ("req_key", "prefix_key"):
        kind = "req" if by == "req_key" else "prefix"
        entry, slot = registry.lookup_slot_key((kind, int(target["id"]), int(target["model_id"])))
    elif by == "blocks_key":
        entry = registry.lookup_blocks_key(int(target["model_id"]))
    elif by == "cache_id":
        entry = registry.get(int(target["cache_id"]))
        slot = int(target.get("index", 0))
        raise_if_false(
            0 <= slot < (1 if entry.is_blocks else entry.count),
            f"batch index {slot} is outside cache {entry.cache_id}",
            LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
        )
    elif by != "addrs":
        raise ProtocolError(f"bad addressing {by!r}")
    if entry is not None and (engine.options.remote_accessible or by == "cache_id"):
        raise_if_false(
            entry.remote_accessible,
            f"cache {entry.cache_id} of cluster {engine.cluster_id} is not remote accessible",
        )
    # Claimed sizes first: nothing is built from an array before its length is known to fit.
    n_local = _count(msg, "local_addrs", MAX_TENSORS, "tensors of its own cache")
    units = max(
        _count(msg, "src_blocks", MAX_PIECES, "source blocks"),
        _count(msg, "dst_blocks", MAX_PIECES, "destination blocks"),
        1,
    )
    regions = None
    if entry is not None:
        n_target = entry.num_tensors
        held = entry.num_tensors * entry.tensor_bytes
        _ = entry.regions  # built here, on the loop, not in a planning thread
    else:
        regions = registry.regions()
        n_target = _count(msg, "raw_addrs", MAX_TENSORS, "tensors here")
        held = 1 << 64  # checked once planned, against the caches the addresses fall in
    # Both sides select as many tensors, at most either side's count.
    pieces = min(n_local, n_target) * units
    raise_if_false(
        pieces <= MAX_PIECES, f"the request selects up to {pieces} ranges, more than {MAX_PIECES}"
    )
    tb, count, is_blocks = f["layout"]
    local_addrs = _arr(msg, "local_addrs")
    if local_addrs is None or not len(local_addrs):
        raise ProtocolError("request without the initiator's layout")
    init_layout = Layout(local_addrs, int(tb), int(count), bool(is_blocks))
    if entry is not None:
        tgt_layout = entry.layout
    else:
        raw = _arr(msg, "raw_addrs")
        rtb, rcount, rblocks = f.get("raw", (0, 1, False))
        if raw is None or not len(raw):
            raise ProtocolError("addressing by addresses without addresses")
        tgt_layout = Layout(raw, int(rtb), int(rcount), bool(rblocks))
    return _Resolved(
        op, by, entry, slot, init_layout, tgt_layout, held, regions, pieces, engine.cluster_id
    )


def _plan_checked(msg: Message, r: _Resolved) -> tuple[Plan, int, np.ndarray, np.ndarray | None]:
    """Plan a resolved request and check every range it names here; pure (safe in a worker
    thread). Returns ``(plan, source slot, source tensor indices, ids of the caches touched
    when addressed by raw addresses)``.

    Raises:
        LLMException: LLM_PARAM_INVALID for a selection that does not fit, leaves registered
            memory or moves more than the caches hold.
        ProtocolError / KeyError / TypeError / ValueError: a malformed request.
    """
    plan, src_slot, src_idx = plan_request(msg, r.init_layout, r.tgt_layout, r.slot, r.held)
    target_side = plan.src if r.op == "pull" else plan.dst
    # Whatever the request said, every range must lie inside memory this endpoint registered:
    # inside the named cache, or (raw addresses) inside registered caches, which are pinned.
    ids = None
    if r.entry is not None:
        starts, ends = r.entry.regions
        raise_if_false(
            check_within(target_side, plan.nbytes, starts, ends),
            f"the request leaves cache {r.entry.cache_id} of cluster {r.cluster_id}",
        )
    else:
        assert r.regions is not None
        starts, ends, all_ids = r.regions
        raise_if_false(
            check_within(target_side, plan.nbytes, starts, ends),
            f"destination addresses are outside the registered memory of cluster {r.cluster_id}",
        )
        j = np.searchsorted(starts, target_side, side="right").astype(np.int64) - 1
        ids = np.unique(all_ids[j])
    # Repeated block indices must not turn a small request into unbounded work.
    raise_if_false(
        plan.total_bytes <= r.held,
        f"the request would move {plan.total_bytes} bytes, more than the {r.held} bytes of "
        "the caches it touches",
    )
    return plan, src_slot, src_idx, ids


def _finish(
    engine: Any,
    link: Link,
    msg: Message,
    r: _Resolved,
    planned: tuple[Plan, int, np.ndarray, np.ndarray | None],
) -> tuple[list[CacheEntry], Plan, tuple[int, np.ndarray] | None, str, int]:
    """The checks of a planned request that need the registry (on the loop, right before the
    caches are pinned): the caches it touches are still there and may be reached this way.

    Raises:
        LLMException: LLM_KV_CACHE_NOT_EXIST for a cache released while the request was
            planned, LLM_PARAM_INVALID for one it may not reach.
    """
    registry = engine.registry
    plan, src_slot, src_idx, ids = planned
    op, by, entry = r.op, r.by, r.entry
    target_side = plan.src if op == "pull" else plan.dst
    if entry is not None:
        raise_if_false(
            not entry.freed and not (by == "cache_id" and entry.id_released),
            f"cache {entry.cache_id} was released",
            LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
        )
        # A key may have been removed, consumed or bound elsewhere while the request was
        # planned: it must still name the very cache and slot that were planned.
        target = msg.fields["target"]
        if by in ("req_key", "prefix_key"):
            kind = "req" if by == "req_key" else "prefix"
            now = registry.lookup_slot_key((kind, int(target["id"]), int(target["model_id"])))
            raise_if_false(
                now[0] is entry and now[1] == r.slot,
                "the key was rebound while the request was planned",
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
            )
        elif by == "blocks_key":
            raise_if_false(
                registry.lookup_blocks_key(int(target["model_id"])) is entry,
                "the key was rebound while the request was planned",
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
            )
        entries = [entry]
    else:
        assert ids is not None
        found = [registry.entries.get(int(c)) for c in ids]
        raise_if_false(
            all(e is not None and not e.freed for e in found),
            f"memory the request names on cluster {engine.cluster_id} was released",
            LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
        )
        entries = [e for e in found if e is not None]
        for e in entries:
            raise_if_false(
                e.remote_accessible,
                f"cache {e.cache_id} of cluster {engine.cluster_id} is not remote accessible",
            )
        held = sum(e.num_tensors * e.tensor_bytes for e in entries)
        raise_if_false(
            plan.total_bytes <= held,
            f"the request would move {plan.total_bytes} bytes, more than the {held} bytes of "
            f"the caches it touches on cluster {engine.cluster_id}",
        )
    # A push writes into our memory: only ever into remote-accessible caches, and by key only
    # in remote-accessible mode (upstream has no push otherwise; a key grants pulls).
    if op == "push":
        raise_if_false(
            engine.options.remote_accessible or by == "addrs",
            f"cluster {engine.cluster_id} takes no pushes by key or id outside "
            "remote-accessible mode",
        )
        for e in entries:
            raise_if_false(
                e.remote_accessible,
                f"cache {e.cache_id} of cluster {engine.cluster_id} is not remote accessible",
            )
    slot_info = None
    if entry is not None and op == "pull" and not entry.is_blocks:
        slot_info = (src_slot, src_idx)
    mode = (
        "local"
        if engine.reachable_by_peer(
            link.trusted_caps(msg.fields.get("caps")), target_side, plan.nbytes
        )
        else "stream"
    )
    return entries, plan, slot_info, mode, len(src_idx)


def _resolve_and_plan(
    engine: Any, link: Link, msg: Message
) -> tuple[list[CacheEntry], Plan, tuple[int, np.ndarray] | None, str, int]:
    """Find the target's cache, plan the request, and check every range, all at once (a
    request of at most ``_INLINE_PIECES`` ranges; larger ones: :func:`_resolve_and_plan_async`).

    Returns ``(caches touched, plan, (slot, tensor indices) for key consumption, mode,
    tensors)``; the first cache is the one the request named, if it named one.

    A peer reaches a cache that is not remote accessible only through a key bound to it
    (request/response mode, where this side moves the bytes); never by id or address.

    Raises:
        LLMException: LLM_KV_CACHE_NOT_EXIST for a missing cache/key, LLM_PARAM_INVALID for
            anything that does not fit (counts over MAX_TENSORS / MAX_PIECES /
            MAX_DESCRIPTORS included).
        ProtocolError / KeyError / TypeError / ValueError: a malformed request.
    """
    r = _resolve(engine, msg)
    return _finish(engine, link, msg, r, _plan_checked(msg, r))


async def _resolve_and_plan_async(
    engine: Any, link: Link, msg: Message
) -> tuple[list[CacheEntry], Plan, tuple[int, np.ndarray] | None, str, int]:
    """:func:`_resolve_and_plan` for any request: one that may select more than
    ``_INLINE_PIECES`` ranges is planned and checked in one of the link's worker threads, so
    that it never holds the event loop (the registry is only read on the loop).

    Raises:
        As :func:`_resolve_and_plan`.
    """
    r = _resolve(engine, msg)
    if r.pieces <= _INLINE_PIECES:
        return _finish(engine, link, msg, r, _plan_checked(msg, r))
    planned = await anyio.to_thread.run_sync(_plan_checked, msg, r, limiter=link.threads)
    return _finish(engine, link, msg, r, planned)


#: requests selecting at most this many ranges are planned on the loop (about a millisecond);
#: larger ones in a worker thread
_INLINE_PIECES = 1 << 14


def _pieces_bound(msg: Message) -> int:
    """An upper bound of the ranges a request selects, from its arrays' sizes alone: at most
    every tensor of the initiator's cache times its longest block list."""
    arrays = msg.arrays
    n = [memoryview(arrays[k]).nbytes // 8 if k in arrays else 0 for k in _COUNTED]
    return n[0] * max(n[1], n[2], 1)


_COUNTED = ("local_addrs", "src_blocks", "dst_blocks")


__all__ += ["FLAG_TO_INITIATOR", "Pending"]
