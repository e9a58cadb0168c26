"""clients.md §6: the CANN samples (pull, push, switch role, transfer_cache_async, xPyD).

Part of the replays of the real ``llm_datadist`` clients: see this package's docstring.
"""

from __future__ import annotations

import json
import socket
import struct
import time
import zlib
from typing import Any

import numpy as np

from llmdd_async.sync import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
    RegisterMemStatus,
    TransferWithCacheKeyConfig,
)

from ._common import (
    HOST,
    POLL_S,
    Peer,
    assert_same,
    host_tensors,
    pattern,
)

# ============================================================================ §6 CANN samples
CANN_PROMPT_CLUSTER, CANN_DECODER_CLUSTER = 1, 2  # the pull samples (comm-domain link)
CANN_PUSH_P, CANN_PUSH_D = 0, 1  # the push / switch_role / transfer samples
CACHE_NUM_TENSORS = 4
CACHE_SHAPE = [2, 16 * 1024]
MEM_POOL_SIZE = 64 * 1024 * 1024
NUM_TENSORS, BLOCKS_NUM, KV_SHAPE = 2, 3, 10


def cann_init_llm_datadist(
    role: LLMRole, cluster_id: int, device_id: int, enable_mem_pool: bool = True
) -> LLMDataDist:
    """``pull_sample_common.init_llm_datadist``."""
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = device_id
    llm_config.enable_cache_manager = True
    if enable_mem_pool:
        llm_config.mem_pool_cfg = f'{{"memory_size": {MEM_POOL_SIZE}}}'
    datadist.init(llm_config.generate_options())
    return datadist


def cann_link(datadist: LLMDataDist, ports: list[int]) -> int:
    """``pull_sample_common.link`` with the single-machine rank table (``is_single``)."""
    rank_table = {
        "server_count": "1",
        "status": "completed",
        "version": "1.2",
        "server_list": [
            {
                "device": [
                    # DEVIATION: llmdd_port (extension) maps each rank to a free port
                    {"device_id": "0", "device_ip": HOST, "rank_id": "0", "llmdd_port": ports[0]},
                    {"device_id": "1", "device_ip": HOST, "rank_id": "1", "llmdd_port": ports[1]},
                ],
                "host_ip": HOST,
                "server_id": "1",
            }
        ],
    }
    cluster_rank_info = {1: 0, 2: 1}
    comm_id = datadist.link("link", cluster_rank_info, json.dumps(rank_table))
    while True:
        ret = datadist.query_register_mem_status(comm_id)
        if ret == RegisterMemStatus.OK:
            return comm_id
        if ret == RegisterMemStatus.FAILED:
            raise RuntimeError("link failed")
        time.sleep(POLL_S)


def _pull_cache_desc() -> CacheDesc:
    return CacheDesc(
        num_tensors=CACHE_NUM_TENSORS,
        shape=CACHE_SHAPE,
        data_type=DataType.DT_FLOAT16,
        placement=Placement.DEVICE,
    )


# ---------------------------------------------------------------- pull_cache_sample.py
def cann_pull_cache_prompt(peer: Peer, ports: list[int]) -> dict:
    datadist = cann_init_llm_datadist(LLMRole.PROMPT, CANN_PROMPT_CLUSTER, 0)
    cache_manager = datadist.cache_manager
    cache_keys = [
        CacheKey(prompt_cluster_id=1, req_id=0, model_id=0),
        CacheKey(prompt_cluster_id=1, req_id=1, model_id=0),
    ]
    cache = cache_manager.allocate_cache(_pull_cache_desc(), cache_keys)
    for i, t in enumerate(cache.tensors):
        t[...] = pattern(900 + i, t.shape, t.dtype)
    comm_id = cann_link(datadist, ports)
    peer.sync()  # cache ready
    peer.sync()  # decoder pull_cache end
    datadist.unlink(comm_id)
    peer.sync()  # wait peer unlink end
    for key in cache_keys:
        cache_manager.remove_cache_key(key)
    cache_manager.deallocate_cache(cache)
    datadist.finalize()
    return {"cache_id": cache.cache_id}


def cann_pull_cache_decoder(peer: Peer, ports: list[int]) -> dict:
    datadist = cann_init_llm_datadist(LLMRole.DECODER, CANN_DECODER_CLUSTER, 1)
    cache_manager = datadist.cache_manager
    cache = cache_manager.allocate_cache(_pull_cache_desc())
    comm_id = cann_link(datadist, ports)
    peer.sync()  # cache ready
    cache_manager.pull_cache(
        CacheKey(prompt_cluster_id=1, req_id=0, model_id=0), cache, batch_index=0
    )
    cache_manager.pull_cache(
        CacheKey(prompt_cluster_id=1, req_id=1, model_id=0), cache, batch_index=1
    )
    checked = 0
    for i, t in enumerate(cache.tensors):
        checked += assert_same(t, pattern(900 + i, t.shape, t.dtype), f"tensor {i}")
    peer.sync()  # pull end
    datadist.unlink(comm_id)
    peer.sync()  # unlink end
    datadist.finalize()
    return {"bytes_checked": checked}


# ---------------------------------------------------------------- pull_blocks_sample.py
def _pull_blocks_tensor(seed: int | None) -> np.ndarray:
    t = np.ones((2, 1024 * 1024), dtype=np.float32)  # torch.ones(...).npu()
    if seed is not None:
        t[...] = pattern(seed, t.shape, np.float32)
    return t


def _allocate_cpu_cache(block_size: int, num_block: int, num_tensors: int) -> tuple:
    cpu_tensors = [
        np.random.default_rng(5 + i).random((num_block, block_size), dtype=np.float32)
        for i in range(num_tensors)
    ]
    cpu_addrs = [t.ctypes.data for t in cpu_tensors]
    cpu_cache_desc = CacheDesc(
        num_tensors=num_tensors,
        shape=[num_block, block_size],
        data_type=DataType.DT_FLOAT,
        placement=Placement.HOST,
    )
    return Cache.create_cpu_cache(cpu_cache_desc, cpu_addrs), cpu_tensors


def cann_pull_blocks_prompt(peer: Peer, ports: list[int]) -> dict:
    datadist = cann_init_llm_datadist(LLMRole.PROMPT, CANN_PROMPT_CLUSTER, 0, enable_mem_pool=False)
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(
        num_tensors=1,
        shape=[2, 1024 * 1024],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )
    tensor = _pull_blocks_tensor(seed=910)
    _ = cache_manager.register_blocks_cache(cache_desc, [tensor.ctypes.data], BlocksCacheKey(1, 0))
    comm_id = cann_link(datadist, ports)
    peer.sync()  # cache ready
    peer.sync()  # decoder pull_blocks end
    datadist.unlink(comm_id)
    peer.sync()  # wait peer unlink end
    datadist.finalize()
    return {}


def cann_pull_blocks_decoder(peer: Peer, ports: list[int]) -> dict:
    datadist = cann_init_llm_datadist(
        LLMRole.DECODER, CANN_DECODER_CLUSTER, 1, enable_mem_pool=False
    )
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(
        num_tensors=1,
        shape=[2, 1024 * 1024],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )
    tensor = _pull_blocks_tensor(seed=None)
    cache = cache_manager.register_blocks_cache(cache_desc, [tensor.ctypes.data])
    comm_id = cann_link(datadist, ports)
    peer.sync()  # cache ready
    cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 1])
    expected = _pull_blocks_tensor(seed=910)
    checked = assert_same(tensor, expected, "after pull")
    cpu_cache, cpu_tensors = _allocate_cpu_cache(1024 * 1024, 2, 1)
    cache_manager.swap_blocks(cache, cpu_cache, {0: 0, 1: 1})  # swap out
    checked += assert_same(cpu_tensors[0], expected, "after swap out")
    tensor[...] = 0  # (the model reuses the device blocks meanwhile)
    cache_manager.swap_blocks(cpu_cache, cache, {0: 0, 1: 1})  # swap in
    checked += assert_same(tensor, expected, "after swap in")
    peer.sync()  # pull_blocks end
    datadist.unlink(comm_id)
    peer.sync()  # wait peer unlink end
    datadist.finalize()
    return {"bytes_checked": checked}


# ---------------------------------------------------------------- pull_from_cache_to_blocks.py
def cann_cache_to_blocks_prompt(peer: Peer, ports: list[int]) -> dict:
    datadist = cann_init_llm_datadist(LLMRole.PROMPT, CANN_PROMPT_CLUSTER, 0)
    comm_id = cann_link(datadist, ports)
    cache_manager = datadist.cache_manager
    cache_key = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    cache = cache_manager.allocate_cache(_pull_cache_desc(), [cache_key])
    tensors = host_tensors(cache.cache_desc.shape, np.float16, cache.tensor_addrs)
    for i, t in enumerate(tensors):
        t[...] = pattern(920 + i, t.shape, t.dtype)
    peer.sync()  # cache ready
    peer.sync()  # decoder pull_blocks end
    datadist.unlink(comm_id)
    peer.sync()  # wait peer unlink end
    cache_manager.remove_cache_key(cache_key)
    cache_manager.deallocate_cache(cache)
    datadist.finalize()
    return {}


def cann_cache_to_blocks_decoder(peer: Peer, ports: list[int]) -> dict:
    datadist = cann_init_llm_datadist(LLMRole.DECODER, CANN_DECODER_CLUSTER, 1)
    cache_manager = datadist.cache_manager
    tensors = [np.ones(CACHE_SHAPE, dtype=np.float16) for _ in range(CACHE_NUM_TENSORS)]
    cache = cache_manager.register_blocks_cache(
        _pull_cache_desc(), [t.ctypes.data for t in tensors]
    )
    comm_id = cann_link(datadist, ports)
    peer.sync()  # cache ready
    cache_key = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    cache_manager.pull_blocks(cache_key, cache, src_blocks=[], dst_blocks=[0])
    checked = 0
    for i, t in enumerate(tensors):
        expected = pattern(920 + i, tuple(CACHE_SHAPE), np.float16)
        checked += assert_same(t[0], expected[0], f"tensor {i} block 0 <- slot 0")
        assert (t[1] == 1).all(), f"tensor {i}: block 1 changed"
    peer.sync()  # pull_blocks end
    datadist.unlink(comm_id)
    peer.sync()  # wait peer unlink end
    datadist.finalize()
    return {"bytes_checked": checked}


# ---------------------------------------------------------------- push/switch/transfer helpers
def cann_init_link_clusters_style(
    role: LLMRole, cluster_id: int, listen_port: int | None, **config: Any
) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    for k, v in config.items():
        setattr(llm_config, k, v)
    if listen_port is not None:
        llm_config.listen_ip_info = f"{HOST}:{listen_port}"
    datadist.init(llm_config.generate_options())
    return datadist


def _small_blocks(seed: int | None, fill: float) -> list[np.ndarray]:
    tensors = [np.full((BLOCKS_NUM, KV_SHAPE), fill, dtype=np.float32) for _ in range(NUM_TENSORS)]
    if seed is not None:
        for i, t in enumerate(tensors):
            t[...] = pattern(seed + i, t.shape, np.float32)
    return tensors


def _small_desc() -> CacheDesc:
    return CacheDesc(
        num_tensors=NUM_TENSORS,
        shape=[BLOCKS_NUM, KV_SHAPE],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )


def _force_unlink(datadist: LLMDataDist, remote_cluster_id: int) -> None:
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = remote_cluster_id
    ret, rets = datadist.unlink_clusters([cluster], 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception(f"unlink failed: {ret!r} {rets!r}")


# ---------------------------------------------------------------- push_blocks_sample.py
def cann_push_blocks_prompt(peer: Peer, p_port: int, d_port: int) -> dict:
    datadist = cann_init_link_clusters_style(LLMRole.PROMPT, CANN_PUSH_P, p_port, local_comm_res="")
    cache_manager = datadist.cache_manager
    tensors = _small_blocks(None, 1.0)  # torch.ones
    cache = cache_manager.register_blocks_cache(
        _small_desc(), [t.ctypes.data for t in tensors], BlocksCacheKey(CANN_PUSH_P, 0)
    )
    peer.sync()  # register end
    peer.sync()  # decoder push blocks end
    checked = 0
    src = _small_blocks(930, 0.0)
    for i, t in enumerate(tensors):
        checked += assert_same(t[[0, 2]], src[i][[0, 1]], f"tensor {i} blocks [0, 2]")
        assert (t[1] == 1).all(), f"tensor {i}: block 1 changed"
    peer.sync()  # DEVIATION: order the two sides' force unlinks (decoder first)
    _force_unlink(datadist, CANN_PUSH_D)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return {"bytes_checked": checked}


def cann_push_blocks_decoder(peer: Peer, p_port: int, d_port: int) -> dict:
    datadist = cann_init_link_clusters_style(
        LLMRole.DECODER, CANN_PUSH_D, d_port, local_comm_res=""
    )
    cache_manager = datadist.cache_manager
    tensors = _small_blocks(930, 0.0)
    cache = cache_manager.register_blocks_cache(
        _small_desc(), [t.ctypes.data for t in tensors], BlocksCacheKey(CANN_PUSH_D, 0)
    )
    peer.sync()  # register end
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = CANN_PUSH_P
    cluster.append_local_ip_info(HOST, d_port)
    cluster.append_remote_ip_info(HOST, p_port)
    ret, _ = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")
    cache_manager.push_blocks(
        BlocksCacheKey(CANN_PUSH_P, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2]
    )
    peer.sync()  # push_blocks end
    _force_unlink(datadist, CANN_PUSH_P)
    peer.sync()  # (ordering, see the prompt)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return {}


# ---------------------------------------------------------------- push_cache_sample.py
def cann_push_cache_prompt(peer: Peer, p_port: int, d_port: int) -> dict:
    datadist = cann_init_link_clusters_style(LLMRole.PROMPT, CANN_PUSH_P, p_port, local_comm_res="")
    cache_manager = datadist.cache_manager
    tensors = _small_blocks(None, 0.0)
    cache = cache_manager.register_cache(_small_desc(), [t.ctypes.data for t in tensors])
    assert cache.cache_id == 1, cache.cache_id  # the decoder hard-codes cache_id=1
    peer.sync()  # register end
    peer.sync()  # decoder push cache end
    src = _small_blocks(940, 1.0)
    checked = 0
    for i, t in enumerate(tensors):
        checked += assert_same(t[0], src[i][0], f"tensor {i} slot 0")
        assert not t[1:].any(), f"tensor {i}: slots 1.. changed"
    peer.sync()  # wait unlink end
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return {"bytes_checked": checked}


def cann_push_cache_decoder(peer: Peer, p_port: int, d_port: int) -> dict:
    datadist = cann_init_link_clusters_style(
        LLMRole.DECODER, CANN_PUSH_D, d_port, local_comm_res=""
    )
    cache_manager = datadist.cache_manager
    tensors = _small_blocks(940, 1.0)
    cache = cache_manager.register_cache(_small_desc(), [t.ctypes.data for t in tensors])
    peer.sync()  # register end
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = CANN_PUSH_P
    cluster.append_local_ip_info(HOST, d_port)
    cluster.append_remote_ip_info(HOST, p_port)
    ret, _ = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")
    cache_manager.push_cache(
        CacheKeyByIdAndIndex(cluster_id=CANN_PUSH_P, cache_id=1, batch_index=0),
        cache,
        src_batch_index=0,
    )
    peer.sync()  # push cache end
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = CANN_PUSH_P
    cluster.append_remote_ip_info(HOST, p_port)
    ret, _ = datadist.unlink_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception(f"unlink failed: {ret!r}")
    peer.sync()  # unlink end
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return {}


# ---------------------------------------------------------------- pull_blocks_xpyd_sample.py
def xpyd_ip_port_to_int(ip_port: str) -> int:
    ip, port_str = ip_port.split(":")
    port = int(port_str)
    if not (0 <= port <= 65535):
        raise ValueError("port must be in 0-65535")
    ip_int = struct.unpack("!I", socket.inet_aton(ip))[0]
    return (ip_int << 16) | port


def _xpyd_tensor(local_ip_port: str) -> np.ndarray:
    # DEVIATION: the sample fills torch.full(..., ip_port_to_int(local_ip_port)); as float32
    # those values all round to the same number, so each prompt gets distinct random data.
    return pattern(zlib.crc32(local_ip_port.encode()), (BLOCKS_NUM, KV_SHAPE), np.float32)


def cann_xpyd_prompt(peer: Peer, local_ip_port: str) -> dict:
    cluster_id = xpyd_ip_port_to_int(local_ip_port)
    datadist = LLMDataDist(LLMRole.PROMPT, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.local_comm_res = ""
    llm_config.listen_ip_info = local_ip_port
    datadist.init(llm_config.generate_options())
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(
        num_tensors=1,
        shape=[BLOCKS_NUM, KV_SHAPE],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )
    tensor = _xpyd_tensor(local_ip_port).copy()
    cache = cache_manager.register_blocks_cache(
        cache_desc, [tensor.ctypes.data], BlocksCacheKey(cluster_id, 0)
    )
    peer.sync()  # DEVIATION: barriers instead of the sample's sleeps (register end)
    peer.sync()  # the decoder finished
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return {"cluster_id": cluster_id}


def cann_xpyd_decoder(peer: Peer, local_ip_port: str, remote_ip_port: str) -> dict:
    cluster_id = xpyd_ip_port_to_int(local_ip_port)
    datadist = LLMDataDist(LLMRole.DECODER, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.local_comm_res = ""
    datadist.init(llm_config.generate_options())
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(
        num_tensors=1,
        shape=[BLOCKS_NUM, KV_SHAPE],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )
    remote_list = remote_ip_port.split(";")
    tensor = np.zeros((BLOCKS_NUM, KV_SHAPE), dtype=np.float32)
    cache = cache_manager.register_blocks_cache(
        cache_desc, [tensor.ctypes.data], BlocksCacheKey(cluster_id, 0)
    )
    peer.sync()  # register end
    cluster_list = []
    for remote in remote_list:
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = xpyd_ip_port_to_int(remote)
        cluster.append_local_ip_info(local_ip_port.split(":")[0], 0)
        cluster.append_remote_ip_info(remote.split(":")[0], int(remote.split(":")[1]))
        cluster_list.append(cluster)
    ret, _ = datadist.link_clusters(cluster_list, 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")
    checked = 0
    for remote in remote_list:
        cache_manager.pull_blocks(
            BlocksCacheKey(xpyd_ip_port_to_int(remote), 0),
            cache,
            src_blocks=[0, 1],
            dst_blocks=[0, 2],
        )
        src = _xpyd_tensor(remote)
        checked += assert_same(tensor[[0, 2]], src[[0, 1]], f"after pull from {remote}")
        assert not tensor[1].any(), "block 1 changed"
    ret, _ = datadist.unlink_clusters(cluster_list, 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception(f"unlink failed: {ret!r}")
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    peer.sync()  # the prompts may go
    return {"bytes_checked": checked, "remotes": len(remote_list)}


# ---------------------------------------------------------------- switch_role_sample.py
def cann_switch_role_prompt(peer: Peer, port: int) -> dict:
    datadist = cann_init_link_clusters_style(LLMRole.PROMPT, CANN_PUSH_P, port, local_comm_res="")
    cache_manager = datadist.cache_manager
    tensors = _small_blocks(950, 1.0)
    cache = cache_manager.register_blocks_cache(
        _small_desc(), [t.ctypes.data for t in tensors], BlocksCacheKey(CANN_PUSH_P, 0)
    )
    peer.sync()  # register end
    peer.sync()  # decoder unlink
    datadist.switch_role(LLMRole.DECODER)
    peer.sync()  # prompt switch role end, close listen
    peer.sync()  # decoder switch role end, listen
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = CANN_PUSH_D
    cluster.append_local_ip_info(HOST, port)
    cluster.append_remote_ip_info(HOST, port)  # both hosts use 26000; here one after the other
    ret, _ = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")
    peer.sync()  # prompt link end
    peer.sync()  # decoder push blocks end
    expected = _switch_role_decoder_after_pull()
    checked = 0
    for i, t in enumerate(tensors):
        checked += assert_same(t, expected[i], f"tensor {i} after the decoder's push")
    peer.sync()  # DEVIATION: order the two sides' force unlinks (decoder first)
    _force_unlink(datadist, CANN_PUSH_D)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return {"bytes_checked": checked}


def _switch_role_decoder_after_pull() -> list[np.ndarray]:
    d = _small_blocks(960, 0.0)
    p = _small_blocks(950, 1.0)
    for i in range(NUM_TENSORS):
        d[i][[0, 2]] = p[i][[0, 1]]
    return d


def cann_switch_role_decoder(peer: Peer, port: int) -> dict:
    datadist = cann_init_link_clusters_style(LLMRole.DECODER, CANN_PUSH_D, None, local_comm_res="")
    cache_manager = datadist.cache_manager
    tensors = _small_blocks(960, 0.0)
    cache = cache_manager.register_blocks_cache(
        _small_desc(), [t.ctypes.data for t in tensors], BlocksCacheKey(CANN_PUSH_D, 0)
    )
    peer.sync()  # register end
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = CANN_PUSH_P
    cluster.append_local_ip_info(HOST, port)
    cluster.append_remote_ip_info(HOST, port)
    ret, _ = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")
    cache_manager.pull_blocks(
        BlocksCacheKey(CANN_PUSH_P, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2]
    )
    expected = _switch_role_decoder_after_pull()
    checked = 0
    for i, t in enumerate(tensors):
        checked += assert_same(t, expected[i], f"tensor {i} after pull")
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = CANN_PUSH_P
    cluster.append_remote_ip_info(HOST, port)
    ret, _ = datadist.unlink_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception(f"unlink failed: {ret!r}")
    peer.sync()  # decoder unlink
    peer.sync()  # prompt switch role end, close listen
    llm_config = LLMConfig()
    llm_config.listen_ip_info = f"{HOST}:{port}"
    datadist.switch_role(LLMRole.PROMPT, llm_config.generate_options())
    peer.sync()  # decoder switch role end, listen
    peer.sync()  # prompt link end
    cache_manager.push_blocks(
        BlocksCacheKey(CANN_PUSH_P, 0),
        cache,
        src_blocks=[0, 1, 2],
        dst_blocks=[0, 1, 2],
        src_layer_range=range(0, 2),
        dst_layer_range=range(0, 2),
        tensor_num_per_layer=1,
    )
    peer.sync()  # decoder push blocks end
    _force_unlink(datadist, CANN_PUSH_P)
    peer.sync()  # (ordering, see the prompt)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return {"bytes_checked": checked}


# ---------------------------------------------------------------- transfer_cache_async_sample.py
class LayerSynchronizerImpl(LayerSynchronizer):
    def __init__(self, ret: bool = True) -> None:
        self._ret = ret
        self.calls: list[tuple[int, int | None]] = []

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.calls.append((layer_index, timeout_in_millis))
        return self._ret


def cann_transfer_async_prompt(peer: Peer, p_port: int, d_port: int) -> dict:
    datadist = cann_init_link_clusters_style(
        LLMRole.PROMPT,
        CANN_PUSH_P,
        p_port,
        enable_cache_manager=True,
        enable_remote_cache_accessible=True,
    )
    cache_manager = datadist.cache_manager
    tensors = _small_blocks(970, 1.0)
    cache = cache_manager.register_blocks_cache(
        _small_desc(), [t.ctypes.data for t in tensors], BlocksCacheKey(CANN_PUSH_P, 0)
    )
    peer.sync()  # register end
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = CANN_PUSH_D
    cluster.append_local_ip_info(HOST, p_port)
    cluster.append_remote_ip_info(HOST, d_port)
    ret, _ = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")
    transfer_config = TransferWithCacheKeyConfig(
        BlocksCacheKey(CANN_PUSH_D, 0), range(0, 1), range(0, 1)
    )
    synchronizer = LayerSynchronizerImpl(True)
    cache_task = cache_manager.transfer_cache_async(cache, synchronizer, [transfer_config])
    results = cache_task.get_results()
    # (the sample ignores the results; the replay checks them)
    assert results == [LLMStatusCode.LLM_SUCCESS], results
    peer.sync()  # transfer cache end
    peer.sync()  # DEVIATION: order the two sides' force unlinks (decoder first)
    _force_unlink(datadist, CANN_PUSH_D)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return {"results": [int(r) for r in results], "synchronize_calls": synchronizer.calls}


def cann_transfer_async_decoder(peer: Peer, p_port: int, d_port: int) -> dict:
    datadist = cann_init_link_clusters_style(
        LLMRole.DECODER,
        CANN_PUSH_D,
        d_port,
        enable_cache_manager=True,
        enable_remote_cache_accessible=True,
    )
    cache_manager = datadist.cache_manager
    tensors = _small_blocks(None, 0.0)
    cache = cache_manager.register_blocks_cache(
        _small_desc(), [t.ctypes.data for t in tensors], BlocksCacheKey(CANN_PUSH_D, 0)
    )
    peer.sync()  # register end
    peer.sync()  # prompt transfer cache end
    src = _small_blocks(970, 1.0)
    checked = 0
    for i, t in enumerate(tensors):
        checked += assert_same(t, src[i], f"tensor {i} after transfer_cache_async")
    _force_unlink(datadist, CANN_PUSH_P)
    peer.sync()  # (ordering, see the prompt)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return {"bytes_checked": checked}
