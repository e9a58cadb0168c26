"""clients.md §2: vLLM-Ascend V0 (the legacy ``KvCacheManager``).

Part of the replays of the real ``llm_datadist`` clients: see this package's docstring.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from llmdd_async.sync import (
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
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

# ============================================================================ §2 vLLM-Ascend V0
V0_LAYERS = 4
V0_HEADS, V0_HEAD_SIZE, V0_HIDDEN = 2, 8, 32
V0_SEQ_LENS = [5, 7]
V0_NUM_SLOTS = 64
V0_SYNC_WAIT = "5000"  # env LLMDATADIST_SYNC_CACHE_WAIT_TIME


def v0_model_data() -> dict[str, Any]:
    """A forward pass's inputs: tokens, slot mapping, paged KV per layer and hidden states."""
    tokens = sum(V0_SEQ_LENS)
    rng = np.random.default_rng(7)
    return {
        "input_tokens": rng.integers(0, 32000, size=tokens).astype(np.int64),
        "slot_mapping": rng.permutation(V0_NUM_SLOTS)[:tokens],
        "kv_caches": [
            (
                pattern(200 + 2 * layer, (V0_NUM_SLOTS, V0_HEADS, V0_HEAD_SIZE), np.float16),
                pattern(201 + 2 * layer, (V0_NUM_SLOTS, V0_HEADS, V0_HEAD_SIZE), np.float16),
            )
            for layer in range(V0_LAYERS)
        ],
        "hidden": pattern(300, (tokens, V0_HIDDEN), np.float16),
    }


class V0KVTransferEngine:
    """``KVTransferEngine`` of vllm-ascend's V0 ``LLMDataDistConnector``."""

    def __init__(self, role: LLMRole, local_rank: int, comm_port: int) -> None:
        self.role = role
        self.local_rank = local_rank
        self.cluster_id = local_rank
        self.comm_port = comm_port  # envs.LLMDATADIST_COMM_PORT (26000)
        self.data_dist = LLMDataDist(self.role, self.cluster_id)
        self.prompt_ip_list = [HOST]
        self.decode_ip_list = [HOST]

    def prepare_data_dist(self) -> None:
        options = {"llm.SyncKvCacheWaitTime": V0_SYNC_WAIT}
        if self.role == LLMRole.PROMPT:
            options["ge.exec.deviceId"] = str(self.local_rank)
            options["llm.listenIpInfo"] = f"{self.prompt_ip_list[self.local_rank]}:{self.comm_port}"
        else:
            options["ge.exec.deviceId"] = str(self.local_rank)
        self.data_dist.init(options)
        self.kv_transfer = self.data_dist.kv_cache_manager

    def make_cluster(self, prefill_ip: str, cluster_id: int = -1) -> LLMClusterInfo:
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = cluster_id
        cluster.append_local_ip_info(self.decode_ip_list[self.local_rank], 0)
        cluster.append_remote_ip_info(prefill_ip, self.comm_port)
        return cluster


def _v0_descs(prompt_side: bool) -> tuple[CacheDesc, ...]:
    tokens = sum(V0_SEQ_LENS)
    kv_shape = (1, tokens, V0_HEADS, V0_HEAD_SIZE)
    kv_seq_dim = 1 if prompt_side else -1
    return (
        CacheDesc(V0_LAYERS, kv_shape, DataType.DT_FLOAT16, seq_len_dim_index=kv_seq_dim),
        CacheDesc(V0_LAYERS, kv_shape, DataType.DT_FLOAT16, seq_len_dim_index=kv_seq_dim),
        CacheDesc(1, (1, tokens, 1, 1), DataType.DT_INT32, seq_len_dim_index=-1),
        CacheDesc(1, (1, tokens, 1, V0_HIDDEN), DataType.DT_FLOAT16, seq_len_dim_index=-1),
    )


def vllm_v0_prompt(peer: Peer, port: int) -> dict:
    engine = V0KVTransferEngine(LLMRole.PROMPT, 0, port)
    engine.prepare_data_dist()
    peer.sync()  # P listens; D's connector init links now
    peer.sync()  # D linked
    # send_kv_caches_and_hidden_states
    data = v0_model_data()
    key_desc, value_desc, input_desc, hidden_desc = _v0_descs(prompt_side=True)
    cid = engine.cluster_id
    kvt = engine.kv_transfer
    key_buffer = kvt.allocate_cache(key_desc, [CacheKey(cid, 0, 1)])
    value_buffer = kvt.allocate_cache(value_desc, [CacheKey(cid, 0, 2)])
    input_buffer = kvt.allocate_cache(input_desc, [CacheKey(cid, 0, 3)])
    hidden_buffer = kvt.allocate_cache(hidden_desc, [CacheKey(cid, 0, 4)])
    key_cache = host_tensors(key_desc.shape, np.float16, key_buffer.per_device_tensor_addrs[0])
    value_cache = host_tensors(
        value_desc.shape, np.float16, value_buffer.per_device_tensor_addrs[0]
    )
    input_cache = host_tensors(input_desc.shape, np.int32, input_buffer.per_device_tensor_addrs[0])
    hidden_cache = host_tensors(
        hidden_desc.shape, np.float16, hidden_buffer.per_device_tensor_addrs[0]
    )
    slot_mapping = data["slot_mapping"]
    for idx, slen in enumerate(V0_SEQ_LENS):
        start_pos = sum(V0_SEQ_LENS[:idx])
        end_pos = start_pos + slen
        current_tokens = data["input_tokens"][start_pos:end_pos].astype(np.int32)
        for layer_id in range(V0_LAYERS):
            k_paged, v_paged = data["kv_caches"][layer_id]
            slots = slot_mapping[start_pos:end_pos]
            key_cache[layer_id][:, start_pos:end_pos, :, :] = k_paged[slots][None]
            value_cache[layer_id][:, start_pos:end_pos, :, :] = v_paged[slots][None]
        input_cache[0][:, start_pos:end_pos, :, :] = current_tokens.reshape(1, slen, 1, 1)
        hidden_cache[0][:, start_pos:end_pos, :, :] = data["hidden"][start_pos:end_pos].reshape(
            1, slen, 1, V0_HIDDEN
        )
    # the same memory as the legacy get_cache_tensors sees it
    for layer_id in range(V0_LAYERS):
        assert_same(
            kvt.get_cache_tensors(key_buffer, layer_id)[0].numpy(),
            key_cache[layer_id],
            f"get_cache_tensors(key, {layer_id})",
        )
    ids = [c.cache_id for c in (key_buffer, value_buffer, input_buffer, hidden_buffer)]
    peer.sync()  # forward done: D pulls
    peer.sync()  # D pulled and closed
    # caches are never freed explicitly (the buffers are dropped with the connector)
    return {"cache_ids": ids}


def vllm_v0_decoder(peer: Peer, port: int) -> dict:
    engine = V0KVTransferEngine(LLMRole.DECODER, 0, port)
    peer.sync()  # P listens
    engine.prepare_data_dist()
    cluster = engine.make_cluster(engine.prompt_ip_list[engine.local_rank], engine.cluster_id)
    _, ret = engine.data_dist.link_clusters([cluster], 20000)  # the result is only logged
    peer.sync()  # linked
    peer.sync()  # P's forward wrote its caches
    # recv_kv_caches_and_hidden_states
    key_desc, value_desc, input_desc, hidden_desc = _v0_descs(prompt_side=False)
    kvt = engine.kv_transfer
    decode_key_buffer = kvt.allocate_cache(key_desc)
    decode_value_buffer = kvt.allocate_cache(value_desc)
    decode_input_buffer = kvt.allocate_cache(input_desc)
    decode_hidden_buffer = kvt.allocate_cache(hidden_desc)
    keys = host_tensors(key_desc.shape, np.float16, decode_key_buffer.per_device_tensor_addrs[0])
    values = host_tensors(
        value_desc.shape, np.float16, decode_value_buffer.per_device_tensor_addrs[0]
    )
    inputs = host_tensors(
        input_desc.shape, np.int32, decode_input_buffer.per_device_tensor_addrs[0]
    )
    hidden = host_tensors(
        hidden_desc.shape, np.float16, decode_hidden_buffer.per_device_tensor_addrs[0]
    )
    remote = cluster.remote_cluster_id
    kvt.pull_cache(CacheKeyByIdAndIndex(remote, 1, 0), decode_key_buffer, 0)
    kvt.pull_cache(CacheKeyByIdAndIndex(remote, 2, 0), decode_value_buffer, 0)
    kvt.pull_cache(CacheKeyByIdAndIndex(remote, 3, 0), decode_input_buffer, 0)
    kvt.pull_cache(CacheKeyByIdAndIndex(remote, 4, 0), decode_hidden_buffer, 0)
    data = v0_model_data()
    slot_mapping = data["slot_mapping"]
    checked = 0
    for idx, slen in enumerate(V0_SEQ_LENS):
        start_pos = sum(V0_SEQ_LENS[:idx])
        end_pos = start_pos + slen
        slots = slot_mapping[start_pos:end_pos]
        for i in range(V0_LAYERS):
            k_paged, v_paged = data["kv_caches"][i]
            checked += assert_same(keys[i][0, start_pos:end_pos], k_paged[slots], f"K{i}")
            checked += assert_same(values[i][0, start_pos:end_pos], v_paged[slots], f"V{i}")
        checked += assert_same(
            inputs[0][0, start_pos:end_pos, 0, 0],
            data["input_tokens"][start_pos:end_pos].astype(np.int32),
            "input ids",
        )
        checked += assert_same(
            hidden[0][0, start_pos:end_pos, 0, :], data["hidden"][start_pos:end_pos], "hidden"
        )
    # close()
    engine.data_dist.unlink_clusters([cluster], 5000)
    peer.sync()
    return {"link": [int(c) for c in ret], "bytes_checked": checked}
