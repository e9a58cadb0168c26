"""The memory a peer's table publishes as regions: sorted, disjoint ``(starts, ends)`` of
the tensors of its remote-accessible caches, what a one-sided range check looks in; and
:class:`TableSnapshot`, a table with everything a link derives from it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .control import CacheInfo, Table

__all__ = ["TableSnapshot", "first_entries", "no_regions", "regions_of"]


def no_regions() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64)


def _disjoint(starts: list[int], ends: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The regions ``[starts[i], ends[i])`` (each end past its start) sorted, with those that
    overlap merged into one.

    A peer's table may list caches over one another (a hostile one, to make a range check
    answer by the wrong region): checks of a range against regions (``check_within``) look in
    one region only, so they need them disjoint. What they then allow is the same memory:
    the union of what the peer published. Vectorised: a sort of 100k tuples in Python held
    the interpreter over 100 ms in one call, whichever thread made it.
    """
    if not starts:
        return no_regions()
    s = np.array(starts, dtype=np.uint64)
    order = np.argsort(s, kind="stable")
    s = s[order]
    e = np.array(ends, dtype=np.uint64)[order]
    # A region starts where a start lies at or past every end before it.
    first = np.ones(len(s), dtype=bool)
    np.greater_equal(s[1:], np.maximum.accumulate(e)[:-1], out=first[1:])
    at = np.flatnonzero(first)
    return s[at], np.maximum.reduceat(e, at)


def first_entries(caches: Iterable[CacheInfo]) -> dict[int, CacheInfo]:
    """The first entry of each cache id among ``caches`` (as a scan finds it): the one entry a
    table or proof is read by, where a peer lists an id twice."""
    first: dict[int, CacheInfo] = {}
    for c in caches:
        first.setdefault(c.cache_id, c)
    return first


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


class TableSnapshot(dict[str, Any]):
    """A peer's TABLE fields as a link keeps them, with what is derived from them made once,
    here: the typed :class:`Table` (keys and ids resolve against it at every transfer of the
    link), its caches by id and the regions it publishes. The caches are kept typed only, not
    as the peer's JSON: a table may list thousands, and every object a link keeps costs each
    pass of the garbage collector, on the loop. A peer's table may hold ~100k values: a link
    builds this in a worker thread, never on its loop.

    Never raises: malformed entries count as nothing, as in :meth:`Table.of`.
    """

    __slots__ = ("by_id", "regions", "typed")

    def __init__(self, fields: Mapping[str, Any]) -> None:
        super().__init__({k: v for k, v in fields.items() if k != "caches"})
        self.typed = Table.of(fields)
        #: the first entry of each cache id (as a scan of ``typed.caches`` finds it): what
        #: resolves a key or an id, what a one-sided pull plans with, and what the regions
        #: are made of (a peer that lists an id twice is read by one entry of it everywhere)
        self.by_id: dict[int, CacheInfo] = first_entries(self.typed.caches)
        self.regions = regions_of(self.by_id.values())
