"""The worker's llmdd_async endpoint: one ``LLMDataDist`` with vLLM's KV as one blocks cache.

Every worker registers its KV as ``BlocksCacheKey(own cluster id, MODEL_ID)``, so a peer's
cache is named by the peer's cluster id alone (:func:`cache_key`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._cluster import LLMClusterInfo
from .._datadist import LLMDataDist
from .._enums import LLMRole, Placement
from .._types import BlocksCacheKey, Cache, CacheDesc
from ._config import ConnectorConfig
from ._layout import KVLayout

__all__ = ["MODEL_ID", "Endpoint", "cache_key", "cluster_info", "open_endpoint"]

MODEL_ID = 0


def cache_key(cluster_id: int) -> BlocksCacheKey:
    """The KV cache of the worker whose endpoint is ``cluster_id``."""
    return BlocksCacheKey(cluster_id, MODEL_ID)


def cluster_info(cluster_id: int, data_host: str, data_port: int) -> LLMClusterInfo:
    """What ``link_clusters`` / ``unlink_clusters`` need to reach a peer's data endpoint."""
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_local_ip_info(data_host, 0)
    info.append_remote_ip_info(data_host, data_port)
    return info


@dataclass(frozen=True)
class Endpoint:
    """A started endpoint with the worker's KV registered."""

    dd: LLMDataDist
    cache: Cache
    layout: KVLayout


async def open_endpoint(
    cfg: ConnectorConfig, cluster_id: int, key: str, layout: KVLayout, tensors: list[Any]
) -> Endpoint:
    """Start the endpoint (listening next to the side channel, keyed with ``key``) and
    register ``tensors`` (vLLM's KV, in :func:`~._layout.derive_layout`'s order).

    Raises:
        LLMException: the endpoint could not start or the KV could not be registered (the
            endpoint is finalized again).
    """
    host = cfg.side_channel_host
    data_host = "127.0.0.1" if host == "localhost" else host
    options = {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.listenIpInfo": f"{data_host}:0",
        "llm.Transport": cfg.transport,
        "llm.SyncKvCacheWaitTime": str(int(cfg.transfer_timeout_s * 1000)),
        "llm.AuthKey": key,
    }
    on_device = not layout.device.startswith("cpu")
    if on_device:
        options["llm.DeviceAdapter"] = "torch"
        options["llm.TorchDevice"] = layout.device
    dd = LLMDataDist(LLMRole.MIX, cluster_id)
    await dd.init(options)
    try:
        desc = CacheDesc(
            layout.num_tensors,
            [layout.num_blocks, layout.block_elems],
            layout.data_type,
            Placement.DEVICE,
        )
        addrs: list[Any] = tensors if on_device else [int(t.data_ptr()) for t in tensors]
        cache = dd.cache_manager.register_blocks_cache(
            desc, addrs, cache_key(cluster_id), remote_accessible=True
        )
    except BaseException:
        await dd.finalize()
        raise
    return Endpoint(dd, cache, layout)
