"""Where a cache's memory comes from: caller memory registered, or pool memory allocated.

Each function checks its arguments (:mod:`._api_checks`), resolves or allocates the tensors'
memory, adds a :class:`._registry.CacheEntry` to the engine's registry and returns it with a
factory of typed numpy views (``Cache.tensors``). Binding keys and building the user-facing
``Cache`` is the :class:`._cache_manager.CacheManager`'s part.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._api_checks import check_desc_for_memory, check_register
from ._checks import check_isinstance
from ._devices import DeviceAdapter, DevicePool
from ._engine import Engine
from ._enums import LLMStatusCode, Placement
from ._errors import LLMException, raise_if_false
from ._memory import check_memory_dtype, host_view, resolve_host_memory
from ._registry import CacheEntry
from ._types import CacheDesc

__all__ = ["Views", "allocate_memory", "register_memory"]

#: the typed views of a cache's tensors, made on demand
Views = Callable[[], list[np.ndarray]]

_POOL_OPTION = {Placement.DEVICE: "llm.MemPoolConfig", Placement.HOST: "llm.HostMemPoolConfig"}


def _typed_views(
    adapter: DeviceAdapter, desc: CacheDesc, raw: Callable[[int], np.ndarray]
) -> Views:
    dtype, shape, n = desc.data_type.numpy_dtype, tuple(desc.shape), desc.num_tensors
    placement = desc.placement

    def views() -> list[np.ndarray]:
        raise_if_false(
            placement == Placement.HOST or adapter.host_addressable,
            f"DEVICE memory of the {adapter.name} adapter is not host-addressable; "
            "use your framework's tensors",
        )
        return [raw(i).view(dtype).reshape(shape) for i in range(n)]

    return views


def _new_entry(
    engine: Engine,
    desc: CacheDesc,
    is_blocks: bool,
    addrs: np.ndarray,
    remote_accessible: bool,
    **extra: Any,
) -> CacheEntry:
    """A registry entry with a fresh id for ``desc`` (not added to the registry yet)."""
    return CacheEntry(
        cache_id=engine.registry.new_id(),
        num_tensors=desc.num_tensors,
        tensor_bytes=desc.size,
        count=desc.shape[0],
        is_blocks=is_blocks,
        placement=desc.placement,
        dtype=desc.data_type.value,
        shape=tuple(desc.shape),
        addrs=addrs,
        remote_accessible=remote_accessible,
        device_memory=not engine.host_reachable(addrs),
        **extra,
    )


def register_memory(
    engine: Engine,
    cache_desc: CacheDesc,
    addrs: Sequence[Any],
    is_blocks: bool,
    remote_accessible: bool | None,
) -> tuple[CacheEntry, Views]:
    """Register caller memory (raw addresses or memory objects, kept alive while registered).

    Raises:
        TypeError / ValueError: wrong argument types.
        LLMException: LLM_PARAM_INVALID as :func:`._api_checks.check_register`, for address 0,
            memory smaller than the description or of another element type, or overlapping
            memory.
    """
    remote_accessible = check_register(cache_desc, addrs, remote_accessible, engine.comm_linked)
    nbytes = cache_desc.size
    for i, a in enumerate(addrs):
        check_memory_dtype(a, cache_desc.data_type, f"addrs[{i}]")
    resolved = []
    for i, a in enumerate(addrs):
        if cache_desc.placement == Placement.DEVICE:
            resolved.append(engine.adapter.resolve(a, nbytes, f"addrs[{i}]"))
        else:
            resolved.append(resolve_host_memory(a, nbytes, f"addrs[{i}]"))
    entry = _new_entry(
        engine,
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

    return entry, _typed_views(engine.adapter, cache_desc, raw)


def _pool(engine: Engine, placement: Placement) -> DevicePool:
    pools = engine.pools
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
    assert pool is not None
    return pool


def allocate_memory(
    engine: Engine, cache_desc: CacheDesc, is_blocks: bool
) -> tuple[CacheEntry, Views]:
    """Allocate a cache's tensors from the pool of its placement.

    Raises:
        TypeError: not a CacheDesc.
        LLMException: LLM_FEATURE_NOT_ENABLED without any pool, LLM_PARAM_INVALID without a
            pool of this placement or for a bad description, LLM_OUT_OF_MEMORY when the pool
            is full.
    """
    check_isinstance("cache_desc", cache_desc, CacheDesc)
    check_desc_for_memory(cache_desc)
    pool = _pool(engine, cache_desc.placement)
    nbytes = cache_desc.size
    page = pool.page_size
    per_tensor = math.ceil(nbytes / page) * page
    # One run for all tensors (one mapping, one allocation); plans still keep each descriptor
    # inside one tensor, as every range check is per tensor.
    alloc = pool.allocate(per_tensor * cache_desc.num_tensors)
    addrs = alloc.addr + np.arange(cache_desc.num_tensors, dtype=np.uint64) * np.uint64(per_tensor)
    entry = _new_entry(
        engine,
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

    return entry, _typed_views(engine.adapter, cache_desc, raw)
