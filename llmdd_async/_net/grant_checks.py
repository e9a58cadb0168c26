"""The initiator's checks of a peer's GRANT against its own request (pure: no I/O, no anyio):
every range the grant names in our cache lies in what the request selected
(:func:`grant_within_selection`) and the grant moves as many bytes as the selection holds
(:func:`grant_covers_selection`), both by :func:`grant_fault`; a layer-wise push's grant is
in layer order (:func:`layer_spans`). A few ranges (most requests) are checked in Python
ints, many with numpy: both give the same answer (offsets compared in uint64: an address
2**63 past a tensor does not wrap into it).
"""

from __future__ import annotations

import bisect

import numpy as np

from .._errors import LLMException
from .._messages import Grant, Op, Result, Shape
from .._planner import region_of, u64_sum
from .._registry import CacheEntry
from .grants import TransferRequest, our_selection

__all__ = [
    "INLINE_BLOCKS", "grant_covers_selection", "grant_fault", "grant_within_selection",
    "layer_spans", "raise_unless_ok", "refusal_of",
]  # fmt: skip

_U64 = np.uint64

#: a request that names more blocks of ours has its GRANT checked in a worker thread (the
#: checks sort them: milliseconds a hundred thousand), whatever the grant's size
INLINE_BLOCKS = 1 << 16


def checks_in_worker(spec: TransferRequest) -> bool:
    """Whether the checks of a GRANT for ``spec`` cost too much for the event loop."""
    blocks = our_selection(spec)[1]
    return blocks is not None and len(blocks) > INLINE_BLOCKS


def _distinct(blocks: np.ndarray) -> np.ndarray:
    """The distinct values of ``blocks``, sorted: a sort, which lets go of the GIL (numpy's
    ``unique`` keeps it, and costs as much again)."""
    s = np.sort(np.asarray(blocks, dtype=np.int64))
    return s[np.concatenate(([True], s[1:] != s[:-1]))] if len(s) else s


def grant_fault(spec: TransferRequest, local: np.ndarray, nbytes: np.ndarray) -> str | None:
    """Why a successful GRANT of ``(local, nbytes)`` does not fit the request, or None: a range
    outside what it selected of our cache, or other than the bytes the selection holds."""
    if not grant_within_selection(spec, local, nbytes):
        return "GRANT points outside what this request selected of our cache"
    return grant_covers_selection(spec, local, nbytes)


def grant_within_selection(spec: TransferRequest, local: np.ndarray, nbytes: np.ndarray) -> bool:
    """True if every range a grant names in our own cache lies in what the request selected:
    in a tensor of its layer window (every tensor without one), the blocks it named, or of
    its batch slot the bytes it named (from its offset). A grant naming anything else of ours
    is refused. Vectorised over descriptors: O(descriptors x log(runs)).
    """
    e = spec.local
    pull = spec.op == Op.PULL
    window, blocks = our_selection(spec)
    tensors = window if len(window) < e.num_tensors else None  # (None: every tensor)
    local_blocks = spec.shape == Shape.BLOCKS or (spec.shape == Shape.SLOT_TO_BLOCKS and pull)
    # What of each tensor is selected: runs of units (firsts, lasts: Python ints for a few,
    # arrays for many), or the bytes [lo, hi) of a tensor
    runs: tuple[list[int], list[int]] | tuple[np.ndarray, np.ndarray] | None = None
    span: tuple[int, int] | None = None
    unit = spec.dst_block_bytes if (pull and spec.dst_block_bytes) else e.stride
    if not local_blocks:  # a slot of ours: the bytes the request names of it
        start = spec.local_slot * e.stride
        lo, size = (spec.dst_offset, spec.size) if pull else (spec.src_offset, spec.size)
        if spec.shape == Shape.SLOT_TO_BLOCKS:  # (a push of our whole slot)
            lo, size = 0, -1
        span = (start + lo, start + (e.stride if size < 0 else min(lo + size, e.stride)))
    elif blocks is not None:
        if len(blocks) <= 64:  # (a few: Python ints, numpy costs microseconds a call)
            selected = set(blocks.tolist())
            if len(local) <= 32:
                return _within_small(e, tensors, local, nbytes, unit, selected)
            runs = _runs(sorted(selected))
        else:  # (a range is checked against runs, never block by block)
            units = _distinct(blocks)
            # Runs of consecutive selected units, inclusive: descriptors may span several.
            brk = np.flatnonzero(units[1:] - units[:-1] != 1)
            runs = (units[np.concatenate(([0], brk + 1))], units[np.concatenate((brk, [-1]))])
        if not len(runs[0]):
            return False
    if len(local) <= 32 and runs is None:
        return _within_small(e, tensors, local, nbytes, unit, None, span)
    tstarts, tends = e.regions
    a = np.asarray(local, dtype=_U64)
    n = np.asarray(nbytes, dtype=_U64)
    t = region_of(a, n, tstarts, tends)  # the tensor of each range (all inside one)
    if t is None:
        return False
    if tensors is not None:
        ti = e.tensor_order[t]
        if ((ti < tensors.start) | (ti >= tensors.stop)).any():
            return False
    off = (a - tstarts[t]).astype(np.int64)
    last = off + n.astype(np.int64) - 1  # inside tensor t: checked above
    if span is not None:
        return bool(((off >= span[0]) & (last < span[1])).all())
    if runs is None:  # every block was asked for
        return True
    b0, b1 = off // unit, last // unit
    run_lo, run_hi = runs
    if len(run_lo) == 1:  # (one run of blocks, or one block: most requests)
        return bool(((b0 >= run_lo[0]) & (b1 <= run_hi[0])).all())
    lo_, hi_ = np.asarray(run_lo, dtype=np.int64), np.asarray(run_hi, dtype=np.int64)
    run = np.searchsorted(lo_, b0, side="right") - 1
    return bool(((run >= 0) & (b1 <= hi_[np.maximum(run, 0)])).all())


def grant_covers_selection(
    spec: TransferRequest, local: np.ndarray, nbytes: np.ndarray
) -> str | None:
    """None if a grant of ``(local, nbytes)`` moves the bytes the request selected of our
    cache, else why not. Ranges inside the selection (:func:`grant_within_selection`) that add
    up to less, or name a range twice, would end the request as a success with part of it
    never moved. Exact where our side alone fixes the size; else bounded (a peer's block
    smaller than ours, the last piece of its slot, a push into the rest of its slot). Ranges
    overlap only where the request names a block of ours more than once.
    """
    pull, e = spec.op == Op.PULL, spec.local
    selected, blocks = our_selection(spec)
    tensors = len(selected)
    shape, dbb = spec.shape, spec.dst_block_bytes if pull else None
    local_blocks = shape is Shape.BLOCKS or (shape is Shape.SLOT_TO_BLOCKS and pull)
    if local_blocks and blocks is None:
        return None  # every block was asked for: grant_within_selection bounds it
    n = 0 if blocks is None else len(blocks)  # (0: a slot of ours, no block named twice)
    if shape is Shape.BLOCKS:
        # (into blocks of dst_block_bytes, the peer's blocks may be smaller: up to that each)
        lo, hi = n, n * (dbb or e.stride)
        lo = hi if dbb is None else lo
    elif shape is Shape.SLOT_TO_BLOCKS and pull:
        unit = dbb or e.stride  # the peer's slot fills all our blocks, the last maybe in part
        lo, hi = (n - 1) * unit + 1, n * unit
    elif shape is Shape.SLOT_TO_BLOCKS:
        lo = hi = e.stride  # (a push of our whole slot)
    elif spec.size >= 0:
        lo = hi = spec.size
    elif pull:
        lo = hi = e.stride - spec.dst_offset
    else:  # a push of the rest of the peer's slot: at most the rest of ours
        lo, hi = 1, e.stride - spec.src_offset
    few = len(local) <= 8  # (Python ints: numpy costs microseconds a call)
    starts, sizes = (local.tolist(), nbytes.tolist()) if few else ([], [])
    total = sum(sizes) if few else u64_sum(nbytes)
    if not tensors * lo <= total <= tensors * hi:
        want = f"{tensors * lo}" if lo == hi else f"{tensors * lo} to {tensors * hi}"
        return f"GRANT moves {total} bytes, but the request selected {want} of our cache"
    if len(local) < 2:
        return None
    distinct = n
    if local_blocks and blocks is not None and n > 1:
        distinct = len(set(blocks.tolist())) if n <= 64 else len(_distinct(blocks))
    if distinct == n:
        disjoint = _disjoint_few(starts, sizes) if few else _disjoint(local, nbytes)
        return None if disjoint else _TWICE
    # A block named twice is written (or read) twice: the ranges cover each block once.
    if shape is not Shape.BLOCKS or dbb is not None:
        return None  # (each piece's size is the peer's: the total bounds it)
    return None if _union_bytes(local, nbytes) == tensors * distinct * e.stride else _TWICE


_TWICE = "GRANT names ranges of our cache more than once"


def _disjoint_few(starts: list[int], sizes: list[int]) -> bool:
    """:func:`_disjoint` of a few ranges, in Python ints."""
    if len(starts) == 2:
        return starts[0] + sizes[0] <= starts[1] or starts[1] + sizes[1] <= starts[0]
    end = 0
    for i in sorted(range(len(starts)), key=starts.__getitem__):
        if starts[i] < end:
            return False
        end = starts[i] + sizes[i]
    return True


def _disjoint(local: np.ndarray, nbytes: np.ndarray) -> bool:
    """True if no two of the ranges ``[local, local + nbytes)`` overlap (ranges inside our
    tensors: no end wraps)."""
    if not nbytes.all():  # (an empty range overlaps nothing, wherever a sort puts it)
        local, nbytes = local[nbytes > 0], nbytes[nbytes > 0]
    by_start = np.argsort(local)
    a, n = local[by_start], nbytes[by_start]
    return not bool((a[1:] < a[:-1] + n[:-1]).any())


def _union_bytes(local: np.ndarray, nbytes: np.ndarray) -> int:
    """The bytes the ranges ``[local, local + nbytes)`` cover, each counted once."""
    order = np.argsort(local, kind="stable")
    a = local[order].astype(np.int64)
    ends = a + nbytes[order].astype(np.int64)
    # Each range adds what lies past the furthest end before it.
    reach = np.concatenate(([0], np.maximum.accumulate(ends)[:-1]))
    return int(np.maximum(ends - np.maximum(a, reach), 0).sum())


def _runs(units: list[int]) -> tuple[list[int], list[int]]:
    """The runs of consecutive ints in sorted ``units``: their firsts and lasts."""
    lo, hi = units[:1], units[:1]
    for u in units[1:]:
        if u == hi[-1] + 1:
            hi[-1] = u
        else:
            lo.append(u)
            hi.append(u)
    return lo, hi


def layer_spans(spec: TransferRequest, local: np.ndarray, nbytes: np.ndarray) -> list[int] | None:
    """Where each layer of a layer-wise push starts in its grant: ``spans[j]`` is the index of
    the first range of layer ``spec.src_range[j]`` (``spans[-1] == len(nbytes)``), or None
    unless the grant is in layer order, every layer an equal share of its bytes, each range
    inside one tensor of its layer (as every plan is: tensor-major). The push then sends
    each layer's ranges as soon as that layer is ready, and only then: a grant out of layer
    order would have it send a layer before it is computed.
    """
    layers, tnpl = spec.src_range, spec.tensor_num_per_layer
    e = spec.local
    if layers is None or not len(layers) or tnpl <= 0 or len(local) != len(nbytes):
        return None
    if len(local) <= 32:
        return _layer_spans_small(e, layers, tnpl, local.tolist(), nbytes.tolist())
    return _layer_spans_numpy(e, layers, tnpl, local, nbytes)


def _layer_spans_small(
    e: CacheEntry, layers: range, tnpl: int, local: list[int], nbytes: list[int]
) -> list[int] | None:
    """:func:`layer_spans` for a few ranges, in plain Python ints."""
    total = sum(nbytes)
    per, rest = divmod(total, len(layers))
    if rest or per <= 0 or min(nbytes) <= 0:
        return None
    starts, tensors, size = e.sorted_addrs, e.sorted_tensors, e.tensor_bytes
    begins = []
    begin = 0
    for a, n in zip(local, nbytes, strict=True):
        t = bisect.bisect_right(starts, a) - 1
        if t < 0 or a - starts[t] + n > size:
            return None
        j = begin // per
        if (begin + n - 1) // per != j or tensors[t] // tnpl != layers.start + j:
            return None
        begins.append(begin)
        begin += n
    return [bisect.bisect_left(begins, m * per) for m in range(len(layers) + 1)]


def _layer_spans_numpy(
    e: CacheEntry, layers: range, tnpl: int, local: np.ndarray, nbytes: np.ndarray
) -> list[int] | None:
    n = np.asarray(nbytes, dtype=np.int64)
    # (a range longer than a tensor is refused before the sum, which could then wrap)
    if ((n <= 0) | (n > e.tensor_bytes)).any():
        return None
    total = int(n.sum())
    per, rest = divmod(total, len(layers))
    if rest or per <= 0:
        return None
    a = np.asarray(local, dtype=_U64)
    order, starts = e.tensor_order, e.regions[0]
    t = np.searchsorted(starts, a, side="right").astype(np.int64) - 1
    if int(t.min()) < 0:
        return None
    # In uint64: an address far past its tensor (2**63 and more) must not wrap to a small
    # offset; where off >= size, size - off wraps, but the first test already refuses.
    off, size = a - starts[t], _U64(e.tensor_bytes)
    if ((off >= size) | (n.astype(_U64) > size - off)).any():
        return None
    layer = order[t] // tnpl  # the layer of each range's tensor
    begin = np.cumsum(n) - n  # where each range starts in the stream
    j = begin // per
    if (((begin + n - 1) // per != j) | (layer != layers.start + j)).any():
        return None
    spans: list[int] = np.searchsorted(begin, np.arange(len(layers) + 1) * per).tolist()
    return spans


def _within_small(
    e: CacheEntry,
    tensors: range | None,
    local: np.ndarray,
    nbytes: np.ndarray,
    unit: int,
    selected: set[int] | None,
    span: tuple[int, int] | None = None,
) -> bool:
    """:func:`grant_within_selection` for a few descriptors, in plain Python ints: each range
    inside one tensor of ``tensors`` (None: any), and there inside ``span`` (bytes of the
    tensor) or the ``selected`` units (None: any)."""
    if selected is not None and not selected:
        return False
    starts, order = e.sorted_addrs, e.sorted_tensors
    size = e.tensor_bytes
    for a, n in zip(local.tolist(), nbytes.tolist(), strict=True):
        t = bisect.bisect_right(starts, a) - 1
        if t < 0 or n <= 0 or (tensors is not None and order[t] not in tensors):
            return False
        off = a - starts[t]
        last = off + n - 1
        if last >= size:
            return False
        if span is not None:
            if off < span[0] or last >= span[1]:
                return False
            continue
        if selected is None:
            continue
        b0, b1 = off // unit, last // unit
        if b0 == b1:  # most ranges lie in one block
            if b0 not in selected:
                return False
        elif b1 - b0 > len(selected) or any(b not in selected for b in range(b0, b1 + 1)):
            return False
    return True


def refusal_of(answer: Grant | Result, default: str) -> LLMException | None:
    """The failure the peer's GRANT or RESULT reports (its status code), None on success."""
    if answer.ok:
        return None
    text = default if answer.message is None else answer.message
    return LLMException(text, status_code=answer.status)


def raise_unless_ok(answer: Grant | Result, default: str) -> None:
    """Raises LLMException with the peer's status code unless ``answer`` reports success."""
    refusal = refusal_of(answer, default)
    if refusal is not None:
        raise refusal
