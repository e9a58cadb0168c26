"""Local copies, checked and planned: ``copy_cache``, ``copy_blocks``, ``swap_blocks``.

Pure: each function checks its arguments against the local cache entries (plain data) and
returns the :class:`._planner.Plan` of descriptors that the device adapter then copies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from ._api_checks import check_desc_for_memory
from ._checks import check_int64, check_isinstance, check_uint32, check_uint64
from ._enums import Placement
from ._errors import raise_if_false
from ._planner import Layout, Plan, plan_block_copies, plan_slots
from ._registry import CacheEntry
from ._types import Cache

__all__ = ["plan_copy_blocks", "plan_copy_cache", "plan_swap_blocks"]


def mapping_arrays(name: str, mapping: Mapping[int, object]) -> tuple[np.ndarray, np.ndarray]:
    """Flatten ``{src: dst}`` or ``{src: [dst, ...]}`` into two index arrays (in dict order).

    Raises:
        TypeError: not a dict, or keys/values that are not ints (or lists of ints).
        ValueError: a negative index.
    """
    if not isinstance(mapping, dict):
        raise TypeError(f"{name} must be dict, got {type(mapping).__name__}")
    srcs: list[int] = []
    dsts: list[int] = []
    for k, v in mapping.items():
        if not isinstance(k, int):
            raise TypeError(f"{name} keys must be int, got {type(k).__name__}")
        targets = v if isinstance(v, list | tuple) else [v]
        for t in targets:
            if not isinstance(t, int):
                raise TypeError(f"{name} values must be int, got {type(t).__name__}")
            srcs.append(k)
            dsts.append(t)
    s = np.asarray(srcs, dtype=np.int64)
    d = np.asarray(dsts, dtype=np.int64)
    if (len(s) and s.min() < 0) or (len(d) and d.min() < 0):
        raise ValueError(f"{name} holds a negative block index")
    return s, d


def check_copy_cache(
    d: CacheEntry,
    s: CacheEntry,
    dst_batch_index: int,
    src_batch_index: int,
    offset: int,
    size: int,
    req_id: int | None,
) -> int:
    """The arguments of ``copy_cache``; returns the bytes per tensor to copy.

    Raises:
        TypeError / ValueError: wrong argument types.
        LLMException: LLM_PARAM_INVALID for blocks caches, differing tensor counts, or
            indices, offset or size outside the slots.
    """
    check_uint32("dst_batch_index", dst_batch_index)
    check_uint32("src_batch_index", src_batch_index)
    check_uint64("offset", offset)
    check_int64("size", size)
    check_uint64("req_id", req_id, optional=True)
    raise_if_false(not d.is_blocks and not s.is_blocks, "copy_cache needs contiguous caches")
    raise_if_false(
        d.num_tensors == s.num_tensors,
        f"tensor counts differ ({d.num_tensors} vs {s.num_tensors})",
    )
    raise_if_false(src_batch_index < s.count, f"src_batch_index >= batch size {s.count}")
    raise_if_false(dst_batch_index < d.count, f"dst_batch_index >= batch size {d.count}")
    raise_if_false(offset < s.stride and offset < d.stride, "offset is outside the slot")
    raise_if_false(size == -1 or size > 0, f"size must be -1 or > 0, got {size}")
    return min(s.stride, d.stride) - offset if size == -1 else size


def plan_copy_cache(
    d: CacheEntry,
    s: CacheEntry,
    dst_batch_index: int,
    src_batch_index: int,
    offset: int,
    size: int,
    req_id: int | None,
) -> Plan:
    """``copy_cache``: one batch slot of ``s`` into one of ``d``.

    Raises:
        as :func:`check_copy_cache`.
    """
    size = check_copy_cache(d, s, dst_batch_index, src_batch_index, offset, size, req_id)
    idx = np.arange(s.num_tensors, dtype=np.int64)
    return plan_slots(
        s.layout, d.layout, idx, idx, src_batch_index, dst_batch_index, size, offset, offset
    )


def plan_copy_blocks(entry: CacheEntry, copy_block_info: dict[int, list[int]]) -> Plan:
    """``copy_blocks``: inside one blocks cache, block ``src`` to every block of its list.

    Raises:
        TypeError / ValueError: wrong argument types.
        LLMException: LLM_PARAM_INVALID for a contiguous cache, indices out of range, a
            destination given twice, or a block that is both source and destination.
    """
    raise_if_false(entry.is_blocks, "copy_blocks needs a blocks cache")
    src_b, dst_b = mapping_arrays("copy_block_info", copy_block_info)
    raise_if_false(len(np.unique(dst_b)) == len(dst_b), "a destination block appears twice")
    raise_if_false(
        not np.isin(dst_b, src_b).any(), "a block cannot be both a source and a destination"
    )
    return plan_block_copies(entry.layout, entry.layout, src_b, dst_b)


def plan_swap_blocks(
    src_cache: Cache,
    dst_cache: Cache,
    src_to_dst: dict[int, int],
    entry_of: Callable[[Cache, str], CacheEntry],
) -> tuple[Plan, list[CacheEntry]]:
    """``swap_blocks`` between a HOST and a DEVICE blocks cache: the plan and the registered
    caches it touches (``entry_of`` finds those; a CPU cache has ``cache_id == -1``).

    Raises:
        TypeError / ValueError: wrong argument types.
        LLMException: LLM_PARAM_INVALID unless both are blocks caches of equal block size and
            tensor count, one HOST and one DEVICE, with indices in range; what ``entry_of``
            raises.
    """
    check_isinstance("src_cache", src_cache, Cache)
    check_isinstance("dst_cache", dst_cache, Cache)
    raise_if_false(
        src_cache.is_blocks_cache and dst_cache.is_blocks_cache,
        "swap_blocks needs blocks caches",
    )
    placements = {src_cache.cache_desc.placement, dst_cache.cache_desc.placement}
    raise_if_false(
        placements == {Placement.HOST, Placement.DEVICE},
        "swap_blocks needs one HOST and one DEVICE cache",
    )
    sides = []
    entries = []
    for name, cache in (("src_cache", src_cache), ("dst_cache", dst_cache)):
        if cache.cache_id == -1:
            desc = cache.cache_desc
            check_desc_for_memory(desc)
            sides.append(Layout.of(cache.tensor_addrs, desc.size, desc.shape[0], True))
        else:
            e = entry_of(cache, name)
            entries.append(e)
            sides.append(e.layout)
    raise_if_false(sides[0].stride == sides[1].stride, "block sizes differ")
    src_b, dst_b = mapping_arrays("src_to_dst", src_to_dst)
    return plan_block_copies(sides[0], sides[1], src_b, dst_b), entries
