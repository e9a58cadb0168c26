"""clients.md §5: the SGLang fork.

Part of the replays of the real ``llm_datadist`` clients: see this package's docstring.
"""

from __future__ import annotations

import json
import queue
import threading
import traceback
from typing import Any

import numpy as np

from llmdd_async.sync import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
)

from ._common import (
    HOST,
    Peer,
    assert_same,
    pattern,
    wait_for,
)

# ============================================================================ §5 SGLang fork
SG_LAYERS = 4
SG_GROUPS = 2  # K buffers, V buffers
SG_TOKENS = 256
SG_TOKEN_SHAPE = (2, 16)
SG_AUX_ROWS = 32
SG_ROOMS = 24
SG_TOKENS_PER_ROOM = 8
SG_CHUNKS = 2
SG_QUEUES = 12
KV_POLL_SUCCESS = 4


def _sg_indices(room: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """P's kv indices, D's kv indices, P's and D's aux index of a room."""
    p = np.random.default_rng(1).permutation(SG_TOKENS).astype(np.int32)
    d = np.random.default_rng(2).permutation(SG_TOKENS).astype(np.int32)
    sl = slice(room * SG_TOKENS_PER_ROOM, (room + 1) * SG_TOKENS_PER_ROOM)
    return p[sl], d[sl], room, SG_AUX_ROWS - 1 - room


def _sg_buffers(seed: int | None) -> tuple[list[list[np.ndarray]], np.ndarray]:
    shape = (SG_TOKENS, *SG_TOKEN_SHAPE)
    groups = []
    for g in range(SG_GROUPS):
        group = []
        for layer in range(SG_LAYERS):
            t = np.zeros(shape, np.float16)
            if seed is not None:
                t[...] = pattern(seed + 10 * g + layer, shape, np.float16)
            group.append(t)
        groups.append(group)
    aux = np.zeros((SG_AUX_ROWS, 16), np.int32)
    if seed is not None:
        aux[...] = pattern(seed + 99, aux.shape, np.int32)
    return groups, aux


def sg_generate_rank_table_a3(device_id: int) -> str:
    """``generate_rank_table_a3`` with what npu-smi / hccn_tool would report."""
    return json.dumps(
        {
            "status": "completed",
            "version": "1.2",
            "server_count": "1",
            "server_list": [
                {
                    "server_id": HOST,
                    "device": [
                        {
                            "device_id": str(device_id),
                            "super_device_id": str(device_id),
                            "device_ip": HOST,
                        }
                    ],
                }
            ],
            "super_pod_list": [{"super_pod_id": "0", "server_list": [{"server_id": HOST}]}],
        }
    )


class SgKVManager:
    """``DataDistKVManager`` of the SGLang datadist backend (world size 1, one node)."""

    def __init__(
        self,
        peer: Peer,
        mode: str,
        gpu_id: int,
        listen_port: int,
        groups: list[list[np.ndarray]],
        aux: np.ndarray,
    ) -> None:
        self.peer = peer
        self.mode = mode
        self.device_id = gpu_id
        self.local_host_ip = HOST
        self.request_status: dict[int, int] = {}
        self.status_lock = threading.Lock()
        self.kv_data_ptr_groups = [[int(t.ctypes.data) for t in g] for g in groups]
        self.kv_data_shape = groups[0][0].shape
        self.aux_data_ptrs = [int(aux.ctypes.data)]
        self.metadata_buffer_size = aux.shape[0]
        llm_config = LLMConfig()
        llm_config.device_id = self.device_id
        llm_config.sync_kv_timeout = 20000
        world_size, node_rank, nnodes = 1, 0, 1
        llm_config.local_comm_res = sg_generate_rank_table_a3(self.device_id)
        self.cluster_id = self.device_id + world_size * node_rank
        if mode == "prefill":
            self.role = LLMRole.PROMPT
            llm_config.listen_ip_info = f"{self.local_host_ip}:{listen_port}"  # 26000 + gpu_id
        else:
            self.role = LLMRole.DECODER
            self.cluster_id += world_size * nnodes
        self.llm_datadist = LLMDataDist(self.role, self.cluster_id)
        self.llm_datadist.init(llm_config.generate_options())
        self.cache_manager = self.llm_datadist.cache_manager
        self.registered_kv_caches: list[Cache] = []
        self.register_buffer_to_engine()
        if mode == "prefill":
            self.transfer_infos: dict[int, dict[int, dict]] = {}
            self.worker_errors: list[str] = []
            self.pushes = 0
            self.transfer_queues: list[queue.Queue] = [queue.Queue() for _ in range(SG_QUEUES)]
            self.workers = [
                threading.Thread(target=self.transfer_worker, args=[q], daemon=True)
                for q in self.transfer_queues
            ]
            for w in self.workers:
                w.start()
        else:
            self.link_clusters_dict: dict[Any, list] = {}
            self.register_link_lock = threading.Lock()

    def register_buffer_to_engine(self) -> None:
        for i, ptrs in enumerate(self.kv_data_ptr_groups):
            cache_desc = CacheDesc(
                num_tensors=len(ptrs),
                shape=tuple(self.kv_data_shape),
                data_type=DataType.DT_FLOAT16,
            )
            self.registered_kv_caches.append(
                self.cache_manager.register_blocks_cache(
                    cache_desc, ptrs, BlocksCacheKey(self.cluster_id, i)
                )
            )
        cache_desc = CacheDesc(
            num_tensors=1, shape=(self.metadata_buffer_size, 16), data_type=DataType.DT_INT32
        )
        self.registered_kv_caches.append(
            self.cache_manager.register_blocks_cache(
                cache_desc,
                [self.aux_data_ptrs[0]],
                BlocksCacheKey(self.cluster_id, len(self.kv_data_ptr_groups)),
            )
        )

    def update_status(self, room: int, status: int) -> None:
        with self.status_lock:
            self.request_status[room] = max(self.request_status.get(room, 0), status)

    # ------------------------------------------------------------ D
    def register_link(self, link_register_key: Any, bootstrap_infos: list[dict]) -> None:
        with self.register_link_lock:
            if link_register_key in self.link_clusters_dict:
                return
            cluster_list = []
            for bootstrap_info in bootstrap_infos:
                cluster = LLMClusterInfo()
                cluster.append_remote_ip_info(bootstrap_info["rank_ip"], bootstrap_info["port"])
                cluster_list.append(cluster)
            try:
                self.llm_datadist.link_clusters(cluster_list, 20000)
            except TypeError:
                self.none_rejected = True  # the current package rejects remote_cluster_id=None
            else:
                raise AssertionError("link_clusters accepted a cluster without remote_cluster_id")
            # DEVIATION: the fork only ran against an older package; set the id it omits.
            for cluster, bootstrap_info in zip(cluster_list, bootstrap_infos, strict=True):
                cluster.remote_cluster_id = bootstrap_info["cluster_id"]
            ret, rets = self.llm_datadist.link_clusters(cluster_list, 20000)
            if ret != LLMStatusCode.LLM_SUCCESS:
                raise Exception(f"link cluster failure {ret} {rets}")
            self.link_clusters_dict[link_register_key] = cluster_list

    # ------------------------------------------------------------ P
    def add_transfer_request(
        self,
        room: int,
        kv_indices: np.ndarray,
        index_slice: slice,
        is_last: bool,
        aux_index: int | None,
    ) -> None:
        self.transfer_queues[room % SG_QUEUES].put(
            (room, kv_indices, index_slice, is_last, aux_index)
        )

    def transfer_worker(self, q: queue.Queue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            room, prefill_kv_indices, index_slice, is_last, prefill_aux_index = item
            try:
                reqs = self.transfer_infos[room].values()
                for req in reqs:
                    chunked_dst_kv_indices = req["dst_kv_indices"][index_slice]
                    for i in range(len(self.kv_data_ptr_groups)):
                        n_tensors = len(self.kv_data_ptr_groups[i])
                        self.cache_manager.push_blocks(
                            BlocksCacheKey(req["cluster_id"], i),
                            self.registered_kv_caches[i],
                            prefill_kv_indices.tolist(),
                            chunked_dst_kv_indices.tolist(),
                            range(n_tensors),
                            range(n_tensors),
                            1,
                        )
                        self.pushes += 1
                    if is_last:
                        last = len(self.kv_data_ptr_groups)
                        self.cache_manager.push_blocks(
                            BlocksCacheKey(req["cluster_id"], last),
                            self.registered_kv_caches[last],
                            [prefill_aux_index],
                            [req["dst_aux_index"]],
                            range(1),
                            range(1),
                            1,
                        )
                if is_last:
                    self.update_status(room, KV_POLL_SUCCESS)
                    for _req in reqs:  # sync_status_to_decode
                        self.peer.send("decoder", (room, KV_POLL_SUCCESS, 0))
            except BaseException:
                # DEVIATION: the fork lets the exception kill the worker; record it instead
                self.worker_errors.append(traceback.format_exc())


def sglang_prompt(peer: Peer, port: int) -> dict:
    groups, aux = _sg_buffers(seed=800)
    mgr = SgKVManager(peer, "prefill", 0, port, groups, aux)
    peer.send("decoder", {"rank_ip": HOST, "port": port, "cluster_id": mgr.cluster_id})
    # bootstrap thread: one TransferInfo per room from D
    for _ in range(SG_ROOMS):
        info = peer.recv()
        info["dst_kv_indices"] = np.frombuffer(info["dst_kv_indices"], dtype=np.int32)
        mgr.transfer_infos.setdefault(info["room"], {})[info["cluster_id"]] = info
    # the scheduler hands every room's chunks to the pushers at once
    per_chunk = SG_TOKENS_PER_ROOM // SG_CHUNKS
    for c in range(SG_CHUNKS):
        for room in range(SG_ROOMS):
            p_idx, _d_idx, p_aux, _d_aux = _sg_indices(room)
            sl = slice(c * per_chunk, (c + 1) * per_chunk)
            is_last = c == SG_CHUNKS - 1
            mgr.add_transfer_request(room, p_idx[sl], sl, is_last, p_aux if is_last else None)
    wait_for(
        lambda: len(mgr.request_status) == SG_ROOMS or bool(mgr.worker_errors),
        "all rooms pushed",
    )
    for q in mgr.transfer_queues:
        q.put(None)
    for w in mgr.workers:
        w.join(10)
    if mgr.worker_errors:
        raise AssertionError(f"{len(mgr.worker_errors)} pushes failed:\n{mgr.worker_errors[0]}")
    peer.sync()  # D verified
    return {"push_calls": mgr.pushes}


def sglang_decoder(peer: Peer, port: int) -> dict:
    groups, aux = _sg_buffers(seed=None)
    mgr = SgKVManager(peer, "decode", 0, port, groups, aux)
    bootstrap_info = peer.recv()
    mgr.register_link(("bootstrap", HOST), [bootstrap_info])
    for room in range(SG_ROOMS):
        _p_idx, d_idx, _p_aux, d_aux = _sg_indices(room)
        peer.send(
            "prompt",
            {
                "room": room,
                "endpoint": HOST,
                "dst_port": 0,
                "dst_kv_indices": d_idx.tobytes(),
                "dst_aux_index": d_aux,
                "required_dst_info_num": 1,
                "cluster_id": mgr.cluster_id,
            },
        )
    while len(mgr.request_status) < SG_ROOMS:  # decode_thread
        room, status, _prefill_rank = peer.recv()
        mgr.update_status(room, status)
    expected_groups, expected_aux = _sg_buffers(seed=800)
    checked = 0
    for room in range(SG_ROOMS):
        p_idx, d_idx, p_aux, d_aux = _sg_indices(room)
        for g in range(SG_GROUPS):
            for layer in range(SG_LAYERS):
                checked += assert_same(
                    groups[g][layer][d_idx],
                    expected_groups[g][layer][p_idx],
                    f"room {room} group {g} layer {layer}",
                )
        checked += assert_same(aux[d_aux], expected_aux[p_aux], f"room {room} aux")
    peer.sync()
    return {"bytes_checked": checked, "none_rejected": getattr(mgr, "none_rejected", False)}
