"""The local cache registry: cache ids, key bindings, references and deferred frees.

Pure bookkeeping over numbers (no I/O, no anyio). Reference §8.1, §8.2, §9.1, §9.4.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ._enums import LLMStatusCode, Placement
from ._errors import LLMException, raise_if_false
from ._planner import Layout

__all__ = ["CacheEntry", "Registry", "SlotKey"]

#: Identity of a bound contiguous-cache key: ("req" | "prefix", id, model_id).
SlotKey = tuple[str, int, int]


@dataclasses.dataclass(eq=False)
class CacheEntry:
    """One registered or allocated cache, as the engine sees it."""

    cache_id: int
    num_tensors: int
    tensor_bytes: int
    count: int
    is_blocks: bool
    placement: Placement
    dtype: int
    shape: tuple[int, ...]
    addrs: np.ndarray
    remote_accessible: bool
    allocated: bool
    release: Callable[[], None] | None = None
    keepalive: Any = None
    #: batch slot -> bound key, for contiguous allocated/registered caches.
    slot_keys: dict[int, SlotKey] = dataclasses.field(default_factory=dict)
    #: tensor indices already pulled per slot, for consumption after layer-ranged pulls.
    pulled: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    id_released: bool = False
    pins: int = 0
    freed: bool = False
    #: memory the CPU cannot address directly (a device adapter's): its bytes are staged
    device_memory: bool = False
    #: requests' pairs of this cache with a peer's layout, prepared once
    #: (``_net.prepared.plan_on_loop``; the loop only)
    pairs: dict[tuple[Any, ...], Any] = dataclasses.field(default_factory=dict)

    @property
    def stride(self) -> int:
        return self.tensor_bytes // self.count

    @functools.cached_property
    def layout(self) -> Layout:
        return Layout(self.addrs, self.tensor_bytes, self.count, self.is_blocks)

    @functools.cached_property
    def sorted_addrs(self) -> list[int]:
        """The tensor addresses in order, as Python ints (checks of small requests)."""
        return sorted(int(a) for a in self.addrs.tolist())

    @functools.cached_property
    def sorted_tensors(self) -> list[int]:
        """The tensor indices in the order of :attr:`sorted_addrs` (a stable sort)."""
        addrs = self.addrs.tolist()
        return sorted(range(len(addrs)), key=addrs.__getitem__)

    @functools.cached_property
    def tensor_order(self) -> np.ndarray:
        """The tensor indices in the order of :attr:`regions` (a stable sort)."""
        return np.argsort(self.addrs.astype(np.uint64), kind="stable")

    @functools.cached_property
    def regions(self) -> tuple[np.ndarray, np.ndarray]:
        """Sorted ``(starts, ends)`` of the cache's tensors."""
        starts = np.sort(self.addrs.astype(np.uint64))
        return starts, starts + np.uint64(self.tensor_bytes)

    def describe(self) -> dict[str, Any]:
        """The entry as published to peers (JSON-able); the addresses of a cache that is not
        remote accessible are nobody's business."""
        return {
            "cache_id": self.cache_id,
            "addrs": [int(a) for a in self.addrs] if self.remote_accessible else [],
            "tensor_bytes": self.tensor_bytes,
            "count": self.count,
            "is_blocks": self.is_blocks,
            "placement": int(self.placement),
            "remote_accessible": self.remote_accessible,
            "dtype": self.dtype,
            **({"device": True} if self.device_memory else {}),
        }


class Registry:
    """Caches of one engine, keyed by ids that start at 1 (clients hard-code this)."""

    def __init__(self) -> None:
        self._next_id = 1
        self.entries: dict[int, CacheEntry] = {}
        self._slot_keys: dict[SlotKey, tuple[int, int]] = {}
        self._blocks_keys: dict[int, int] = {}
        self._regions: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._reachable: tuple[np.ndarray, np.ndarray] | None = None
        #: the published table as of the last change (a peer's table request reads it)
        self._table: dict[str, Any] | None = None
        #: how often the table was built (once per change of caches or keys, never per peer
        #: request; tests count on it)
        self.table_builds = 0
        #: told of every entry added (may raise: the add is undone) and of every entry whose
        #: memory goes, before it goes (a transfer engine registers / deregisters it)
        self.on_add: Callable[[CacheEntry], None] | None = None
        self.on_free: Callable[[CacheEntry], None] | None = None
        #: called when a cache id is released (before any of its memory is), so that peers
        #: reading our caches one-sidedly learn that their table snapshot went stale
        self.on_release: Callable[[], None] | None = None

    # ---------------------------------------------------------------- ids and entries
    def new_id(self) -> int:
        cid = self._next_id
        self._next_id += 1
        return cid

    def add(self, entry: CacheEntry) -> None:
        """Add an entry after checking that its memory overlaps no other cache.

        Raises:
            LLMException: LLM_PARAM_INVALID for overlapping memory; whatever ``on_add`` raises
                (a transfer engine refusing the memory).
        """
        starts = entry.addrs.astype(np.uint64)
        order = np.argsort(starts)
        s = starts[order]
        e = s + np.uint64(entry.tensor_bytes)
        raise_if_false(
            bool(np.all(s[1:] >= e[:-1])), "tensor addresses of one cache overlap each other"
        )
        if self.entries:
            r_starts, r_ends, _ = self.regions()
            k = np.searchsorted(r_starts, s, side="right")
            j = k.astype(np.int64) - 1  # the region starting at or before each start
            lo_hit = (j >= 0) & (s < r_ends[np.maximum(j, 0)])
            hi_hit = (k < len(r_starts)) & (r_starts[np.minimum(k, len(r_starts) - 1)] < e)
            raise_if_false(
                not bool(np.any(lo_hit | hi_hit)), "cache memory overlaps a registered cache"
            )
        self.entries[entry.cache_id] = entry
        self._changed()
        if self.on_add is not None:
            try:
                self.on_add(entry)
            except BaseException:
                del self.entries[entry.cache_id]
                self._changed()
                raise

    def get(self, cache_id: int) -> CacheEntry:
        """Raises LLMException(LLM_KV_CACHE_NOT_EXIST) for an unknown or released id."""
        entry = self.entries.get(cache_id)
        if entry is None or entry.id_released:
            raise LLMException(
                f"cache {cache_id} does not exist", status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
            )
        return entry

    def _changed(self) -> None:
        self._regions = None
        self._reachable = None
        self._table = None

    def reachable_regions(self) -> tuple[np.ndarray, np.ndarray]:
        """Sorted ``(starts, ends)`` of the tensors of live remote-accessible caches: all a
        peer may ever reach directly (the published table lists exactly these addresses)."""
        if self._reachable is None:
            starts, ends, ids = self.regions()
            ra = (
                np.array([self.entries[int(c)].remote_accessible for c in ids], dtype=bool)
                if len(ids)
                else np.zeros(0, dtype=bool)
            )
            self._reachable = (starts[ra], ends[ra])
        return self._reachable

    def regions(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sorted ``(starts, ends, cache_ids)`` of every live tensor, for bounds checks."""
        if self._regions is None:
            live = [e for e in self.entries.values() if not e.freed]
            if not live:
                z = np.zeros(0, dtype=np.uint64)
                self._regions = (z, z, np.zeros(0, dtype=np.int64))
            else:
                starts = np.concatenate([e.addrs.astype(np.uint64) for e in live])
                sizes = np.concatenate(
                    [np.full(e.num_tensors, e.tensor_bytes, dtype=np.uint64) for e in live]
                )
                ids = np.concatenate(
                    [np.full(e.num_tensors, e.cache_id, dtype=np.int64) for e in live]
                )
                order = np.argsort(starts, kind="stable")
                self._regions = (starts[order], starts[order] + sizes[order], ids[order])
        return self._regions

    def published_table(self) -> dict[str, Any]:
        """The cache table a peer snapshots in remote-accessible mode (JSON-able). Built once
        per change of caches or keys: peers asking for it again get the same object, which
        callers must not modify."""
        if self._table is None:
            self.table_builds += 1
            self._table = {
                "caches": [e.describe() for e in self.iter_live()],
                "blocks_keys": {str(m): cid for m, cid in self._blocks_keys.items()},
                "slot_keys": [
                    [k[0], k[1], k[2], cid, slot] for k, (cid, slot) in self._slot_keys.items()
                ],
            }
        return self._table

    def iter_live(self) -> Iterator[CacheEntry]:
        return (e for e in self.entries.values() if not e.id_released and not e.freed)

    # ---------------------------------------------------------------- keys
    def check_slot_keys(self, count: int, keys: list[SlotKey | None]) -> None:
        """Raises LLMException(LLM_PARAM_INVALID) for more keys than ``count`` slots, a key
        bound elsewhere, or a key repeated in ``keys``."""
        raise_if_false(
            len(keys) <= count, f"{len(keys)} cache keys for a cache of batch size {count}"
        )
        given = [k for k in keys if k is not None]
        raise_if_false(len(set(given)) == len(given), "the same cache key appears twice")
        for k in given:
            raise_if_false(k not in self._slot_keys, f"cache key {k} is already bound")

    def bind_slot_keys(self, entry: CacheEntry, keys: list[SlotKey | None]) -> None:
        """Bind ``keys[i]`` to slot ``i`` (None = empty slot); all-or-nothing.

        Raises:
            LLMException: as :meth:`check_slot_keys`.
        """
        self.check_slot_keys(entry.count, keys)
        self._table = None
        for slot, k in enumerate(keys):
            if k is not None:
                self._slot_keys[k] = (entry.cache_id, slot)
                entry.slot_keys[slot] = k

    def bind_blocks_key(self, entry: CacheEntry, model_id: int) -> None:
        """The latest registration of a model_id wins (upstream behaviour)."""
        self._blocks_keys[model_id] = entry.cache_id
        self._table = None

    def lookup_slot_key(self, key: SlotKey) -> tuple[CacheEntry, int]:
        """Raises LLMException(LLM_KV_CACHE_NOT_EXIST) for an unbound key."""
        hit = self._slot_keys.get(key)
        if hit is None:
            raise LLMException(
                f"no cache is bound to key {key}", status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
            )
        return self.entries[hit[0]], hit[1]

    def lookup_blocks_key(self, model_id: int) -> CacheEntry:
        """Raises LLMException(LLM_KV_CACHE_NOT_EXIST) for an unbound model_id."""
        cid = self._blocks_keys.get(model_id)
        entry = self.entries.get(cid) if cid is not None else None
        if entry is None or entry.id_released or entry.freed:
            raise LLMException(
                f"no blocks cache is bound to model_id {model_id}",
                status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
            )
        return entry

    def unbind_slot_key(self, key: SlotKey) -> None:
        """Unbind a key of an allocated cache (registered caches keep theirs); unknown: no-op."""
        hit = self._slot_keys.get(key)
        if hit is None:
            return
        entry = self.entries[hit[0]]
        if not entry.allocated:
            return
        del self._slot_keys[key]
        self._table = None
        entry.slot_keys.pop(hit[1], None)
        entry.pulled.pop(hit[1], None)
        self._maybe_free(entry)

    def note_pulled(self, entry: CacheEntry, slot: int, tensors: np.ndarray) -> None:
        """Consume a req key once every tensor of its slot was pulled (reference §8.1).

        Prefix keys and keys of registered caches are never consumed.
        """
        key = entry.slot_keys.get(slot)
        if key is None or key[0] != "req" or not entry.allocated:
            return
        seen = entry.pulled.get(slot)
        if seen is None:
            seen = entry.pulled[slot] = np.zeros(entry.num_tensors, dtype=bool)
        seen[tensors] = True
        if seen.all():
            self.unbind_slot_key(key)

    # ---------------------------------------------------------------- lifetime
    def pin(self, entry: CacheEntry) -> None:
        entry.pins += 1

    def unpin(self, entry: CacheEntry) -> None:
        entry.pins -= 1
        self._maybe_free(entry)

    def release_id(self, entry: CacheEntry) -> None:
        """Drop the id reference; memory goes once no key or transfer holds the cache."""
        if entry.id_released:
            return
        if self.on_release is not None:
            self.on_release()
        entry.id_released = True
        self._table = None
        if entry.is_blocks:
            for model_id, cid in list(self._blocks_keys.items()):
                if cid == entry.cache_id:
                    del self._blocks_keys[model_id]
        if not entry.allocated:
            for k in list(entry.slot_keys.values()):
                self._slot_keys.pop(k, None)
            entry.slot_keys.clear()
        self._maybe_free(entry)

    def _maybe_free(self, entry: CacheEntry) -> None:
        if entry.freed or not entry.id_released or entry.slot_keys or entry.pins:
            return
        entry.freed = True
        del self.entries[entry.cache_id]
        self._changed()
        if self.on_free is not None:
            self.on_free(entry)
        if entry.release is not None:
            entry.release()
        entry.keepalive = None

    def close(self) -> None:
        """Free everything (engine shutdown); pins no longer matter once transfers are fenced."""
        if self.entries and self.on_release is not None:
            self.on_release()  # before any memory goes, as for release_id
        for entry in list(self.entries.values()):
            entry.slot_keys.clear()
            entry.pins = 0
            entry.id_released = True
            self._maybe_free(entry)
        self._slot_keys.clear()
        self._blocks_keys.clear()
        self._changed()
