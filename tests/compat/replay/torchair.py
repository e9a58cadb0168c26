"""clients.md §7: TorchAir.

Part of the replays of the real ``llm_datadist`` clients: see this package's docstring.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from llmdd_async.sync import (
    CacheDesc,
    CacheKey,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
)

from ._common import (
    HOST,
    Peer,
    assert_same,
    host_tensors,
    pattern,
)

# ============================================================================ §7 TorchAir
TA_LAYERS = 4
TA_DESC_SHAPE = [4, 16, 2, 8]  # [batch, seq, heads // ws, head dim]
TA_MEM = "16777216"  # ge.flowGraphMemMaxSize, scaled down with the shapes


def _ta_desc() -> CacheDesc:
    return CacheDesc(num_tensors=2 * TA_LAYERS, shape=TA_DESC_SHAPE, data_type=DataType.DT_FLOAT16)


def _ta_kv(seed: int) -> list[np.ndarray]:
    return [pattern(seed + i, tuple(TA_DESC_SHAPE), np.float16) for i in range(2 * TA_LAYERS)]


def torchair_prompt(peer: Peer, port: int) -> dict:
    engine = LLMDataDist(LLMRole.PROMPT, 0)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.listen_ip_info = f"{HOST}:{port}"
    llm_config.ge_options = {"ge.flowGraphMemMaxSize": TA_MEM}
    engine.init(llm_config.generate_options())
    kv_cache_manager = engine.kv_cache_manager

    def allocate(start_id: int, end_id: int) -> tuple:
        keys = [
            CacheKey(prompt_cluster_id=0, req_id=i, model_id=0) for i in range(start_id, end_id)
        ]
        return kv_cache_manager.allocate_cache(_ta_desc(), keys), keys

    def run_model(cache: Any, seed: int) -> None:
        kv_tensors = host_tensors(
            cache.cache_desc.shape, np.float16, cache.per_device_tensor_addrs[0]
        )
        mid = len(kv_tensors) // 2
        k_tensors, v_tensors = kv_tensors[:mid], kv_tensors[mid:]
        for layer, (k, v) in enumerate(zip(k_tensors, v_tensors, strict=True)):
            k[...] = _ta_kv(seed)[layer]
            v[...] = _ta_kv(seed)[mid + layer]

    warmup_kv_cache, warmup_cache_keys = allocate(0, 4)
    run_model(warmup_kv_cache, 1000)
    kv_cache, cache_keys = allocate(4, 8)
    run_model(kv_cache, 1100)
    peer.sync()  # DEVIATION: a barrier instead of time.sleep(1200): caches ready
    peer.sync()  # the decoder is done
    for allocated_cache in [warmup_kv_cache, kv_cache]:
        kv_cache_manager.deallocate_cache(allocated_cache)
    for key in warmup_cache_keys + cache_keys:
        kv_cache_manager.remove_cache_key(key)
    engine.finalize()
    return {}


def torchair_decoder(peer: Peer, port: int) -> dict:
    engine = LLMDataDist(LLMRole.DECODER, 0)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.ge_options = {"ge.flowGraphMemMaxSize": TA_MEM}
    engine.init(llm_config.generate_options())
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 0
    cluster.append_local_ip_info(HOST, port)
    cluster.append_remote_ip_info(HOST, port)
    clusters_info = [cluster]
    peer.sync()  # the prompt allocated its caches (and listens)
    link = engine.link_clusters(clusters_info)
    kv_cache_manager = engine.kv_cache_manager
    kv_cache = kv_cache_manager.allocate_cache(_ta_desc())
    batch_size = 4
    checked = 0
    for start_id, end_id, seed in ((0, 4, 1000), (4, 8, 1100)):
        for index in range(start_id, end_id):
            prompt_cache_key = CacheKey(prompt_cluster_id=0, req_id=index, model_id=0)
            kv_cache_manager.pull_cache(prompt_cache_key, kv_cache, index % batch_size)
        got = host_tensors(
            kv_cache.cache_desc.shape, np.float16, kv_cache.per_device_tensor_addrs[0]
        )
        for i, t in enumerate(got):
            checked += assert_same(t, _ta_kv(seed)[i], f"requests {start_id}..{end_id} tensor {i}")
    kv_cache_manager.deallocate_cache(kv_cache)
    unlink = engine.unlink_clusters(clusters_info)
    engine.finalize()
    peer.sync()
    return {"link": repr(link), "unlink": repr(unlink), "bytes_checked": checked}
