"""Prepared transfers: plan once, reuse per request (NIXL's prepared descriptor lists).

A request of blocks between the same two caches, with the same layer windows, is
planned from a :class:`~.._planner.BlockPair` made by the first: the tensor windows, the
selected tensors' addresses and the block sizes, checked once, and whether the side that must
stay inside a region (the source of a one-sided pull, our own cache on the target) lies
whole in it, so that no block range can leave it and no range check per request is needed.
The next requests only place their blocks, with the full planner's answers and refusals.

* the target keeps its pairs on the entry of the cache a request named, keyed by the peer's
  layout (:func:`plan_on_loop`, on the loop only);
* an initiator that plans a request from the peer's table (a one-sided pull, a push whose
  bytes follow its request) keeps its pairs in its view of that table, made again when
  either layout or the region changes (:func:`plan_prepared`).

A pair holds ints, lists and arrays of its own only, never a layout (a peer's is a view of
its request frame), pairs at most ``_KEYED_TENSORS`` tensors, and each place keeps at most
``_KEPT_PAIRS``. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import LLMException, raise_param
from .._messages import Op, Request, Shape
from .._planner import BlockPair, Layout, Plan, check_within, tensor_windows
from .grants import Planned, Resolved, TransferRequest, check_total, plan_checked

__all__ = ["plan_on_loop", "plan_prepared"]

_U64 = np.uint64

#: a link's view of the peer's table, or a cache of ours, keeps at most this many prepared
#: pairs (then starts again)
_KEPT_PAIRS = 64
#: a pair of more tensors is never made (such requests are planned in full), and a peer's
#: layout of more is never a kept pair's key (which holds 8 bytes a tensor)
_KEYED_TENSORS = 256


def plan_prepared(
    pairs: dict[tuple[Any, ...], Any],
    spec: TransferRequest,
    tgt: Layout,
    regions: tuple[np.ndarray, np.ndarray],
    max_bytes: int | None = None,
) -> Plan | None:
    """The plan of a request of blocks between our cache and the peer's cache ``tgt``
    (as its table describes it), from the pair of the two kept in ``pairs`` (the link's view
    of the peer's table; :class:`BlockPair`: tensor windows, addresses and block sizes, checked
    by the first request that paired them); None when it must be planned in full
    (:func:`plan_selection`, which also says what does not fit, or a plan over ``max_bytes``).

    ``regions`` is the memory the source must lie in (the peer's published memory for a
    one-sided pull, our own cache for a push planned here). A pair is made again when either
    layout or ``regions`` change, and serves only when every selected source tensor lies whole
    in ``regions``: then no block range can leave it, and no range check per request is needed.
    """
    src_b, dst_b = spec.src_blocks, spec.dst_blocks
    if spec.shape is not Shape.BLOCKS or src_b is None or dst_b is None:
        return None
    if not 0 < len(src_b) == len(dst_b):
        return None
    pull, ours = spec.op is Op.PULL, spec.local.layout
    key = (
        pull, spec.target.cache_id, spec.local.cache_id, spec.src_range, spec.dst_range,
        spec.tensor_num_per_layer, spec.dst_block_bytes,
    )  # fmt: skip
    kept = pairs.get(key)
    if kept is None or kept[0] is not tgt or kept[1] is not ours or kept[2] is not regions:
        src, dst = (tgt, ours) if pull else (ours, tgt)
        pair: BlockPair | None = None
        whole = False
        try:
            src_idx, dst_idx = tensor_windows(
                src.num_tensors, dst.num_tensors, spec.src_range, spec.dst_range,
                spec.tensor_num_per_layer,
            )  # fmt: skip
            if len(src_idx) <= _KEYED_TENSORS:  # (a pair holds its tensors' addresses)
                pair = BlockPair(src, dst, src_idx, dst_idx, spec.dst_block_bytes)
                whole = _whole(pair.src_arr, src.count * pair.piece, regions)
        except LLMException:
            return None
        if len(pairs) >= _KEPT_PAIRS:
            pairs.clear()
        kept = pairs[key] = (tgt, ours, regions, pair, whole)
    pair, whole = kept[3], kept[4]
    if pair is None or not whole:
        return None
    if max_bytes is not None and pair.tensors * len(src_b) * pair.piece > max_bytes:
        return None
    return pair.plan_arrays(src_b, dst_b)


def _whole(bases: np.ndarray, extent: int, regions: tuple[np.ndarray, np.ndarray]) -> bool:
    """True if ``[base, base + extent)`` lies inside one of ``regions`` for every base."""
    return check_within(bases, np.full(len(bases), extent, dtype=_U64), *regions)


def plan_on_loop(req: Request, res: Resolved) -> Planned:
    """:func:`plan_checked` on the loop: a request of blocks of a cache it named (by
    key or id) is planned from the pair of that cache with the peer's layout prepared by the
    first such request (:class:`BlockPair`: tensor windows, addresses and block sizes, checked
    once, kept on our cache's entry), and serves only where our selected tensors lie whole in
    the cache (then no block range can leave it). Anything else is planned in full.

    Raises:
        As :func:`plan_checked`.
    """
    entry, src_b, dst_b = res.entry, req.src_blocks, req.dst_blocks
    if entry is None or req.shape is not Shape.BLOCKS or src_b is None or dst_b is None:
        return plan_checked(req, res)
    if not 0 < len(src_b) == len(dst_b):
        return plan_checked(req, res)
    pull, theirs = req.op is Op.PULL, res.init_layout
    if theirs.num_tensors > _KEYED_TENSORS:
        return plan_checked(req, res)
    key = (
        pull, theirs.addrs.tobytes(), theirs.tensor_bytes, theirs.count, theirs.is_blocks,
        req.src_range, req.dst_range, req.tensor_num_per_layer, req.dst_block_bytes,
    )  # fmt: skip
    kept = entry.pairs.get(key)
    if kept is None:
        src, dst = (res.tgt_layout, theirs) if pull else (theirs, res.tgt_layout)
        src_idx, dst_idx = tensor_windows(
            src.num_tensors, dst.num_tensors, req.src_range, req.dst_range,
            req.tensor_num_per_layer,
        )  # fmt: skip
        pair: BlockPair | None = None
        whole = False
        if len(src_idx) <= _KEYED_TENSORS:  # (a pair holds its tensors' addresses)
            try:
                pair = BlockPair(src, dst, src_idx, dst_idx, req.dst_block_bytes)
            except LLMException:
                return plan_checked(req, res)  # (it says what does not fit, as it always did)
            # Our side: the source of a pull, the destination of a push.
            if pull:
                whole = _whole(pair.src_arr, src.count * pair.piece, entry.regions)
            else:
                whole = _whole(pair.dst_arr, pair.dst_count * pair.dst_unit, entry.regions)
        if len(entry.pairs) >= _KEPT_PAIRS:
            entry.pairs.clear()
        kept = entry.pairs[key] = (pair, src_idx if pair is not None else None, whole)
    pair, chosen, whole = kept
    if pair is None or chosen is None or not whole:
        return plan_checked(req, res)
    pieces = pair.tensors * len(src_b)
    if pieces * pair.piece > res.held:  # (before the blocks are looked at, as plan_selection)
        raise_param(
            f"the request would move {pieces * pair.piece} bytes, more than the {res.held} "
            "bytes of the caches it touches"
        )
    plan = pair.plan_arrays(src_b, dst_b)
    check_total(plan, res)
    return plan, res.slot if pull else req.local_slot, chosen, None
