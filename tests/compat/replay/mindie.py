"""clients.md §3: MindIE-LLM.

Part of the replays of the real ``llm_datadist`` clients: see this package's docstring.
"""

from __future__ import annotations

import ipaddress
import json
import threading
import time
import traceback
from collections import deque
from typing import Any

import numpy as np

from llmdd_async.sync import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    RegisterMemStatus,
)

from ._common import (
    HOST,
    Peer,
    aligned_zeros,
    assert_same,
    pattern,
    wait_for,
)

# ============================================================================ §3 MindIE-LLM
MINDIE_LAYERS = 3
MINDIE_NUM_BLOCKS = 12
MINDIE_BLOCK_SHAPE = (4, 2, 16)
MINDIE_SRC_BLOCKS = [1, 2, 3, 9]
MINDIE_DST_BLOCKS = [4, 5, 6, 0]


class MindieStatus:  # MindieLlmStatusCode / ErrorCode values the worker returns
    SUCCESS = 0
    PD_ALREADY_LINK = 1
    PD_RETRY_QUERY = 2
    PD_LINK_ERROR = 3
    PD_UNLINK_ERROR = 4
    PD_PULL_KV_ERROR = 5
    PD_BLOCK_ID_OUT_OF_RANGE = 6
    PD_MODEL_INSTANCE_ID_ERROR = 7


STR_DTYPE_TO_DTYPE = {
    "float16": DataType.DT_FLOAT16,
    "bfloat16": DataType.DT_BF16,
    "float": DataType.DT_FLOAT,
    "int8": DataType.DT_INT8,
}


class MindieLinkResult:
    def __init__(self) -> None:
        self._lists: dict[str, list[str]] = {
            "waitting": [],
            "running": [],
            "success": [],
            "failed": [],
        }
        self._lock = threading.Lock()

    def move(self, link_ip: str, to: str | None) -> None:
        with self._lock:
            for lst in self._lists.values():
                if link_ip in lst:
                    lst.remove(link_ip)
            if to is not None:
                self._lists[to].append(link_ip)

    def get_all_status(self) -> dict[str, list[str]]:
        with self._lock:
            return {k: list(v) for k, v in self._lists.items()}


class MindieRankInfo:
    def __init__(
        self,
        remote_cluster_id: int,
        remote_physical_device_id: int,
        remote_device_ip: str,
        remote_host_ip: str,
        local_host_ip: str,
        local_cluster_id: int,
        local_device_ip: str,
        local_physical_device_id: int,
        local_llmdd_port: int,
        remote_llmdd_port: int,
    ) -> None:
        self.local_cluster_id = local_cluster_id
        self.remote_cluster_id = remote_cluster_id
        self.remote_physical_device_id = str(remote_physical_device_id)
        self.remote_device_ip = remote_device_ip
        self.remote_server_id = remote_host_ip
        self.local_server_id = local_host_ip
        self.local_device_ip = local_device_ip
        self.local_physical_device_id = str(local_physical_device_id)
        self.local_llmdd_port = local_llmdd_port
        self.remote_llmdd_port = remote_llmdd_port
        # DEVIATION: rank 0 goes to the numerically smaller device IP; every endpoint here is
        # 127.0.0.1, where the client's {ip: rank} dict collapses, so ties go by cluster id.
        local_key = (ipaddress.ip_address(local_device_ip), local_cluster_id)
        remote_key = (ipaddress.ip_address(remote_device_ip), remote_cluster_id)
        self.remote_rank_id, self.local_rank_id = (0, 1) if remote_key < local_key else (1, 0)

    @staticmethod
    def create_device(device_id: str, device_ip: str, rank_id: int, llmdd_port: int) -> dict:
        return {
            "device_id": device_id,
            "device_ip": device_ip,
            "rank_id": str(rank_id),
            "llmdd_port": llmdd_port,  # DEVIATION: extension field
        }

    def get_rank_table(self) -> str:
        local = self.create_device(
            self.local_physical_device_id,
            self.local_device_ip,
            self.local_rank_id,
            self.local_llmdd_port,
        )
        remote = self.create_device(
            self.remote_physical_device_id,
            self.remote_device_ip,
            self.remote_rank_id,
            self.remote_llmdd_port,
        )
        if self.remote_server_id == self.local_server_id:
            server_list = [{"device": [local, remote], "server_id": str(self.local_server_id)}]
            server_count = "1"
        else:
            first, second = (
                (local, remote) if self.local_rank_id < self.remote_rank_id else (remote, local)
            )
            server_list = [
                {"device": [first], "server_id": "a"},
                {"device": [second], "server_id": "b"},
            ]
            server_count = "2"
        return json.dumps(
            {
                "server_count": server_count,
                "server_list": server_list,
                "status": "completed",
                "version": "1.0",
            }
        )

    def get_cluster_rank_info(self) -> dict[int, int]:
        if self.local_rank_id < self.remote_rank_id:
            return {
                int(self.local_cluster_id): self.local_rank_id,
                int(self.remote_cluster_id): self.remote_rank_id,
            }
        return {
            int(self.remote_cluster_id): self.remote_rank_id,
            int(self.local_cluster_id): self.local_rank_id,
        }


class MindieEngine:
    """``SeparateDeploymentEngine``."""

    def __init__(
        self,
        role: str,
        local_cluster_id: int,
        local_logic_device_id: int = 0,
        kv_trans_timeout: int = 1,
        kv_link_timeout: int = 1080,
    ) -> None:
        engine_role = {"prefill": LLMRole.PROMPT, "decoder": LLMRole.DECODER, "flex": LLMRole.MIX}[
            role
        ]
        self.separate_deployment_engine = LLMDataDist(engine_role, local_cluster_id)
        llm_config = LLMConfig()
        llm_config.device_id = local_logic_device_id
        llm_config.enable_cache_manager = True
        llm_config.enable_remote_cache_accessible = True
        llm_config.link_total_time = int(kv_link_timeout)
        llm_config.link_retry_count = 80
        if kv_trans_timeout <= 0:
            kv_trans_timeout = 1
        llm_config.sync_kv_timeout = kv_trans_timeout * 1000
        llm_options = llm_config.generate_options()
        self.separate_deployment_engine.init(llm_options)
        self.npu_cache_map: dict[int, Cache] = {}

    def link(
        self,
        cluster_rank_info: dict,
        rank_table: str,
        remote_dp_instance_id: int,
        local_dp_instance_id: int,
    ) -> dict:
        rank_table_dict = json.loads(rank_table)
        server_list = rank_table_dict.get("server_list", [])
        if rank_table_dict.get("server_count") == "1":
            devices = server_list[0].get("device", [])
            device_ip1, device_ip2 = devices[0].get("device_ip"), devices[1].get("device_ip")
        else:
            device_ip1 = server_list[0]["device"][0].get("device_ip")
            device_ip2 = server_list[1]["device"][0].get("device_ip")
        if device_ip1 > device_ip2:
            link_name = f"link{device_ip1}:{device_ip2}"
        else:
            link_name = f"link{device_ip2}:{device_ip1}"
        lo, hi = sorted((remote_dp_instance_id, local_dp_instance_id))
        link_name = link_name + f"_{lo}:{hi}"
        try:
            result = self.separate_deployment_engine.link(link_name, cluster_rank_info, rank_table)
            if result == LLMStatusCode.LLM_ALREADY_LINK:  # dead check: link() raises instead
                return {"status": MindieStatus.PD_ALREADY_LINK, "comm_id": None}
            return {"status": MindieStatus.SUCCESS, "comm_id": result}
        except LLMException:
            return {"status": MindieStatus.PD_LINK_ERROR, "comm_id": None}

    def unlink(self, comm_id: int) -> int:
        try:
            self.separate_deployment_engine.unlink(comm_id)
            return MindieStatus.SUCCESS
        except LLMException:
            return MindieStatus.PD_UNLINK_ERROR

    def set_npu_cache(self, model_id: int, npu_cache: Cache) -> None:
        self.npu_cache_map[model_id] = npu_cache

    def pull_kv(
        self,
        model_id: int,
        src_block_table: list[int],
        dst_block_table: list[int],
        remote_cluster_id: int,
    ) -> int:
        remote_cache_key = BlocksCacheKey(cluster_id=remote_cluster_id, model_id=model_id)
        try:
            self.separate_deployment_engine.cache_manager.pull_blocks(
                remote_cache_key, self.npu_cache_map[model_id], src_block_table, dst_block_table
            )
            return MindieStatus.SUCCESS
        except LLMException as e:
            self.last_pull_error = e.status_code
            return MindieStatus.PD_PULL_KV_ERROR

    def register_blocks_cache(
        self, cache_desc: CacheDesc, npu_addrs: list[int], cache_key: BlocksCacheKey
    ) -> Cache:
        cache_manager = self.separate_deployment_engine.cache_manager
        return cache_manager.register_blocks_cache(cache_desc, npu_addrs, cache_key)

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        return self.separate_deployment_engine.query_register_mem_status(comm_id)

    def finalize(self) -> None:
        self.separate_deployment_engine.finalize()


class MindieWorker:
    """``SeparateDeploymentWorker``: windowed asynchronous linking (≤16 in flight)."""

    def __init__(
        self, role: str, local_physical_device_id: int, local_cluster_id: int, local_llmdd_port: int
    ) -> None:
        self.local_physical_device_id = local_physical_device_id
        self.local_cluster_id = local_cluster_id
        self.local_device_ip = HOST
        self.local_host_ip = HOST
        self.local_llmdd_port = local_llmdd_port
        self.cluster_comm_map: dict[int, int] = {}
        self.window_size = 16
        self.window: deque = deque()
        self.link_queue: deque = deque()
        self.link_queue_cond = threading.Condition()
        self.window_cond = threading.Condition()
        self.cluster_map_lock = threading.Lock()
        self.link_result = MindieLinkResult()
        self.cache_desc_map: dict[int, CacheDesc] = {}
        self.max_block_nums_map: dict[int, int] = {}
        self.queries = 0
        self.link_errors: list[str] = []
        self.separate_deployment_engine = MindieEngine(role, local_cluster_id)
        for target in (self._fill_window_worker, self._process_window_worker):
            threading.Thread(target=target, daemon=True).start()

    def build(
        self, model_id: int, num_tensors: int, num_blocks: int, blockshape: Any, dtype: str
    ) -> None:
        block_shape = tuple(map(int, blockshape))
        self.cache_desc_map[model_id] = CacheDesc(
            num_tensors=int(num_tensors),
            shape=(int(num_blocks), *block_shape),
            data_type=STR_DTYPE_TO_DTYPE[dtype],
            placement=Placement.DEVICE,
        )
        self.max_block_nums_map[model_id] = num_blocks

    def set_npu_cache(self, model_id: int, npu_addrs: list[int]) -> None:
        try:
            cache_key = BlocksCacheKey(cluster_id=self.local_cluster_id, model_id=model_id)
            npu_cache = self.separate_deployment_engine.register_blocks_cache(
                self.cache_desc_map[model_id], npu_addrs, cache_key
            )
            self.separate_deployment_engine.set_npu_cache(model_id, npu_cache)
        except Exception as e:
            raise Exception("Failed to register blocks cache") from e

    def pull_blocks(
        self, remote_model_instance_id: int, src_block_table: list[int], dst_block_table: list[int]
    ) -> int:
        with self.cluster_map_lock:
            if remote_model_instance_id not in self.cluster_comm_map:
                return MindieStatus.PD_MODEL_INSTANCE_ID_ERROR
        for model_id in self.cache_desc_map:
            if not all(0 <= x < self.max_block_nums_map[model_id] for x in dst_block_table):
                return MindieStatus.PD_BLOCK_ID_OUT_OF_RANGE
            rt = self.separate_deployment_engine.pull_kv(
                model_id=model_id,
                src_block_table=src_block_table,
                dst_block_table=dst_block_table,
                remote_cluster_id=remote_model_instance_id,
            )
            if rt != MindieStatus.SUCCESS:
                return rt
        return MindieStatus.SUCCESS

    def query_link_status(self) -> dict[str, list[str]]:
        return self.link_result.get_all_status()

    def link(self, **params: Any) -> None:
        items = []
        for instance_id, cluster_ids in params["remote_cluster_ids"].items():
            for index in range(len(cluster_ids)):
                items.append(
                    {
                        "remote_cluster_id": cluster_ids[index],
                        "remote_physical_device_id": params["remote_physical_device_ids"][
                            instance_id
                        ][index],
                        "remote_device_ip": params["remote_device_ips"][instance_id][index],
                        "remote_host_ip": params["host_ips"][instance_id][index],
                        "remote_llmdd_port": params["remote_llmdd_ports"][instance_id][index],
                        "remote_dp_instance_id": params["remote_dp_instance_ids"][instance_id],
                        "local_dp_instance_id": params["local_dp_instance_id"],
                    }
                )
        with self.link_queue_cond:
            for item in items:
                self.link_queue.append(item)
                self.link_result.move(item["remote_device_ip"], "waitting")
            self.link_queue_cond.notify()

    def unlink(self, remote_cluster_id: int) -> int:
        with self.cluster_map_lock:
            if remote_cluster_id not in self.cluster_comm_map:
                return MindieStatus.PD_UNLINK_ERROR
            comm_id = self.cluster_comm_map.pop(remote_cluster_id)
        return self.separate_deployment_engine.unlink(comm_id)

    def unlink_all(self) -> None:
        with self.link_queue_cond:
            self.link_queue.clear()
        with self.window_cond:
            self.window.clear()
        for cluster_id in list(self.cluster_comm_map):
            ret = self.unlink(cluster_id)
            if ret != MindieStatus.SUCCESS:
                raise Exception("SeparateDeploymentEngine: unlink_all fail")

    def finalize(self) -> None:
        self.unlink_all()
        self.separate_deployment_engine.finalize()

    def _try_create_link(self, p: dict) -> tuple[bool, dict | None]:
        try:
            rank_info = MindieRankInfo(
                remote_cluster_id=p["remote_cluster_id"],
                remote_physical_device_id=p["remote_physical_device_id"],
                remote_device_ip=p["remote_device_ip"],
                remote_host_ip=p["remote_host_ip"],
                local_host_ip=self.local_host_ip,
                local_cluster_id=self.local_cluster_id,
                local_device_ip=self.local_device_ip,
                local_physical_device_id=self.local_physical_device_id,
                local_llmdd_port=self.local_llmdd_port,
                remote_llmdd_port=p["remote_llmdd_port"],
            )
            result = self.separate_deployment_engine.link(
                rank_info.get_cluster_rank_info(),
                rank_info.get_rank_table(),
                p["remote_dp_instance_id"],
                p["local_dp_instance_id"],
            )
            if result["status"] == MindieStatus.SUCCESS and result["comm_id"] is not None:
                with self.cluster_map_lock:
                    self.cluster_comm_map[p["remote_cluster_id"]] = result["comm_id"]
                return True, {"comm_id": result["comm_id"], "link_params": p}
            return False, None
        except Exception:
            self.link_errors.append(traceback.format_exc())  # the client logs it
            return False, None

    def _query_mem_status(self, item: dict) -> int:
        comm_id, p = item["comm_id"], item["link_params"]
        query_attempt = 0
        while query_attempt < 3:
            try:
                self.queries += 1
                status = self.separate_deployment_engine.query_register_mem_status(comm_id)
                if status == RegisterMemStatus.OK:
                    return MindieStatus.SUCCESS
                elif status == RegisterMemStatus.FAILED:
                    self.unlink(p["remote_cluster_id"])
                    return MindieStatus.PD_LINK_ERROR
                query_attempt += 1
                if query_attempt < 3:
                    time.sleep(0.05)
            except Exception:
                self.unlink(p["remote_cluster_id"])
                return MindieStatus.PD_LINK_ERROR
        return MindieStatus.PD_RETRY_QUERY

    def _fill_window_worker(self) -> None:
        while True:
            with self.link_queue_cond:
                if not self.link_queue_cond.wait_for(
                    lambda: len(self.link_queue) > 0 and len(self.window) < self.window_size,
                    timeout=0.1,
                ):
                    continue
                item = self.link_queue.popleft()
            ok, window_item = self._try_create_link(item)
            with self.window_cond:
                if ok:
                    self.window.append(window_item)
                    self.link_result.move(item["remote_device_ip"], "running")
                else:
                    self.link_result.move(item["remote_device_ip"], "failed")

    def _process_window_worker(self) -> None:
        while True:
            with self.window_cond:
                if not self.window:
                    self.window_cond.wait(0.1)
                    continue
                item = self.window.popleft()
            status = self._query_mem_status(item)
            with self.window_cond:
                ip = item["link_params"]["remote_device_ip"]
                if status == MindieStatus.SUCCESS:
                    self.link_result.move(ip, "success")
                elif status == MindieStatus.PD_RETRY_QUERY:
                    self.window.append(item)  # still PREPARING: re-queued
                else:
                    self.link_result.move(ip, "failed")


def _mindie_side(
    peer: Peer, role: str, cluster_ids: dict, ports: dict, seed: int | None, link_delay: float
) -> tuple:
    me, other = ("prefill", "decoder") if role == "prefill" else ("decoder", "prefill")
    worker = MindieWorker(
        role,
        local_physical_device_id=0 if role == "prefill" else 1,
        local_cluster_id=cluster_ids[me],
        local_llmdd_port=ports[me],
    )
    shape = (MINDIE_NUM_BLOCKS, *MINDIE_BLOCK_SHAPE)
    tensors = {m: [aligned_zeros(shape, np.float16) for _ in range(MINDIE_LAYERS)] for m in (0, 1)}
    if seed is not None:
        for m, ts in tensors.items():
            for layer, t in enumerate(ts):
                t[...] = pattern(seed + 10 * m + layer, shape, np.float16)
    for m in (0, 1):  # K is model 0, V is model 1
        worker.build(m, MINDIE_LAYERS, MINDIE_NUM_BLOCKS, MINDIE_BLOCK_SHAPE, "float16")
        worker.set_npu_cache(m, [t.ctypes.data for t in tensors[m]])
    peer.sync()  # both registered before linking
    # The coordinator's link commands reach the instances at different times: the prefill
    # instance's status stays PREPARING until the decoder joins, so its 3-try polls re-queue.
    time.sleep(link_delay)
    worker.link(
        remote_cluster_ids={0: [cluster_ids[other]]},
        remote_physical_device_ids={0: [1 if role == "prefill" else 0]},
        remote_device_ips={0: [HOST]},
        host_ips={0: [HOST]},
        remote_llmdd_ports={0: [ports[other]]},  # DEVIATION: extension parameter
        remote_dp_instance_ids={0: 1 if role == "prefill" else 0},
        local_dp_instance_id=0 if role == "prefill" else 1,
    )
    wait_for(
        lambda: (
            HOST in worker.query_link_status()["success"]
            or HOST in worker.query_link_status()["failed"]
        ),
        "the MindIE link window",
    )
    status = worker.query_link_status()
    assert HOST in status["success"], f"link failed: {status} {worker.link_errors}"
    return worker, tensors


def mindie_prompt(peer: Peer, cluster_ids: dict, ports: dict) -> dict:
    worker, _tensors = _mindie_side(peer, "prefill", cluster_ids, ports, seed=500, link_delay=0.0)
    peer.sync()  # D pulled
    worker.finalize()
    return {"queries": worker.queries}


def mindie_decoder(peer: Peer, cluster_ids: dict, ports: dict) -> dict:
    worker, tensors = _mindie_side(peer, "decoder", cluster_ids, ports, seed=None, link_delay=0.5)
    out_of_range = worker.pull_blocks(
        cluster_ids["prefill"], MINDIE_SRC_BLOCKS, [MINDIE_NUM_BLOCKS] * len(MINDIE_SRC_BLOCKS)
    )
    assert out_of_range == MindieStatus.PD_BLOCK_ID_OUT_OF_RANGE, out_of_range
    rt = worker.pull_blocks(cluster_ids["prefill"], MINDIE_SRC_BLOCKS, MINDIE_DST_BLOCKS)
    assert rt == MindieStatus.SUCCESS, (
        f"pull_blocks returned {rt} "
        f"(status_code {getattr(worker.separate_deployment_engine, 'last_pull_error', None)!r})"
    )
    checked = 0
    shape = (MINDIE_NUM_BLOCKS, *MINDIE_BLOCK_SHAPE)
    for m, ts in tensors.items():
        for layer, t in enumerate(ts):
            expected = pattern(500 + 10 * m + layer, shape, np.float16)
            checked += assert_same(
                t[MINDIE_DST_BLOCKS], expected[MINDIE_SRC_BLOCKS], f"model {m} layer {layer}"
            )
            rest = np.setdiff1d(np.arange(MINDIE_NUM_BLOCKS), MINDIE_DST_BLOCKS)
            assert not t[rest].any(), f"model {m} layer {layer}: other blocks changed"
    peer.sync()
    worker.finalize()
    return {"bytes_checked": checked, "queries": worker.queries}
