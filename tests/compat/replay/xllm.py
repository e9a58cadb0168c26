"""clients.md §8: xLLM (the C++ API).

Part of the replays of the real ``llm_datadist`` clients: see this package's docstring.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from llmdd_async.sync import (
    CacheDesc,
    CacheIndex,
    DataType,
    KvCacheExtParam,
    LLMClusterInfo,
    LlmDataDist,
    LLMRole,
)

from ._common import (
    HOST,
    Peer,
    aligned_zeros,
    assert_same,
    check_ok,
    pattern,
)

# ============================================================================ §8 xLLM (C++ API)
XL_LAYERS = 3
XL_NUM_BLOCKS = 16
XL_BLOCK = (4, 2, 16)
XL_PULL = ([1, 2, 3, 10], [5, 6, 7, 0])  # src (P) blocks, dst (D) blocks
XL_PUSH = ([11, 12], [13, 14])


def xllm_convert_ip_port_to_uint64(ip: str, port: int) -> int:
    return (struct.unpack("!I", socket.inet_aton(ip))[0] << 16) | port


class XllmLayerSynchronizer:
    """``NPULayerSynchronizerImpl``: one event per layer, set when the layer's compute ends."""

    def __init__(self, num_layers: int) -> None:
        self.events = [threading.Event() for _ in range(num_layers)]

    def synchronize_layer(self, layer_index: int) -> None:
        if not self.events[layer_index].wait(30):
            raise TimeoutError(f"layer {layer_index} never computed")


class XllmTransfer:
    """``LlmDataDistTransfer``."""

    def __init__(self, listen_port: int, role: LLMRole) -> None:
        self.host_ip = HOST
        self.listen_port = listen_port
        self.cluster_id = xllm_convert_ip_port_to_uint64(self.host_ip, listen_port)
        self.llm_data_dist = LlmDataDist(self.cluster_id, role)
        self.linked_cluster_ids: set[int] = set()

    def initialize(self, device_id: int) -> None:
        options = {
            "llm.DeviceId": str(device_id),
            "llm.ListenIpInfo": f"{self.host_ip}:{self.listen_port}",
        }
        check_ok(self.llm_data_dist.initialize(options), "Initialize LlmDataList")

    def allocate_kv_cache(self, num_layers: int) -> None:
        shape = (XL_NUM_BLOCKS, *XL_BLOCK)
        self.num_layers = num_layers
        self.k_tensors = [aligned_zeros(shape, np.float16) for _ in range(num_layers)]
        self.v_tensors = [aligned_zeros(shape, np.float16) for _ in range(num_layers)]
        k_desc = CacheDesc(num_layers, list(shape), DataType.DT_FLOAT16)
        v_desc = CacheDesc(num_layers, list(shape), DataType.DT_FLOAT16)
        ret, self.k_cache_id = self.llm_data_dist.register_kv_cache(
            k_desc, [t.ctypes.data for t in self.k_tensors]
        )
        check_ok(ret, "Register key cache")
        ret, self.v_cache_id = self.llm_data_dist.register_kv_cache(
            v_desc, [t.ctypes.data for t in self.v_tensors]
        )
        check_ok(ret, "Register value cache")

    def _cluster_info(self, cluster_id: int, remote_ip: str, remote_port: int) -> LLMClusterInfo:
        info = LLMClusterInfo()
        info.remote_cluster_id = cluster_id
        info.append_local_ip_info(self.host_ip, self.listen_port)
        info.append_remote_ip_info(remote_ip, remote_port)
        return info

    def link_cluster(self, cluster_id: int, device_ip: str, port: int) -> bool:
        if cluster_id in self.linked_cluster_ids:
            return True
        ret, _rets = self.llm_data_dist.link_llm_clusters(
            [self._cluster_info(cluster_id, device_ip, port)], 60000
        )
        check_ok(ret, "LinkLlmClusters")
        self.linked_cluster_ids.add(cluster_id)
        return True

    def unlink_cluster(
        self, cluster_id: int, remote_ip: str, remote_port: int, force_flag: bool
    ) -> bool:
        ret, _rets = self.llm_data_dist.unlink_llm_clusters(
            [self._cluster_info(cluster_id, remote_ip, remote_port)], 1000, force_flag
        )
        check_ok(ret, "UnlinkLlmClusters")
        self.linked_cluster_ids.discard(cluster_id)
        return True

    def pull_kv_blocks(
        self,
        src_cluster_id: int,
        src_k_cache_id: int,
        src_v_cache_id: int,
        src_blocks: list[int],
        dst_blocks: list[int],
    ) -> bool:
        k_ret = self.llm_data_dist.pull_kv_blocks(
            CacheIndex(src_cluster_id, src_k_cache_id), self.k_cache_id, src_blocks, dst_blocks
        )
        v_ret = self.llm_data_dist.pull_kv_blocks(
            CacheIndex(src_cluster_id, src_v_cache_id), self.v_cache_id, src_blocks, dst_blocks
        )
        check_ok(k_ret, "PullKvBlocks (K)")
        check_ok(v_ret, "PullKvBlocks (V)")
        return True

    def push_kv_blocks(self, merged_kv_infos: dict, layer_synchronizer: Any) -> bool:
        for layer_index in range(self.num_layers):
            layer_synchronizer.synchronize_layer(layer_index)
            for kv_info in merged_kv_infos.values():
                if not kv_info["src_blocks"]:
                    continue
                ext_param = KvCacheExtParam(
                    (layer_index, layer_index), (layer_index, layer_index), 1
                )
                k_ret = self.llm_data_dist.push_kv_blocks(
                    self.k_cache_id,
                    CacheIndex(kv_info["dst_cluster_id"], kv_info["dst_k_cache_id"]),
                    kv_info["src_blocks"],
                    kv_info["dst_blocks"],
                    ext_param,
                )
                v_ret = self.llm_data_dist.push_kv_blocks(
                    self.v_cache_id,
                    CacheIndex(kv_info["dst_cluster_id"], kv_info["dst_v_cache_id"]),
                    kv_info["src_blocks"],
                    kv_info["dst_blocks"],
                    ext_param,
                )
                check_ok(k_ret, f"PushKvBlocks (K, layer {layer_index})")
                check_ok(v_ret, f"PushKvBlocks (V, layer {layer_index})")
        return True


def _xl_expected(seed: int, kind: int, layer: int) -> np.ndarray:
    return pattern(seed + 10 * kind + layer, (XL_NUM_BLOCKS, *XL_BLOCK), np.float16)


def xllm_prompt(peer: Peer, p_port: int, d_port: int) -> dict:
    t = XllmTransfer(p_port, LLMRole.PROMPT)
    t.initialize(0)
    t.allocate_kv_cache(XL_LAYERS)
    for layer in range(XL_LAYERS):
        t.k_tensors[layer][...] = _xl_expected(1200, 0, layer)
        t.v_tensors[layer][...] = _xl_expected(1200, 1, layer)
    peer.send("decoder", (t.cluster_id, t.k_cache_id, t.v_cache_id))  # xLLM's own RPC
    d_cluster_id, d_k_id, d_v_id = peer.recv()
    peer.sync()  # D pulled and unlinked
    # push mode: the prompt links to the decoder and pushes layer by layer while "computing"
    t.link_cluster(d_cluster_id, HOST, d_port)
    sync = XllmLayerSynchronizer(XL_LAYERS)

    def forward() -> None:
        for layer in range(XL_LAYERS):
            src = XL_PUSH[0]
            t.k_tensors[layer][src] = _xl_expected(1300, 0, layer)[src]
            t.v_tensors[layer][src] = _xl_expected(1300, 1, layer)[src]
            sync.events[layer].set()
            time.sleep(0.01)

    compute = threading.Thread(target=forward)
    compute.start()
    t.push_kv_blocks(
        {
            "req": {
                "dst_cluster_id": d_cluster_id,
                "dst_k_cache_id": d_k_id,
                "dst_v_cache_id": d_v_id,
                "src_blocks": XL_PUSH[0],
                "dst_blocks": XL_PUSH[1],
            }
        },
        sync,
    )
    compute.join()
    peer.sync()  # pushed
    peer.sync()  # D verified
    t.unlink_cluster(d_cluster_id, HOST, d_port, False)
    peer.sync()  # unlinked: the decoder may finalize
    t.llm_data_dist.finalize()
    return {"cluster_id": t.cluster_id, "cache_ids": [t.k_cache_id, t.v_cache_id]}


def xllm_decoder(peer: Peer, p_port: int, d_port: int) -> dict:
    t = XllmTransfer(d_port, LLMRole.DECODER)
    t.initialize(0)
    t.allocate_kv_cache(XL_LAYERS)
    p_cluster_id, p_k_id, p_v_id = peer.recv()
    peer.send("prompt", (t.cluster_id, t.k_cache_id, t.v_cache_id))
    t.link_cluster(p_cluster_id, HOST, p_port)
    t.pull_kv_blocks(p_cluster_id, p_k_id, p_v_id, *XL_PULL)
    checked = 0
    src, dst = XL_PULL
    for layer in range(XL_LAYERS):
        checked += assert_same(t.k_tensors[layer][dst], _xl_expected(1200, 0, layer)[src], "K")
        checked += assert_same(t.v_tensors[layer][dst], _xl_expected(1200, 1, layer)[src], "V")
    t.unlink_cluster(p_cluster_id, HOST, p_port, False)
    peer.sync()  # pulled and unlinked
    peer.sync()  # the prompt pushed
    src, dst = XL_PUSH
    for layer in range(XL_LAYERS):
        checked += assert_same(t.k_tensors[layer][dst], _xl_expected(1300, 0, layer)[src], "K")
        checked += assert_same(t.v_tensors[layer][dst], _xl_expected(1300, 1, layer)[src], "V")
    peer.sync()  # verified
    peer.sync()  # the prompt unlinked
    t.llm_data_dist.finalize()
    return {"bytes_checked": checked}
