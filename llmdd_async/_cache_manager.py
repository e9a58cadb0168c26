"""``CacheManager``: local bookkeeping as plain calls, every data movement as a ``CacheTask``.

Reference §8. A thin surface: each method runs its argument checks (pure, in
:mod:`._api_checks`) synchronously at the call, before a task exists, then hands the work on:
memory to :mod:`._cache_memory` and the registry, movements to :mod:`._movements` (which
starts them under the scheduler, owner of every per-link turn and deadline).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._api_checks import (
    check_mem_infos,
    check_pull_blocks,
    check_pull_cache,
    check_pull_key,
    check_push_blocks,
    check_push_cache,
    check_transfer,
    layer_kwargs,
    pull_kwargs,
    push_ranges,
    slot_keys,
)
from ._cache_memory import Views, allocate_memory, register_memory
from ._checks import check_int64, check_isinstance
from ._engine import Engine
from ._enums import LLMStatusCode
from ._errors import LLMException, raise_if_false, raise_param
from ._local_copy import plan_copy_blocks, plan_copy_cache, plan_swap_blocks
from ._messages import Op, Shape
from ._movements import (
    release_allocated,
    require_remote_accessible_mode,
    start_copy,
    start_request,
    start_transfer,
)
from ._registry import CacheEntry
from ._task import CacheTask
from ._types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    MemInfo,
    TransferConfig,
    TransferWithCacheKeyConfig,
    slot_key_of,
)

__all__ = ["CacheManager"]


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
        """The live engine. Raises RuntimeError once finalized or off the loop's thread."""
        engine = self._engine
        if engine.closed:
            raise RuntimeError("llm datadist is not initialized")
        engine.check_thread()
        return engine

    def _entry(self, cache: Cache, name: str) -> CacheEntry:
        check_isinstance(name, cache, Cache)
        if not cache.valid:  # (on every request: the message is formatted only when it fails)
            raise_param(f"{name} ({cache}) is no longer valid")
        entry = self.engine.registry.entries.get(cache.cache_id)
        if entry is None or entry.id_released or not cache.issued_by(self):
            raise LLMException(
                f"{name}: cache {cache.cache_id} is not a cache of this endpoint",
                status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
            )
        return entry

    def _make_cache(self, entry: CacheEntry, desc: CacheDesc, views: Views) -> Cache:
        cache = self._cache_cls(
            entry.cache_id,
            desc,
            [int(a) for a in entry.addrs],
            entry.is_blocks,
            is_registered=not entry.allocated,
            views=views,
        )
        cache.issuer = self
        return cache

    def _blocks_cache(
        self, entry: CacheEntry, desc: CacheDesc, views: Views, key: BlocksCacheKey | None
    ) -> Cache:
        desc.mark_blocks()  # upstream sets its hidden flag on the caller's description
        if key is not None:
            self._engine.registry.bind_blocks_key(entry, key.model_id)
        return self._make_cache(entry, desc, views)

    def _slot_keys(
        self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey], registered: bool
    ) -> list[tuple[str, int, int] | None]:
        count, keys = slot_keys(cache_desc, cache_keys, registered)
        self.engine.registry.check_slot_keys(count, keys)
        return keys

    # ------------------------------------------------------------------ registration
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
        entry, views = register_memory(self.engine, cache_desc, addrs, False, remote_accessible)
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
        entry, views = register_memory(self.engine, cache_desc, addrs, True, remote_accessible)
        return self._blocks_cache(entry, cache_desc, views, blocks_cache_key)

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
        entry, views = allocate_memory(self.engine, cache_desc, False)
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
        entry, views = allocate_memory(self.engine, cache_desc, True)
        return self._blocks_cache(entry, cache_desc, views, blocks_cache_key)

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
        if entry is None or not entry.allocated or not cache.issued_by(self):
            return
        cache.invalidate()
        self._engine.registry.release_id(entry)

    def release_dropped(self, cache_id: int) -> None:
        """Free an allocated cache whose last reference went (legacy ``KvCache``), from any
        thread; a no-op once the engine is finalized."""
        engine = self._engine
        if engine.closed:
            return
        engine.call_soon(lambda: release_allocated(engine, cache_id))

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
        check_mem_infos(mem_infos)
        raise LLMException(
            "remap_registered_memory is reserved upstream and not needed by this library's "
            "transports",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        )

    # ------------------------------------------------------------------ local movement
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
        d, s = self._entry(dst, "dst"), self._entry(src, "src")
        plan = plan_copy_cache(d, s, dst_batch_index, src_batch_index, offset, size, req_id)
        return start_copy(self.engine, "copy_cache", plan, [s, d])

    def copy_blocks(self, cache: Cache, copy_block_info: dict[int, list[int]]) -> CacheTask:
        """Inside one blocks cache, copy block ``src`` to every block in its list.

        Raises:
            TypeError / ValueError: wrong argument types.
            LLMException: LLM_PARAM_INVALID for a contiguous cache, indices out of range, a
                destination given twice, or a block that is both source and destination.
        """
        entry = self._entry(cache, "cache")
        plan = plan_copy_blocks(entry, copy_block_info)
        return start_copy(self.engine, "copy_blocks", plan, [entry])

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
        plan, entries = plan_swap_blocks(src_cache, dst_cache, src_to_dst, self._entry)
        return start_copy(self.engine, "swap_blocks", plan, entries)

    # ------------------------------------------------------------------ remote movement
    def pull_cache(
        self,
        cache_key: CacheKey | CacheKeyByIdAndIndex,
        cache: Cache,
        batch_index: int = 0,
        size: int = -1,
        *,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
        src_cache_offset: int = -1,
        dst_cache_offset: int = -1,
    ) -> CacheTask:
        """Pull one contiguous batch slot of a linked peer into local slot ``batch_index``.

        ``size`` bytes per tensor (-1: the local slot after ``dst_cache_offset``). The layer
        ranges select tensors ``[start * n, stop * n)`` with ``n = tensor_num_per_layer``
        (upstream's keyword arguments); the offsets (-1: none) are bytes into each tensor's
        slot. A req key of a cache the peer allocated is consumed once this pull succeeded
        (request/response mode).

        Raises:
            TypeError / ValueError: wrong argument types (a CacheKey in remote-accessible mode).
            LLMException: LLM_PARAM_INVALID for a blocks cache, bad size, slot, ranges or
                offsets, an invalid key, or the own cluster id; LLM_NOT_YET_LINK without a
                link. The task fails with LLM_KV_CACHE_NOT_EXIST when the peer has no such
                key/cache/slot, LLM_TIMEOUT after ``sync_kv_timeout``, LLM_LINK_FAILED when the
                peer dies.
        """
        layers = (src_layer_range, dst_layer_range, tensor_num_per_layer)
        kw = pull_kwargs(*layers, src_cache_offset, dst_cache_offset)
        check_pull_key("cache_key", cache_key, self.engine.options.remote_accessible, False)
        entry = self._entry(cache, "cache")
        ranges = check_pull_cache(entry, cache_key, batch_index, size, kw)
        offsets = {"src_offset": kw["src_cache_offset"], "dst_offset": kw["dst_cache_offset"]}
        return start_request(
            self.engine, "pull_cache", Op.PULL, cache_key, Shape.SLOT, entry, ranges,
            local_slot=batch_index, size=size, **offsets,
        )  # fmt: skip

    def pull_blocks(
        self,
        src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
        dst_cache: Cache,
        src_blocks: Sequence[int] = (),
        dst_blocks: Sequence[int] = (),
        *,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
    ) -> CacheTask:
        """Pull blocks of a linked peer into local blocks.

        With a BlocksCacheKey: block ``src_blocks[i]`` lands in ``dst_blocks[i]`` (runs that are
        consecutive on both sides move as one copy). With a CacheKey / CacheKeyByIdAndIndex:
        the peer's contiguous slot is cut into block-sized pieces, piece ``i`` landing in
        ``dst_blocks[i]`` (``src_blocks`` must be empty). The layer ranges as for
        :meth:`pull_cache`.

        Raises:
            TypeError / ValueError: wrong argument types.
            LLMException: LLM_PARAM_INVALID for a contiguous destination, empty or unequal
                block lists, local indices out of range, bad ranges or the own cluster id;
                LLM_NOT_YET_LINK without a link. The task fails as for :meth:`pull_cache`
                (LLM_PARAM_INVALID for remote indices out of range).
        """
        kw = layer_kwargs(src_layer_range, dst_layer_range, tensor_num_per_layer)
        check_pull_key("src_cache_key", src_cache_key, self.engine.options.remote_accessible, True)
        to_blocks = isinstance(src_cache_key, BlocksCacheKey)
        return self._pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks, kw, to_blocks)

    def pull_blocks_by_id(
        self,
        key: CacheKeyByIdAndIndex,
        dst_cache: Cache,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        src_r: range | None,
        dst_r: range | None,
        n: int,
    ) -> CacheTask:
        """Blocks -> blocks by the peer's cache id (C++ PullKvBlocks); raises as pull_blocks."""
        kw = layer_kwargs(src_r, dst_r, n)
        return self._pull_blocks(key, dst_cache, src_blocks, dst_blocks, kw, True)

    def _pull_blocks(
        self,
        key: Any,
        dst_cache: Cache,
        src_blocks: Any,
        dst_blocks: Any,
        kw: dict[str, Any],
        to_blocks: bool,
    ) -> CacheTask:
        """``kw`` as :func:`._api_checks.layer_kwargs`; ``to_blocks``: blocks -> blocks."""
        entry = self._entry(dst_cache, "dst_cache")
        shape, src_b, dst_b, ranges = check_pull_blocks(
            entry, key, src_blocks, dst_blocks, kw, to_blocks
        )
        return start_request(
            self.engine,
            "pull_blocks",
            Op.PULL,
            key,
            shape,
            entry,
            ranges,
            src_blocks=src_b,
            dst_blocks=dst_b,
        )

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
        require_remote_accessible_mode(self.engine, "push_cache")
        check_isinstance("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex)
        entry = self._entry(src_cache, "src_cache")
        ranges, steps = check_push_cache(
            entry, src_batch_index, size, src_layer_range, dst_layer_range, tensor_num_per_layer
        )
        return start_request(
            self.engine,
            "push_cache",
            Op.PUSH,
            dst_cache_key,
            Shape.SLOT,
            entry,
            ranges,
            steps,
            local_slot=src_batch_index,
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
        require_remote_accessible_mode(self.engine, "push_blocks")
        check_isinstance("dst_cache_key", dst_cache_key, BlocksCacheKey)
        layers = (src_layer_range, dst_layer_range, tensor_num_per_layer)
        return self._push_blocks(dst_cache_key, src_cache, src_blocks, dst_blocks, layers)

    def push_blocks_by_id(
        self,
        key: CacheKeyByIdAndIndex,
        src_cache: Cache,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        src_r: range | None,
        dst_r: range | None,
        n: int,
    ) -> CacheTask:
        """Blocks -> blocks by the peer's cache id (C++ PushKvBlocks); raises as push_blocks."""
        require_remote_accessible_mode(self.engine, "push_blocks")
        return self._push_blocks(key, src_cache, src_blocks, dst_blocks, (src_r, dst_r, n))

    def _push_blocks(
        self, key: Any, src_cache: Cache, src_blocks: Any, dst_blocks: Any, layers: tuple[Any, ...]
    ) -> CacheTask:
        """``layers``: the unchecked ``(src_layer_range, dst_layer_range, tensors per layer)``."""
        entry = self._entry(src_cache, "src_cache")
        src_b, dst_b = check_push_blocks(entry, src_blocks, dst_blocks)
        ranges, steps = push_ranges(entry, *layers)
        return start_request(
            self.engine,
            "push_blocks",
            Op.PUSH,
            key,
            Shape.BLOCKS,
            entry,
            ranges,
            steps,
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

        ``get_results()`` gives one code per config: None where no layer started and nothing
        failed for it (a fetch of its peer's table that failed or timed out sets its code);
        configs to the same cluster share one result, as upstream.

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
        ra = engine.options.remote_accessible
        ts = check_transfer(
            entry,
            layer_synchronizer,
            transfer_configs,
            src_block_indices,
            dst_block_indices,
            dst_block_memory_size,
            tensor_num_per_layer,
            ra,
        )
        return start_transfer(engine, entry, layer_synchronizer, transfer_configs, ts)
