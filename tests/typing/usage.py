"""What a typed program sees of the public API (checked by mypy --strict, never run)."""

from __future__ import annotations

import numpy as np
from typing_extensions import assert_type

import llmdd_async as dd


async def pull_and_report(prompt: dd.LLMDataDist, decoder: dd.LLMDataDist) -> float:
    address = prompt.listen_address
    assert address is not None  # None unless llm.listenIpInfo is set
    info = dd.LLMClusterInfo()
    info.remote_cluster_id = 1
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(*address)
    code, codes = await decoder.link_clusters([info], 3000)
    assert_type(code, dd.LLMStatusCode)
    assert_type(codes, list[dd.LLMStatusCode])
    cm = decoder.cache_manager
    assert_type(cm, dd.CacheManager)
    desc = dd.CacheDesc(2, [16, 4096], dd.DataType.DT_UINT8)
    cache = cm.register_blocks_cache(desc, [np.zeros((16, 4096), np.uint8) for _ in range(2)])
    assert_type(cache, dd.Cache)
    task = cm.pull_blocks(dd.BlocksCacheKey(1, 0), cache, [0, 1], [3, 2], src_layer_range=range(1))
    assert_type(task, dd.CacheTask)
    assert_type(task.task_id, int)  # the task_id of its log events
    await task
    stats = task.statistics()
    assert_type(stats, dd.TaskStatistics)
    link = decoder.link_statistics(1)
    assert_type(link, dd.LinkStatistics)
    recent: tuple[dd.TransferRecord, ...] = link.recent
    await cm.pull_cache(dd.CacheKeyByIdAndIndex(1, 1, 0), cache, 0, -1, tensor_num_per_layer=2)
    ev = dd.LayerEvents(num_layers=4)
    ev.layer_ready(0)
    return stats.gbps + link.bytes + len(recent)
