"""clients.md §4: Omni-Infer.

Part of the replays of the real ``llm_datadist`` clients: see this package's docstring.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import struct
import time
from typing import Any

import numpy as np

from llmdd_async.sync import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)

from ._common import (
    HOST,
    NP_TO_DT,
    Peer,
    assert_same,
    pattern,
)

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
