"""Replays of the real ``llm_datadist`` clients (``clients.md``) on ``llmdd_async.sync``.

Every client has a prompt-side and a decoder-side function that make the same calls, in the
same order and with the same argument shapes, as that client does (section numbers refer to
``clients.md``). Upstream allows one initialised ``LLMDataDist`` per process, so each side runs
in its own spawned process (:func:`run_replay`). What the real deployments exchange out of band
(zmq metadata, xLLM's RPC, torch.distributed barriers, files) goes through a
:class:`Peer`: a barrier shared by all processes of a replay and an inbox per process.

Only ``127.0.0.1`` is used and every port comes from the test (bound to port 0 first). The
samples' fixed ports (26000, 26001, ...) map to such free ports. Memory is host memory: the
default "host" device adapter treats ``Placement.DEVICE`` addresses as host addresses, so
numpy arrays' ``ctypes.data`` stand in for ``tensor.data_ptr()``. Prompt data comes from
:func:`pattern` with fixed seeds, and decoders check the received bytes against it.

Deviations from a client's exact calls are marked ``DEVIATION`` in the code.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import inspect
import ipaddress
import json
import math
import multiprocessing as mp
import os
import queue
import socket
import struct
import threading
import time
import traceback
import zlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from llmdd_async.sync import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheIndex,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCacheExtParam,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LlmDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    RegisterMemStatus,
    TransferWithCacheKeyConfig,
)

HOST = "127.0.0.1"
MiB = 1 << 20
BARRIER_TIMEOUT = 30.0
RECV_TIMEOUT = 30.0
#: the clients poll query_register_mem_status every second; the replays poll faster
POLL_S = 0.05

NP_TO_DT = {
    np.dtype(np.float16): DataType.DT_FLOAT16,
    np.dtype(np.float32): DataType.DT_FLOAT,
    np.dtype(np.int32): DataType.DT_INT32,
    np.dtype(np.int8): DataType.DT_INT8,
    np.dtype(np.int64): DataType.DT_INT64,
}


# ============================================================================ process harness
class Peer:
    """One replay process's view of the others: a shared barrier (the samples'
    ``dist.barrier()``) and inboxes (zmq / RPC / files of the real deployments)."""

    def __init__(self, name: str, barrier: Any, inboxes: dict[str, Any]) -> None:
        self.name = name
        self.barrier = barrier
        self.inboxes = inboxes

    def sync(self, timeout: float = BARRIER_TIMEOUT) -> None:
        self.barrier.wait(timeout)

    def send(self, to: str, message: Any) -> None:
        self.inboxes[to].put(message)

    def recv(self, timeout: float = RECV_TIMEOUT) -> Any:
        """The next message; gives up early once another process failed (barrier broken)."""
        end = time.monotonic() + timeout
        while True:
            try:
                return self.inboxes[self.name].get(timeout=0.2)
            except queue.Empty:
                if self.barrier.broken:
                    raise RuntimeError("another replay process failed") from None
                if time.monotonic() > end:
                    raise


def _child_main(fn: Callable[..., Any], peer: Peer, results: Any, kwargs: dict) -> None:
    try:
        data = fn(peer, **kwargs)
    except BaseException:
        results.put((peer.name, ("error", traceback.format_exc())))
        with contextlib.suppress(Exception):
            peer.barrier.abort()
        # A failed replay may leave threads blocked on its peer: leave at once (the result
        # is flushed first) instead of waiting for them in the interpreter's shutdown.
        results.close()
        results.join_thread()
        os._exit(1)
    results.put((peer.name, ("ok", data)))


def run_replay(
    roles: dict[str, tuple[Callable[..., Any], dict[str, Any]]], timeout: float = 60.0
) -> dict[str, Any]:
    """Run ``fn(peer, **kwargs)`` for every role in its own spawned process.

    Returns each role's returned data. Raises AssertionError with every child's traceback if
    a child raised, reported nothing within ``timeout`` seconds, did not exit afterwards, or
    exited with a non-zero code.
    """
    ctx = mp.get_context("spawn")
    names = list(roles)
    barrier = ctx.Barrier(len(names))
    inboxes = {n: ctx.Queue() for n in names}
    results = ctx.Queue()
    procs: dict[str, Any] = {}
    for n in names:
        fn, kwargs = roles[n]
        proc = ctx.Process(
            target=_child_main,
            args=(fn, Peer(n, barrier, inboxes), results, kwargs),
            name=f"replay-{n}",
            daemon=True,
        )
        proc.start()
        procs[n] = proc
    deadline = time.monotonic() + timeout
    outcomes: dict[str, tuple[str, Any]] = {}
    exited_at: dict[str, float] = {}
    try:
        while len(outcomes) < len(names) and time.monotonic() < deadline:
            try:
                name, outcome = results.get(timeout=0.2)
            except queue.Empty:
                now = time.monotonic()
                for n, proc in procs.items():
                    if (
                        n not in outcomes
                        and proc.exitcode is not None
                        and now - exited_at.setdefault(n, now) > 3.0
                    ):
                        outcomes[n] = ("error", f"exited ({proc.exitcode}) without a result")
                continue
            outcomes[name] = outcome
        for proc in procs.values():
            proc.join(max(1.0, min(15.0, deadline + 10.0 - time.monotonic())))
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    primary: list[str] = []
    secondary: list[str] = []
    for n in names:
        proc = procs[n]
        status, payload = outcomes.get(n, ("missing", None))
        if status == "missing":
            primary.append(f"--- {n}: no result within {timeout:.0f} s (killed)")
        elif status == "error":
            text = f"--- {n} raised:\n{payload}"
            (secondary if "BrokenBarrierError" in payload else primary).append(text)
        elif proc.exitcode != 0:
            primary.append(f"--- {n} returned but exited with code {proc.exitcode}")
    if primary or secondary:
        raise AssertionError("client replay failed\n" + "\n".join(primary + secondary))
    return {n: outcomes[n][1] for n in names}


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that were free on 127.0.0.1 a moment ago."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# ============================================================================ memory helpers
def pattern(seed: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Deterministic contents: random bytes viewed as ``dtype`` (compare bytes, not values)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def aligned_zeros(shape: tuple[int, ...], dtype: Any, align: int = 2 * MiB) -> np.ndarray:
    """Zeroed memory starting on an ``align`` boundary (``aclrtMalloc(HUGE_ONLY)``-like)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def host_tensors(shape: Any, dtype: Any, addrs: list[int]) -> list[np.ndarray]:
    """Views of raw addresses, as ``torchair.llm_datadist.create_npu_tensors`` builds them."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    return [
        np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(int(a)))
        .view(dtype)
        .reshape(tuple(shape))
        for a in addrs
    ]


def assert_same(actual: np.ndarray, expected: np.ndarray, what: str) -> int:
    """Byte-exact comparison; returns the number of bytes compared."""
    a = np.ascontiguousarray(actual).reshape(-1).view(np.uint8)
    e = np.ascontiguousarray(expected).reshape(-1).view(np.uint8)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: {a.size} bytes received, {e.size} expected")
    diff = np.flatnonzero(a != e)
    if diff.size:
        raise AssertionError(
            f"{what}: {diff.size} of {a.size} bytes differ (first at byte {int(diff[0])})"
        )
    return int(a.size)


def check_ok(ret: Any, what: str) -> None:
    """The C++ client's check: anything but LLM_SUCCESS fails, logged as a hex code."""
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise AssertionError(f"{what} failed, ret = {int(ret):#x} ({ret!r})")


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


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
    _wait_for(
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
    _wait_for(
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


# ============================================================================ §4 Omni-Infer
OMNI_KV_CACHE_RETRY_TIMES = 1
OMNI_KV_CACHE_RETRY_WAIT_SECOND = 1
OMNI_SYNC_KV_TIMEOUT = 5000
OMNI_LINK_TIMEOUT = 5000
OMNI_NUM_DIE_PER_MACH = 16
OMNI_RETRYABLE_CODES = [
    LLMStatusCode.LLM_REPEAT_REQUEST,
    LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT,
    LLMStatusCode.LLM_PROCESSING_LINK,
    LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY,
    LLMStatusCode.LLM_TIMEOUT,
    LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT,
    LLMStatusCode.LLM_LINK_BUSY,
]
OMNI_LAYERS = 3
OMNI_NUM_BLOCKS = 12
OMNI_BLOCK_SHAPE = (4, 2, 16)
#: (P's src blocks, D's target blocks) of the two requests D pulls
OMNI_REQ1 = ([2, 3, 4], [5, 6, 7])
OMNI_REQ2 = ([8, 9], [0, 1])


def omni_ip_port_to_int(ip_port: str, tp_size: int, tp_rank: int = 0) -> int:
    """``[ ip (32 bits) | port (16 bits) | tp_size (16 bits) ]``."""
    ip, port_str = ip_port.split(":")
    port = int(port_str)
    if not (0 <= port <= 65535):
        raise ValueError(" port must be in 0-65535 ")
    ip_int = struct.unpack("!I", socket.inet_aton(ip))[0]
    return (ip_int << 32) | (port << 16) | (tp_size & 0xFFFF)


def omni_cluster_id_to_ip_port(cluster_id: int) -> tuple[str, int, int]:
    tp_size = cluster_id & 0xFFFF
    port = (cluster_id >> 16) & 0xFFFF
    ip = socket.inet_ntoa(struct.pack("!I", (cluster_id >> 32) & 0xFFFFFFFF))
    return f"{ip}:{port}", tp_size, 0


def omni_kv_caches(seed: int | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    shape = (OMNI_NUM_BLOCKS, *OMNI_BLOCK_SHAPE)
    out = {}
    for layer in range(OMNI_LAYERS):
        k, v = np.zeros(shape, np.float16), np.zeros(shape, np.float16)
        if seed is not None:
            k[...] = pattern(seed + 2 * layer, shape, np.float16)
            v[...] = pattern(seed + 2 * layer + 1, shape, np.float16)
        out[f"model.layers.{layer}.self_attn.attn"] = (k, v)
    return out


def omni_unzip_kv_cache_dict(kv_caches: dict) -> list[list[np.ndarray]]:
    _, first = next(iter(kv_caches.items()))
    flatten: list[list[np.ndarray]] = [[] for _ in range(len(first))]
    for layer_name in sorted(kv_caches, key=lambda n: int(n.split(".")[2])):
        for index, sub_cache in enumerate(kv_caches[layer_name]):
            flatten[index].append(sub_cache)
    return flatten


class OmniManager:
    """``LLMDataDistManager`` (the local_comm_res / link_clusters revision), tp=dp=pp=1."""

    def __init__(self, is_prefill: bool, local_host_ip: str, host_port: int) -> None:
        self.is_prefill = is_prefill
        self.role = LLMRole.PROMPT if is_prefill else LLMRole.DECODER
        self.local_host_ip = local_host_ip
        self.host_port = host_port
        self.local_rank = 0
        self.rank = 0
        self.tp_size = 1
        self.prefill_dp_size = 1
        self.cluster_id = omni_ip_port_to_int(f"{local_host_ip}:{host_port + self.local_rank}", 1)
        self.data_dist_option: dict | None = None
        self.data_dist_engine_is_inited = False
        self.data_dist_engine = self._init_llm_data_dist()
        self.registered_kv_caches: list[Cache] = []
        self.registered_link_infos: dict[tuple, list[int]] = {}
        self.relinks = 0
        self.pull_failures: list[str] = []

    def _init_llm_data_dist(self) -> LLMDataDist:
        llm_config = LLMConfig()
        llm_config.device_id = self.local_rank
        llm_config.local_comm_res = ""
        llm_config.sync_kv_timeout = OMNI_SYNC_KV_TIMEOUT
        llm_config.enable_remote_cache_accessible = True
        llm_config.local_comm_res = ""
        if self.is_prefill:
            llm_config.listen_ip_info = f"{self.local_host_ip}:{self.host_port + self.local_rank}"
        options = llm_config.generate_options()
        self.data_dist_option = options
        data_dist = LLMDataDist(self.role, self.cluster_id)
        data_dist.init(options)
        self.data_dist_engine_is_inited = True
        return data_dist

    def _finalize_llm_data_dist(self) -> None:
        self.data_dist_engine.finalize()
        self.data_dist_engine_is_inited = False

    def _reinit_llm_data_dist(self) -> None:
        self.data_dist_engine.init(self.data_dist_option)
        self.data_dist_engine_is_inited = True

    def _get_local_ip(self) -> str:
        return HOST  # DEVIATION: the client asks a UDP socket "connected" to 8.8.8.8

    def _get_cluster_id_list(
        self, host_cluster_ids: Any, prefill_dp_rank: int, d_rank: int, tp_rank: int = 0
    ) -> list[int]:
        if isinstance(host_cluster_ids, int):
            host_cluster_ids = [host_cluster_ids]
        ip_ports = []
        for host_cluster_id in host_cluster_ids:
            ip_port, prefill_tp_size, _ = omni_cluster_id_to_ip_port(host_cluster_id)
            ip_ports.append(ip_port)
        p_rank_start = 0  # get_p_start_rank(...) for tp=dp=1
        cluster_id_list = []
        for p_rank in [p_rank_start + i * prefill_tp_size for i in range(self.prefill_dp_size)]:
            ip, port_str = ip_ports[p_rank // OMNI_NUM_DIE_PER_MACH].split(":")
            port = int(port_str) + (p_rank % OMNI_NUM_DIE_PER_MACH)
            cluster_id_list.append(omni_ip_port_to_int(f"{ip}:{port}", prefill_tp_size))
        return cluster_id_list

    def _clusters(self, prompt_cluster_id_list: list[int]) -> list[LLMClusterInfo]:
        clusters = []
        for prompt_cluster_id in prompt_cluster_id_list:
            cluster = LLMClusterInfo()
            host_ip, _tp_size, _tp_rank = omni_cluster_id_to_ip_port(prompt_cluster_id)
            remote_host_ip, port = host_ip.split(":")
            cluster.remote_cluster_id = prompt_cluster_id
            cluster.append_local_ip_info(self._get_local_ip(), 0)
            cluster.append_remote_ip_info(remote_host_ip, int(port))
            clusters.append(cluster)
        return clusters

    def register_link(self, host_cluster_id: tuple, prefill_dp_rank: int, d_rank: int) -> None:
        prompt_cluster_id_list = self._get_cluster_id_list(
            host_cluster_id[1:], prefill_dp_rank, d_rank
        )
        ret, _ = self.data_dist_engine.link_clusters(
            self._clusters(prompt_cluster_id_list), timeout=OMNI_LINK_TIMEOUT
        )
        if ret != LLMStatusCode.LLM_SUCCESS:
            raise Exception(f"link failed ({ret!r})")
        if not self.is_prefill:
            self.registered_link_infos[(host_cluster_id, prefill_dp_rank, d_rank)] = (
                prompt_cluster_id_list
            )

    def close_link(self, host_cluster_id: tuple, prefill_dp_rank: int, d_rank: int) -> None:
        prompt_cluster_id_list = self._get_cluster_id_list(
            host_cluster_id[1:], prefill_dp_rank, d_rank
        )
        ret, rets = self.data_dist_engine.unlink_clusters(
            self._clusters(prompt_cluster_id_list), timeout=OMNI_LINK_TIMEOUT, force=True
        )
        if ret != LLMStatusCode.LLM_SUCCESS:
            raise Exception(
                f"unlink failed ({ret!r}, {rets!r}); pull failures so far: {self.pull_failures}"
            )
        if not self.is_prefill:
            self.registered_link_infos.pop((host_cluster_id, prefill_dp_rank, d_rank), None)

    def unregister_link(self) -> None:
        if self.is_prefill:
            self._finalize_llm_data_dist()
        else:
            for host_cluster_id, dp_rank, d_rank in list(self.registered_link_infos.keys()):
                self.close_link(host_cluster_id, dp_rank, d_rank)

    async def _pull_blocks(
        self,
        src_cache_key: BlocksCacheKey,
        dst_cache: Cache,
        src_blocks: list[int],
        dst_blocks: list[int],
    ) -> bool:
        pull_sync = self.data_dist_engine.cache_manager.pull_blocks
        for attempt in range(OMNI_KV_CACHE_RETRY_TIMES):
            try:
                await asyncio.to_thread(pull_sync, src_cache_key, dst_cache, src_blocks, dst_blocks)
                return True
            except asyncio.CancelledError as exc:
                raise RuntimeError("Pull blocks operation cancelled") from exc
            except LLMException as e:
                code = getattr(e, "status_code", None)
                self.pull_failures.append(repr(code))
                if code in OMNI_RETRYABLE_CODES:
                    if attempt < OMNI_KV_CACHE_RETRY_TIMES - 1:
                        await asyncio.sleep(OMNI_KV_CACHE_RETRY_WAIT_SECOND)
                        continue
                    return False
                return False
            except (TypeError, ValueError) as e:
                self.pull_failures.append(repr(e))
                return False
        return False

    def pull_kv(
        self,
        src_blocks: list[int],
        tgt_blocks: list[int],
        prompt_cluster_id: int,
        prefill_dp_rank: int,
    ) -> None:
        for model_id, kv_cache in enumerate(self.registered_kv_caches):
            prompt_cache_key = BlocksCacheKey(
                prompt_cluster_id=prompt_cluster_id, model_id=model_id
            )
            ret = self._run_coro_sync(
                lambda k=prompt_cache_key, c=kv_cache: self._pull_blocks(
                    k, c, src_blocks, tgt_blocks
                )
            )
            if not ret:
                self._refresh_link(prompt_cluster_id, prefill_dp_rank, self.rank)
                ret_updated = self._run_coro_sync(
                    lambda k=prompt_cache_key, c=kv_cache: self._pull_blocks(
                        k, c, src_blocks, tgt_blocks
                    )
                )
                if not ret_updated:
                    raise RuntimeError("Failed to pull kv even if rebuild the kv link!")

    def _refresh_link(self, prompt_cluster_id: int, prefill_dp_rank: int, d_rank: int) -> None:
        found = self._get_host_cluster_id(prompt_cluster_id, prefill_dp_rank, d_rank)
        if found is None:
            raise RuntimeError("Unregistered host cluster id!!!")
        host_cluster_id, prefill_dp_rank, d_rank = found
        self.relinks += 1
        self.close_link(host_cluster_id, prefill_dp_rank, d_rank)
        self.register_link(host_cluster_id, prefill_dp_rank, d_rank)

    def _get_host_cluster_id(
        self, prompt_cluster_id: int, prefill_dp_rank: int, d_rank: int
    ) -> tuple | None:
        metas = [
            key
            for key, values in self.registered_link_infos.items()
            if prompt_cluster_id in values and key[1] == prefill_dp_rank and key[2] == d_rank
        ]
        return metas[0] if metas else None

    def register_memory(self, kv_caches: dict) -> None:
        if not self.data_dist_engine_is_inited:
            self._reinit_llm_data_dist()
        if len(self.registered_kv_caches) > 0:
            raise ValueError("Attr `registered_kv_caches` must be empty before register kv_caches.")
        flatten_kv_caches = omni_unzip_kv_cache_dict(kv_caches)
        for model_id, sub_kv_caches in enumerate(flatten_kv_caches):
            cache_desc = CacheDesc(
                num_tensors=len(sub_kv_caches),
                shape=tuple(sub_kv_caches[0].shape),
                data_type=NP_TO_DT[sub_kv_caches[0].dtype],
            )
            cache_addrs = [int(item.ctypes.data) for item in sub_kv_caches]
            if self.is_prefill:
                cache_key = BlocksCacheKey(self.data_dist_engine.cluster_id, model_id=model_id)
            else:
                cache_key = None
            cache = self.data_dist_engine.cache_manager.register_blocks_cache(
                cache_desc, cache_addrs, cache_key
            )
            self.registered_kv_caches.append(cache)

    def unregister_memory(self) -> None:
        if not self.is_prefill:
            for kv_cache in self.registered_kv_caches:
                self.data_dist_engine.cache_manager.unregister_cache(kv_cache.cache_id)
        self.registered_kv_caches = []

    def _run_coro_sync(self, coro_or_callable: Any) -> Any:
        if inspect.iscoroutine(coro_or_callable):
            coro = coro_or_callable
        elif callable(coro_or_callable):
            result = coro_or_callable()
            if not inspect.iscoroutine(result):
                return result
            coro = result
        else:
            raise ValueError(f"Expected coroutine or callable, got {type(coro_or_callable)}")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro)
        raise RuntimeError("Detected a running asyncio event loop in current thread.")


def omni_prompt(peer: Peer, p_port: int, d_port: int) -> dict:
    kv_caches = omni_kv_caches(seed=None)
    mgr = OmniManager(True, HOST, p_port)
    first_id = mgr.cluster_id
    for name, (k, v) in omni_kv_caches(seed=600).items():  # request 1's KV
        kv_caches[name][0][...], kv_caches[name][1][...] = k, v
    mgr.register_memory(kv_caches)
    peer.send("decoder", mgr.cluster_id)
    peer.sync()  # 1: both registered
    peer.sync()  # 2: D pulled request 1
    # Omni's P teardown and restart on the same object: unregister_memory + unregister_link
    # (finalize), then register_memory re-inits with the kept options.
    mgr.unregister_memory()
    mgr.unregister_link()
    assert not mgr.data_dist_engine.is_initialized()
    for name, (k, v) in omni_kv_caches(seed=700).items():  # request 2's KV
        kv_caches[name][0][...], kv_caches[name][1][...] = k, v
    mgr.register_memory(kv_caches)
    assert mgr.data_dist_engine.is_initialized() and mgr.cluster_id == first_id
    peer.sync()  # 3: P is back
    peer.sync()  # 4: D pulled request 2 and unregistered
    mgr.unregister_link()  # finalize
    return {"cluster_id": mgr.cluster_id}


def omni_decoder(peer: Peer, p_port: int, d_port: int) -> dict:
    kv_caches = omni_kv_caches(seed=None)
    mgr = OmniManager(False, HOST, d_port)
    mgr.register_memory(kv_caches)
    prompt_cluster_id = peer.recv()
    peer.sync()  # 1
    host_cluster_id = (round(time.monotonic() * 1000), prompt_cluster_id)
    mgr.register_link(host_cluster_id, 0, mgr.rank)
    checked = 0

    def verify(req: tuple, seed: int) -> int:
        n = 0
        src, dst = req
        expected = omni_kv_caches(seed)
        for name, parts in kv_caches.items():
            for part, tensor in enumerate(parts):
                n += assert_same(tensor[dst], expected[name][part][src], f"{name}[{part}]")
        return n

    mgr.pull_kv(*OMNI_REQ1, prompt_cluster_id, 0)
    checked += verify(OMNI_REQ1, 600)
    peer.sync()  # 2
    peer.sync()  # 3: P finalized and re-initialised; our link died with its finalize
    mgr.pull_kv(*OMNI_REQ2, prompt_cluster_id, 0)  # fails, re-links, pulls again
    checked += verify(OMNI_REQ2, 700)
    assert mgr.relinks == 1, f"expected one re-link, got {mgr.relinks}"
    checked += verify(OMNI_REQ1, 600)  # request 1's blocks are still there
    mgr.unregister_link()
    mgr.unregister_memory()
    peer.sync()  # 4
    return {"bytes_checked": checked, "relinks": mgr.relinks, "pull_failures": mgr.pull_failures}


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
    _wait_for(
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


# ---------------------------------------------------------------- multiple_device_samples
# Ascend/samples ``python/level1_single_api/10_llm_data_dist/multiple_device_samples/
# pull_cache_multiple_devices_sample.py``: legacy mode, one process drives four devices (P: 0-3,
# D: 4-7 of one host); ``--cluster_id 1`` is the prompt, ``--cluster_id 2`` the decoder.
MD_CLUSTER_ID = {"prompt": 1, "decoder": 2}
#: DEVIATION: the sample's CacheDesc(80, [2, 2 * 1024 * 1024], DT_FLOAT16) is 640 MiB per
#: device; scaled down
MD_CACHE_DESC_ARGS = (8, [2, 4 * 1024], DataType.DT_FLOAT16)


def md_all_ips() -> list[str]:
    """``get_device_ips()`` (``hccn_tool`` per device): here every device is 127.0.0.1."""
    return [HOST] * 8


def _md_data(device_index: int, tensor: int) -> np.ndarray:
    shape = tuple(MD_CACHE_DESC_ARGS[1])
    return pattern(7000 + 100 * device_index + tensor, shape, np.float16)


def md_init_llm_datadist(role: LLMRole, cluster_id: int, all_ips: list[str], ports: list[int]):
    config_file = "numa_config.json" if role == LLMRole.PROMPT else "numa_config_1.json"
    os.environ["RESOURCE_CONFIG_PATH"] = os.path.join(os.getcwd(), config_file)

    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    cluster_config: dict[str, Any] = {
        "logic_device_id": ["0:0:0:0", "0:0:1:0", "0:0:2:0", "0:0:3:0"]
    }
    if role == LLMRole.PROMPT:
        # DEVIATION: port ports[i] instead of 26000 for all (the devices share 127.0.0.1 here)
        cluster_config["listen_ip_info"] = [
            {"ip": ip, "port": port} for ip, port in zip(all_ips[:4], ports[:4], strict=True)
        ]
    llm_config.cluster_info = json.dumps(cluster_config)
    # pull_cache timeout, ms
    llm_config.sync_kv_timeout = 3000
    llm_options = llm_config.generate_options()
    llm_options.update(
        {
            "ge.flowGraphMemMaxSize": "1000000000",
            "ge.session_device_id": "0" if role == LLMRole.PROMPT else "4",
        }
    )
    datadist.init(llm_options)
    return datadist


def md_link_unlink(
    datadist: LLMDataDist, all_ips: list[str], ports: list[int], is_link: bool = True
) -> list[int]:
    cluster_info = LLMClusterInfo()
    cluster_info.remote_cluster_id = 1
    for i in range(4):
        cluster_info.append_local_ip_info(all_ips[i + 4], ports[i + 4])  # DEVIATION: 26000
        cluster_info.append_remote_ip_info(all_ips[i], ports[i])  # DEVIATION: 26000
    func = datadist.link_clusters if is_link else datadist.unlink_clusters
    _, rets = func([cluster_info], 5000)
    for ret in rets:
        if ret != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link failed, ret = {ret}")
    return [int(r) for r in rets]


def md_prompt(peer: Peer, ports: list[int]) -> dict:
    all_ips = md_all_ips()
    datadist = md_init_llm_datadist(LLMRole.PROMPT, MD_CLUSTER_ID["prompt"], all_ips, ports)
    prompt_cache_keys = [
        CacheKey(prompt_cluster_id=1, req_id=1),
        CacheKey(prompt_cluster_id=1, req_id=2),
    ]
    kv_cache_manager = datadist.kv_cache_manager
    kv_cache = kv_cache_manager.allocate_cache(CacheDesc(*MD_CACHE_DESC_ARGS), prompt_cache_keys)
    for device_index in [0, 1, 2, 3]:
        # (torch.npu.set_device(device_index))
        kv_tensor_addrs = kv_cache.per_device_tensor_addrs[device_index]
        kv_tensors = host_tensors(kv_cache.cache_desc.shape, np.float16, kv_tensor_addrs)
        for i, kv_tensor in enumerate(kv_tensors):
            # DEVIATION: a pattern per device and tensor instead of fill_(2), so that the
            # decoder can tell every device's data apart
            kv_tensor[...] = _md_data(device_index, i)
    peer.sync()  # DEVIATION: a barrier instead of the decoder's time.sleep(20): filled
    peer.sync()  # DEVIATION: a barrier instead of time.sleep(40): the decoder is done
    per_device = kv_cache.per_device_tensor_addrs
    datadist.finalize()
    return {"cache_id": kv_cache.cache_id, "distinct_devices": len({tuple(a) for a in per_device})}


def md_decoder(peer: Peer, ports: list[int]) -> dict:
    all_ips = md_all_ips()
    datadist = md_init_llm_datadist(LLMRole.DECODER, MD_CLUSTER_ID["decoder"], all_ips, ports)
    peer.sync()  # the prompt listens and filled its caches (see the prompt)
    # (replay check, not in the sample: one remote address for four devices is refused)
    short = LLMClusterInfo()
    short.remote_cluster_id = 1
    short.append_local_ip_info(all_ips[4], ports[4])
    short.append_remote_ip_info(all_ips[0], ports[0])
    short_ret = datadist.link_clusters([short], 5000)
    link_rets = md_link_unlink(datadist, all_ips, ports)
    kv_cache_manager = datadist.kv_cache_manager
    kv_cache = kv_cache_manager.allocate_cache(CacheDesc(*MD_CACHE_DESC_ARGS))
    kv_cache_manager.pull_cache(CacheKey(prompt_cluster_id=1, req_id=1), kv_cache, batch_index=1)
    checked = 0
    for device_index in [0, 1, 2, 3]:
        # (torch.npu.set_device(device_index + 4))
        kv_tensor_addrs = kv_cache.per_device_tensor_addrs[device_index]
        kv_tensors = host_tensors(kv_cache.cache_desc.shape, np.float16, kv_tensor_addrs)
        for i, kv_tensor in enumerate(kv_tensors):
            # (the sample logs the values; the replay checks them: req 1 is the prompt's
            # batch slot 0, pulled into slot 1 of the same device)
            want = _md_data(device_index, i)[0]
            checked += assert_same(kv_tensor[1], want, f"device {device_index} tensor {i}")
    unlink_rets = md_link_unlink(datadist, all_ips, ports, False)
    datadist.finalize()
    peer.sync()
    return {
        "short_ret": [int(short_ret[0]), [int(c) for c in short_ret[1]]],
        "link_rets": link_rets,
        "unlink_rets": unlink_rets,
        "devices": len(kv_cache.per_device_tensor_addrs),
        "bytes_checked": checked,
    }


# ---------------------------------------------------------------- multi-device, more calls
# Not a client: the rest of the legacy multi-device surface, with the other option spelling
# (LLMConfig.device_id as a list, "ip:port;ip:port" listen addresses).
MDX_DESC_ARGS = (2, [6, 256], DataType.DT_INT8)  # blocks cache: 6 blocks of 256 bytes


def _mdx_init(role: LLMRole, cluster_id: int, listen: str | None) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = [0, 1]
    if listen is not None:
        llm_config.listen_ip_info = listen
    llm_config.ge_options = {"ge.flowGraphMemMaxSize": "16777216"}
    datadist.init(llm_config.generate_options())
    return datadist


def _mdx_cluster(ports: list[int], with_remote: bool = True) -> LLMClusterInfo:
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 1
    cluster.append_local_ip_info(HOST, 0)
    if with_remote:
        for port in ports:
            cluster.append_remote_ip_info(HOST, port)
    return cluster


def mdx_prompt(peer: Peer, ports: list[int]) -> dict:
    datadist = _mdx_init(LLMRole.PROMPT, 1, ";".join(f"{HOST}:{p}" for p in ports))
    kvm = datadist.kv_cache_manager
    cache = kvm.allocate_blocks_cache(CacheDesc(*MDX_DESC_ARGS), BlocksCacheKey(1, 0))
    for device, tensor in enumerate(kvm.get_cache_tensors(cache, 1)):
        tensor.numpy()[...] = pattern(8000 + device, tuple(MDX_DESC_ARGS[1]), np.int8)
    refused = []
    for call in (
        lambda: kvm.transfer_cache_async(cache, LayerSynchronizerImpl(), []),
        lambda: datadist.switch_role(LLMRole.DECODER),
    ):
        try:
            call()
        except LLMException as exc:
            refused.append(int(exc.status_code))
    peer.sync()  # filled and listening
    peer.sync()  # the decoder is done
    kvm.deallocate_cache(cache)
    datadist.finalize()
    return {"refused": refused}


def mdx_decoder(peer: Peer, ports: list[int]) -> dict:
    datadist = _mdx_init(LLMRole.DECODER, 2, None)
    peer.sync()
    ret, _ = datadist.link_clusters([_mdx_cluster(ports)], 5000)
    check_ok(ret, "link_clusters")
    datadist.check_link_status(1)
    kvm = datadist.kv_cache_manager
    cache = kvm.allocate_blocks_cache(CacheDesc(*MDX_DESC_ARGS))
    kvm.pull_blocks(BlocksCacheKey(1, 0), cache, [4, 1], [0, 5])
    copy = kvm.allocate_blocks_cache(CacheDesc(*MDX_DESC_ARGS))
    kvm.copy_blocks(cache, {0: [2]})
    checked = 0
    for device, tensor in enumerate(kvm.get_cache_tensors(cache, 1)):
        want = pattern(8000 + device, tuple(MDX_DESC_ARGS[1]), np.int8)
        got = tensor.numpy()
        checked += assert_same(got[[0, 5, 2]], want[[4, 1, 4]], f"device {device}")
    kvm.deallocate_cache(copy)
    kvm.deallocate_cache(cache)
    ret, _ = datadist.unlink_clusters([_mdx_cluster(ports, with_remote=False)], 5000, True)
    check_ok(ret, "force unlink_clusters")
    try:
        datadist.check_link_status(1)
        after_unlink = 0
    except LLMException as exc:
        after_unlink = int(exc.status_code)
    datadist.finalize()
    peer.sync()
    return {"bytes_checked": checked, "after_unlink": after_unlink}


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


# ============================================================================ threads at once
CC_BLOCKS = 64
CC_BLOCK = (256,)  # float32: 1 KiB blocks
CC_JOBS = 8
CC_PUSHERS = 12


def _cc_cache(seed: int | None) -> list[np.ndarray]:
    ts = [np.zeros((CC_BLOCKS, *CC_BLOCK), np.float32) for _ in range(2)]
    if seed is not None:
        for i, t in enumerate(ts):
            t[...] = pattern(seed + i, t.shape, np.float32)
    return ts


def _cc_endpoint(
    role: LLMRole, cluster_id: int, listen_port: int | None, seeds: dict[int, int | None]
) -> tuple[LLMDataDist, dict, dict]:
    dd = LLMDataDist(role, cluster_id)
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.local_comm_res = ""
    cfg.sync_kv_timeout = 10000
    if listen_port is not None:
        cfg.listen_ip_info = f"{HOST}:{listen_port}"
    dd.init(cfg.generate_options())
    desc = CacheDesc(2, [CC_BLOCKS, *CC_BLOCK], DataType.DT_FLOAT)
    memory, caches = {}, {}
    for model_id, seed in seeds.items():
        memory[model_id] = _cc_cache(seed)
        caches[model_id] = dd.cache_manager.register_blocks_cache(
            desc, [t.ctypes.data for t in memory[model_id]], BlocksCacheKey(cluster_id, model_id)
        )
    return dd, memory, caches


def _cc_pusher_blocks(i: int) -> tuple[list[int], list[int]]:
    """Pusher ``i``'s source blocks and its destination blocks (disjoint between pushers)."""
    return [i, i + CC_PUSHERS], [CC_BLOCKS - 1 - i, CC_BLOCKS - 1 - i - CC_PUSHERS]


def _run_pushers(
    cm: Any, key_of: Callable[[], BlocksCacheKey], cache: Cache, start: threading.Barrier
) -> list[str]:
    errors: list[str] = []

    def push(i: int) -> None:
        try:
            start.wait(30)
            src, dst = _cc_pusher_blocks(i)
            cm.push_blocks(key_of(), cache, src, dst, range(2), range(2), 1)  # SGLang's shape
        except BaseException:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=push, args=(i,)) for i in range(CC_PUSHERS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
        if th.is_alive():
            errors.append("a pusher thread hung")
    return errors


def concurrency_prompt(peer: Peer, port: int) -> dict:
    dd, memory, caches = _cc_endpoint(LLMRole.PROMPT, 1, port, {0: 1400, 1: 1500, 2: None, 3: 1700})
    peer.sync()  # registered
    peer.sync()  # D linked
    errors = _run_pushers(
        dd.cache_manager, lambda: BlocksCacheKey(2, 3), caches[3], threading.Barrier(CC_PUSHERS)
    )
    if errors:
        raise AssertionError(f"{len(errors)} pushers failed:\n{errors[0]}")
    peer.sync()  # both sides done
    checked = 0
    src = _cc_cache(1600)
    for i in range(CC_PUSHERS):
        s, d = _cc_pusher_blocks(i)
        for t in range(2):
            checked += assert_same(memory[2][t][d], src[t][s], f"D's pusher {i} tensor {t}")
    peer.sync()  # both verified
    dd.finalize()
    return {"bytes_checked": checked}


def concurrency_decoder(peer: Peer, port: int) -> dict:
    dd, memory, caches = _cc_endpoint(
        LLMRole.DECODER, 2, None, {0: None, 1: None, 2: 1600, 3: None}
    )
    cm = dd.cache_manager
    peer.sync()  # registered
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 1
    cluster.append_local_ip_info(HOST, 0)
    cluster.append_remote_ip_info(HOST, port)
    ret, rets = dd.link_clusters([cluster], 5000)
    check_ok(ret, f"link_clusters {rets}")
    peer.sync()  # linked
    jobs = [
        (list(range(4 * j, 4 * j + 4)), list(range(63 - 4 * j, 59 - 4 * j, -1)))
        for j in range(CC_JOBS)
    ]
    start = threading.Barrier(2 + CC_PUSHERS)
    errors: list[str] = []

    def vllm_style() -> None:  # one ThreadPoolExecutor(1) worker issuing every pull
        try:
            start.wait(30)
            with ThreadPoolExecutor(1) as executor:
                futures = [
                    executor.submit(cm.pull_blocks, BlocksCacheKey(1, 0), caches[0], s, d)
                    for s, d in jobs
                ]
                for f in futures:
                    f.result(60)
        except BaseException:
            errors.append(traceback.format_exc())

    def omni_style() -> None:  # asyncio.to_thread around blocking pulls, all at once
        async def main() -> None:
            await asyncio.gather(
                *[
                    asyncio.to_thread(cm.pull_blocks, BlocksCacheKey(1, 1), caches[1], s, d)
                    for s, d in jobs
                ]
            )

        try:
            start.wait(30)
            asyncio.run(main())
        except BaseException:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=vllm_style), threading.Thread(target=omni_style)]
    for th in threads:
        th.start()
    errors += _run_pushers(cm, lambda: BlocksCacheKey(1, 2), caches[2], start)  # SGLang's 12
    for th in threads:
        th.join(60)
        if th.is_alive():
            errors.append("a puller thread hung")
    if errors:
        raise AssertionError(f"{len(errors)} callers failed:\n{errors[0]}")
    peer.sync()  # both sides done
    checked = 0
    for model_id, seed in ((0, 1400), (1, 1500)):
        src = _cc_cache(seed)
        for s, d in jobs:
            for t in range(2):
                checked += assert_same(memory[model_id][t][d], src[t][s], f"model {model_id}")
    src = _cc_cache(1700)
    for i in range(CC_PUSHERS):
        s, d = _cc_pusher_blocks(i)
        for t in range(2):
            checked += assert_same(memory[3][t][d], src[t][s], f"P's pusher {i} tensor {t}")
    peer.sync()  # both verified
    dd.finalize()
    return {"bytes_checked": checked}
