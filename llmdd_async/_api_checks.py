"""The argument checks of the cache and endpoint API (reference §5-§8), pure and apart.

Everything here looks only at its arguments (and at local cache entries, plain data): no
engine, no event loop, no I/O. Each function raises upstream's exception class for the case
(``TypeError`` / ``ValueError`` for types and integer ranges, ``LLMException`` with
LLM_PARAM_INVALID for semantic checks) so that a call fails synchronously, before any task
exists. :class:`._cache_manager.CacheManager` runs them, then does the work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._checks import (
    UINT64_MAX,
    check_index_list,
    check_int32,
    check_int64,
    check_isinstance,
    check_list_of,
    check_range,
    check_uint32,
    check_uint64,
)
from ._cluster import LLMClusterInfo
from ._enums import LLMStatusCode, Memtype, Placement
from ._errors import LLMException, raise_if_false, raise_param
from ._messages import Shape
from ._registry import CacheEntry, SlotKey
from ._types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    MemInfo,
    TransferConfig,
    TransferWithCacheKeyConfig,
    slot_key_of,
)

__all__ = [
    "TransferShape",
    "block_lists",
    "check_clusters",
    "check_config",
    "check_desc_for_memory",
    "check_layer_args",
    "check_mem_infos",
    "check_pull_blocks",
    "check_pull_cache",
    "check_pull_key",
    "check_push_blocks",
    "check_push_cache",
    "check_register",
    "check_synchronizer",
    "check_transfer",
    "layer_kwargs",
    "pull_kwargs",
    "push_ranges",
    "slot_keys",
]


# ---------------------------------------------------------------------- descriptions, keys
def check_desc_for_memory(desc: CacheDesc) -> None:
    """A description memory can be laid out for.

    Raises:
        LLMException: LLM_PARAM_INVALID for 0 or over 32 dims, a dim <= 0, ``DT_STRING`` or no
            tensors.
    """
    shape = desc.shape
    raise_if_false(1 <= len(shape) <= 32, f"shape must have 1 to 32 dims, got {len(shape)}")
    raise_if_false(all(d > 0 for d in shape), f"shape dims must be > 0, got {shape}")
    try:
        desc.data_type.itemsize  # noqa: B018 - raises for DT_STRING
    except ValueError as exc:
        raise LLMException(str(exc), status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
    raise_if_false(desc.num_tensors > 0, "num_tensors must be > 0")


def slot_keys(
    cache_desc: CacheDesc, cache_keys: Sequence[CacheKey], registered: bool
) -> tuple[int, list[SlotKey | None]]:
    """``(slot count, engine identity of each key)``; the registry checks the bindings.

    Registered caches skip keys whose req_id is unset (upstream); allocated caches treat them
    as prefix keys or empty-slot placeholders.

    Raises:
        TypeError: not a CacheDesc, or keys that are not a list/tuple of CacheKey.
    """
    check_isinstance("cache_desc", cache_desc, CacheDesc)
    check_list_of("cache_keys", cache_keys, CacheKey)
    keys = [None if registered and k.req_id == UINT64_MAX else slot_key_of(k) for k in cache_keys]
    return (cache_desc.shape[0] if cache_desc.shape else 0), keys


def check_register(
    cache_desc: CacheDesc, addrs: Any, remote_accessible: bool | None, comm_linked: bool
) -> bool:
    """The arguments of ``register_(blocks_)cache``; returns the effective remote_accessible
    (DEVICE memory is, HOST memory is not, and nothing is by default after ``link()``).

    Raises:
        TypeError: bad argument types.
        LLMException: LLM_PARAM_INVALID for empty or wrong-length ``addrs``, a bad description,
            or ``remote_accessible=True`` after ``link()``.
    """
    check_isinstance("cache_desc", cache_desc, CacheDesc)
    check_isinstance("addrs", addrs, (list, tuple))
    check_isinstance("remote_accessible", remote_accessible, bool, optional=True)
    raise_if_false(len(addrs) > 0, "addrs must not be empty")
    raise_if_false(
        len(addrs) == cache_desc.num_tensors,
        f"{len(addrs)} addresses for {cache_desc.num_tensors} tensors",
    )
    check_desc_for_memory(cache_desc)
    if remote_accessible is None:
        remote_accessible = cache_desc.placement == Placement.DEVICE and not comm_linked
    raise_if_false(
        not (remote_accessible and comm_linked),
        "remote_accessible=True is not allowed after link()",
    )
    return remote_accessible


def check_mem_infos(mem_infos: MemInfo | Sequence[MemInfo]) -> None:
    """The items of ``remap_registered_memory``.

    Raises:
        TypeError: bad argument types.
        LLMException: LLM_PARAM_INVALID for a non-device item, address 0 or size 0.
    """
    items = [mem_infos] if isinstance(mem_infos, MemInfo) else mem_infos
    check_isinstance("mem_infos", items, (list, tuple))
    for i, m in enumerate(items):
        check_isinstance(f"mem_infos[{i}]", m, MemInfo)
        raise_if_false(m.mem_type == Memtype.MEM_TYPE_DEVICE, "mem_type must be DEVICE")
        raise_if_false(m.addr != 0 and m.size > 0, "addr must be != 0 and size > 0")


def check_clusters(clusters: Any, timeout: Any) -> None:
    """The arguments of ``link_clusters`` / ``unlink_clusters``.

    Raises:
        TypeError / ValueError: not a list of LLMClusterInfo, a ``remote_cluster_id`` left None
            or not a uint64, a timeout that is not an int32.
        LLMException: LLM_PARAM_INVALID for ``timeout <= 0``.
    """
    for i, c in enumerate(check_list_of("clusters", clusters, LLMClusterInfo)):
        if c.remote_cluster_id is None:
            raise TypeError(f"clusters[{i}].remote_cluster_id must be set (uint64)")
        check_uint64(f"clusters[{i}].remote_cluster_id", c.remote_cluster_id)
    check_int32("timeout", timeout)
    raise_if_false(timeout > 0, f"timeout must be > 0 ms, got {timeout}")


# ---------------------------------------------------------------------- remote movement
def layer_kwargs(
    src_layer_range: range | None, dst_layer_range: range | None, tensor_num_per_layer: int
) -> dict[str, Any]:
    """The layer arguments of a pull as the checks take them (unchecked: see
    :func:`check_layer_args`); ``pull_blocks`` has no offsets (:func:`pull_kwargs`)."""
    return {
        "src_layer_range": src_layer_range,
        "dst_layer_range": dst_layer_range,
        "tensor_num_per_layer": tensor_num_per_layer,
    }


#: the keyword arguments of ``pull_cache`` and their defaults
def pull_kwargs(
    src_layer_range: range | None = None,
    dst_layer_range: range | None = None,
    tensor_num_per_layer: int = 2,
    src_cache_offset: int = -1,
    dst_cache_offset: int = -1,
) -> dict[str, Any]:
    """A pull's keyword arguments (upstream's layer ranges, our offsets) as one dict, the
    offsets checked (-1 becomes 0).

    Raises:
        TypeError: an offset that is not an int. ValueError: an offset outside int64.
        LLMException: LLM_PARAM_INVALID for an offset below -1.
    """
    out = layer_kwargs(src_layer_range, dst_layer_range, tensor_num_per_layer)
    for name, value in (
        ("src_cache_offset", src_cache_offset),
        ("dst_cache_offset", dst_cache_offset),
    ):
        check_int64(name, value)
        if value < -1:  # (on every pull: the message is formatted only when it fails)
            raise_param(f"{name} must be >= 0 (or -1 for none)")
        out[name] = max(0, int(value))
    return out


def block_lists(src_blocks: Any, dst_blocks: Any) -> tuple[np.ndarray, np.ndarray]:
    """Both block index lists as arrays. Raises TypeError / ValueError as check_index_list."""
    src_b = check_index_list("src_blocks", src_blocks)
    dst_b = check_index_list("dst_blocks", dst_blocks)
    assert src_b is not None  # not optional
    assert dst_b is not None
    return src_b, dst_b


def check_layer_args(
    entry: CacheEntry,
    src_layer_range: Any,
    dst_layer_range: Any,
    tensor_num_per_layer: Any,
    local_is_dst: bool,
) -> tuple[range | None, range | None, int]:
    """Layer ranges of a pull, checked with local knowledge only (the peer checks its side).

    Raises:
        TypeError / ValueError: wrong types. LLMException: LLM_PARAM_INVALID for a bad
            ``tensor_num_per_layer``, a range outside the local cache, or ranges that select
            different tensor counts.
    """
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


def check_pull_key(name: str, key: Any, remote_accessible: bool, blocks: bool) -> None:
    """The source key of ``pull_cache`` (``blocks=False``) or ``pull_blocks``: a
    CacheKeyByIdAndIndex, a CacheKey outside remote-accessible mode, a BlocksCacheKey for
    blocks.

    Raises:
        TypeError: another key type.
    """
    allowed: tuple[type, ...] = (
        (CacheKeyByIdAndIndex,) if remote_accessible else (CacheKey, CacheKeyByIdAndIndex)
    )
    check_isinstance(name, key, (BlocksCacheKey, *allowed) if blocks else allowed)


def check_pull_cache(
    entry: CacheEntry, cache_key: Any, batch_index: int, size: int, kw: dict[str, Any]
) -> tuple[range | None, range | None, int]:
    """The arguments of ``pull_cache`` (``kw`` from :func:`pull_kwargs`); returns the ranges.

    Raises:
        TypeError / ValueError: wrong argument types.
        LLMException: LLM_PARAM_INVALID for a blocks cache, bad size, slot, ranges or offsets,
            or an invalid key.
    """
    check_uint32("batch_index", batch_index)
    check_int64("size", size)
    raise_if_false(not entry.is_blocks, "pull_cache needs a contiguous (non-blocks) cache")
    raise_if_false(size == -1 or size > 0, f"size must be -1 or > 0, got {size}")
    raise_if_false(batch_index < entry.count, f"batch_index {batch_index} >= {entry.count}")
    raise_if_false(kw["dst_cache_offset"] < entry.stride, "dst_cache_offset is outside the slot")
    raise_if_false(
        size <= entry.stride - kw["dst_cache_offset"],
        f"size {size} exceeds the local slot of {entry.stride} bytes",
    )
    if isinstance(cache_key, CacheKey):
        cache_key.check_pullable()
    return check_layer_args(
        entry, kw["src_layer_range"], kw["dst_layer_range"], kw["tensor_num_per_layer"], True
    )


def check_pull_blocks(
    entry: CacheEntry,
    src_cache_key: Any,
    src_blocks: Any,
    dst_blocks: Any,
    kw: dict[str, Any],
    blocks_to_blocks: bool,
) -> tuple[Shape, np.ndarray | None, np.ndarray, tuple[range | None, range | None, int]]:
    """The arguments of ``pull_blocks``: ``(shape, src blocks or None, dst blocks, ranges)``.

    Raises:
        TypeError / ValueError: wrong argument types.
        LLMException: LLM_PARAM_INVALID for a contiguous destination, empty or unequal block
            lists, local indices out of range, or bad ranges.
    """
    src_b, dst_b = block_lists(src_blocks, dst_blocks)
    raise_if_false(entry.is_blocks, "pull_blocks needs a blocks destination cache")
    raise_if_false(len(dst_b) > 0, "dst_blocks must not be empty")
    top = max(dst_b.tolist()) if 0 < len(dst_b) <= 64 else int(dst_b.max(initial=0))
    if top >= entry.count:
        raise_param(f"dst block {top} >= the local {entry.count} blocks")
    if blocks_to_blocks:
        raise_if_false(len(src_b) > 0, "src_blocks must not be empty with a BlocksCacheKey")
        if len(src_b) != len(dst_b):
            raise_param(f"src_blocks ({len(src_b)}) and dst_blocks ({len(dst_b)}) differ in length")
        shape = Shape.BLOCKS
    else:
        raise_if_false(len(src_b) == 0, "src_blocks must be empty when pulling a contiguous slot")
        if isinstance(src_cache_key, CacheKey):
            src_cache_key.check_pullable()
        shape = Shape.SLOT_TO_BLOCKS
    ranges = check_layer_args(
        entry, kw["src_layer_range"], kw["dst_layer_range"], kw["tensor_num_per_layer"], True
    )
    return shape, (src_b if shape is Shape.BLOCKS else None), dst_b, ranges


def push_ranges(
    entry: CacheEntry, src_layer_range: Any, dst_layer_range: Any, tnpl: Any
) -> tuple[tuple[range | None, range | None, int], int]:
    """``((src range, dst range, tensors per layer), layers)`` of a push: its ranges and its
    number of layers (the deadline budget).

    Both None means every tensor, as for pulls (so a one-tensor cache with the default
    ``tensor_num_per_layer=2`` still moves its tensor).

    Raises:
        TypeError / ValueError: wrong types. LLMException: LLM_PARAM_INVALID for bad,
            unequal or out-of-cache ranges.
    """
    check_uint32("tensor_num_per_layer", tnpl)
    n = int(tnpl)
    raise_if_false(n > 0, "tensor_num_per_layer must be > 0")
    src_r = check_range("src_layer_range", src_layer_range)
    dst_r = check_range("dst_layer_range", dst_layer_range)
    layers = entry.num_tensors // n
    if src_r is None and dst_r is None:
        return (None, None, n), max(1, layers)
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
    return (src_r, dst_r, n), len(src_r)


def check_push_cache(
    entry: CacheEntry,
    src_batch_index: int,
    size: int,
    src_layer_range: Any,
    dst_layer_range: Any,
    tensor_num_per_layer: Any,
) -> tuple[tuple[range | None, range | None, int], int]:
    """The arguments of ``push_cache``; returns its ranges and layer count as
    :func:`push_ranges`.

    Raises:
        TypeError / ValueError: wrong argument types.
        LLMException: LLM_PARAM_INVALID for a blocks cache, ``size != -1``, a slot outside the
            cache, bad or unequal ranges.
    """
    check_uint32("src_batch_index", src_batch_index)
    check_int64("size", size)
    raise_if_false(not entry.is_blocks, "push_cache needs a contiguous (non-blocks) cache")
    raise_if_false(size == -1, f"push_cache only supports size=-1, got {size}")
    raise_if_false(src_batch_index < entry.count, "src_batch_index is outside the cache")
    return push_ranges(entry, src_layer_range, dst_layer_range, tensor_num_per_layer)


def check_push_blocks(entry: CacheEntry, src_blocks: Any, dst_blocks: Any) -> tuple[Any, Any]:
    """The block lists of ``push_blocks``.

    Raises:
        TypeError / ValueError: wrong types. LLMException: LLM_PARAM_INVALID for a contiguous
            source, empty or unequal lists, or local indices out of range.
    """
    src_b, dst_b = block_lists(src_blocks, dst_blocks)
    raise_if_false(entry.is_blocks, "push_blocks needs a blocks source cache")
    raise_if_false(len(dst_b) > 0, "dst_blocks must not be empty")
    raise_if_false(len(src_b) > 0, "src_blocks must not be empty")
    if len(src_b) != len(dst_b):
        raise_param(f"src_blocks ({len(src_b)}) and dst_blocks ({len(dst_b)}) differ in length")
    top = max(src_b.tolist()) if len(src_b) <= 64 else int(src_b.max())
    if top >= entry.count:
        raise_param(f"src block {top} >= the local {entry.count} blocks")
    return src_b, dst_b


# ---------------------------------------------------------------------- transfer_cache_async
def check_synchronizer(sync: Any) -> None:
    """Raises TypeError unless ``sync`` has a callable ``synchronize_layer``."""
    if not callable(getattr(sync, "synchronize_layer", None)):
        raise TypeError(
            "layer_synchronizer must be a LayerSynchronizer or AsyncLayerSynchronizer "
            f"(something with synchronize_layer), got {type(sync).__name__}"
        )


@dataclasses.dataclass(frozen=True)
class TransferShape:
    """What every config of one ``transfer_cache_async`` shares: how the source is read."""

    shape: Shape
    tensor_num_per_layer: int
    #: the source's layers
    layers: int
    #: a contiguous source with block indices is read as blocks of its dim-0 slices, as
    #: upstream's engine does (§7, §9.1)
    read_as_blocks: bool
    src_blocks: np.ndarray | None
    dst_blocks: np.ndarray | None
    #: bytes of one destination block, when the caller gave them
    dst_block_bytes: int | None


def check_transfer(
    entry: CacheEntry,
    layer_synchronizer: Any,
    transfer_configs: Any,
    src_block_indices: Any,
    dst_block_indices: Any,
    dst_block_memory_size: Any,
    tensor_num_per_layer: Any,
    remote_accessible: bool,
) -> TransferShape:
    """The arguments of ``transfer_cache_async`` that all its configs share.

    Raises:
        TypeError / ValueError: wrong argument types, or the wrong config class for the mode.
        LLMException: LLM_PARAM_INVALID for a HOST source, a tensor count that is not a
            multiple of ``tensor_num_per_layer``, missing or unequal block lists, or a missing
            or stray ``dst_block_memory_size``.
    """
    check_synchronizer(layer_synchronizer)
    check_isinstance("transfer_configs", transfer_configs, (list, tuple))
    cfg_type = TransferWithCacheKeyConfig if remote_accessible else TransferConfig
    for i, c in enumerate(transfer_configs):
        if not isinstance(c, cfg_type):
            raise TypeError(
                f"transfer_configs[{i}] must be {cfg_type.__name__} when remote-accessible "
                f"mode is {'on' if remote_accessible else 'off'}, got {type(c).__name__}"
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
    read_as_blocks = False
    if src_b is not None:
        read_as_blocks = not entry.is_blocks
        raise_if_false(dst_b is not None, "dst_block_indices are required with src_block_indices")
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
        # A blocks source without indices (upstream's own sample does this): every block, to
        # the same block positions of the destination.
        raise_if_false(
            dst_b is None, "dst_block_indices need src_block_indices with a blocks source"
        )
        src_b = dst_b = np.arange(entry.count, dtype=np.int64)
    elif dst_b is not None:
        raise_if_false(len(dst_b) > 0, "dst_block_indices must not be empty")
        raise_if_false(
            dbm is not None,
            "dst_block_memory_size is required for a contiguous source sent to blocks",
        )
    if dst_b is None:
        raise_if_false(
            dbm is None, "dst_block_memory_size must be None or 0 for a contiguous target"
        )
    if src_b is not None:
        shape = Shape.BLOCKS
    else:
        shape = Shape.SLOT_TO_BLOCKS if dst_b is not None else Shape.SLOT
    return TransferShape(shape, tnpl, entry.num_tensors // tnpl, read_as_blocks, src_b, dst_b, dbm)


def check_config(
    i: int,
    config: TransferConfig | TransferWithCacheKeyConfig,
    entry: CacheEntry,
    ts: TransferShape,
) -> range:
    """One config of ``transfer_cache_async``; returns its source layer range.

    Raises:
        LLMException: LLM_PARAM_INVALID for a layer range outside the cache, a wrong number of
            ``dst_addrs``, or a ``src_batch_index`` that a blocks source or the cache forbids.
    """
    src_r = config.src_layer_range or range(0, ts.layers)
    raise_if_false(
        src_r.stop <= ts.layers,
        f"transfer_configs[{i}].src_layer_range {src_r} exceeds the {ts.layers} layers",
    )
    raise_if_false(
        ts.src_blocks is None or config.src_batch_index == 0,
        f"transfer_configs[{i}].src_batch_index must be 0 with a blocks source",
    )
    raise_if_false(
        entry.is_blocks or config.src_batch_index < entry.count,
        f"transfer_configs[{i}].src_batch_index is outside the source cache",
    )
    if isinstance(config, TransferConfig):
        raise_if_false(
            len(config.dst_addrs) == 2 * len(src_r),
            f"transfer_configs[{i}] needs {2 * len(src_r)} dst_addrs (K and V for "
            f"each of {len(src_r)} layers), got {len(config.dst_addrs)}",
        )
    return src_r
