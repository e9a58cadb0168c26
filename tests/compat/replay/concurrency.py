"""Threads at once: many threads of one client pulling and pushing on one endpoint.

Part of the replays of the real ``llm_datadist`` clients: see this package's docstring.
"""

from __future__ import annotations

import asyncio
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
)

from ._common import (
    HOST,
    Peer,
    assert_same,
    check_ok,
    pattern,
)

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
