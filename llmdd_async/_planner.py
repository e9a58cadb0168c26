"""The planner: cache layouts + selections -> coalesced copy descriptors (pure numpy, no I/O).

A plan is three equal-length uint64 arrays ``(src, dst, nbytes)`` of absolute addresses in the
two address spaces involved (local, or the peer's as published). Everything is vectorised:
a 4096-block x 80-tensor request is a handful of numpy operations, never a loop per block.
Validation follows reference §8.1, §8.2 and §9.1-§9.3 and raises
``LLMException(LLM_PARAM_INVALID)`` (or ``LLM_KV_CACHE_NOT_EXIST`` for a missing slot).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from ._enums import LLMStatusCode
from ._errors import LLMException, raise_if_false, raise_param

__all__ = [
    "MAX_DESCRIPTORS",
    "MAX_PIECES",
    "MAX_TENSORS",
    "BlockPair",
    "Layout",
    "Plan",
    "check_within",
    "coalesce",
    "plan_block_copies",
    "plan_blocks",
    "plan_slot_to_blocks",
    "plan_slots",
    "region_of",
    "tensor_windows",
]

_U64 = np.uint64


@dataclasses.dataclass(frozen=True)
class Layout:
    """Memory layout of one cache: ``len(addrs)`` tensors of ``tensor_bytes`` each.

    Dim 0 of every tensor has ``count`` entries (batch slots or blocks) of ``stride`` bytes.
    """

    addrs: np.ndarray
    tensor_bytes: int
    count: int
    is_blocks: bool

    @property
    def num_tensors(self) -> int:
        return len(self.addrs)

    @property
    def stride(self) -> int:
        return self.tensor_bytes // self.count

    @property
    def addr_list(self) -> list[int]:
        """The tensor addresses as Python ints (small plans are built from them), made once
        per layout (no ``cached_property``: 3.11's takes a lock; a peer's is new per request)."""
        cached: list[int] | None = self.__dict__.get("_addr_list")
        if cached is None:
            cached = self.__dict__["_addr_list"] = self.addrs.tolist()
        return cached

    @classmethod
    def of(
        cls, addrs: Sequence[int] | np.ndarray, tensor_bytes: int, count: int, is_blocks: bool
    ) -> Layout:
        return cls(np.asarray(addrs, dtype=_U64), int(tensor_bytes), int(count), bool(is_blocks))


def u64_sum(arr: np.ndarray) -> int:
    """The sum of a uint64 array, modulo 2**64 (numpy costs microseconds on a few items)."""
    if len(arr) <= 64:
        return int(sum(arr.tolist())) & _MASK
    return int(arr.sum(dtype=_U64))


@dataclasses.dataclass(frozen=True)
class Plan:
    """Copy descriptors: copy ``nbytes[i]`` bytes from ``src[i]`` to ``dst[i]``."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def total_bytes(self) -> int:
        """The bytes the plan moves (modulo 2**64, as numpy sums them)."""
        return u64_sum(self.nbytes)

    @classmethod
    def empty(cls) -> Plan:
        return cls(*[np.zeros(0, dtype=_U64)] * 3)


def coalesce(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, row: int | None = None) -> Plan:
    """Merge consecutive descriptors that are contiguous on both sides (order is kept).

    With ``row``, descriptors ``[k*row, (k+1)*row)`` belong to one tensor and never merge with
    another tensor's, even where the tensors touch in memory (pool tensors do): every range
    then stays inside one tensor, which is what both ends check.
    """
    src = np.asarray(src, dtype=_U64).ravel()
    dst = np.asarray(dst, dtype=_U64).ravel()
    nbytes = np.asarray(nbytes, dtype=_U64).ravel()
    if len(nbytes) <= 1:
        return Plan(src, dst, nbytes)
    ends_s = src[:-1] + nbytes[:-1]
    ends_d = dst[:-1] + nbytes[:-1]
    brk = (src[1:] != ends_s) | (dst[1:] != ends_d)
    if row is not None and row > 0:
        brk[row - 1 :: row] = True
    starts = np.flatnonzero(np.concatenate(([True], brk)))
    return Plan(src[starts], dst[starts], np.add.reduceat(nbytes, starts).astype(_U64))


#: ``_every_tensor(n)`` for the first 64 tensor counts seen (one per cache layout, a few per
#: process); bounded, as a peer names its own count
_EVERY: dict[int, np.ndarray] = {}


def _every_tensor(count: int) -> np.ndarray:
    """``arange(count)``, read-only: most requests select every tensor, on both sides."""
    every = _EVERY.get(count)
    if every is None:
        every = np.arange(count, dtype=np.int64)
        every.flags.writeable = False
        if count <= 4096 and len(_EVERY) < 64:
            _EVERY[count] = every
    return every


def tensor_windows(
    src_count: int,
    dst_count: int,
    src_layer_range: range | None,
    dst_layer_range: range | None,
    tensor_num_per_layer: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Tensor indices selected by layer ranges (reference §9.2).

    Layer ``l`` is tensors ``[l*N, (l+1)*N)`` with ``N = tensor_num_per_layer``. None means
    every tensor of that side.

    Raises:
        LLMException: LLM_PARAM_INVALID when N is 0 or does not divide a tensor count that a
            range refers to, a window leaves its cache, or the two sides' counts differ.
    """
    # (Checks on every request's path: messages are formatted only when they fail.)
    n = tensor_num_per_layer
    if n <= 0:
        raise_param(f"tensor_num_per_layer must be > 0, got {n}")
    if (src_layer_range is not None or dst_layer_range is not None) and (
        src_count % n or dst_count % n
    ):
        raise_param(
            f"tensor_num_per_layer {n} must divide the tensor counts ({src_count}, {dst_count})"
        )

    def window(r: range | None, count: int, side: str) -> np.ndarray:
        if r is None:
            return _every_tensor(count)
        if not (r.step == 1 and 0 <= r.start < r.stop):
            raise_param(f"bad {side}_layer_range {r}")
        if r.stop * n > count:
            raise_param(
                f"{side}_layer_range {r} exceeds the {count // n} layers of the {side} cache"
            )
        return np.arange(r.start * n, r.stop * n, dtype=np.int64)

    src_idx = window(src_layer_range, src_count, "src")
    dst_idx = window(dst_layer_range, dst_count, "dst")
    if len(src_idx) != len(dst_idx):
        raise_param(f"source selects {len(src_idx)} tensors but destination selects {len(dst_idx)}")
    return src_idx, dst_idx


def _outer(
    src_bases: np.ndarray,
    dst_bases: np.ndarray,
    src_offs: np.ndarray,
    dst_offs: np.ndarray,
    nbytes: np.ndarray,
) -> Plan:
    # Tensor-major, piece-minor order: consecutive pieces of one tensor end up adjacent, which is
    # what lets contiguous block runs merge (within a tensor, never across two).
    pieces = len(nbytes)
    raise_if_false(
        len(src_bases) * pieces <= MAX_PIECES,
        f"the request names {len(src_bases)} tensors x {pieces} pieces, more than "
        f"{MAX_PIECES} ranges",
    )
    if len(src_bases) * pieces <= _SMALL:
        return _outer_lists(
            src_bases.tolist(), dst_bases.tolist(), src_offs.tolist(), dst_offs.tolist(),
            nbytes.tolist(),
        )  # fmt: skip
    so, do, nb = src_offs.astype(_U64), dst_offs.astype(_U64), nbytes.astype(_U64)
    # A few tensors at a time, each group merged before the next is built: the temporaries
    # of a request stay near _CHUNK_PIECES ranges whatever its size (merging never crosses a
    # tensor, so the result is the same as in one piece).
    step = max(1, _CHUNK_PIECES // max(1, pieces))
    parts: list[Plan] = []
    kept = 0
    for t0 in range(0, len(src_bases), step):
        sb, db = src_bases[t0 : t0 + step], dst_bases[t0 : t0 + step]
        s = (sb[:, None] + so[None, :]).ravel()
        d = (db[:, None] + do[None, :]).ravel()
        # (one piece per tensor, as a block of a many-tensor cache: nothing merges)
        nbs = np.full(len(sb), nb[0], dtype=_U64) if pieces == 1 else np.tile(nb, len(sb))
        part = coalesce(s, d, nbs, row=pieces) if pieces > 1 else Plan(s, d, nbs)
        kept += len(part)
        raise_if_false(
            kept <= MAX_DESCRIPTORS,
            f"the request needs more than {MAX_DESCRIPTORS} copy descriptors",
        )
        parts.append(part)
    if len(parts) == 1:
        return parts[0]
    return Plan(
        np.concatenate([p.src for p in parts]),
        np.concatenate([p.dst for p in parts]),
        np.concatenate([p.nbytes for p in parts]),
    )


#: most tensors one request may name, on either side (its initiator's layout, or the raw
#: addresses it names here)
MAX_TENSORS = 1 << 16
#: most ranges (tensors x blocks, or slot pieces) one request may select before contiguous
#: ones merge
MAX_PIECES = 1 << 22
#: most copy descriptors one request may need once contiguous ranges are merged
MAX_DESCRIPTORS = 1 << 20
#: ranges planned at once (bounds a large plan's temporaries)
_CHUNK_PIECES = 1 << 18


#: below this many descriptors, plans are built with Python ints: numpy's fixed cost per call
#: (a few microseconds) is most of a small request's planning time
_SMALL = 64
_MASK = (1 << 64) - 1


def _outer_lists(
    src_bases: list[int],
    dst_bases: list[int],
    src_offs: list[int],
    dst_offs: list[int],
    nbytes: list[int],
) -> Plan:
    """:func:`_outer` followed by :func:`coalesce`, for a few descriptors on Python ints
    (same result, same uint64 wrap-around).

    Raises:
        ValueError: the two sides name different numbers of tensors or pieces.
    """
    k = len(nbytes)
    if len(src_bases) != len(dst_bases) or not len(src_offs) == len(dst_offs) == k:
        raise ValueError("the two sides of a plan differ in tensors or pieces")
    # A piece merges into the one before it when it continues it on both sides. A tensor's
    # base shifts both pieces alike, so where runs start is the same in every tensor (and
    # no run crosses two tensors): found once, on the offsets.
    starts = [
        i
        for i in range(k)
        if not i
        or (src_offs[i - 1] + nbytes[i - 1]) & _MASK != src_offs[i]
        or (dst_offs[i - 1] + nbytes[i - 1]) & _MASK != dst_offs[i]
    ]
    if len(starts) < k:  # some pieces merge: each run once, its bytes summed
        bounds = [*starts, k]
        nbytes = [sum(nbytes[a:b]) & _MASK for a, b in itertools.pairwise(bounds)]
        src_offs = [src_offs[i] for i in starts]
        dst_offs = [dst_offs[i] for i in starts]
    s = [(b + o) & _MASK for b in src_bases for o in src_offs]
    d = [(b + o) & _MASK for b in dst_bases for o in dst_offs]
    return Plan(
        np.array(s, dtype=_U64),
        np.array(d, dtype=_U64),
        np.array(nbytes * len(src_bases), dtype=_U64),
    )


def plan_slots(
    src: Layout,
    dst: Layout,
    src_tensors: np.ndarray,
    dst_tensors: np.ndarray,
    src_slot: int,
    dst_slot: int,
    size: int = -1,
    src_offset: int = 0,
    dst_offset: int = 0,
) -> Plan:
    """Contiguous slot -> contiguous slot, ``size`` bytes per tensor.

    ``size == -1`` means the rest of the destination slot after ``dst_offset``.

    Raises:
        LLMException: LLM_KV_CACHE_NOT_EXIST for a source slot outside the source cache;
            LLM_PARAM_INVALID for a bad destination slot, size or offset.
    """
    raise_if_false(
        0 <= src_slot < src.count,
        f"source batch index {src_slot} is outside its {src.count} slots",
        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
    )
    raise_if_false(0 <= dst_slot < dst.count, f"batch_index {dst_slot} >= batch size {dst.count}")
    raise_if_false(0 <= src_offset < src.stride, f"src offset {src_offset} >= slot {src.stride}")
    raise_if_false(0 <= dst_offset < dst.stride, f"dst offset {dst_offset} >= slot {dst.stride}")
    if size == -1:
        size = dst.stride - dst_offset
    raise_if_false(size > 0, f"size must be -1 or > 0, got {size}")
    raise_if_false(
        size <= src.stride - src_offset and size <= dst.stride - dst_offset,
        f"size {size} exceeds the slot (source {src.stride - src_offset} bytes, "
        f"destination {dst.stride - dst_offset} bytes after the offsets)",
    )
    s0 = np.array([src_slot * src.stride + src_offset], dtype=_U64)
    d0 = np.array([dst_slot * dst.stride + dst_offset], dtype=_U64)
    return _outer(
        src.addrs[src_tensors], dst.addrs[dst_tensors], s0, d0, np.array([size], dtype=_U64)
    )


def _check_blocks(blocks: np.ndarray | list[int], count: int, side: str) -> None:
    code = LLMStatusCode.LLM_PARAM_INVALID
    if not len(blocks):
        return
    # numpy's reductions cost microseconds each on a handful of indices; Python's do not.
    if isinstance(blocks, list):
        lo, hi = min(blocks), max(blocks)
    elif len(blocks) <= 64:
        values = blocks.tolist()
        lo, hi = min(values), max(values)
    else:
        lo, hi = int(blocks.min()), int(blocks.max())
    if lo < 0:
        raise LLMException(f"{side} block index {lo} < 0", status_code=code)
    if hi >= count:
        raise LLMException(f"{side} block index {hi} >= its {count} blocks", status_code=code)


class BlockPair:
    """Two caches and their selected tensors as :func:`plan_blocks` pairs them, before the
    block indices: checked once, kept for the requests that pair them again (a prepared
    transfer, ``_net.prepared``). It holds ints and arrays of its own, never a layout (a peer's
    is a view of its request). :meth:`plan_arrays` is plan_blocks for the block indices.

    Raises:
        LLMException: LLM_PARAM_INVALID for block sizes that do not fit (as plan_blocks).
    """

    __slots__ = (
        "dst_arr", "dst_bases", "dst_count", "dst_unit", "piece", "src_arr", "src_bases",
        "src_count", "tensors",
    )  # fmt: skip

    def __init__(
        self,
        src: Layout,
        dst: Layout,
        src_tensors: np.ndarray,
        dst_tensors: np.ndarray,
        dst_block_bytes: int | None = None,
    ) -> None:
        if not src.is_blocks:
            raise_param("source must be a blocks cache")
        piece = src.stride
        if dst_block_bytes is None:
            if not dst.is_blocks:
                raise_param("destination must be a blocks cache")
            if dst.stride != piece:
                raise_param(
                    f"block sizes differ (source {piece} bytes, destination {dst.stride} bytes)"
                )
            dst_unit = dst.stride
        else:
            dst_unit = dst_block_bytes
            if piece > dst_unit:
                raise_param(
                    f"source block of {piece} bytes does not fit a destination block of "
                    f"{dst_unit} bytes"
                )
        self.piece, self.dst_unit, self.dst_count = piece, dst_unit, dst.tensor_bytes // dst_unit
        self.src_count = src.count
        #: the selected tensors' addresses on each side (copies), and as Python ints for a
        #: few tensors (:meth:`plan`'s: an int costs 40 bytes, and more are planned in numpy)
        self.src_arr: np.ndarray = src.addrs[src_tensors].astype(_U64, copy=False)
        self.dst_arr: np.ndarray = dst.addrs[dst_tensors].astype(_U64, copy=False)
        self.tensors = n = len(self.src_arr)
        self.src_bases: list[int] = self.src_arr.tolist() if n <= _SMALL else []
        self.dst_bases: list[int] = self.dst_arr.tolist() if n <= _SMALL else []

    def plan(self, src_blocks: list[int], dst_blocks: list[int]) -> Plan:
        """Block ``src_blocks[i]`` of every selected tensor to ``dst_blocks[i]`` in Python
        ints: a few descriptors (tensors x blocks at most 64), equal non-empty lists.

        Raises:
            LLMException: LLM_PARAM_INVALID for an index out of range.
        """
        piece, unit, sa, da = self.piece, self.dst_unit, self.src_bases, self.dst_bases
        # (Python ints: an index of 2**63 or more, from the wire, is out of range, not negative)
        _check_blocks(src_blocks, self.src_count, "src")
        _check_blocks(dst_blocks, self.dst_count, "dst")
        if len(src_blocks) == 1:  # one block (most small requests): a range per tensor
            s = [(a + src_blocks[0] * piece) & _MASK for a in sa]
            d = [(a + dst_blocks[0] * unit) & _MASK for a in da]
            return Plan(np.array(s, _U64), np.array(d, _U64), np.array([piece] * len(s), _U64))
        return _outer_lists(
            sa, da, [b * piece for b in src_blocks], [b * unit for b in dst_blocks],
            [piece] * len(src_blocks),
        )  # fmt: skip

    def plan_arrays(self, src_blocks: np.ndarray, dst_blocks: np.ndarray) -> Plan:
        """:meth:`plan` for any number of blocks (equal non-empty integer arrays), in numpy
        past a few descriptors. Raises as :meth:`plan`, and LLMException (LLM_PARAM_INVALID)
        for more than ``MAX_PIECES`` ranges or ``MAX_DESCRIPTORS`` descriptors."""
        pieces = self.tensors * len(src_blocks)
        if pieces <= _SMALL:
            return self.plan(src_blocks.tolist(), dst_blocks.tolist())
        if pieces > MAX_PIECES:  # (before the indices, as plan_selection)
            raise_param(f"the request selects {pieces} ranges, more than {MAX_PIECES}")
        # (an index of 2**63 or more, from the wire, turns negative here: refused as such)
        sb, db = src_blocks.astype(np.int64), dst_blocks.astype(np.int64)
        _check_blocks(sb, self.src_count, "src")
        _check_blocks(db, self.dst_count, "dst")
        so, do = sb.astype(_U64) * _U64(self.piece), db.astype(_U64) * _U64(self.dst_unit)
        return _outer(self.src_arr, self.dst_arr, so, do, np.full(len(sb), self.piece, _U64))


def plan_blocks(
    src: Layout,
    dst: Layout,
    src_tensors: np.ndarray,
    dst_tensors: np.ndarray,
    src_blocks: np.ndarray,
    dst_blocks: np.ndarray,
    dst_block_bytes: int | None = None,
) -> Plan:
    """Blocks -> blocks: block ``src_blocks[i]`` of every selected tensor to ``dst_blocks[i]``.
    Destination blocks are ``dst_block_bytes`` apart (default: the destination's own block
    size, which must then equal the source's); each copy is one source block.

    Raises:
        LLMException: LLM_PARAM_INVALID for unequal or empty lists, indices out of range, or
            block sizes that do not fit.
    """
    if not len(dst_blocks):
        raise_param("dst_blocks must not be empty")
    if len(src_blocks) != len(dst_blocks):
        raise_param(
            f"src_blocks ({len(src_blocks)}) and dst_blocks ({len(dst_blocks)}) differ in length"
        )
    pair = BlockPair(src, dst, src_tensors, dst_tensors, dst_block_bytes)
    return pair.plan_arrays(src_blocks, dst_blocks)


def plan_slot_to_blocks(
    src: Layout,
    dst: Layout,
    src_tensors: np.ndarray,
    dst_tensors: np.ndarray,
    src_slot: int,
    dst_blocks: np.ndarray,
    dst_block_bytes: int | None = None,
) -> Plan:
    """Contiguous slot -> blocks: piece ``i`` of the slot (block-sized) lands in ``dst_blocks[i]``.

    The slot must need exactly ``len(dst_blocks)`` pieces; the last piece may be partial.
    Blocks are ``dst_block_bytes`` apart (default: the destination's block size).

    Raises:
        LLMException: LLM_KV_CACHE_NOT_EXIST for a missing source slot; LLM_PARAM_INVALID for
            a destination that is not blocks, a wrong number of blocks or indices out of range.
    """
    raise_if_false(
        dst_block_bytes is not None or dst.is_blocks, "destination must be a blocks cache"
    )
    raise_if_false(len(dst_blocks) > 0, "dst_blocks must not be empty")
    raise_if_false(
        0 <= src_slot < src.count,
        f"source batch index {src_slot} is outside its {src.count} slots",
        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
    )
    bb = dst.stride if dst_block_bytes is None else dst_block_bytes
    raise_if_false(bb > 0, "block size must be > 0")
    pieces = -(-src.stride // bb)
    raise_if_false(
        len(dst_blocks) == pieces,
        f"a source slot of {src.stride} bytes fills {pieces} blocks of {bb} bytes, "
        f"but {len(dst_blocks)} dst_blocks were given",
    )
    _check_blocks(dst_blocks, dst.tensor_bytes // bb, "dst")
    k = np.arange(pieces, dtype=_U64)
    lengths = np.minimum(_U64(bb), _U64(src.stride) - k * _U64(bb))
    return _outer(
        src.addrs[src_tensors],
        dst.addrs[dst_tensors],
        _U64(src_slot * src.stride) + k * _U64(bb),
        dst_blocks.astype(_U64) * _U64(bb),
        lengths,
    )


def plan_block_copies(
    src: Layout, dst: Layout, src_blocks: np.ndarray, dst_blocks: np.ndarray
) -> Plan:
    """Every tensor's block ``src_blocks[i]`` -> block ``dst_blocks[i]`` (same tensor index).

    Raises:
        LLMException: LLM_PARAM_INVALID for differing tensor counts or block sizes, or an
            index out of range.
    """
    raise_if_false(
        src.num_tensors == dst.num_tensors,
        f"tensor counts differ ({src.num_tensors} vs {dst.num_tensors})",
    )
    idx = np.arange(src.num_tensors, dtype=np.int64)
    if len(src_blocks) == 0:
        return Plan.empty()
    return plan_blocks(src, dst, idx, idx, src_blocks, dst_blocks)


def check_within(
    addrs: np.ndarray, nbytes: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> bool:
    """True if every ``[addrs[i], addrs[i]+nbytes[i])`` lies inside one ``[starts[j], ends[j])``.

    ``starts`` must be sorted and the regions must not overlap.
    """
    if len(addrs) == 0:
        return True
    if len(starts) == 0:
        return False
    if len(addrs) <= _SMALL and len(starts) <= 4 * _SMALL:
        # Python ints for small inputs: numpy's per-call cost dominates there.
        lo, hi = starts.tolist(), ends.tolist()
        for a_, n_ in zip(np.asarray(addrs).tolist(), np.asarray(nbytes).tolist(), strict=True):
            j_ = bisect.bisect_right(lo, a_) - 1
            if j_ < 0 or a_ + n_ > hi[j_] or a_ + n_ >= 1 << 64:
                return False
        return True
    a = np.asarray(addrs, dtype=_U64)
    n = np.asarray(nbytes, dtype=_U64)
    return region_of(a, n, starts, ends) is not None


def region_of(
    addrs: np.ndarray, nbytes: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> np.ndarray | None:
    """:func:`check_within` over uint64 arrays (at least one range), vectorised: the index of
    the region holding each range, or None unless every range lies inside one."""
    j = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
    if int(j.min()) < 0:
        return None
    end = addrs + nbytes
    if not ((end >= addrs) & (end <= ends[j])).all():
        return None
    return j


def split_plan(plan: Plan, parts: int) -> list[Plan]:
    """Cut a plan into at most ``parts`` pieces of about equal bytes, in order.

    A descriptor that straddles a cut is divided, so the pieces can run on separate threads.
    """
    total = plan.total_bytes
    if parts <= 1 or len(plan) == 0 or total == 0:
        return [plan]
    ends = np.cumsum(plan.nbytes, dtype=_U64)
    starts = ends - plan.nbytes
    out = []
    lo = 0
    for k in range(1, parts + 1):
        hi = total * k // parts
        if hi <= lo:
            continue
        # descriptors overlapping [lo, hi)
        i0 = int(np.searchsorted(ends, _U64(lo), side="right"))
        i1 = int(np.searchsorted(starts, _U64(hi), side="left"))
        sel = slice(i0, i1)
        s_start, s_end = starts[sel], ends[sel]
        cut_lo = np.maximum(s_start, _U64(lo))
        cut_hi = np.minimum(s_end, _U64(hi))
        shift = cut_lo - s_start
        out.append(Plan(plan.src[sel] + shift, plan.dst[sel] + shift, cut_hi - cut_lo))
        lo = hi
    return out
