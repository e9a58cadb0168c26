"""Legacy mode (cache-manager mode off): KvCacheManager, role rules, KvCache, timeouts."""

from __future__ import annotations

import base64
import gc

import numpy as np
import pytest
from helpers import cluster, expected_tensor, link

import llmdd_async as dd
from llmdd_async._kv_cache_manager import KvCache
from llmdd_async.testing import PeerProcess, encode_key, pool_of, wait_until

pytestmark = pytest.mark.anyio

S = dd.LLMStatusCode
LEGACY = {"ge.flowGraphMemMaxSize": str(64 << 20), "llm.SyncKvCacheWaitTime": "2000"}


def legacy(**extra: str) -> dict[str, str]:
    return {**LEGACY, **extra}


async def test_mode_selection_and_role_rules() -> None:
    with pytest.raises(dd.LLMException) as err:  # a legacy PROMPT must listen
        async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(legacy()):
            pass
    assert err.value.status_code == S.LLM_PARAM_INVALID
    async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(legacy()) as d:
        kvm = d.kv_cache_manager
        assert kvm.is_initialized()
        with pytest.raises(dd.LLMException):
            _ = d.cache_manager
        desc = dd.CacheDesc(2, [2, 64], dd.DataType.DT_FLOAT16)
        rows = [
            lambda: kvm.allocate_cache(desc, [dd.CacheKey(2, 1)]),  # keys: PROMPT only
            lambda: kvm.remove_cache_key(dd.CacheKey(2, 1)),  # PROMPT only
            lambda: kvm.allocate_cache(
                dd.CacheDesc(1, [2], dd.DataType.DT_FLOAT, dd.Placement.HOST)
            ),  # DEVICE only
        ]
        for row in rows:
            with pytest.raises(dd.LLMException) as err:
                row()
            assert err.value.status_code == S.LLM_PARAM_INVALID
        cache = kvm.allocate_cache(desc)
        assert isinstance(cache, KvCache)
        assert cache.per_device_tensor_addrs == [cache.tensor_addrs]
        tensors = kvm.get_cache_tensors(cache, 1)
        assert len(tensors) == 1 and tensors[0].numpy().shape == (2, 64)
        with pytest.raises(dd.LLMException):
            kvm.get_cache_tensors(cache, 2)
        with pytest.raises(dd.LLMException) as err:
            kvm.transfer_cache_async(cache, dd.LayerEvents(), [dd.TransferConfig(1, [1, 2])])
        assert err.value.status_code == S.LLM_PARAM_INVALID  # PROMPT only
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(
        legacy(**{"llm.listenIpInfo": "127.0.0.1:0"})
    ) as p:
        kvm = p.kv_cache_manager
        with pytest.raises(dd.LLMException) as err:
            kvm.pull_blocks(
                dd.BlocksCacheKey(2),
                kvm.allocate_blocks_cache(dd.CacheDesc(1, [4, 8], dd.DataType.DT_UINT8)),
                [0],
                [0],
            )
        assert err.value.status_code == S.LLM_PARAM_INVALID  # DECODER only
        with pytest.raises(dd.LLMException) as err:
            await p.check_link_status(2)
        assert err.value.status_code == S.LLM_PARAM_INVALID  # client (DECODER) only


async def test_pull_cache_offsets_and_list_only_pull_blocks() -> None:
    popts = legacy(**{"llm.listenIpInfo": "127.0.0.1:0"})
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, popts) as p:
        await p.request(
            "alloc",
            kind="cache",
            num_tensors=2,
            shape=[2, 256],
            keys=[encode_key(dd.CacheKey(1, 7)), encode_key(dd.CacheKey(1, 8))],
            seed=80,
        )
        await p.request(
            "alloc",
            kind="blocks",
            num_tensors=2,
            shape=[8, 64],
            blocks_key=encode_key(dd.BlocksCacheKey(1, 0)),
            seed=81,
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(legacy()) as d:
            await link(d, 1, p.listen)
            await d.check_link_status(1)
            kvm = d.kv_cache_manager
            dst = kvm.allocate_cache(dd.CacheDesc(2, [1, 256], dd.DataType.DT_UINT8))
            # size -1: the local slot minus dst_cache_offset
            await kvm.pull_cache(
                dd.CacheKey(1, 8), dst, 0, src_cache_offset=16, dst_cache_offset=56
            )
            for t in range(2):
                got = dst.tensors[t][0]
                assert np.array_equal(got[56:], expected_tensor(80, t, (2, 256))[1][16:216])
                assert not got[:56].any()
            blocks = kvm.allocate_blocks_cache(dd.CacheDesc(2, [8, 64], dd.DataType.DT_UINT8))
            with pytest.raises(TypeError):
                kvm.pull_blocks(dd.BlocksCacheKey(1, 0), blocks, (1, 2), [3, 4])
            with pytest.raises(dd.LLMException):
                kvm.pull_blocks(dd.BlocksCacheKey(1, 0), blocks, [], [])
            with pytest.raises(dd.LLMException):
                kvm.pull_blocks(dd.BlocksCacheKey(1, 0), blocks, [1, 2], [3])
            with pytest.raises(TypeError):
                kvm.pull_blocks(dd.CacheKey(1, 7), blocks, [1], [3])
            await kvm.pull_blocks(dd.BlocksCacheKey(1, 0), blocks, [1, 2], [3, 4])
            for t in range(2):
                assert np.array_equal(
                    blocks.tensors[t][[3, 4]], expected_tensor(81, t, (8, 64))[[1, 2]]
                )


async def test_legacy_timeouts_report_wait_process_timeout() -> None:
    popts = legacy(**{"llm.listenIpInfo": "127.0.0.1:0"})
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, popts) as p:
        await p.request(
            "alloc",
            kind="blocks",
            num_tensors=1,
            shape=[4, 64],
            blocks_key=encode_key(dd.BlocksCacheKey(1, 0)),
            seed=82,
        )
        opts = legacy(**{"llm.SyncKvCacheWaitTime": "300"})
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(opts) as d:
            await link(d, 1, p.listen)
            kvm = d.kv_cache_manager
            blocks = kvm.allocate_blocks_cache(dd.CacheDesc(1, [4, 64], dd.DataType.DT_UINT8))
            p.pause()
            try:
                task = kvm.pull_blocks(dd.BlocksCacheKey(1, 0), blocks, [1], [1])
                with pytest.raises(dd.LLMException) as err:
                    await task
                assert err.value.status_code == S.LLM_WAIT_PROCESS_TIMEOUT
                assert await task.synchronize() == S.LLM_WAIT_PROCESS_TIMEOUT
                with pytest.raises(dd.LLMException) as err:
                    await d.check_link_status(1)
                assert err.value.status_code == S.LLM_WAIT_PROCESS_TIMEOUT
            finally:
                p.resume()
            await d.check_link_status(1)
            await d.unlink_clusters([cluster(1)], force=True)
            with pytest.raises(dd.LLMException) as err:
                await d.check_link_status(1)
            assert err.value.status_code == S.LLM_NOT_YET_LINK


async def test_dropping_a_kv_cache_frees_it() -> None:
    async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(legacy()) as d:
        kvm = d.kv_cache_manager
        pool = pool_of(d, dd.Placement.DEVICE)
        free = pool.free_bytes
        cache = kvm.allocate_cache(dd.CacheDesc(2, [4, 4096], dd.DataType.DT_UINT8))
        assert pool.free_bytes < free
        del cache
        gc.collect()
        await wait_until(lambda: pool.free_bytes == free, 5, 0.01)
        assert pool.free_bytes == free
        cpu = KvCache.create_cpu_cache(
            dd.CacheDesc(1, [2, 8], dd.DataType.DT_UINT8, dd.Placement.HOST), [[4096]]
        )
        assert cpu.per_device_tensor_addrs == [[4096]]
        with pytest.raises(dd.LLMException):
            kvm.deallocate_cache(cpu)


async def test_same_cluster_id_on_both_sides_is_allowed_in_legacy_mode() -> None:
    """TorchAir's sample links cluster 0 to cluster 0; cache-manager mode refuses that."""
    popts = legacy(**{"llm.listenIpInfo": "127.0.0.1:0"})
    async with PeerProcess.start(dd.LLMRole.PROMPT, 0, popts) as p:
        await p.request(
            "alloc",
            kind="cache",
            num_tensors=2,
            shape=[1, 32],
            keys=[encode_key(dd.CacheKey(0, 3))],
            seed=83,
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 0).running(legacy()) as d:
            await link(d, 0, p.listen)
            dst = d.kv_cache_manager.allocate_cache(dd.CacheDesc(2, [1, 32], dd.DataType.DT_UINT8))
            await d.kv_cache_manager.pull_cache(dd.CacheKey(prompt_cluster_id=0, req_id=3), dst)
            got = base64.b64encode(dst.tensors[1].tobytes())
            assert got == base64.b64encode(expected_tensor(83, 1, (1, 32)).tobytes())


class _AllReady:
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


async def test_transfer_cache_async_src_block_indices_on_a_contiguous_cache() -> None:
    """Ascend's old prompt_transfer_cache_sample: src_block_indices on an allocate_cache cache.

    The engine reads dim 0 as the blocks axis of any cache (reference §7, §9.1), so block i of
    a contiguous source is its batch slot i; without dst_block_memory_size the destination's
    blocks are that size too."""
    async with PeerProcess.start(dd.LLMRole.DECODER, 2, legacy()) as d:
        dst_id = await d.request("alloc", kind="blocks", num_tensors=4, shape=[6, 64])
        wide_id = await d.request("alloc", kind="blocks", num_tensors=4, shape=[3, 128])
        dst_addrs = await d.request("addrs", cache_id=dst_id)
        wide_addrs = await d.request("addrs", cache_id=wide_id)
        popts = legacy(**{"llm.listenIpInfo": "127.0.0.1:0"})
        async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(popts) as p:
            linked = await d.request("link", cluster_id=1, ip="127.0.0.1", port=p.listen_address[1])
            assert linked == [0, [0]]
            kvm = p.kv_cache_manager
            src = kvm.allocate_cache(dd.CacheDesc(4, [4, 64], dd.DataType.DT_UINT8))
            for t in range(4):
                src.tensors[t][...] = expected_tensor(90, t, (4, 64))
            config = dd.TransferConfig(2, dst_addrs)
            for bad in (([0, 1], [2]), ([0], None), ([4], [0])):  # lengths, no dst, range
                with pytest.raises(dd.LLMException) as err:
                    kvm.transfer_cache_async(src, _AllReady(), [config], *bad)
                assert err.value.status_code == S.LLM_PARAM_INVALID
            await kvm.transfer_cache_async(src, _AllReady(), [config], [3, 0, 1], [5, 2, 3])
            # into larger destination blocks: each slot lands at the start of its block
            await kvm.transfer_cache_async(
                src, _AllReady(), [dd.TransferConfig(2, wide_addrs)], [2], [1], 128
            )
            for t in range(4):
                want = expected_tensor(90, t, (4, 64))
                got = np.frombuffer(
                    base64.b64decode(await d.request("read", cache_id=dst_id, tensor=t)), np.uint8
                ).reshape(6, 64)
                assert np.array_equal(got[[5, 2, 3]], want[[3, 0, 1]])
                assert not got[[0, 1, 4]].any()
                wide = np.frombuffer(
                    base64.b64decode(await d.request("read", cache_id=wide_id, tensor=t)), np.uint8
                ).reshape(3, 128)
                assert np.array_equal(wide[1, :64], want[2])
                assert not wide[1, 64:].any() and not wide[[0, 2]].any()
