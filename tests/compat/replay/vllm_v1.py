"""clients.md §1: vLLM-Ascend V1 (``llmdatadist_c_mgr_connector``).

Part of the replays of the real ``llm_datadist`` clients: see this package's docstring.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from llmdd_async.sync import (
    BlocksCacheKey,
    CacheDesc,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    RegisterMemStatus,
)

from ._common import (
    HOST,
    NP_TO_DT,
    POLL_S,
    Peer,
    aligned_zeros,
    assert_same,
    pattern,
    wait_for,
)

# ============================================================================ §1 vLLM-Ascend V1
V1_LAYERS = 3
V1_NUM_BLOCKS = 16
V1_MHA_BLOCK = (4, 2, 16)  # block_size, kv heads, head size
V1_MLA_BLOCKS = ((4, 1, 32), (4, 1, 8))  # k_normed, k_pe
#: (request id, D's local block ids, P's remote block ids); the first is a prefix-cache hit
V1_REQUESTS = (
    ("req-prefix-hit", [3, 4, 5], [7, 8, 9, 10, 11]),
    ("req-scattered", [12, 1, 2, 6], [0, 14, 15, 13]),
)


def v1_get_transfer_timeout_value() -> int:
    """``vllm_ascend.distributed.utils.get_transfer_timeout_value``."""
    env = os.getenv("ASCEND_TRANSFER_TIMEOUT", "")
    if env:
        return int(env)
    hccl_rdma_timeout = int(os.getenv("HCCL_RDMA_TIMEOUT", "20"))
    hccl_rdma_retry_cnt = int(os.getenv("HCCL_RDMA_RETRY_CNT", "7"))
    return int(4.096 * (2**hccl_rdma_timeout) * hccl_rdma_retry_cnt // 1000 + 3000)


def v1_kv_caches(variant: str, seed: int | None) -> dict[str, tuple[np.ndarray, ...]]:
    """``{layer_name: (K, V)}`` (MHA) or ``(k_normed, k_pe)`` (MLA), 2 MiB aligned."""
    shapes = (V1_MHA_BLOCK, V1_MHA_BLOCK) if variant == "mha" else V1_MLA_BLOCKS
    caches = {}
    for layer in range(V1_LAYERS):
        parts = []
        for part, block_shape in enumerate(shapes):
            t = aligned_zeros((V1_NUM_BLOCKS, *block_shape), np.float16)
            if seed is not None:
                t[...] = pattern(seed + 10 * layer + part, t.shape, t.dtype)
            parts.append(t)
        caches[f"model.layers.{layer}.self_attn.attn"] = tuple(parts)
    return caches


@dataclasses.dataclass
class V1AgentMetadata:
    super_pod_id: str | None
    server_id: str
    device_id: str
    device_ip: str
    super_device_id: str | None
    cluster_id: int
    #: DEVIATION (extension): where this device's comm-domain rank listens (rank table field)
    llmdd_port: int


class VllmV1Worker:
    """``LLMDataDistCMgrConnectorWorker`` (vllm-ascend V1), tp=pcp=dcp=1."""

    def __init__(self, peer: Peer, kv_role: str, global_rank_table: dict) -> None:
        self.peer = peer
        self.local_ip = HOST
        self.tp_size, self.tp_rank, self.pcp_rank, self.pcp_size, self.dcp_size = 1, 0, 0, 1, 1
        self.executor = ThreadPoolExecutor(1)
        self.thread_lock = threading.Lock()
        if kv_role == "kv_producer":
            self.llm_datadist_role = LLMRole.PROMPT
        elif kv_role == "kv_consumer":
            self.llm_datadist_role = LLMRole.DECODER
        else:
            raise RuntimeError(f"unexpected kv role {kv_role}")
        self.linked_cluster: dict[int, int] = {}
        self.local_agent_metadata = self.read_agent_metadata(global_rank_table)
        self.llm_datadist = LLMDataDist(
            self.llm_datadist_role, self.local_agent_metadata.cluster_id
        )
        self.init_llm_datadist()
        self.finished_reqs: set[str] = set()
        self.listener_errors: list[str] = []

    def init_llm_datadist(self) -> None:
        llm_config = LLMConfig()
        llm_config.device_id = 0  # local_rank
        llm_config.sync_kv_timeout = v1_get_transfer_timeout_value()
        llm_config.enable_switch_role = True
        llm_config.enable_cache_manager = True
        llm_config.enable_remote_cache_accessible = True
        llm_config_options = llm_config.generate_options()
        self.llm_datadist.init(llm_config_options)
        self.cache_manager = self.llm_datadist.cache_manager

    def read_agent_metadata(self, global_rank_table: dict) -> V1AgentMetadata:
        key = (
            "prefill_device_list"
            if self.llm_datadist_role == LLMRole.PROMPT
            else "decode_device_list"
        )
        device_list = [d for d in global_rank_table[key] if d.get("server_id") == self.local_ip]
        info = device_list[self.pcp_rank * self.tp_size + self.tp_rank]
        return V1AgentMetadata(
            super_pod_id=info.get("super_pod_id", None),
            server_id=info["server_id"],
            device_id=info["device_id"],
            device_ip=info["device_ip"],
            super_device_id=info.get("super_device_id", None),
            cluster_id=int(info["cluster_id"]),
            llmdd_port=int(info["llmdd_port"]),
        )

    def register_kv_caches(self, kv_caches: dict[str, tuple[np.ndarray, ...]]) -> None:
        self.kv_caches = kv_caches  # the model runner owns (and keeps) the tensors
        _, first_kv_cache_tuple = next(iter(kv_caches.items()))
        first_kv_cache = first_kv_cache_tuple[0]
        assert len(first_kv_cache_tuple) > 1
        kv_cache_dtype = first_kv_cache.dtype
        self.use_mla = (
            first_kv_cache_tuple[0].shape[-1] != first_kv_cache_tuple[1].shape[-1]
            and len(first_kv_cache_tuple) == 2
        )
        self.num_blocks = first_kv_cache.shape[0]
        alignment = 2 * 1024 * 1024
        cid = int(self.local_agent_metadata.cluster_id)
        if self.use_mla:
            k_normed_addrs, k_pe_addrs = [], []
            for cache_or_caches in kv_caches.values():
                assert len(cache_or_caches) > 1
                k_normed, k_pe = cache_or_caches[0], cache_or_caches[1]
                k_normed_addrs.append(k_normed.ctypes.data)  # tensor.data_ptr()
                k_pe_addrs.append(k_pe.ctypes.data)
            self.cache_addr = (k_normed_addrs, k_pe_addrs)
            self.cache_desc = (
                CacheDesc(len(k_normed_addrs), [*k_normed.shape], NP_TO_DT[kv_cache_dtype]),
                CacheDesc(len(k_pe_addrs), [*k_pe.shape], NP_TO_DT[kv_cache_dtype]),
            )
            self.cache_key = (
                BlocksCacheKey(cluster_id=cid, model_id=0),
                BlocksCacheKey(cluster_id=cid, model_id=1),
            )
            try:
                self.cache = (
                    self.cache_manager.register_blocks_cache(
                        self.cache_desc[0], self.cache_addr[0], self.cache_key[0]
                    ),
                    self.cache_manager.register_blocks_cache(
                        self.cache_desc[1], self.cache_addr[1], self.cache_key[1]
                    ),
                )
            except (TypeError, ValueError) as exc:
                raise RuntimeError("unexpected parameter to register_block_cache") from exc
        else:
            self.cache_addr = []
            for cache_or_caches in kv_caches.values():
                for cache in cache_or_caches:
                    base_addr = cache.ctypes.data
                    assert base_addr % alignment == 0, (
                        "The address of the registered kv cache should be aligned to 2M"
                    )
                    self.cache_addr.append(base_addr)
            self.cache_desc = CacheDesc(
                len(self.cache_addr), [*cache.shape], NP_TO_DT[kv_cache_dtype]
            )
            self.cache_key = BlocksCacheKey(cluster_id=cid)
            try:
                self.cache = self.cache_manager.register_blocks_cache(
                    self.cache_desc, self.cache_addr, self.cache_key
                )
            except (TypeError, ValueError) as exc:
                raise RuntimeError("unexpected parameter to register_block_cache") from exc
        if self.llm_datadist_role == LLMRole.PROMPT:
            # DEVIATION: only P starts the metadata listener (nobody contacts D's).
            self.ready_event = threading.Event()
            self.listener = threading.Thread(
                target=self.listen_for_agent_metadata_req,
                args=(self.ready_event,),
                daemon=True,
                name="metadata_agent_listener",
            )
            self.listener.start()
            self.ready_event.wait()

    # ---------------------------------------------------------------- the zmq ROUTER thread
    def listen_for_agent_metadata_req(self, event: threading.Event) -> None:
        msg_to_send = dataclasses.asdict(self.local_agent_metadata)
        event.set()
        try:
            while True:
                event_msg, decode_msg = self.peer.recv(timeout=60.0)
                if event_msg == "stop":
                    return
                if event_msg == "ReqForMetadata":
                    self.peer.send("decoder", ("metadata", msg_to_send))
                    self.add_remote_agent(V1AgentMetadata(**decode_msg))
                elif event_msg == "ReqForFinished":
                    with self.thread_lock:
                        self.finished_reqs.add(decode_msg[0])
                    self.peer.send("decoder", ("ack", "receiving decode finished"))
                else:
                    raise RuntimeError(f"unexpected request event {event_msg}")
        except BaseException:
            self.listener_errors.append(traceback.format_exc())

    # ---------------------------------------------------------------- linking
    def add_remote_agent(self, metadata: V1AgentMetadata) -> int:
        remote_cluster_id = metadata.cluster_id
        if remote_cluster_id in self.linked_cluster:
            return remote_cluster_id
        is_same_server = metadata.server_id == self.local_agent_metadata.server_id
        if self.llm_datadist_role == LLMRole.PROMPT:
            prefill_metadata, decode_metadata = self.local_agent_metadata, metadata
        else:
            prefill_metadata, decode_metadata = metadata, self.local_agent_metadata
        comm_name = f"pd_comm_{prefill_metadata.device_ip}_{decode_metadata.device_ip}"
        cluster_rank_info = {prefill_metadata.cluster_id: 0, decode_metadata.cluster_id: 1}

        def device(meta: V1AgentMetadata, rank: str) -> dict:
            return {
                k: v
                for k, v in [
                    ("device_id", meta.device_id),
                    ("device_ip", meta.device_ip),
                    ("super_device_id", meta.super_device_id),
                    ("rank_id", rank),
                    ("llmdd_port", meta.llmdd_port),  # DEVIATION: extension field
                ]
                if v is not None
            }

        rank_table: dict[str, Any] = {
            "version": "1.2",
            "server_count": "1" if is_same_server else "2",
            "status": "completed",
            "server_list": [],
        }
        prefill_server = {
            "device": [device(prefill_metadata, "0")],
            "server_id": prefill_metadata.server_id,
        }
        if is_same_server:
            prefill_server["device"].append(device(decode_metadata, "1"))
            rank_table["server_list"].append(prefill_server)
        else:
            rank_table["server_list"].append(prefill_server)
            rank_table["server_list"].append(
                {"device": [device(decode_metadata, "1")], "server_id": decode_metadata.server_id}
            )
        comm_id = self.llm_datadist.link(comm_name, cluster_rank_info, json.dumps(rank_table))
        while True:
            ret = self.llm_datadist.query_register_mem_status(comm_id=comm_id)
            if ret == RegisterMemStatus.OK:
                break
            elif ret == RegisterMemStatus.FAILED:
                raise RuntimeError(f"Linking failed, comm id: {comm_id}")
            time.sleep(POLL_S)  # DEVIATION: the client sleeps 1 s
        self.linked_cluster.update({remote_cluster_id: comm_id})
        return remote_cluster_id

    def remove_remote_agent(self, cluster_id: int) -> None:
        comm_id = self.linked_cluster[cluster_id]
        try:
            self.llm_datadist.unlink(comm_id)
            self.linked_cluster.pop(cluster_id)
        except LLMException:
            pass  # logged by the client, not raised

    def connect_to_remote_agent(self, host: str, port: int) -> int:
        # zmq REQ to the P rank's ROUTER: our metadata out, P's back; then link.
        self.peer.send("prompt", ("ReqForMetadata", dataclasses.asdict(self.local_agent_metadata)))
        kind, metadata = self.peer.recv()
        assert kind == "metadata", kind
        return self.add_remote_agent(V1AgentMetadata(**metadata))

    def send_finish_to_remote(self, host: str, ports: list[int], request_id: str) -> None:
        for _port in ports:
            self.peer.send("prompt", ("ReqForFinished", [request_id]))
            self.peer.recv()

    # ---------------------------------------------------------------- transfer (D)
    def start_load_kv(self, requests: tuple) -> list:
        futures = []
        for req_id, local_block_ids, remote_block_ids in requests:
            futures.append(
                self.executor.submit(
                    self._read_blocks,
                    local_block_ids=local_block_ids,
                    remote_block_ids=remote_block_ids,
                    remote_ip=HOST,
                    remote_port=0,
                    request_id=req_id,
                )
            )
        return futures

    def _read_blocks(
        self,
        local_block_ids: list[int],
        remote_block_ids: list[int],
        remote_ip: str,
        remote_port: int,
        request_id: str,
    ) -> list[int]:
        # _get_kv_split_metadata with equal cp/dcp: one remote P rank, all blocks
        remote_kv_num, remote_ports, remote_block_nums = 1, [remote_port], [len(remote_block_ids)]
        local_block_offset = 0
        remote_block_ids_full, local_block_ids_full = remote_block_ids, local_block_ids
        for remote_kv_id in range(remote_kv_num):
            num_blocks_to_pull = remote_block_nums[remote_kv_id]
            remote_block_ids = remote_block_ids_full[:num_blocks_to_pull]
            local_block_ids = local_block_ids_full[
                local_block_offset : local_block_offset + num_blocks_to_pull
            ]
            local_block_offset += num_blocks_to_pull
            remote_cluster_id = self.connect_to_remote_agent(remote_ip, remote_ports[0])
            num_local_blocks = len(local_block_ids)
            if num_local_blocks == 0:
                return []
            num_remote_blocks = len(remote_block_ids)
            assert num_local_blocks <= num_remote_blocks
            if num_local_blocks < num_remote_blocks:
                remote_block_ids = remote_block_ids[-num_local_blocks:]
            try:
                if self.use_mla:
                    for model_id in (0, 1):
                        self.cache_manager.pull_blocks(
                            BlocksCacheKey(cluster_id=remote_cluster_id, model_id=model_id),
                            self.cache[model_id],
                            remote_block_ids,
                            local_block_ids,
                        )
                else:
                    self.cache_manager.pull_blocks(
                        BlocksCacheKey(cluster_id=remote_cluster_id),
                        self.cache,
                        remote_block_ids,
                        local_block_ids,
                    )
            except (TypeError, ValueError) as exc:
                raise RuntimeError("Passing unexpected parameter to pull_blocks") from exc
            except LLMException as exc:
                raise RuntimeError(
                    "Timeout during pull_blocks, you can try to increase the sync_kv_timeout "
                    f"config or checking your connect status ({exc.status_code!r}: {exc})"
                ) from exc
        self.send_finish_to_remote(remote_ip, remote_ports, request_id)
        return remote_block_ids


def _v1_rank_table(ports: list[int]) -> dict:
    """The offline global rank table (env DISAGGREGATED_PREFILL_RANK_TABLE_PATH)."""
    return {
        "prefill_device_list": [
            {
                "server_id": HOST,
                "device_id": "0",
                "device_ip": HOST,
                "cluster_id": "1",
                "llmdd_port": ports[0],
            },
        ],
        "decode_device_list": [
            {
                "server_id": HOST,
                "device_id": "1",
                "device_ip": HOST,
                "cluster_id": "2",
                "llmdd_port": ports[1],
            },
        ],
    }


def vllm_v1_prompt(peer: Peer, ports: list[int], variant: str) -> dict:
    worker = VllmV1Worker(peer, "kv_producer", _v1_rank_table(ports))
    worker.register_kv_caches(v1_kv_caches(variant, seed=100))
    wanted = {r[0] for r in V1_REQUESTS}
    wait_for(
        lambda: wanted <= worker.finished_reqs or bool(worker.listener_errors),
        "the decoder's finished messages",
    )
    if worker.listener_errors:
        raise AssertionError("metadata listener failed:\n" + worker.listener_errors[0])
    peer.sync()  # D removed its remote agent
    for cluster_id in list(worker.linked_cluster):
        worker.remove_remote_agent(cluster_id)
    peer.send("prompt", ("stop", None))
    worker.listener.join(10)
    return {"finished": sorted(worker.finished_reqs), "linked_after": dict(worker.linked_cluster)}


def vllm_v1_decoder(peer: Peer, ports: list[int], variant: str) -> dict:
    worker = VllmV1Worker(peer, "kv_consumer", _v1_rank_table(ports))
    caches = v1_kv_caches(variant, seed=None)
    worker.register_kv_caches(caches)
    futures = worker.start_load_kv(V1_REQUESTS)
    used_remote = [f.result(timeout=60) for f in futures]
    worker.executor.shutdown(wait=True)
    expected = v1_kv_caches(variant, seed=100)
    checked = 0
    touched = np.zeros(V1_NUM_BLOCKS, dtype=bool)
    for (_, local_ids, _), remote_ids in zip(V1_REQUESTS, used_remote, strict=True):
        touched[local_ids] = True
        for name, parts in caches.items():
            for part, tensor in enumerate(parts):
                checked += assert_same(
                    tensor[local_ids],
                    expected[name][part][remote_ids],
                    f"{name}[{part}] blocks {local_ids} <- {remote_ids}",
                )
    for name, parts in caches.items():
        for part, tensor in enumerate(parts):
            assert not tensor[~touched].any(), f"{name}[{part}]: blocks nobody pulled changed"
    for cluster_id in list(worker.linked_cluster):
        worker.remove_remote_agent(cluster_id)
    peer.sync()  # tell P we removed ours
    return {"remote_ids": used_remote, "bytes_checked": checked}
