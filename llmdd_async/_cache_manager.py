"""``CacheManager``: local bookkeeping as plain calls, every data movement as a ``CacheTask``.

Reference §8. Every argument check runs synchronously at the call, before a task exists.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._checks import (
    UINT64_MAX,
    check_index_list,
    check_int64,
    check_isinstance,
    check_list_of,
    check_range,
    check_uint32,
    check_uint64,
)
from ._engine import Engine
from ._enums import LLMStatusCode, Memtype, Placement
from ._errors import LLMException, raise_if_false
from ._memory import check_memory_dtype, host_view, resolve_host_memory
from ._net.transfer import XferSpec, initiate
from ._planner import Layout, Plan, mapping_arrays, plan_block_copies, plan_slots
from ._registry import CacheEntry, SlotKey
from ._scheduler import Destination, run_layerwise
from ._task import CacheTask, TaskControl
from ._types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    MemInfo,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

__all__ = ["CacheManager"]

_POOL_OPTION = {Placement.DEVICE: "llm.MemPoolConfig", Placement.HOST: "llm.HostMemPoolConfig"}


def slot_key_of(key: CacheKey) -> SlotKey | None:
    """The engine identity of a key; None for a placeholder (neither id valid)."""
    if key.req_id != UINT64_MAX:
        return ("req", key.req_id, key.model_id)
    if key.prefix_id != UINT64_MAX:
        return ("prefix", key.prefix_id, key.model_id)
    return None


def _check_desc_for_memory(desc: CacheDesc) -> None:
    shape = desc.shape
    raise_if_false(1 <= len(shape) <= 32, f"shape must have 1 to 32 dims, got {len(shape)}")
    raise_if_false(all(d > 0 for d in shape), f"shape dims must be > 0, got {shape}")
    try:
        desc.data_type.itemsize  # noqa: B018 - raises for DT_STRING
    except ValueError as exc:
        raise LLMException(str(exc), status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
    raise_if_false(desc.num_tensors > 0, "num_tensors must be > 0")


def _block_lists(src_blocks: Any, dst_blocks: Any) -> tuple[np.ndarray, np.ndarray]:
    """Both block index lists as arrays. Raises TypeError / ValueError as check_index_list."""
    src_b = check_index_list("src_blocks", src_blocks)
    dst_b = check_index_list("dst_blocks", dst_blocks)
    assert src_b is not None  # not optional
    assert dst_b is not None
    return src_b, dst_b


class CacheManager:
    """Caches of one endpoint and the movements between them.

    Obtained from ``LLMDataDist.cache_manager``; valid until the engine is finalized.
    """

    def __init__(self, engine: Engine, cache_cls: type[Cache] = Cache) -> None:
        self._engine = engine
        self._cache_cls = cache_cls

    # ------------------------------------------------------------------ helpers
    @property
    def closed(self) -> bool:
        """True once the engine behind this manager was finalized."""
        return self._engine.closed

    @property
    def engine(self) -> Engine:
        engine = self._engine
        if engine.closed:
            raise RuntimeError("llm datadist is not initialized")
        engine.check_thread()
        return engine

    def _entry(self, cache: Cache, name: str) -> CacheEntry:
        check_isinstance(name, cache, Cache)
        raise_if_false(cache.valid, f"{name} ({cache}) is no longer valid")
        entry = self.engine.registry.entries.get(cache.cache_id)
        if entry is None or entry.id_released or cache._owner is not self:
            raise LLMException(
                f"{name}: cache {cache.cache_id} is not a cache of this endpoint",
                status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
            )
        return entry

    def _make_cache(
        self, entry: CacheEntry, desc: CacheDesc, views: Callable[[], list[np.ndarray]]
    ) -> Cache:
        cache = self._cache_cls(
            entry.cache_id,
            desc,
            [int(a) for a in entry.addrs],
            entry.is_blocks,
            is_registered=not entry.allocated,
            _views=views,
        )
        cache._owner = self
        return cache

    def _typed_views(
        self, desc: CacheDesc, raw: Callable[[int], np.ndarray]
    ) -> Callable[[], list[np.ndarray]]:
        dtype, shape, n = desc.data_type.numpy_dtype, tuple(desc.shape), desc.num_tensors
        placement = desc.placement
        adapter = self._engine.adapter

        def views() -> list[np.ndarray]:
            raise_if_false(
                placement == Placement.HOST or adapter.host_addressable,
                f"DEVICE memory of the {adapter.name} adapter is not host-addressable; "
                "use your framework's tensors",
            )
            return [raw(i).view(dtype).reshape(shape) for i in range(n)]

        return views

    def _slot_keys(
        self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey], registered: bool
    ) -> list[SlotKey | None]:
        check_isinstance("cache_desc", cache_desc, CacheDesc)
        check_list_of("cache_keys", cache_keys, CacheKey)
        # Registered caches skip keys whose req_id is unset (upstream); allocated caches treat
        # them as prefix keys or empty-slot placeholders.
        keys = [
            None if registered and k.req_id == UINT64_MAX else slot_key_of(k) for k in cache_keys
        ]
        count = cache_desc.shape[0] if cache_desc.shape else 0
        self.engine.registry.check_slot_keys(count, keys)
        return keys

    # ------------------------------------------------------------------ registration
    def _new_entry(
        self,
        desc: CacheDesc,
        is_blocks: bool,
        addrs: np.ndarray,
        remote_accessible: bool,
        **extra: Any,
    ) -> CacheEntry:
        """A registry entry with a fresh id for ``desc`` (not added to the registry yet)."""
        return CacheEntry(
            cache_id=self.engine.registry.new_id(),
            num_tensors=desc.num_tensors,
            tensor_bytes=desc.size,
            count=desc.shape[0],
            is_blocks=is_blocks,
            placement=desc.placement,
            dtype=desc.data_type.value,
            shape=tuple(desc.shape),
            addrs=addrs,
            remote_accessible=remote_accessible,
            **extra,
        )

    def _register(
        self,
        cache_desc: CacheDesc,
        addrs: Sequence[Any],
        is_blocks: bool,
        remote_accessible: bool | None,
    ) -> tuple[CacheEntry, Callable[[], list[np.ndarray]]]:
        engine = self.engine
        check_isinstance("cache_desc", cache_desc, CacheDesc)
        check_isinstance("addrs", addrs, (list, tuple))
        check_isinstance("remote_accessible", remote_accessible, bool, optional=True)
        raise_if_false(len(addrs) > 0, "addrs must not be empty")
        raise_if_false(
            len(addrs) == cache_desc.num_tensors,
            f"{len(addrs)} addresses for {cache_desc.num_tensors} tensors",
        )
        _check_desc_for_memory(cache_desc)
        if remote_accessible is None:
            remote_accessible = cache_desc.placement == Placement.DEVICE and not engine.comm_linked
        raise_if_false(
            not (remote_accessible and engine.comm_linked),
            "remote_accessible=True is not allowed after link()",
        )
        nbytes = cache_desc.size
        for i, a in enumerate(addrs):
            check_memory_dtype(a, cache_desc.data_type, f"addrs[{i}]")
        resolved = []
        for i, a in enumerate(addrs):
            if cache_desc.placement == Placement.DEVICE:
                resolved.append(engine.adapter.resolve(a, nbytes, f"addrs[{i}]"))
            else:
                resolved.append(resolve_host_memory(a, nbytes, f"addrs[{i}]"))
        entry = self._new_entry(
            cache_desc,
            is_blocks,
            np.array([r[0] for r in resolved], dtype=np.uint64),
            remote_accessible,
            allocated=False,
            keepalive=[r[1] for r in resolved],
        )
        engine.registry.add(entry)
        engine.prefault(entry.addrs, nbytes)

        def raw(i: int) -> np.ndarray:
            keep = resolved[i][1]
            if keep is not None:
                return keep[1].reshape(-1).view(np.uint8)[:nbytes]
            return host_view(int(entry.addrs[i]), nbytes)

        return entry, self._typed_views(cache_desc, raw)

    def register_cache(
        self,
        cache_desc: CacheDesc,
        addrs: Sequence[Any],
        cache_keys: Sequence[CacheKey] = (),
        remote_accessible: bool | None = None,
    ) -> Cache:
        """Register caller-owned memory as a contiguous cache; returns it with a new id.

        ``addrs`` holds one raw address or one memory object (numpy array, CPU tensor, anything
        with the buffer protocol / ``__array_interface__`` / ``__dlpack__``) per tensor; objects
        are kept alive while registered. ``cache_keys[i]`` binds batch slot ``i``; keys of
        registered caches are never consumed.

        A typed object must hold ``cache_desc.data_type`` elements; untyped or byte (uint8)
        memory is taken as it is. An object larger than ``cache_desc.size`` bytes is accepted
        and only its first ``size`` bytes are registered (as for a raw address into a larger
        buffer: a cache may be carved out of one arena); ``cache.tensors`` covers that part.

        Raises:
            TypeError / ValueError: wrong argument types.
            LLMException: LLM_PARAM_INVALID for an empty or wrong-length ``addrs``, address 0,
                memory smaller than the description or of another element type, overlapping
                memory, bad shape, too many or already-bound keys.
        """
        keys = self._slot_keys(cache_desc, cache_keys, registered=True)
        entry, views = self._register(cache_desc, addrs, False, remote_accessible)
        self._engine.registry.bind_slot_keys(entry, keys)
        return self._make_cache(entry, cache_desc, views)

    def register_blocks_cache(
        self,
        cache_desc: CacheDesc,
        addrs: Sequence[Any],
        blocks_cache_key: BlocksCacheKey | None = None,
        remote_accessible: bool | None = None,
    ) -> Cache:
        """Register caller-owned memory as a paged cache (``shape[0]`` = number of blocks).

        A key binds ``model_id``; a later registration with the same model_id takes it over.
        Sets the hidden blocks flag on ``cache_desc`` as upstream does.

        Raises:
            TypeError / ValueError: wrong argument types.
            LLMException: LLM_PARAM_INVALID as for :meth:`register_cache` (memory of another
                element type, or smaller than the description, included).
        """
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey, optional=True)
        entry, views = self._register(cache_desc, addrs, True, remote_accessible)
        cache_desc._is_blocks = True
        if blocks_cache_key is not None:
            self._engine.registry.bind_blocks_key(entry, blocks_cache_key.model_id)
        return self._make_cache(entry, cache_desc, views)

    def unregister_cache(self, cache_id: int) -> None:
        """Forget a registered cache; an unknown id is a no-op.

        Raises:
            TypeError / ValueError: ``cache_id`` is not an int64.
            LLMException: LLM_PARAM_INVALID for a cache that was allocated (use deallocate).
        """
        check_int64("cache_id", cache_id)
        registry = self.engine.registry
        entry = registry.entries.get(cache_id)
        if entry is None or entry.id_released:
            return
        raise_if_false(not entry.allocated, f"cache {cache_id} was allocated; use deallocate_cache")
        registry.release_id(entry)

    # ------------------------------------------------------------------ allocation
    def _pool(self, placement: Placement) -> Any:
        pools = self.engine.pools
        if not pools:
            raise LLMException(
                "no memory pool is configured (llm.MemPoolConfig / llm.HostMemPoolConfig)",
                status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )
        pool = pools.get(placement)
        raise_if_false(
            pool is not None,
            f"no {placement.name} memory pool is configured ({_POOL_OPTION[placement]})",
        )
        return pool

    def _allocate(
        self, cache_desc: CacheDesc, is_blocks: bool
    ) -> tuple[CacheEntry, Callable[[], list[np.ndarray]]]:
        engine = self.engine
        check_isinstance("cache_desc", cache_desc, CacheDesc)
        _check_desc_for_memory(cache_desc)
        pool = self._pool(cache_desc.placement)
        nbytes = cache_desc.size
        page = pool.page_size
        per_tensor = math.ceil(nbytes / page) * page
        # One run for all tensors (one mapping, one allocation); plans still keep each
        # descriptor inside one tensor, as every range check is per tensor.
        alloc = pool.allocate(per_tensor * cache_desc.num_tensors)
        addrs = alloc.addr + np.arange(cache_desc.num_tensors, dtype=np.uint64) * np.uint64(
            per_tensor
        )
        entry = self._new_entry(
            cache_desc,
            is_blocks,
            addrs.astype(np.uint64),
            cache_desc.placement == Placement.DEVICE and not engine.comm_linked,
            allocated=True,
            release=lambda: pool.free(alloc),
        )
        try:
            engine.registry.add(entry)
        except BaseException:
            pool.free(alloc)
            raise
        engine.prefault(entry.addrs, nbytes)

        def raw(i: int) -> np.ndarray:
            return pool.view(alloc, i * per_tensor, nbytes)

        return entry, self._typed_views(cache_desc, raw)

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()) -> Cache:
        """Allocate a contiguous cache from the pool of its placement; ``cache_keys[i]`` binds
        slot ``i`` (a key with neither id valid leaves that slot empty).

        The memory is freed once the cache is deallocated AND every bound key is consumed or
        removed.

        Raises:
            TypeError / ValueError: wrong argument types.
            LLMException: LLM_FEATURE_NOT_ENABLED without any pool, LLM_PARAM_INVALID without a
                pool of this placement or for bad keys, LLM_OUT_OF_MEMORY when the pool is full.
        """
        keys = self._slot_keys(cache_desc, cache_keys, registered=False)
        entry, views = self._allocate(cache_desc, False)
        self._engine.registry.bind_slot_keys(entry, keys)
        return self._make_cache(entry, cache_desc, views)

    def allocate_blocks_cache(
        self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None
    ) -> Cache:
        """Allocate a paged cache from the pool of its placement.

        Raises:
            TypeError: wrong argument types.
            LLMException: as for :meth:`allocate_cache`.
        """
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey, optional=True)
        entry, views = self._allocate(cache_desc, True)
        cache_desc._is_blocks = True
        if blocks_cache_key is not None:
            self._engine.registry.bind_blocks_key(entry, blocks_cache_key.model_id)
        return self._make_cache(entry, cache_desc, views)

    def deallocate_cache(self, cache: Cache) -> None:
        """Drop an allocated contiguous cache's id; memory goes when its keys are gone too.

        Unknown, already freed or registered caches are a no-op.

        Raises:
            TypeError: not a Cache. LLMException: LLM_PARAM_INVALID for a blocks cache.
        """
        check_isinstance("cache", cache, Cache)
        raise_if_false(not cache.is_blocks_cache, "use deallocate_blocks_cache for a blocks cache")
        self._deallocate(cache)

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        """Free an allocated blocks cache (after in-flight transfers on it are fenced).

        Raises:
            TypeError: not a Cache. LLMException: LLM_PARAM_INVALID for a contiguous cache.
        """
        check_isinstance("cache", cache, Cache)
        raise_if_false(cache.is_blocks_cache, "cache is not a blocks cache")
        self._deallocate(cache)

    def _deallocate(self, cache: Cache) -> None:
        entry = self.engine.registry.entries.get(cache.cache_id)
        if entry is None or not entry.allocated or cache._owner is not self:
            return
        cache._invalidate()
        self._engine.registry.release_id(entry)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unbind a key of an allocated cache; unknown keys and registered caches: no-op.

        Raises:
            TypeError: not a CacheKey.
        """
        check_isinstance("cache_key", cache_key, CacheKey)
        key = slot_key_of(cache_key)
        if key is not None:
            self.engine.registry.unbind_slot_key(key)

    def remap_registered_memory(self, mem_infos: MemInfo | Sequence[MemInfo]) -> None:
        """Re-register device memory after a memory fault (reserved upstream).

        Raises:
            TypeError: bad argument types.
            LLMException: LLM_PARAM_INVALID for a non-device item, address 0 or size 0;
                LLM_FEATURE_NOT_ENABLED otherwise: host and socket memory never needs remapping.
        """
        items = [mem_infos] if isinstance(mem_infos, MemInfo) else mem_infos
        check_isinstance("mem_infos", items, (list, tuple))
        for i, m in enumerate(items):
            check_isinstance(f"mem_infos[{i}]", m, MemInfo)
            raise_if_false(m.mem_type == Memtype.MEM_TYPE_DEVICE, "mem_type must be DEVICE")
            raise_if_false(m.addr != 0 and m.size > 0, "addr must be != 0 and size > 0")
        raise LLMException(
            "remap_registered_memory is reserved upstream and not needed by this library's "
            "transports",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        )

    # ------------------------------------------------------------------ local movement
    def _local_task(self, kind: str, plan: Plan, entries: list[CacheEntry]) -> CacheTask:
        engine = self.engine
        registry = engine.registry
        for e in entries:
            registry.pin(e)

        async def body(ctl: TaskControl) -> None:
            try:
                n = await engine.adapter.copy(plan, ctl.token)
                ctl.add(n, len(plan))
            finally:
                for e in entries:
                    registry.unpin(e)

        return engine.start_task(engine.new_task(kind), body)

    def copy_cache(
        self,
        dst: Cache,
        src: Cache,
        dst_batch_index: int = 0,
        src_batch_index: int = 0,
        offset: int = 0,
        size: int = -1,
        req_id: int | None = None,
    ) -> CacheTask:
        """Copy one batch slot between two local contiguous caches (note: dst first).

        ``size`` bytes per tensor from ``offset`` (-1: the rest of the slot).

        Raises:
            TypeError / ValueError: wrong argument types.
            LLMException: LLM_PARAM_INVALID for blocks caches, differing tensor counts, or
                indices, offset or size outside the slots; LLM_KV_CACHE_NOT_EXIST for a cache
                that is not this endpoint's.
        """
        check_uint32("dst_batch_index", dst_batch_index)
        check_uint32("src_batch_index", src_batch_index)
        check_uint64("offset", offset)
        check_int64("size", size)
        check_uint64("req_id", req_id, optional=True)
        d, s = self._entry(dst, "dst"), self._entry(src, "src")
        raise_if_false(not d.is_blocks and not s.is_blocks, "copy_cache needs contiguous caches")
        raise_if_false(
            d.num_tensors == s.num_tensors,
            f"tensor counts differ ({d.num_tensors} vs {s.num_tensors})",
        )
        raise_if_false(src_batch_index < s.count, f"src_batch_index >= batch size {s.count}")
        raise_if_false(dst_batch_index < d.count, f"dst_batch_index >= batch size {d.count}")
        raise_if_false(offset < s.stride and offset < d.stride, "offset is outside the slot")
        raise_if_false(size == -1 or size > 0, f"size must be -1 or > 0, got {size}")
        if size == -1:
            size = min(s.stride, d.stride) - offset
        idx = np.arange(s.num_tensors, dtype=np.int64)
        plan = plan_slots(
            s.layout, d.layout, idx, idx, src_batch_index, dst_batch_index, size, offset, offset
        )
        return self._local_task("copy_cache", plan, [s, d])

    def copy_blocks(self, cache: Cache, copy_block_info: dict[int, list[int]]) -> CacheTask:
        """Inside one blocks cache, copy block ``src`` to every block in its list.

        Raises:
            TypeError / ValueError: wrong argument types.
            LLMException: LLM_PARAM_INVALID for a contiguous cache, indices out of range, a
                destination given twice, or a block that is both source and destination.
        """
        entry = self._entry(cache, "cache")
        raise_if_false(entry.is_blocks, "copy_blocks needs a blocks cache")
        src_b, dst_b = mapping_arrays("copy_block_info", copy_block_info)
        raise_if_false(len(np.unique(dst_b)) == len(dst_b), "a destination block appears twice")
        raise_if_false(
            not np.isin(dst_b, src_b).any(), "a block cannot be both a source and a destination"
        )
        plan = plan_block_copies(entry.layout, entry.layout, src_b, dst_b)
        return self._local_task("copy_blocks", plan, [entry])

    def swap_blocks(
        self, src_cache: Cache, dst_cache: Cache, src_to_dst: dict[int, int]
    ) -> CacheTask:
        """Swap blocks between a HOST and a DEVICE blocks cache (either direction).

        The host side is usually ``Cache.create_cpu_cache(...)`` over your own memory.

        Raises:
            TypeError / ValueError: wrong argument types.
            LLMException: LLM_PARAM_INVALID unless both are blocks caches of equal block size
                and tensor count, one HOST and one DEVICE, with indices in range.
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
                _check_desc_for_memory(desc)
                sides.append(Layout.of(cache.tensor_addrs, desc.size, desc.shape[0], True))
            else:
                e = self._entry(cache, name)
                entries.append(e)
                sides.append(e.layout)
        raise_if_false(sides[0].stride == sides[1].stride, "block sizes differ")
        src_b, dst_b = mapping_arrays("src_to_dst", src_to_dst)
        plan = plan_block_copies(sides[0], sides[1], src_b, dst_b)
        return self._local_task("swap_blocks", plan, entries)

    # ------------------------------------------------------------------ remote movement
    def _check_layer_args(
        self,
        entry: CacheEntry,
        src_layer_range: Any,
        dst_layer_range: Any,
        tensor_num_per_layer: Any,
        local_is_dst: bool,
    ) -> tuple[range | None, range | None, int]:
        """Checks that need only local knowledge (the peer checks its own side)."""
        src_r = check_range("src_layer_range", src_layer_range)
        dst_r = check_range("dst_layer_range", dst_layer_range)
        check_uint32("tensor_num_per_layer", tensor_num_per_layer)
        n = int(tensor_num_per_layer)
        raise_if_false(n > 0, "tensor_num_per_layer must be > 0")
        local_r, other_r = (dst_r, src_r) if local_is_dst else (src_r, dst_r)
        if src_r is not None or dst_r is not None:
            raise_if_false(
                n <= entry.num_tensors,
                f"tensor_num_per_layer {n} exceeds the cache's {entry.num_tensors} tensors",
            )
            raise_if_false(
                entry.num_tensors % n == 0,
                f"tensor_num_per_layer {n} must divide the local tensor count {entry.num_tensors}",
            )
        if local_r is not None:
            raise_if_false(
                local_r.stop * n <= entry.num_tensors,
                f"layer range {local_r} exceeds the {entry.num_tensors // n} local layers",
            )
        if src_r is not None and dst_r is not None:
            raise_if_false(
                len(src_r) == len(dst_r),
                f"src_layer_range {src_r} and dst_layer_range {dst_r} differ in length",
            )
        elif other_r is not None:
            raise_if_false(
                len(other_r) * n == entry.num_tensors,
                f"the peer's layer range {other_r} selects {len(other_r) * n} tensors but the "
                f"local cache has {entry.num_tensors}",
            )
        return src_r, dst_r, n

    def _peer_check(self, cluster_id: int) -> Any:
        raise_if_false(
            cluster_id != self.engine.cluster_id or not self.engine.options.cache_manager,
            f"cannot transfer with own cluster id {cluster_id}",
        )
        return self.engine.links.get(cluster_id)

    def _target_of(self, key: Any) -> dict[str, Any]:
        if isinstance(key, BlocksCacheKey):
            return {"by": "blocks_key", "model_id": key.model_id}
        if isinstance(key, CacheKeyByIdAndIndex):
            return {"by": "cache_id", "cache_id": key.cache_id, "index": key.batch_index}
        sk = slot_key_of(key)
        assert sk is not None  # check_pullable ran
        return {"by": f"{sk[0]}_key", "id": sk[1], "model_id": sk[2]}

    def _start_remote(
        self,
        kind: str,
        op: str,
        key: Any,
        shape: str,
        entry: CacheEntry,
        steps: int = 1,
        **spec_fields: Any,
    ) -> CacheTask:
        """Start a transfer with the peer ``key`` names; ``steps`` layers of deadline budget.

        Raises:
            LLMException: LLM_PARAM_INVALID for a local cache the peer may not reach, or the
                own cluster id; LLM_NOT_YET_LINK without a link.
        """
        self._check_remote_accessible(entry)
        link = self._peer_check(key.cluster_id)
        spec = XferSpec(op, self._target_of(key), shape, entry, **spec_fields)
        engine = self.engine
        registry = engine.registry
        entry = spec.local
        registry.pin(entry)
        timeout = engine.sync_kv_timeout_s

        async def body(ctl: TaskControl) -> None:
            try:
                if engine.options.remote_accessible:
                    table = link.table
                    if table is None:  # the first transfer of the link fetches it
                        ctl.set_deadline(timeout)
                        table = await link.fetch_table(timeout)
                        ctl.set_deadline(None)
                    spec.target = _resolve_in_table(table, spec.target, link.peer_cluster_id)
                async with link.transfer_lock.hold(exclusive=False):
                    # The deadline runs from when the link is ours, not while queueing.
                    ctl.set_deadline(timeout * steps)
                    link.check_alive()
                    ctl.add(*await initiate(engine, link, spec, ctl.token, ctl.deadline))
            finally:
                registry.unpin(entry)

        return engine.start_task(engine.new_task(kind), body)

    def _pull_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        unknown = set(kwargs) - _PULL_KWARGS
        if unknown:
            raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
        out = dict(_PULL_DEFAULTS)
        out.update(kwargs)
        for name in ("src_cache_offset", "dst_cache_offset"):
            check_int64(name, out[name])
            raise_if_false(out[name] >= -1, f"{name} must be >= 0 (or -1 for none)")
            out[name] = max(0, int(out[name]))
        return out

    def pull_cache(
        self,
        cache_key: CacheKey | CacheKeyByIdAndIndex,
        cache: Cache,
        batch_index: int = 0,
        size: int = -1,
        **kwargs: Any,
    ) -> CacheTask:
        """Pull one contiguous batch slot of a linked peer into local slot ``batch_index``.

        ``size`` bytes per tensor (-1: the local slot after ``dst_cache_offset``). Keyword
        arguments: ``src_layer_range``, ``dst_layer_range``, ``tensor_num_per_layer`` (2),
        ``src_cache_offset``, ``dst_cache_offset``. A req key of a cache the peer allocated is
        consumed once this pull succeeded (request/response mode).

        Raises:
            TypeError / ValueError: wrong argument types (a CacheKey in remote-accessible mode).
            LLMException: LLM_PARAM_INVALID for a blocks cache, bad size, slot, ranges or
                offsets, an invalid key, or the own cluster id; LLM_NOT_YET_LINK without a
                link. The task fails with LLM_KV_CACHE_NOT_EXIST when the peer has no such
                key/cache/slot, LLM_TIMEOUT after ``sync_kv_timeout``, LLM_LINK_FAILED when the
                peer dies.
        """
        engine = self.engine
        kw = self._pull_kwargs(kwargs)
        allowed = (
            (CacheKeyByIdAndIndex,)
            if engine.options.remote_accessible
            else (CacheKey, CacheKeyByIdAndIndex)
        )
        check_isinstance("cache_key", cache_key, allowed)
        entry = self._entry(cache, "cache")
        check_uint32("batch_index", batch_index)
        check_int64("size", size)
        raise_if_false(not entry.is_blocks, "pull_cache needs a contiguous (non-blocks) cache")
        raise_if_false(size == -1 or size > 0, f"size must be -1 or > 0, got {size}")
        raise_if_false(batch_index < entry.count, f"batch_index {batch_index} >= {entry.count}")
        raise_if_false(
            kw["dst_cache_offset"] < entry.stride, "dst_cache_offset is outside the slot"
        )
        raise_if_false(
            size <= entry.stride - kw["dst_cache_offset"],
            f"size {size} exceeds the local slot of {entry.stride} bytes",
        )
        if isinstance(cache_key, CacheKey):
            cache_key.check_pullable()
        src_r, dst_r, n = self._check_layer_args(
            entry, kw["src_layer_range"], kw["dst_layer_range"], kw["tensor_num_per_layer"], True
        )
        return self._start_remote(
            "pull_cache",
            "pull",
            cache_key,
            "slot",
            entry,
            local_slot=batch_index,
            size=size,
            src_offset=kw["src_cache_offset"],
            dst_offset=kw["dst_cache_offset"],
            src_range=src_r,
            dst_range=dst_r,
            tensor_num_per_layer=n,
        )

    def pull_blocks(
        self,
        src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
        dst_cache: Cache,
        src_blocks: Sequence[int] = (),
        dst_blocks: Sequence[int] = (),
        **kwargs: Any,
    ) -> CacheTask:
        """Pull blocks of a linked peer into local blocks.

        With a BlocksCacheKey: block ``src_blocks[i]`` lands in ``dst_blocks[i]`` (runs that are
        consecutive on both sides move as one copy). With a CacheKey / CacheKeyByIdAndIndex:
        the peer's contiguous slot is cut into block-sized pieces, piece ``i`` landing in
        ``dst_blocks[i]`` (``src_blocks`` must be empty). Keyword arguments as
        :meth:`pull_cache` (layer ranges, ``tensor_num_per_layer``).

        Raises:
            TypeError / ValueError: wrong argument types.
            LLMException: LLM_PARAM_INVALID for a contiguous destination, empty or unequal
                block lists, local indices out of range, bad ranges or the own cluster id;
                LLM_NOT_YET_LINK without a link. The task fails as for :meth:`pull_cache`
                (LLM_PARAM_INVALID for remote indices out of range).
        """
        engine = self.engine
        kw = self._pull_kwargs(kwargs)
        allowed: tuple[type, ...] = (
            (BlocksCacheKey, CacheKeyByIdAndIndex)
            if engine.options.remote_accessible
            else (BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex)
        )
        check_isinstance("src_cache_key", src_cache_key, allowed)
        return self._pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks, kw, False)

    def _pull_blocks_by_id(
        self,
        key: CacheKeyByIdAndIndex,
        dst_cache: Cache,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        src_r: range | None,
        dst_r: range | None,
        n: int,
    ) -> CacheTask:
        """Blocks -> blocks addressed by the peer's cache id (the C++ API's PullKvBlocks)."""
        kw = {"src_layer_range": src_r, "dst_layer_range": dst_r, "tensor_num_per_layer": n}
        return self._pull_blocks(key, dst_cache, src_blocks, dst_blocks, kw, True)

    def _pull_blocks(
        self,
        src_cache_key: Any,
        dst_cache: Cache,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        kw: dict[str, Any],
        blocks_by_id: bool,
    ) -> CacheTask:
        entry = self._entry(dst_cache, "dst_cache")
        src_b, dst_b = _block_lists(src_blocks, dst_blocks)
        raise_if_false(entry.is_blocks, "pull_blocks needs a blocks destination cache")
        raise_if_false(len(dst_b) > 0, "dst_blocks must not be empty")
        top = max(dst_b.tolist()) if 0 < len(dst_b) <= 64 else int(dst_b.max(initial=0))
        raise_if_false(top < entry.count, f"dst block {top} >= the local {entry.count} blocks")
        if isinstance(src_cache_key, BlocksCacheKey) or blocks_by_id:
            raise_if_false(len(src_b) > 0, "src_blocks must not be empty with a BlocksCacheKey")
            raise_if_false(
                len(src_b) == len(dst_b),
                f"src_blocks ({len(src_b)}) and dst_blocks ({len(dst_b)}) differ in length",
            )
            shape = "blocks"
        else:
            raise_if_false(
                len(src_b) == 0, "src_blocks must be empty when pulling a contiguous slot"
            )
            if isinstance(src_cache_key, CacheKey):
                src_cache_key.check_pullable()
            shape = "slot_to_blocks"
        src_r, dst_r, n = self._check_layer_args(
            entry, kw["src_layer_range"], kw["dst_layer_range"], kw["tensor_num_per_layer"], True
        )
        return self._start_remote(
            "pull_blocks",
            "pull",
            src_cache_key,
            shape,
            entry,
            src_range=src_r,
            dst_range=dst_r,
            tensor_num_per_layer=n,
            src_blocks=src_b if shape == "blocks" else None,
            dst_blocks=dst_b,
        )

    def _require_remote_accessible_mode(self, kind: str) -> None:
        """Raises LLMException(LLM_PARAM_INVALID) outside remote-accessible mode."""
        raise_if_false(
            self.engine.options.remote_accessible,
            f"{kind} needs llm.EnableRemoteCacheAccessible=1",
        )

    def _check_remote_accessible(self, entry: CacheEntry) -> None:
        if self.engine.options.remote_accessible:
            raise_if_false(
                entry.remote_accessible,
                f"cache {entry.cache_id} is not remote accessible (register it with "
                "remote_accessible=True)",
            )

    def _push_ranges(
        self, entry: CacheEntry, src_layer_range: Any, dst_layer_range: Any, tnpl: Any
    ) -> tuple[range | None, range | None, int, int]:
        """Ranges of a push and its number of layers (the deadline budget).

        Both None means every tensor, as for pulls (so a one-tensor cache with the default
        ``tensor_num_per_layer=2`` still moves its tensor).
        """
        check_uint32("tensor_num_per_layer", tnpl)
        n = int(tnpl)
        raise_if_false(n > 0, "tensor_num_per_layer must be > 0")
        src_r = check_range("src_layer_range", src_layer_range)
        dst_r = check_range("dst_layer_range", dst_layer_range)
        layers = entry.num_tensors // n
        if src_r is None and dst_r is None:
            return None, None, n, max(1, layers)
        src_r = src_r or range(0, layers)
        dst_r = dst_r or range(0, layers)
        raise_if_false(
            len(src_r) == len(dst_r),
            f"src_layer_range {src_r} and dst_layer_range {dst_r} differ in length",
        )
        raise_if_false(
            entry.num_tensors % n == 0 and src_r.stop <= layers,
            f"src_layer_range {src_r} exceeds the {layers} local layers",
        )
        return src_r, dst_r, n, len(src_r)

    def push_cache(
        self,
        dst_cache_key: CacheKeyByIdAndIndex,
        src_cache: Cache,
        src_batch_index: int = 0,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        size: int = -1,
        tensor_num_per_layer: int = 2,
    ) -> CacheTask:
        """Push a local contiguous slot into a peer's slot (remote-accessible mode).

        The peer's cache is found in its published table (snapshotted on first use). The
        budget is ``sync_kv_timeout`` per layer, as upstream's per-layer calls.

        Raises:
            TypeError / ValueError: wrong argument types.
            LLMException: LLM_PARAM_INVALID outside remote-accessible mode, for a blocks
                cache, ``size != -1``, bad or unequal ranges; LLM_NOT_YET_LINK without a link.
        """
        self._require_remote_accessible_mode("push_cache")
        check_isinstance("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex)
        entry = self._entry(src_cache, "src_cache")
        check_uint32("src_batch_index", src_batch_index)
        check_int64("size", size)
        raise_if_false(not entry.is_blocks, "push_cache needs a contiguous (non-blocks) cache")
        raise_if_false(size == -1, f"push_cache only supports size=-1, got {size}")
        raise_if_false(src_batch_index < entry.count, "src_batch_index is outside the cache")
        src_r, dst_r, n, steps = self._push_ranges(
            entry, src_layer_range, dst_layer_range, tensor_num_per_layer
        )
        return self._start_remote(
            "push_cache",
            "push",
            dst_cache_key,
            "slot",
            entry,
            steps,
            local_slot=src_batch_index,
            src_range=src_r,
            dst_range=dst_r,
            tensor_num_per_layer=n,
        )

    def push_blocks(
        self,
        dst_cache_key: BlocksCacheKey,
        src_cache: Cache,
        src_blocks: Sequence[int] = (),
        dst_blocks: Sequence[int] = (),
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
    ) -> CacheTask:
        """Push local blocks into a peer's blocks cache (remote-accessible mode).

        Raises:
            TypeError / ValueError: wrong argument types.
            LLMException: LLM_PARAM_INVALID outside remote-accessible mode, for a contiguous
                source, empty or unequal block lists, local indices out of range, bad ranges;
                LLM_NOT_YET_LINK without a link. The task fails with LLM_PARAM_INVALID for
                remote indices out of range.
        """
        self._require_remote_accessible_mode("push_blocks")
        check_isinstance("dst_cache_key", dst_cache_key, BlocksCacheKey)
        return self._push_blocks(
            dst_cache_key,
            src_cache,
            src_blocks,
            dst_blocks,
            src_layer_range,
            dst_layer_range,
            tensor_num_per_layer,
        )

    def _push_blocks_by_id(
        self,
        key: CacheKeyByIdAndIndex,
        src_cache: Cache,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        src_r: range | None,
        dst_r: range | None,
        n: int,
    ) -> CacheTask:
        """Blocks -> blocks addressed by the peer's cache id (the C++ API's PushKvBlocks)."""
        self._require_remote_accessible_mode("push_blocks")
        return self._push_blocks(key, src_cache, src_blocks, dst_blocks, src_r, dst_r, n)

    def _push_blocks(
        self,
        dst_cache_key: Any,
        src_cache: Cache,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        src_layer_range: Any,
        dst_layer_range: Any,
        tensor_num_per_layer: Any,
    ) -> CacheTask:
        entry = self._entry(src_cache, "src_cache")
        src_b, dst_b = _block_lists(src_blocks, dst_blocks)
        raise_if_false(entry.is_blocks, "push_blocks needs a blocks source cache")
        raise_if_false(len(dst_b) > 0, "dst_blocks must not be empty")
        raise_if_false(len(src_b) > 0, "src_blocks must not be empty")
        raise_if_false(
            len(src_b) == len(dst_b),
            f"src_blocks ({len(src_b)}) and dst_blocks ({len(dst_b)}) differ in length",
        )
        raise_if_false(
            int(src_b.max()) < entry.count,
            f"src block {int(src_b.max())} >= the local {entry.count} blocks",
        )
        src_r, dst_r, n, steps = self._push_ranges(
            entry, src_layer_range, dst_layer_range, tensor_num_per_layer
        )
        return self._start_remote(
            "push_blocks",
            "push",
            dst_cache_key,
            "blocks",
            entry,
            steps,
            src_range=src_r,
            dst_range=dst_r,
            tensor_num_per_layer=n,
            src_blocks=src_b,
            dst_blocks=dst_b,
        )

    def transfer_cache_async(
        self,
        src_cache: Cache,
        layer_synchronizer: Any,
        transfer_configs: Sequence[TransferConfig | TransferWithCacheKeyConfig],
        src_block_indices: Sequence[int] | None = None,
        dst_block_indices: Sequence[int] | None = None,
        dst_block_memory_size: int | None = None,
        *,
        tensor_num_per_layer: int = 2,
    ) -> CacheTask:
        """Push ``src_cache`` layer by layer while the model computes later layers.

        For each source layer (K and V: 2 tensors) the synchronizer is awaited -- blocking
        ``LayerSynchronizer`` in a worker thread, ``AsyncLayerSynchronizer`` on the loop,
        ``LayerEvents`` signalled by a forward pass -- and the layer then goes to every
        destination whose range holds it, while the next layer is already being awaited.
        Destinations: raw peer addresses (``TransferConfig``, request/response mode) or a key
        (``TransferWithCacheKeyConfig``, remote-accessible mode), contiguous or blocks.
        ``dst_layer_range`` maps relative to ``src_layer_range`` (upstream indexed it by the
        absolute source layer, which broke ranges not starting at 0). ``src_block_indices`` on a
        contiguous source select its batch slots (dim 0), as upstream's engine reads them;
        destination blocks are then slot-sized unless ``dst_block_memory_size`` says otherwise.

        ``get_results()`` gives one code per config (None where no layer started); configs to
        the same cluster share one result, as upstream.

        ``tensor_num_per_layer`` (keyword only, an extension; default 2 = K and V) is how many
        consecutive tensors one layer holds, as for :meth:`pull_blocks`: 1 for caches that keep
        K and V in one tensor per layer (vLLM's CPU backend). Raw ``TransferConfig``
        destinations need the default.

        Raises:
            TypeError / ValueError: wrong argument types, or the wrong config class for the
                mode.
            LLMException: LLM_PARAM_INVALID for a HOST source, an odd tensor count, missing or
                unequal block lists, a missing or stray ``dst_block_memory_size``, a layer
                range outside the cache, a wrong number of ``dst_addrs``, a non-zero
                ``src_batch_index`` with blocks, or an own cluster id; LLM_NOT_YET_LINK without
                a link to a destination.
        """
        engine = self.engine
        entry = self._entry(src_cache, "src_cache")
        _check_synchronizer(layer_synchronizer)
        check_isinstance("transfer_configs", transfer_configs, (list, tuple))
        ra = engine.options.remote_accessible
        cfg_type = TransferWithCacheKeyConfig if ra else TransferConfig
        for i, c in enumerate(transfer_configs):
            if not isinstance(c, cfg_type):
                raise TypeError(
                    f"transfer_configs[{i}] must be {cfg_type.__name__} when remote-accessible "
                    f"mode is {'on' if ra else 'off'}, got {type(c).__name__}"
                )
        src_b = check_index_list("src_block_indices", src_block_indices, optional=True)
        dst_b = check_index_list("dst_block_indices", dst_block_indices, optional=True)
        check_uint64("dst_block_memory_size", dst_block_memory_size, optional=True)
        dbm = int(dst_block_memory_size) if dst_block_memory_size else None
        raise_if_false(len(transfer_configs) > 0, "transfer_configs must not be empty")
        raise_if_false(
            entry.placement != Placement.HOST, "transfer_cache_async does not take a HOST source"
        )
        check_uint32("tensor_num_per_layer", tensor_num_per_layer)
        tnpl = int(tensor_num_per_layer)
        raise_if_false(tnpl >= 1, "tensor_num_per_layer must be >= 1")
        raise_if_false(
            tnpl == 2 or cfg_type is TransferWithCacheKeyConfig,
            "TransferConfig destinations need tensor_num_per_layer=2 (K and V addresses)",
        )
        raise_if_false(
            entry.num_tensors % tnpl == 0,
            f"the source needs {tnpl} tensors per layer: {entry.num_tensors} is not a multiple",
        )
        layers = entry.num_tensors // tnpl
        #: what the requests describe as the source: a contiguous cache with block indices
        #: is read as blocks of its dim-0 slices, as upstream's engine does (§7, §9.1)
        source = entry
        if src_b is not None:
            if not entry.is_blocks:
                source = dataclasses.replace(entry, is_blocks=True)
            raise_if_false(
                dst_b is not None, "dst_block_indices are required with src_block_indices"
            )
            assert dst_b is not None
            raise_if_false(
                len(src_b) == len(dst_b) and len(src_b) > 0,
                "src_block_indices and dst_block_indices must be non-empty and of equal length",
            )
            raise_if_false(
                int(src_b.max()) < entry.count,
                f"src block {int(src_b.max())} >= the {entry.count} source blocks",
            )
        elif entry.is_blocks:
            # A blocks source without indices (upstream's own sample does this): every block,
            # to the same block positions of the destination.
            raise_if_false(
                dst_b is None, "dst_block_indices need src_block_indices with a blocks source"
            )
            src_b = dst_b = np.arange(entry.count, dtype=np.int64)
        else:
            if dst_b is not None:
                raise_if_false(len(dst_b) > 0, "dst_block_indices must not be empty")
                raise_if_false(
                    dbm is not None,
                    "dst_block_memory_size is required for a contiguous source sent to blocks",
                )
        if dst_b is None:
            raise_if_false(
                dbm is None, "dst_block_memory_size must be None or 0 for a contiguous target"
            )
        shape = (
            "blocks" if src_b is not None else ("slot_to_blocks" if dst_b is not None else "slot")
        )
        dests: list[Destination] = []
        slots: list[int] = []
        #: cluster id -> (result slot, link): configs to one cluster share both
        per_cluster: dict[int, tuple[int, Any]] = {}
        for i, c in enumerate(transfer_configs):
            src_r = c.src_layer_range or range(0, layers)
            raise_if_false(
                src_r.stop <= layers,
                f"transfer_configs[{i}].src_layer_range {src_r} exceeds the {layers} layers",
            )
            raise_if_false(
                src_b is None or c.src_batch_index == 0,
                f"transfer_configs[{i}].src_batch_index must be 0 with a blocks source",
            )
            raise_if_false(
                entry.is_blocks or c.src_batch_index < entry.count,
                f"transfer_configs[{i}].src_batch_index is outside the source cache",
            )
            if isinstance(c, TransferConfig):
                raise_if_false(
                    len(c.dst_addrs) == 2 * len(src_r),
                    f"transfer_configs[{i}] needs {2 * len(src_r)} dst_addrs (K and V for "
                    f"each of {len(src_r)} layers), got {len(c.dst_addrs)}",
                )
            cid = c.dst_cluster_id
            if cid not in per_cluster:
                per_cluster[cid] = (len(per_cluster), self._peer_check(cid))
            slot, link = per_cluster[cid]
            slots.append(slot)
            dests.append(
                Destination(
                    i,
                    slot,
                    link,
                    list(src_r),
                    self._layer_spec_factory(source, c, src_r, shape, src_b, dst_b, dbm, tnpl),
                )
            )
        self._check_remote_accessible(entry)
        registry = engine.registry
        registry.pin(entry)
        timeout = engine.sync_kv_timeout_s
        sync_timeout = engine.options.layer_sync_timeout_ms
        window = engine.options.layer_window

        async def body(ctl: TaskControl) -> None:
            try:
                if ra:
                    # A control round trip, not payload: it needs no turn on the link.
                    for d in dests:
                        table = await d.link.fetch_table(timeout)
                        d.make_spec = _with_table(d.make_spec, table, d.link.peer_cluster_id)
                await run_layerwise(
                    engine, ctl, layer_synchronizer, dests, timeout, sync_timeout, window
                )
            finally:
                registry.unpin(entry)

        return engine.start_task(engine.new_task("transfer_cache_async", slots), body)

    def _layer_spec_factory(
        self,
        entry: CacheEntry,
        config: TransferConfig | TransferWithCacheKeyConfig,
        src_r: range,
        shape: str,
        src_b: np.ndarray | None,
        dst_b: np.ndarray | None,
        dbm: int | None,
        tnpl: int = 2,
    ) -> Callable[[int], XferSpec]:
        """Build the one-layer request of ``config`` for source layer ``layer``."""
        src_slot = config.src_batch_index
        if isinstance(config, TransferWithCacheKeyConfig):
            dst_r = config.dst_layer_range
            target = self._target_of(config.cache_key)

            def keyed(layer: int) -> XferSpec:
                dst_layer = dst_r.start + (layer - src_r.start)
                return XferSpec(
                    "push",
                    dict(target),
                    shape,
                    entry,
                    local_slot=src_slot,
                    src_range=range(layer, layer + 1),
                    dst_range=range(dst_layer, dst_layer + 1),
                    tensor_num_per_layer=tnpl,
                    src_blocks=src_b,
                    dst_blocks=dst_b,
                    dst_block_bytes=dbm,
                )

            return keyed
        addrs = np.asarray(config.dst_addrs, dtype=np.uint64)
        unit = dbm or entry.stride  # bytes of one destination block
        if dst_b is not None:
            count = int(dst_b.max()) + 1
            raw_tb, raw_count, raw_blocks = unit * count, count, True
        else:
            raw_tb, raw_count, raw_blocks = entry.stride, 1, False

        def raw(layer: int) -> XferSpec:
            k = 2 * (layer - src_r.start)
            return XferSpec(
                "push",
                {"by": "addrs"},
                shape,
                entry,
                local_slot=src_slot,
                src_range=range(layer, layer + 1),
                dst_range=range(0, 1),
                src_blocks=src_b,
                dst_blocks=dst_b,
                dst_block_bytes=unit if dst_b is not None else None,
                raw_addrs=addrs[k : k + 2],
                raw_tensor_bytes=raw_tb,
                raw_count=raw_count,
                raw_is_blocks=raw_blocks,
            )

        return raw


_PULL_DEFAULTS: dict[str, Any] = {
    "src_layer_range": None,
    "dst_layer_range": None,
    "tensor_num_per_layer": 2,
    "src_cache_offset": -1,
    "dst_cache_offset": -1,
}
_PULL_KWARGS = set(_PULL_DEFAULTS)


def _resolve_in_table(table: dict[str, Any], target: dict[str, Any], peer: int) -> dict[str, Any]:
    """Resolve a target against the peer's table snapshot (remote-accessible mode).

    Raises:
        LLMException: LLM_KV_CACHE_NOT_EXIST when the snapshot has no such cache or key;
            LLM_PARAM_INVALID when that cache is not remote accessible.
    """
    by = target["by"]
    if by == "blocks_key":
        cid = table.get("blocks_keys", {}).get(str(target["model_id"]))
        index = 0
    elif by == "cache_id":
        cid, index = target["cache_id"], target.get("index", 0)
    else:
        return target
    entry = next((c for c in table.get("caches", []) if c.get("cache_id") == cid), None)
    if cid is None or entry is None:
        raise LLMException(
            f"cluster {peer} published no cache for {target} (its table is snapshotted at the "
            "first transfer of a link: register before that, or re-link)",
            status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
        )
    raise_if_false(
        entry.get("remote_accessible"), f"cache {cid} of cluster {peer} is not remote accessible"
    )
    return {"by": "cache_id", "cache_id": cid, "index": index}


def _check_synchronizer(sync: Any) -> None:
    if not callable(getattr(sync, "synchronize_layer", None)):
        raise TypeError(
            "layer_synchronizer must be a LayerSynchronizer or AsyncLayerSynchronizer "
            f"(something with synchronize_layer), got {type(sync).__name__}"
        )


def _with_table(
    make: Callable[[int], XferSpec], table: dict[str, Any], peer: int
) -> Callable[[int], XferSpec]:
    """Resolve a keyed destination through the peer's table snapshot once, for every layer."""
    resolved: dict[str, Any] = {}

    def make_resolved(layer: int) -> XferSpec:
        spec = make(layer)
        if spec.target.get("by") != "addrs":
            if not resolved:
                resolved.update(_resolve_in_table(table, spec.target, peer))
            spec.target = dict(resolved)
        return spec

    return make_resolved
