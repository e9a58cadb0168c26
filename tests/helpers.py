"""Helpers shared by the tests (imported as a plain module)."""

from __future__ import annotations

import json
from typing import Any


def pool_json(size: int, page_shift: int = 16) -> str:
    return json.dumps({"memory_size": size, "page_shift": page_shift})


def cm_options(**extra: str) -> dict[str, str]:
    """Cache-manager mode options with a small device and host pool."""
    opts = {
        "llm.EnableCacheManager": "1",
        "llm.MemPoolConfig": pool_json(64 << 20),
        "llm.HostMemPoolConfig": pool_json(16 << 20),
    }
    opts.update(extra)
    return opts


TRANSPORTS = ["tcp", "same-host"]


def endpoint_options(
    transport: str = "auto", *, listen: bool = False, ra: bool = False, **extra: str
) -> dict[str, str]:
    """Options of a test endpoint: cache-manager mode, pools, chosen transport."""
    opts = cm_options(**{"llm.Transport": transport})
    if listen:
        opts["llm.listenIpInfo"] = "127.0.0.1:0"
    if ra:
        opts["llm.EnableRemoteCacheAccessible"] = "1"
    opts.update(extra)
    return opts


def cluster(cluster_id: int, address: tuple[str, int] | None = None) -> Any:
    import llmdd_async as dd

    ci = dd.LLMClusterInfo()
    ci.remote_cluster_id = cluster_id
    ci.append_local_ip_info("127.0.0.1", 0)
    if address is not None:
        ci.append_remote_ip_info(address[0], address[1])
    return ci


async def link(local: Any, cluster_id: int, address: tuple[str, int], timeout: int = 3000) -> Any:
    """link_clusters to one peer; asserts success."""
    import llmdd_async as dd

    code, codes = await local.link_clusters([cluster(cluster_id, address)], timeout)
    assert code == dd.LLMStatusCode.LLM_SUCCESS, codes
    return codes


def expected_tensor(seed: int, tensor: int, shape: tuple[int, ...]) -> Any:
    """What a test peer wrote into tensor ``tensor`` of a cache filled with ``seed``."""
    import math

    from llmdd_async.testing import pattern

    return pattern(seed + tensor, math.prod(shape)).reshape(shape)
