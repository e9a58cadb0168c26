"""The memory a peer's table publishes as regions: sorted, disjoint ``(starts, ends)`` of
the tensors of its remote-accessible caches, what a one-sided range check looks in."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .control import CacheInfo

__all__ = ["regions_of", "regions_of_table"]


def _no_regions() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64)


def _disjoint(starts: list[int], ends: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The regions ``[starts[i], ends[i])`` sorted, with those that overlap merged into one.

    A peer's table may list caches over one another (a hostile one, to make a range check
    answer by the wrong region): checks of a range against regions (``check_within``) look in
    one region only, so they need them disjoint. What they then allow is the same memory:
    the union of what the peer published.
    """
    if not starts:
        return _no_regions()
    out_s: list[int] = []
    out_e: list[int] = []
    for s, e in sorted(zip(starts, ends, strict=True)):
        if out_e and s < out_e[-1]:
            out_e[-1] = max(out_e[-1], e)
        else:
            out_s.append(s)
            out_e.append(e)
    return np.array(out_s, dtype=np.uint64), np.array(out_e, dtype=np.uint64)


def regions_of_table(table: Any) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, disjoint ``(starts, ends)`` of the tensors of the remote-accessible caches a
    peer's table (or proof message) lists (overlapping ones merged); malformed entries count
    as nothing."""
    starts: list[int] = []
    ends: list[int] = []
    caches = table.get("caches") if isinstance(table, dict) else None
    for c in caches if isinstance(caches, list) else []:
        if not isinstance(c, dict) or c.get("remote_accessible") is not True:
            continue
        size, addrs = c.get("tensor_bytes"), c.get("addrs")
        if not isinstance(size, int) or not isinstance(addrs, list):
            continue
        for a in addrs:
            if isinstance(a, int) and a > 0 and size > 0 and a + size < 2**64:
                starts.append(a)
                ends.append(a + size)
    return _disjoint(starts, ends)


def regions_of(caches: Iterable[CacheInfo]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, disjoint ``(starts, ends)`` of the tensors of the remote-accessible ``caches``
    (overlapping ones merged; a zero address or size, or a tensor past 2**64, counts as
    nothing)."""
    starts: list[int] = []
    ends: list[int] = []
    for c in caches:
        if not c.remote_accessible or c.tensor_bytes <= 0:
            continue
        for a in c.addrs:
            if a > 0 and a + c.tensor_bytes < 2**64:
                starts.append(a)
                ends.append(a + c.tensor_bytes)
    return _disjoint(starts, ends)
