"""How a request names the peer's cache: the wire's addressing format.

A key of the API becomes a *target* (an :class:`~.._messages.Address`: a req/prefix key, a
blocks key's model_id, a cache id and slot, or raw tensor addresses); in remote-accessible
mode a target is resolved against the peer's published table snapshot to a cache id. The
one-layer requests of ``transfer_cache_async`` are built here too, one factory per
destination config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._enums import LLMStatusCode
from .._errors import LLMException, raise_param
from .._messages import Address, By, Op, Shape
from .._registry import CacheEntry
from .._types import (
    BlocksCacheKey,
    CacheKeyByIdAndIndex,
    TransferConfig,
    TransferWithCacheKeyConfig,
    slot_key_of,
)
from .grants import TransferRequest
from .peer_view import cache_info, typed_table

__all__ = ["layer_spec_factory", "resolve_in_table", "target_of", "with_table"]


def target_of(key: Any) -> Address:
    """The target of an API key (a CacheKey must already be pullable)."""
    if isinstance(key, BlocksCacheKey):
        return Address(By.BLOCKS_KEY, model_id=key.model_id)
    if isinstance(key, CacheKeyByIdAndIndex):
        return Address(By.CACHE_ID, cache_id=key.cache_id, index=key.batch_index)
    sk = slot_key_of(key)
    assert sk is not None  # check_pullable ran
    return Address(By.REQ_KEY if sk[0] == "req" else By.PREFIX_KEY, id=sk[1], model_id=sk[2])


def resolve_in_table(table: Mapping[str, Any], target: Address, peer: int) -> Address:
    """Resolve a target (ours) against the peer's table snapshot (remote-accessible mode);
    the table's malformed entries count as nothing.

    Raises:
        LLMException: LLM_KV_CACHE_NOT_EXIST when the snapshot has no such cache or key;
            LLM_PARAM_INVALID when that cache is not remote accessible.
    """
    by = target.by
    if by is By.BLOCKS_KEY:
        cid: int | None = typed_table(table).blocks_keys.get(str(target.model_id))
        index = 0
    elif by is By.CACHE_ID:
        cid, index = target.cache_id, target.index
    else:
        return target
    entry = cache_info(table, cid)
    if cid is None or entry is None:
        what = f"cache id {cid}" if by is By.CACHE_ID else f"blocks key {target.model_id}"
        raise LLMException(
            f"cluster {peer} published no cache for {what} (its table is snapshotted at the "
            "first transfer of a link: register before that, or re-link)",
            status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
        )
    if not entry.remote_accessible:
        raise_param(f"cache {cid} of cluster {peer} is not remote accessible")
    return Address(By.CACHE_ID, cache_id=cid, index=index)


def with_table(
    make: Callable[[range], TransferRequest], table: Mapping[str, Any], peer: int
) -> Callable[[range], TransferRequest]:
    """Resolve a keyed destination through the peer's table snapshot once, for every layer.

    The returned factory raises as :func:`resolve_in_table` (at its first layers).
    """
    resolved: list[Address] = []

    def make_resolved(layers: range) -> TransferRequest:
        spec = make(layers)
        if spec.target.by is not By.ADDRS:
            if not resolved:
                resolved.append(resolve_in_table(table, spec.target, peer))
            spec.target = resolved[0]
        return spec

    return make_resolved


def layer_spec_factory(
    entry: CacheEntry,
    config: TransferConfig | TransferWithCacheKeyConfig,
    src_r: range,
    shape: Shape,
    src_b: np.ndarray | None,
    dst_b: np.ndarray | None,
    dbm: int | None,
    tnpl: int = 2,
) -> Callable[[range], TransferRequest]:
    """The push of ``config`` for a run of consecutive source layers (one request for all of
    them): by key (its ``dst_layer_range`` maps relative to ``src_r``) or to the raw addresses
    of a ``TransferConfig``.

    ``shape``, the block lists ``src_b`` / ``dst_b``, the destination block bytes ``dbm`` and
    ``tnpl`` (tensors per layer) are the transfer's, the same for every config.
    """
    src_slot = config.src_batch_index
    if isinstance(config, TransferWithCacheKeyConfig):
        dst_r = config.dst_layer_range
        target = target_of(config.cache_key)

        def keyed(layers: range) -> TransferRequest:
            dst_layer = dst_r.start + (layers.start - src_r.start)
            return TransferRequest(
                Op.PUSH,
                target,
                shape,
                entry,
                local_slot=src_slot,
                src_range=layers,
                dst_range=range(dst_layer, dst_layer + len(layers)),
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

    def raw(layers: range) -> TransferRequest:
        # two addresses (K and V) per layer of the config, from its first layer on
        k = 2 * (layers.start - src_r.start)
        return TransferRequest(
            Op.PUSH,
            Address(By.ADDRS),
            shape,
            entry,
            local_slot=src_slot,
            src_range=layers,
            dst_range=range(0, len(layers)),
            src_blocks=src_b,
            dst_blocks=dst_b,
            dst_block_bytes=unit if dst_b is not None else None,
            raw_addrs=addrs[k : k + 2 * len(layers)],
            raw_tensor_bytes=raw_tb,
            raw_count=raw_count,
            raw_is_blocks=raw_blocks,
        )

    return raw
