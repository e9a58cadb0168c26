"""What a request may select and what a grant may name: the pure checks of both ends.

No I/O, no anyio: the initiator's request in its own terms (:class:`TransferRequest`; its
check of a grant against it is :mod:`.grant_checks`); the target's resolution of a
peer's :class:`~.._messages.Request` against its registry (:func:`resolve`), its plan and the
check of every range it names (:func:`plan_checked`, safe in a worker thread; requests of a
few blocks are planned from prepared pairs, :mod:`.prepared`), and the checks that need the
registry again right before the caches are pinned (:func:`finish`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from .._checks import check_same_dtype
from .._enums import LLMStatusCode
from .._errors import LLMException, ProtocolError, raise_if_false, raise_param
from .._messages import Address, By, Cap, Mode, Op, Request, Shape, caps_of
from .._planner import (
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
from .._registry import CacheEntry

if TYPE_CHECKING:
    from .host import LinkHost

__all__ = [
    "INLINE_PIECES",
    "Planned",
    "Resolved",
    "TransferRequest",
    "finish",
    "check_total",
    "plan_checked",
    "plan_request",
    "plan_selection",
    "resolve",
]

_U64 = np.uint64

#: requests selecting at most this many ranges are planned on the loop (about a millisecond);
#: larger ones in a worker thread
INLINE_PIECES = 1 << 14


@dataclasses.dataclass
class TransferRequest:
    """What the initiator asks for, in source/destination terms: the target's cache (as
    ``target``, the wire's addressing), the selection, and its own cache ``local``."""

    op: Op  # pull: the target is the source; push: the target is the destination
    target: Address  # how to find the target's cache
    shape: Shape
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

    def __post_init__(self) -> None:
        # (calling an enum costs a microsecond: most callers pass members already)
        if type(self.op) is not Op:
            self.op = Op(self.op)
        if type(self.shape) is not Shape:
            self.shape = Shape(self.shape)

    def to_wire(
        self, req_id: int, caps: dict[str, bool], timeout_ms: int, eager: tuple[int, int] | None
    ) -> Request:
        """The XFER_REQ (``caps``: how we reach the peer's memory; ``eager``: :mod:`.eager`)."""
        e = self.local
        return Request(
            req_id,
            self.op,
            self.target,
            self.shape,
            (e.tensor_bytes, e.count, e.is_blocks),
            e.addrs,
            caps=caps_of(caps),
            timeout_ms=timeout_ms,
            local_slot=self.local_slot,
            size=self.size,
            src_offset=self.src_offset,
            dst_offset=self.dst_offset,
            src_range=self.src_range,
            dst_range=self.dst_range,
            tensor_num_per_layer=self.tensor_num_per_layer,
            dst_block_bytes=self.dst_block_bytes,
            src_blocks=self.src_blocks,
            dst_blocks=self.dst_blocks,
            raw=(
                None
                if self.raw_addrs is None
                else (self.raw_tensor_bytes, self.raw_count, self.raw_is_blocks)
            ),
            raw_addrs=self.raw_addrs,
            dtype=e.dtype,
            eager=eager,
        )


def our_selection(spec: TransferRequest) -> tuple[range, np.ndarray | None]:
    """What a request selects of our own cache: its tensors (its layer window's, else all)
    and our block list (None: a slot, or every block)."""
    pull, e = spec.op == Op.PULL, spec.local
    window, blocks = (
        (spec.dst_range, spec.dst_blocks) if pull else (spec.src_range, spec.src_blocks)
    )
    if window is None:
        return range(e.num_tensors), blocks
    n = spec.tensor_num_per_layer
    return range(window.start * n, window.stop * n), blocks


def selection_bound(spec: TransferRequest) -> tuple[int, int]:
    """About the bytes a request selects of our own cache, and at most how many ranges (a
    range per tensor and block, before contiguous ones merge): cheap, before planning, a
    block or a slot counted whole."""
    pull, e = spec.op == Op.PULL, spec.local
    selected, blocks = our_selection(spec)
    tensors = len(selected)
    if blocks is not None:
        unit = (spec.dst_block_bytes if pull else None) or e.stride
        return tensors * len(blocks) * unit, tensors * max(1, len(blocks))
    return tensors * (spec.size if spec.size >= 0 else e.stride), tensors


# ====================================================================== initiator's check
# ====================================================================== planning
def plan_request(
    req: Request, init_layout: Layout, tgt_layout: Layout, slot: int, max_bytes: int | None = None
) -> tuple[Plan, int, np.ndarray]:
    """Plan a request the peer sent, between its cache and ours (our batch ``slot``).
    Returns ``(plan, source slot, source tensor indices)``.

    Raises:
        LLMException: LLM_PARAM_INVALID for a selection that does not fit the two layouts.
        ProtocolError: a shape without the block lists it needs.
    """
    return plan_selection(
        req.op,
        req.shape,
        init_layout,
        tgt_layout,
        slot,
        local_slot=req.local_slot,
        src_range=req.src_range,
        dst_range=req.dst_range,
        tnpl=req.tensor_num_per_layer,
        size=req.size,
        src_offset=req.src_offset,
        dst_offset=req.dst_offset,
        src_blocks=req.src_blocks,
        dst_blocks=req.dst_blocks,
        dst_block_bytes=req.dst_block_bytes,
        max_bytes=max_bytes,
    )


def plan_selection(
    op: Op,
    shape: Shape,
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
    pull = op == Op.PULL
    src, dst = (tgt_layout, init_layout) if pull else (init_layout, tgt_layout)
    src_slot, dst_slot = (slot, local_slot) if pull else (local_slot, slot)
    src_idx, dst_idx = tensor_windows(src.num_tensors, dst.num_tensors, src_range, dst_range, tnpl)
    if shape == Shape.BLOCKS and src_blocks is not None:
        # Every descriptor of a blocks plan is one source block: its size is known now.
        pieces = len(src_idx) * len(src_blocks)
        if pieces > MAX_PIECES:
            raise_param(f"the request selects {pieces} ranges, more than {MAX_PIECES}")
        if max_bytes is not None and pieces * src.stride > max_bytes:
            raise_param(
                f"the request would move {pieces * src.stride} bytes, more than the "
                f"{max_bytes} bytes of the caches it touches"
            )
    if shape == Shape.SLOT:
        raise_if_false(
            not src.is_blocks and not dst.is_blocks, "slot transfers need contiguous caches"
        )
        plan = plan_slots(
            src, dst, src_idx, dst_idx, src_slot, dst_slot, size, src_offset, dst_offset
        )
    elif shape == Shape.BLOCKS:
        if src_blocks is None or dst_blocks is None:
            raise ProtocolError("blocks request without block lists")
        plan = plan_blocks(
            src,
            dst,
            src_idx,
            dst_idx,
            src_blocks,  # (any integer type: see plan_blocks)
            dst_blocks,
            dst_block_bytes,
        )
    elif shape == Shape.SLOT_TO_BLOCKS:
        raise_if_false(not src.is_blocks, "source must be a contiguous cache")
        if dst_blocks is None:
            raise ProtocolError("slot_to_blocks request without dst_blocks")
        plan = plan_slot_to_blocks(
            src, dst, src_idx, dst_idx, src_slot, dst_blocks.astype(np.int64), dst_block_bytes
        )
    else:
        raise ProtocolError(f"bad shape {shape!r}")
    return plan, src_slot, src_idx


# ====================================================================== target's checks
@dataclasses.dataclass
class Resolved:
    """A peer's request resolved against our registry, before it is planned: all that
    :func:`plan_checked` needs (in a worker thread for a large one)."""

    op: Op
    by: By
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


#: a planned request: (plan, source slot, source tensor indices, ids of the caches touched
#: when addressed by raw addresses)
Planned = tuple[Plan, int, np.ndarray, "np.ndarray | None"]


def _count(arr: np.ndarray | None, limit: int, what: str) -> int:
    """How many u64 the request's array holds (0 when absent).

    Raises:
        LLMException: LLM_PARAM_INVALID for more than ``limit``.
    """
    n = 0 if arr is None else len(arr)
    if n > limit:  # (on every request: the message is formatted only when it fails)
        raise_param(f"the request names {n} {what}, more than {limit}")
    return n


def _slot_kind(by: By) -> str:
    return "req" if by is By.REQ_KEY else "prefix"


def resolve(engine: LinkHost, req: Request) -> Resolved:
    """Find the target's cache and parse the request's layouts, after checking the counts it
    claims (tensors, blocks) against fixed caps and the target cache, before any array is
    built. Runs on the loop (the registry is not thread-safe); costs O(tensors).

    Raises:
        LLMException: LLM_KV_CACHE_NOT_EXIST for a missing cache/key, LLM_PARAM_INVALID for
            counts over the caps or anything that does not fit.
    """
    registry = engine.registry
    target = req.target
    by = target.by
    entry: CacheEntry | None = None
    slot = 0
    if by is By.REQ_KEY or by is By.PREFIX_KEY:
        entry, slot = registry.lookup_slot_key((_slot_kind(by), target.id, target.model_id))
    elif by is By.BLOCKS_KEY:
        entry = registry.lookup_blocks_key(target.model_id)
    elif by is By.CACHE_ID:
        entry = registry.get(target.cache_id)
        slot = target.index
        raise_if_false(
            0 <= slot < (1 if entry.is_blocks else entry.count),
            f"batch index {slot} is outside cache {entry.cache_id}",
            LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
        )
    if entry is not None and (engine.options.remote_accessible or by is By.CACHE_ID):
        raise_if_false(
            entry.remote_accessible,
            f"cache {entry.cache_id} of cluster {engine.cluster_id} is not remote accessible",
        )
    if entry is not None and req.dtype != entry.dtype:  # (the message costs microseconds)
        ours = f"cache {entry.cache_id} of cluster {engine.cluster_id}"
        if req.op is Op.PULL:
            check_same_dtype(entry.dtype, req.dtype, f"pull from {ours} into the peer's cache")
        else:
            check_same_dtype(req.dtype, entry.dtype, f"push from the peer's cache into {ours}")
    # Claimed sizes first: nothing is built from an array before its length is known to fit.
    n_local = _count(req.local_addrs, MAX_TENSORS, "tensors of its own cache")
    units = max(
        _count(req.src_blocks, MAX_PIECES, "source blocks"),
        _count(req.dst_blocks, MAX_PIECES, "destination blocks"),
        1,
    )
    regions = None
    if entry is not None:
        n_target = entry.num_tensors
        held = entry.num_tensors * entry.tensor_bytes
        _ = entry.regions  # built here, on the loop, not in a planning thread
    else:
        regions = registry.regions()
        n_target = _count(req.raw_addrs, MAX_TENSORS, "tensors here")
        held = 1 << 64  # checked once planned, against the caches the addresses fall in
    # Both sides select as many tensors, at most either side's count.
    pieces = min(n_local, n_target) * units
    if pieces > MAX_PIECES:
        raise_param(f"the request selects up to {pieces} ranges, more than {MAX_PIECES}")
    tb, count, is_blocks = req.layout
    raise_if_false(count > 0, f"the request's own cache has {count} slots or blocks")
    dbb = req.dst_block_bytes
    raise_if_false(dbb is None or dbb > 0, f"destination blocks of {dbb} bytes")
    init_layout = Layout(req.local_addrs, tb, count, is_blocks)
    if entry is not None:
        tgt_layout = entry.layout
    else:
        assert req.raw_addrs is not None  # Request.decode: addressing by address has them
        rtb, rcount, rblocks = req.raw or (0, 1, False)
        raise_if_false(rcount > 0, f"the request names memory of {rcount} slots or blocks")
        tgt_layout = Layout(req.raw_addrs, rtb, rcount, rblocks)
    return Resolved(
        req.op, by, entry, slot, init_layout, tgt_layout, held, regions, pieces, engine.cluster_id
    )


def plan_checked(req: Request, res: Resolved) -> Planned:
    """Plan a resolved request and check every range it names here; pure (safe in a worker
    thread).

    Raises:
        LLMException: LLM_PARAM_INVALID for a selection that does not fit, leaves registered
            memory or moves more than the caches hold.
        ProtocolError: a shape without the block lists it needs.
    """
    plan, src_slot, src_idx = plan_request(req, res.init_layout, res.tgt_layout, res.slot, res.held)
    target_side = plan.src if res.op == Op.PULL else plan.dst
    # Whatever the request said, every range must lie inside memory this endpoint registered:
    # inside the named cache, or (raw addresses) inside registered caches, which are pinned.
    ids = None
    if res.entry is not None:
        starts, ends = res.entry.regions
        if not check_within(target_side, plan.nbytes, starts, ends):
            raise_param(
                f"the request leaves cache {res.entry.cache_id} of cluster {res.cluster_id}"
            )
    else:
        assert res.regions is not None
        starts, ends, all_ids = res.regions
        raise_if_false(
            check_within(target_side, plan.nbytes, starts, ends),
            f"destination addresses are outside the registered memory of cluster {res.cluster_id}",
        )
        j = np.searchsorted(starts, target_side, side="right").astype(np.int64) - 1
        ids = np.unique(all_ids[j])
    check_total(plan, res)
    return plan, src_slot, src_idx, ids


def check_total(plan: Plan, res: Resolved) -> None:
    """Repeated block indices must not turn a small request into unbounded work."""
    total = plan.total_bytes
    if total > res.held:
        raise_param(
            f"the request would move {total} bytes, more than the {res.held} bytes of the "
            "caches it touches"
        )


def finish(
    engine: LinkHost, req: Request, res: Resolved, planned: Planned, caps: dict[str, bool]
) -> tuple[list[CacheEntry], Plan, tuple[int, np.ndarray] | None, Mode, int]:
    """The checks of a planned request that need the registry (on the loop, right before the
    caches are pinned): the caches it touches are still there and may be reached this way.
    ``caps``: what the link lets the initiator use of what it claimed. Returns ``(caches
    touched, plan, (slot, tensor indices) for key consumption, mode, tensors)``; the first
    cache is the one the request named, if it named one.

    Raises:
        LLMException: LLM_KV_CACHE_NOT_EXIST for a cache released while the request was
            planned, LLM_PARAM_INVALID for one it may not reach.
    """
    registry = engine.registry
    plan, src_slot, src_idx, ids = planned
    op, by, entry = res.op, res.by, res.entry
    target_side = plan.src if op == Op.PULL else plan.dst
    if entry is not None:
        if entry.freed or (by is By.CACHE_ID and entry.id_released):
            raise LLMException(
                f"cache {entry.cache_id} was released",
                status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
            )
        # A key may have been removed, consumed or bound elsewhere while the request was
        # planned: it must still name the very cache and slot that were planned.
        target = req.target
        if by is By.REQ_KEY or by is By.PREFIX_KEY:
            now = registry.lookup_slot_key((_slot_kind(by), target.id, target.model_id))
            raise_if_false(
                now[0] is entry and now[1] == res.slot,
                "the key was rebound while the request was planned",
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
            )
        elif by is By.BLOCKS_KEY:
            raise_if_false(
                registry.lookup_blocks_key(target.model_id) is entry,
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
    if op == Op.PUSH:
        raise_if_false(
            engine.options.remote_accessible or by is By.ADDRS,
            f"cluster {engine.cluster_id} takes no pushes by key or id outside "
            "remote-accessible mode",
        )
        for e in entries:
            raise_if_false(
                e.remote_accessible,
                f"cache {e.cache_id} of cluster {engine.cluster_id} is not remote accessible",
            )
    slot_info = None
    if entry is not None and op == Op.PULL and not entry.is_blocks:
        slot_info = (src_slot, src_idx)
    reachable = engine.reachable_by_peer(caps, target_side, plan.nbytes) or (
        op == Op.PULL and entry is not None and _reads_itself(engine, by, caps, target_side)
    )
    mode = Mode.LOCAL if reachable else Mode.STREAM
    return entries, plan, slot_info, mode, len(src_idx)


def _reads_itself(engine: LinkHost, by: By, caps: dict[str, bool], ranges: np.ndarray) -> bool:
    """A pull by key of a cache that is not remote accessible may still be copied by the
    initiator itself (a LOCAL grant: one copy instead of the stream, its own fence and
    deadline) when the link is one the kernel proved to join two processes of the same user
    (``caps`` hold only what the link's kind lets a peer claim) and the initiator says its
    ``process_vm_readv`` reaches any of our memory (its own probe of us): a peer that could
    read these bytes without us anyway, and whom the key grants them. Its grant names only the
    ranges the key gives, pinned until its DONE. Only an initiator that says it takes such a
    grant (``Cap.KEY_READS``) gets one. A same-user process that claims the probe falsely
    learns those ranges' addresses and cannot read them (it could read our
    ``/proc/<pid>/maps``)."""
    return (
        by in (By.REQ_KEY, By.PREFIX_KEY, By.BLOCKS_KEY)
        and bool(caps.get(Cap.KEY_READS) and caps.get(Cap.PVR))
        and engine.host_reachable(ranges)
    )
