"""pull_* / push_* between a real prompt process and this process, over TCP and same-host.

The prompt runs in a child process (``llmdd_async.testing.PeerProcess``) and fills its caches
with ``pattern(seed + tensor)``; this process is the decoder and compares bytes exactly.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import (
    TRANSPORTS,
    cluster,
    endpoint_options,
    expected_tensor,
    link,
)

import llmdd_async as dd
from llmdd_async.testing import (
    DEFAULT_OPTIONS,
    PeerProcess,
    encode_key,
    engine_of,
    link_of,
    linked_pair,
    wait_until,
)

pytestmark = pytest.mark.anyio

S = dd.LLMStatusCode
PROMPT, DECODER = 1, 2


@contextlib.asynccontextmanager
async def pair(
    transport: str, ra: bool = False, **extra: str
) -> AsyncIterator[tuple[PeerProcess, dd.LLMDataDist]]:
    """A prompt process (listening) and a local decoder linked to it."""
    popts = endpoint_options(transport, listen=True, ra=ra, **extra)
    dopts = endpoint_options(transport, listen=True, ra=ra, **extra)
    async with PeerProcess.start(dd.LLMRole.PROMPT, PROMPT, popts) as p:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, DECODER).running(dopts) as d:
            await link(d, PROMPT, p.listen)
            yield p, d


def key(k: object) -> dict[str, object]:
    return {"key": encode_key(k)}


async def read_tensor(p: PeerProcess, cache_id: int, tensor: int) -> bytes:
    return base64.b64decode(await p.request("read", cache_id=cache_id, tensor=tensor))


# ------------------------------------------------------------------ pull_blocks
@pytest.mark.parametrize("registered", [False, True], ids=["pool", "registered"])
async def test_pull_blocks_blocks_to_blocks(transport, registered) -> None:
    shape = (32, 256)
    async with pair(transport) as (p, d):
        await p.request(
            "register" if registered else "alloc",
            kind="blocks",
            num_tensors=4,
            shape=list(shape),
            blocks_key=encode_key(dd.BlocksCacheKey(PROMPT, 0)),
            seed=10,
        )
        cm = d.cache_manager
        local = [np.zeros(shape, np.uint8) for _ in range(4)]
        dst = cm.register_blocks_cache(dd.CacheDesc(4, list(shape), dd.DataType.DT_UINT8), local)
        src_blocks = [5, 6, 7, 31, 0, 12]
        dst_blocks = [0, 1, 2, 3, 9, 30]
        task = cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 0), dst, src_blocks, dst_blocks)
        await task
        for t in range(4):
            want = np.zeros(shape, np.uint8)
            want[dst_blocks] = expected_tensor(10, t, shape)[src_blocks]
            assert np.array_equal(local[t], want)
        stats = task.statistics()
        assert stats.bytes == 4 * 6 * 256
        # 5,6,7 -> 0,1,2 merge: 4 descriptors per tensor instead of 6.
        assert stats.descriptors == 4 * 4


async def test_pull_blocks_contiguous_slot_to_blocks(transport) -> None:
    async with pair(transport) as (p, d):
        await p.request(
            "alloc",
            kind="cache",
            num_tensors=2,
            shape=[2, 1000],
            keys=[encode_key(dd.CacheKey(PROMPT, 5)), encode_key(dd.CacheKey(PROMPT, 6))],
            seed=20,
        )
        dst = d.cache_manager.allocate_blocks_cache(dd.CacheDesc(2, [8, 256], dd.DataType.DT_UINT8))
        await d.cache_manager.pull_blocks(dd.CacheKey(PROMPT, 6), dst, (), [7, 1, 2, 4])
        for t in range(2):
            slot = expected_tensor(20, t, (2, 1000))[1]
            got = dst.tensors[t]
            assert np.array_equal(np.concatenate([got[7], got[1], got[2]]), slot[:768])
            assert np.array_equal(got[4][:232], slot[768:])
        # the req key of an allocated cache is consumed by the successful pull
        with pytest.raises(dd.LLMException) as err:
            await d.cache_manager.pull_blocks(dd.CacheKey(PROMPT, 6), dst, (), [0, 1, 2, 3])
        assert err.value.status_code == S.LLM_KV_CACHE_NOT_EXIST


# ------------------------------------------------------------------ pull_cache
async def test_pull_cache_by_key_consumes_it_and_by_id_too(transport) -> None:
    shape = (3, 512)
    async with pair(transport) as (p, d):
        cid = await p.request(
            "alloc",
            kind="cache",
            num_tensors=4,
            shape=list(shape),
            keys=[encode_key(dd.CacheKey(PROMPT, r)) for r in (100, 101, 102)],
            seed=30,
        )
        cm = d.cache_manager
        dst = cm.allocate_cache(dd.CacheDesc(4, list(shape), dd.DataType.DT_UINT8))
        await cm.pull_cache(dd.CacheKey(PROMPT, 101), dst, batch_index=2)
        for t in range(4):
            assert np.array_equal(dst.tensors[t][2], expected_tensor(30, t, shape)[1])
        with pytest.raises(dd.LLMException) as err:
            await cm.pull_cache(dd.CacheKey(PROMPT, 101), dst, batch_index=0)
        assert err.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
        # By id and slot: slot 2 holds req 102, which is consumed the same way.
        await cm.pull_cache(dd.CacheKeyByIdAndIndex(PROMPT, cid, 2), dst, batch_index=0)
        assert np.array_equal(dst.tensors[3][0], expected_tensor(30, 3, shape)[2])
        with pytest.raises(dd.LLMException) as err:
            await cm.pull_cache(dd.CacheKey(PROMPT, 102), dst)
        assert err.value.status_code == S.LLM_KV_CACHE_NOT_EXIST


async def test_pull_cache_size_offsets_and_layer_ranges(transport) -> None:
    shape = (2, 400)
    async with pair(transport) as (p, d):
        await p.request(
            "alloc",
            kind="cache",
            num_tensors=6,
            shape=list(shape),
            keys=[encode_key(dd.CacheKey(PROMPT, 1, prefix_id=2**64 - 1))],
            seed=40,
        )
        cm = d.cache_manager
        dst = cm.allocate_cache(dd.CacheDesc(6, list(shape), dd.DataType.DT_UINT8))
        # source layers 1..2 (tensors 2..5) into destination layers 0..1 (tensors 0..3), 100
        # bytes from source offset 50 to destination offset 10 of slot 1.
        await cm.pull_cache(
            dd.CacheKey(PROMPT, 1),
            dst,
            1,
            100,
            src_layer_range=range(1, 3),
            dst_layer_range=range(0, 2),
            src_cache_offset=50,
            dst_cache_offset=10,
        )
        for t in range(6):
            got = dst.tensors[t][1]
            if t < 4:
                assert np.array_equal(got[10:110], expected_tensor(40, t + 2, shape)[0][50:150])
                assert not got[:10].any() and not got[110:].any()
            else:
                assert not got.any()
        # With layer ranges, the key is consumed only once every tensor was pulled: the
        # first pull took layers 1..2, this one takes layer 0 (twice: still bound after one).
        await cm.pull_cache(
            dd.CacheKey(PROMPT, 1), dst, 0, src_layer_range=range(1, 2), dst_layer_range=range(1, 2)
        )
        await cm.pull_cache(
            dd.CacheKey(PROMPT, 1), dst, 0, src_layer_range=range(0, 1), dst_layer_range=range(0, 1)
        )
        with pytest.raises(dd.LLMException) as err:
            await cm.pull_cache(dd.CacheKey(PROMPT, 1), dst, 0)
        assert err.value.status_code == S.LLM_KV_CACHE_NOT_EXIST


async def test_prefix_keys_and_registered_caches_are_never_consumed(transport) -> None:
    async with pair(transport) as (p, d):
        prefix = dd.CacheKey(PROMPT, 2**64 - 1, 0, 77)
        await p.request(
            "alloc", kind="cache", num_tensors=2, shape=[1, 64], keys=[encode_key(prefix)], seed=1
        )
        await p.request(
            "register",
            kind="cache",
            num_tensors=2,
            shape=[1, 64],
            keys=[encode_key(dd.CacheKey(PROMPT, 9))],
            seed=2,
        )
        cm = d.cache_manager
        dst = cm.allocate_cache(dd.CacheDesc(2, [1, 64], dd.DataType.DT_UINT8))
        for _ in range(2):
            await cm.pull_cache(prefix, dst)
            assert np.array_equal(dst.tensors[1][0], expected_tensor(1, 1, (1, 64))[0])
            await cm.pull_cache(dd.CacheKey(PROMPT, 9), dst)
            assert np.array_equal(dst.tensors[0][0], expected_tensor(2, 0, (1, 64))[0])


# ------------------------------------------------------------------ errors
async def test_errors_known_at_the_call_raise_at_once(transport) -> None:
    async with pair(transport) as (_, d):
        cm = d.cache_manager
        blocks = cm.allocate_blocks_cache(dd.CacheDesc(2, [8, 64], dd.DataType.DT_UINT8))
        cont = cm.allocate_cache(dd.CacheDesc(2, [2, 64], dd.DataType.DT_UINT8))
        cases = [
            (lambda: cm.pull_blocks(dd.BlocksCacheKey(9, 0), blocks, [0], [0]), S.LLM_NOT_YET_LINK),
            (
                lambda: cm.pull_blocks(dd.BlocksCacheKey(DECODER, 0), blocks, [0], [0]),
                S.LLM_PARAM_INVALID,
            ),
            (
                lambda: cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 0), blocks, [0], [8]),
                S.LLM_PARAM_INVALID,
            ),
            (
                lambda: cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 0), blocks, [0, 1], [0]),
                S.LLM_PARAM_INVALID,
            ),
            (
                lambda: cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 0), blocks, [], [0]),
                S.LLM_PARAM_INVALID,
            ),
            (
                lambda: cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 0), cont, [0], [0]),
                S.LLM_PARAM_INVALID,
            ),
            (lambda: cm.pull_blocks(dd.CacheKey(PROMPT, 1), blocks, [1], [0]), S.LLM_PARAM_INVALID),
            (lambda: cm.pull_cache(dd.CacheKey(PROMPT, 1), blocks), S.LLM_PARAM_INVALID),
            (lambda: cm.pull_cache(dd.CacheKey(PROMPT, 1), cont, 2), S.LLM_PARAM_INVALID),
            (lambda: cm.pull_cache(dd.CacheKey(PROMPT, 1), cont, size=0), S.LLM_PARAM_INVALID),
            (lambda: cm.pull_cache(dd.CacheKey(PROMPT, 1), cont, size=65), S.LLM_PARAM_INVALID),
            (lambda: cm.pull_cache(dd.CacheKey(PROMPT, 2**64 - 1), cont), S.LLM_PARAM_INVALID),
            (
                lambda: cm.pull_cache(dd.CacheKey(PROMPT, 1), cont, dst_layer_range=range(1, 2)),
                S.LLM_PARAM_INVALID,
            ),  # only one local layer of 2 tensors
            (
                lambda: cm.pull_cache(
                    dd.CacheKey(PROMPT, 1),
                    cont,
                    src_layer_range=range(0, 1),
                    dst_layer_range=range(0, 2),
                    tensor_num_per_layer=1,
                ),
                S.LLM_PARAM_INVALID,
            ),
            (
                lambda: cm.pull_cache(dd.CacheKey(PROMPT, 1), cont, src_layer_range=range(0, 2, 2)),
                S.LLM_PARAM_INVALID,
            ),
            (
                lambda: cm.push_blocks(dd.BlocksCacheKey(PROMPT, 0), blocks, [0], [0]),
                S.LLM_PARAM_INVALID,
            ),  # push needs remote-accessible mode
        ]
        for i, (call, code) in enumerate(cases):
            with pytest.raises(dd.LLMException) as err:
                call()
            assert err.value.status_code == code, i
        with pytest.raises(TypeError):
            cm.pull_cache(dd.CacheKey(PROMPT, 1), cont, unknown_option=1)
        with pytest.raises(TypeError):
            cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 0), blocks, [0.5], [0])
        with pytest.raises(ValueError):
            cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 0), blocks, [-1], [0])


async def test_errors_found_by_the_peer_fail_the_task(transport) -> None:
    async with pair(transport) as (p, d):
        await p.request(
            "alloc",
            kind="blocks",
            num_tensors=2,
            shape=[4, 64],
            blocks_key=encode_key(dd.BlocksCacheKey(PROMPT, 0)),
            seed=1,
        )
        await p.request(
            "alloc",
            kind="cache",
            num_tensors=4,
            shape=[1, 64],
            keys=[encode_key(dd.CacheKey(PROMPT, 3))],
            seed=2,
        )
        cm = d.cache_manager
        blocks = cm.allocate_blocks_cache(dd.CacheDesc(2, [8, 64], dd.DataType.DT_UINT8))
        cont = cm.allocate_cache(dd.CacheDesc(2, [1, 64], dd.DataType.DT_UINT8))
        cases = [
            (
                cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 5), blocks, [0], [0]),
                S.LLM_KV_CACHE_NOT_EXIST,
            ),
            (cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 0), blocks, [4], [0]), S.LLM_PARAM_INVALID),
            (cm.pull_cache(dd.CacheKey(PROMPT, 44), cont), S.LLM_KV_CACHE_NOT_EXIST),
            (cm.pull_cache(dd.CacheKeyByIdAndIndex(PROMPT, 99, 0), cont), S.LLM_KV_CACHE_NOT_EXIST),
            (
                cm.pull_cache(dd.CacheKeyByIdAndIndex(PROMPT, 2, 1), cont),
                S.LLM_KV_CACHE_NOT_EXIST,
            ),  # remote batch index out of range
            # the peer's cache has 4 tensors, ours 2: the counts must match
            (cm.pull_cache(dd.CacheKey(PROMPT, 3), cont), S.LLM_PARAM_INVALID),
            (
                cm.pull_cache(dd.CacheKey(PROMPT, 3), cont, src_layer_range=range(2, 3)),
                S.LLM_PARAM_INVALID,
            ),  # the peer has only 2 layers
        ]
        for i, (task, code) in enumerate(cases):
            with pytest.raises(dd.LLMException) as err:
                await task
            assert err.value.status_code == code, i
            assert await task.synchronize() == code
        # None of the failed pulls consumed the key: it is still pullable.
        await cm.pull_cache(dd.CacheKey(PROMPT, 3), cont, src_layer_range=range(1, 2))
        assert np.array_equal(cont.tensors[1][0], expected_tensor(2, 3, (1, 64))[0])


async def test_a_stalled_peer_times_out_and_the_link_recovers(transport) -> None:
    async with pair(transport, **{"llm.SyncKvCacheWaitTime": "300"}) as (p, d):
        await p.request(
            "alloc",
            kind="blocks",
            num_tensors=1,
            shape=[4, 64],
            blocks_key=encode_key(dd.BlocksCacheKey(PROMPT, 0)),
            seed=3,
        )
        cm = d.cache_manager
        dst = cm.allocate_blocks_cache(dd.CacheDesc(1, [4, 64], dd.DataType.DT_UINT8))
        p.pause()
        try:
            task = cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 0), dst, [1], [1])
            with anyio.fail_after(5):
                with pytest.raises(dd.LLMException) as err:
                    await task
            assert err.value.status_code == S.LLM_TIMEOUT
            assert not dst.tensors[0].any()
        finally:
            p.resume()
        await cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 0), dst, [2], [2])
        assert np.array_equal(dst.tensors[0][2], expected_tensor(3, 0, (4, 64))[2])


@pytest.mark.parametrize("transport", ["tcp", *TRANSPORTS[2:]], indirect=True)
async def test_peer_killed_mid_transfer_fails_promptly_other_links_survive(transport) -> None:
    big = (64, 1 << 20)  # 64 MiB
    # A deadline well past the 5 s that "promptly" allows: the kill, not the clock, must end it.
    opts = {"llm.MemPoolConfig": '{"memory_size": 201326592}', "llm.SyncKvCacheWaitTime": "10000"}
    async with (
        pair(transport, **opts) as (p, d),
        PeerProcess.start(dd.LLMRole.PROMPT, 3, endpoint_options(transport, listen=True)) as other,
    ):
        await p.request(
            "alloc",
            kind="blocks",
            num_tensors=1,
            shape=list(big),
            blocks_key=encode_key(dd.BlocksCacheKey(PROMPT, 0)),
            seed=4,
        )
        await other.request(
            "alloc",
            kind="blocks",
            num_tensors=1,
            shape=[4, 64],
            blocks_key=encode_key(dd.BlocksCacheKey(3, 0)),
            seed=5,
        )
        await link(d, 3, other.listen)
        cm = d.cache_manager
        dst = cm.allocate_blocks_cache(dd.CacheDesc(1, list(big), dd.DataType.DT_UINT8))
        task = cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 0), dst, list(range(64)), list(range(64)))
        one_sided = transport in ("nixl", "mooncake")
        if one_sided:  # nothing to watch on the link; the engine is under way
            await anyio.sleep(0.005)
        while not one_sided and task.statistics().bytes == 0 and not task.done():
            await anyio.sleep(0.001)
            if link_of(d, PROMPT, alive=False).bytes_moved > 0:
                break
        p.kill()
        with anyio.fail_after(5), pytest.raises(dd.LLMException) as err:
            await task
        assert err.value.status_code == S.LLM_LINK_FAILED
        small = cm.allocate_blocks_cache(dd.CacheDesc(1, [4, 64], dd.DataType.DT_UINT8))
        await cm.pull_blocks(dd.BlocksCacheKey(3, 0), small, [0], [3])
        assert np.array_equal(small.tensors[0][3], expected_tensor(5, 0, (4, 64))[0])
        with pytest.raises(dd.LLMException) as err:
            cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 0), dst, [0], [0])
        assert err.value.status_code == S.LLM_LINK_FAILED  # the link is down, and says why
        # (Killed while NIXL moves the bytes, the peer may leave a request of ours unread on
        # the link's socket: the kernel then resets the connection instead of closing it.)
        why = ["peer closed the connection"]
        if transport != "tcp":
            why.append("connection reset by peer")
        assert any(w in str(err.value) for w in why), str(err.value)


async def test_cancelling_a_pull_fences_it_and_keeps_the_link(transport) -> None:
    big = (32, 1 << 20)
    opts = {"llm.MemPoolConfig": '{"memory_size": 134217728}'}
    async with pair(transport, **opts) as (p, d):
        await p.request(
            "alloc",
            kind="blocks",
            num_tensors=1,
            shape=list(big),
            blocks_key=encode_key(dd.BlocksCacheKey(PROMPT, 0)),
            seed=6,
        )
        cm = d.cache_manager
        dst = cm.allocate_blocks_cache(dd.CacheDesc(1, list(big), dd.DataType.DT_UINT8))
        task = cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 0), dst, list(range(32)), list(range(32)))
        await anyio.sleep(0.005)
        task.cancel()
        with pytest.raises(dd.TransferCancelled):
            await task
        # Fenced: nothing writes into the destination any more.
        snapshot = dst.tensors[0].copy()
        await anyio.sleep(0.2)
        assert np.array_equal(dst.tensors[0], snapshot)
        # The link still works, and a fresh pull gets every byte.
        await cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 0), dst, list(range(32)), list(range(32)))
        assert np.array_equal(dst.tensors[0], expected_tensor(6, 0, big))


async def test_a_pull_stopped_while_its_big_grant_is_checked_closes_its_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GRANT of many descriptors is checked in a worker thread, which also makes the stream
    the bytes land through (a pinned staging buffer, for device memory). A pull cancelled
    meanwhile still closes that stream once the check returns."""
    blocks, block = 20_000, 16  # 20 000 descriptors: the grant is checked off the loop
    async with pair("tcp") as (p, d):
        await p.request(
            "alloc",
            kind="blocks",
            num_tensors=1,
            shape=[blocks, block],
            blocks_key=encode_key(dd.BlocksCacheKey(PROMPT, 0)),
            seed=3,
        )
        cm = d.cache_manager
        dst = cm.allocate_blocks_cache(dd.CacheDesc(1, [blocks, block], dd.DataType.DT_UINT8))
        engine = engine_of(d)
        real = engine.make_stream
        entered, release = threading.Event(), threading.Event()
        made: list[Any] = []
        closed: list[Any] = []

        def make_stream(addrs: Any, nbytes: Any, limiter: Any = None) -> Any:
            stream = real(addrs, nbytes, limiter)
            real_close = stream.close

            def close() -> None:
                closed.append(stream)
                real_close()

            stream.close = close  # type: ignore[method-assign]
            made.append(stream)
            entered.set()
            release.wait(10)  # the pull is cancelled meanwhile
            return stream

        monkeypatch.setattr(engine, "make_stream", make_stream)
        shuffled = np.random.default_rng(0).permutation(blocks).tolist()
        try:
            task = cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 0), dst, shuffled, list(range(blocks)))
            await wait_until(entered.is_set, 10)
            task.cancel()
            with anyio.fail_after(10), pytest.raises(dd.TransferCancelled):
                await task
        finally:
            release.set()
        await wait_until(lambda: bool(closed), 5)
        await anyio.sleep(0.1)
        assert len(made) == 1
        assert closed == made  # once


async def test_concurrent_pulls_on_one_link_all_land(transport) -> None:
    async with pair(transport) as (p, d):
        await p.request(
            "alloc",
            kind="blocks",
            num_tensors=2,
            shape=[64, 4096],
            blocks_key=encode_key(dd.BlocksCacheKey(PROMPT, 0)),
            seed=7,
        )
        cm = d.cache_manager
        dsts = [
            cm.allocate_blocks_cache(dd.CacheDesc(2, [64, 4096], dd.DataType.DT_UINT8))
            for _ in range(4)
        ]
        perms = [np.random.default_rng(i).permutation(64).tolist() for i in range(4)]
        tasks = [
            cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 0), dsts[i], perms[i], list(range(64)))
            for i in range(4)
        ]
        for t in tasks:
            await t
        for i in range(4):
            for t in range(2):
                assert np.array_equal(
                    dsts[i].tensors[t], expected_tensor(7, t, (64, 4096))[perms[i]]
                )


# ------------------------------------------------------------------ remote-accessible mode
async def test_push_blocks_and_push_cache(transport) -> None:
    async with pair(transport, ra=True) as (p, d):
        pb = await p.request(
            "register",
            kind="blocks",
            num_tensors=4,
            shape=[16, 128],
            blocks_key=encode_key(dd.BlocksCacheKey(PROMPT, 0)),
        )
        pc = await p.request("register", kind="cache", num_tensors=4, shape=[2, 300])
        cm = d.cache_manager
        src = cm.allocate_blocks_cache(dd.CacheDesc(4, [16, 128], dd.DataType.DT_UINT8))
        for t, arr in enumerate(src.tensors):
            arr[...] = expected_tensor(50, t, (16, 128))
        await cm.push_blocks(dd.BlocksCacheKey(PROMPT, 0), src, [1, 2, 3], [10, 11, 0])
        for t in range(4):
            got = np.frombuffer(await read_tensor(p, pb, t), np.uint8).reshape(16, 128)
            assert np.array_equal(got[[10, 11, 0]], expected_tensor(50, t, (16, 128))[[1, 2, 3]])
            assert not got[1:10].any()
        # SGLang's pattern: every tensor is one "layer" (tensor_num_per_layer=1).
        await cm.push_blocks(
            dd.BlocksCacheKey(PROMPT, 0), src, [5], [5], range(0, 4), range(0, 4), 1
        )
        got = np.frombuffer(await read_tensor(p, pb, 3), np.uint8).reshape(16, 128)
        assert np.array_equal(got[5], expected_tensor(50, 3, (16, 128))[5])
        csrc = cm.allocate_cache(dd.CacheDesc(4, [1, 300], dd.DataType.DT_UINT8))
        for t, arr in enumerate(csrc.tensors):
            arr[...] = t + 1
        await cm.push_cache(
            dd.CacheKeyByIdAndIndex(PROMPT, pc, 1),
            csrc,
            src_layer_range=range(1, 2),
            dst_layer_range=range(0, 1),
        )
        got = [
            np.frombuffer(await read_tensor(p, pc, t), np.uint8).reshape(2, 300) for t in range(4)
        ]
        assert (got[0][1] == 3).all() and (got[1][1] == 4).all()
        assert not got[0][0].any() and not got[2].any()


async def test_pull_by_id_in_remote_accessible_mode_and_table_snapshot(transport) -> None:
    async with pair(transport, ra=True) as (p, d):
        first = await p.request("register", kind="cache", num_tensors=2, shape=[1, 64], seed=8)
        cm = d.cache_manager
        dst = cm.register_cache(
            dd.CacheDesc(2, [1, 64], dd.DataType.DT_UINT8),
            [np.zeros(64, np.uint8), np.zeros(64, np.uint8)],
        )
        with pytest.raises(TypeError):
            cm.pull_cache(dd.CacheKey(PROMPT, 1), dst)  # only by id in this mode
        await cm.pull_cache(dd.CacheKeyByIdAndIndex(PROMPT, first, 0), dst)
        assert np.array_equal(dst.tensors[1][0], expected_tensor(8, 1, (1, 64))[0])
        # Registered after the first transfer: invisible until the link is made again.
        later = await p.request("register", kind="cache", num_tensors=2, shape=[1, 64], seed=9)
        with pytest.raises(dd.LLMException) as err:
            await cm.pull_cache(dd.CacheKeyByIdAndIndex(PROMPT, later, 0), dst)
        assert err.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
        await d.unlink_clusters([cluster(PROMPT)], force=True)
        await p.request("wait_link_down", cluster_id=DECODER)  # the peer noticed
        await link(d, PROMPT, p.listen)
        await cm.pull_cache(dd.CacheKeyByIdAndIndex(PROMPT, later, 0), dst)
        assert np.array_equal(dst.tensors[0][0], expected_tensor(9, 0, (1, 64))[0])
        # A cache the peer did not make remote accessible cannot be pulled.
        hidden = await p.request(
            "register", kind="cache", num_tensors=2, shape=[1, 64], placement="HOST", seed=1
        )
        await d.unlink_clusters([cluster(PROMPT)], force=True)
        await p.request("wait_link_down", cluster_id=DECODER)  # the peer noticed
        await link(d, PROMPT, p.listen)
        with pytest.raises(dd.LLMException) as err:
            await cm.pull_cache(dd.CacheKeyByIdAndIndex(PROMPT, hidden, 0), dst)
        assert err.value.status_code == S.LLM_PARAM_INVALID


@pytest.mark.parametrize("ra", [False, True], ids=["grant", "remote-accessible"])
async def test_same_host_pulls_in_remote_accessible_mode_are_one_sided(ra: bool) -> None:
    """In remote-accessible mode a same-host pull is planned from the peer's table and copied
    without a round trip ("direct"); errors are the ones the peer would give. Pushes are
    always granted by the peer (it may have released the memory since its table was taken)."""
    async with pair("same-host", ra=ra) as (p, d):
        theirs = await p.request(
            "alloc",
            kind="blocks",
            num_tensors=2,
            shape=[16, 256],
            blocks_key=encode_key(dd.BlocksCacheKey(PROMPT, 0)),
            seed=31,
        )
        cm = d.cache_manager
        dst = cm.allocate_blocks_cache(dd.CacheDesc(2, [16, 256], dd.DataType.DT_UINT8))
        key = dd.BlocksCacheKey(PROMPT, 0)
        await cm.pull_blocks(key, dst, [5, 3, 9], [0, 1, 2])
        for t in range(2):
            want = expected_tensor(31, t, (16, 256))
            assert np.array_equal(dst.tensors[t][:3], want[[5, 3, 9]])
        recent = d.link_statistics(PROMPT).recent
        assert recent[-1].mode == ("direct" if ra else "local")
        with pytest.raises(dd.LLMException) as err:
            await cm.pull_blocks(key, dst, [16], [0])  # no block 16 over there
        assert err.value.status_code == S.LLM_PARAM_INVALID
        if ra:
            dst.tensors[0][4] = 7
            await cm.push_blocks(key, dst, [4], [4])
            assert d.link_statistics(PROMPT).recent[-1].mode == "local"
            got = base64.b64decode(await p.request("read", cache_id=theirs, tensor=0))
            assert (np.frombuffer(got, np.uint8).reshape(16, 256)[4] == 7).all()


async def _peer_blocks(p: Any, shape: tuple[int, int], seed: int) -> int:
    """The peer allocates a blocks cache of two tensors of ``shape`` under
    ``BlocksCacheKey(PROMPT, 0)``, filled from ``seed``; its cache id."""
    cache_id: int = await p.request(
        "alloc",
        kind="blocks",
        num_tensors=2,
        shape=list(shape),
        blocks_key=encode_key(dd.BlocksCacheKey(PROMPT, 0)),
        seed=seed,
    )
    return cache_id


async def test_every_block_of_a_pool_cache_whose_tensors_touch(transport) -> None:
    """Pool tensors of a page-multiple size lie back to back: a pull of every block must not
    merge the last block of one tensor with the first of the next (each end checks ranges per
    tensor; before, 256 of 256 blocks failed with "the request leaves cache 1")."""
    async with pair(transport) as (p, d):
        shape = (256, 16384)  # 4 MiB per tensor: a whole number of pool pages
        await _peer_blocks(p, shape, 41)
        cm = d.cache_manager
        dst = cm.allocate_blocks_cache(dd.CacheDesc(2, list(shape), dd.DataType.DT_UINT8))
        every = list(range(shape[0]))
        task = cm.pull_blocks(dd.BlocksCacheKey(PROMPT, 0), dst, every, every)
        await task
        for t in range(2):
            assert np.array_equal(dst.tensors[t], expected_tensor(41, t, shape))
        assert task.statistics().descriptors == 2  # one per tensor


@pytest.mark.parametrize("transport", ["same-host", "tcp"])
async def test_a_cache_released_after_the_snapshot_is_never_read(transport: str) -> None:
    """The peer deallocates a cache after our table snapshot and allocates another at the
    same addresses: a pull of the old id is refused (LLM_KV_CACHE_NOT_EXIST) and never returns
    the new cache's bytes, one-sided or not (the peer's epoch moved)."""
    async with pair(transport, ra=True) as (p, d):
        shape = (1, 4096)
        old = await p.request("alloc", kind="cache", num_tensors=2, shape=list(shape), seed=3)
        cm = d.cache_manager
        dst = cm.allocate_cache(dd.CacheDesc(2, list(shape), dd.DataType.DT_UINT8))
        await cm.pull_cache(dd.CacheKeyByIdAndIndex(PROMPT, old, 0), dst)
        assert np.array_equal(dst.tensors[0], expected_tensor(3, 0, shape))
        before = await p.request("addrs", cache_id=old)
        await p.request("call", method="deallocate_cache", args=[{"cache": old}], kwargs={})
        new = await p.request("alloc", kind="cache", num_tensors=2, shape=list(shape), seed=9)
        assert await p.request("addrs", cache_id=new) == before  # the same memory, reused
        dst.tensors[0][...] = 0
        with pytest.raises(dd.LLMException) as err:
            await cm.pull_cache(dd.CacheKeyByIdAndIndex(PROMPT, old, 0), dst)
        assert err.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
        assert not dst.tensors[0].any()  # nothing of the new cache landed


async def test_a_lying_table_never_steers_a_one_sided_pull() -> None:
    """What the peer's table says is checked before a one-sided pull: a cache whose addresses
    leave what the peer published as reachable, or an epoch address that is not in the
    peer's shared pages, makes the pull go to the peer (which answers for its caches), and
    only our own planned destination is ever written."""
    async with pair("same-host", ra=True) as (p, d):
        shape = (8, 256)
        theirs = await _peer_blocks(p, shape, 51)
        cm = d.cache_manager
        dst = cm.allocate_blocks_cache(dd.CacheDesc(2, list(shape), dd.DataType.DT_UINT8))
        key = dd.BlocksCacheKey(PROMPT, 0)
        await cm.pull_blocks(key, dst, [1], [1])
        lnk = link_of(d, PROMPT).raw
        assert lnk.statistics().recent[-1].mode == "direct"
        want = [expected_tensor(51, t, shape) for t in range(2)]
        honest = lnk.view.caches[theirs]
        # 1. Addresses shifted past the published regions: not read one-sidedly.
        shifted = tuple(a + (1 << 40) for a in honest.addrs)
        lnk.view.caches[theirs] = dataclasses.replace(honest, addrs=shifted)
        await cm.pull_blocks(key, dst, [2], [2])
        assert lnk.statistics().recent[-1].mode != "direct"
        # 2. A bogus epoch address: the view is refreshed and the peer serves the pull.
        lnk.view.caches[theirs] = honest
        good_epoch = lnk.view.epoch
        assert good_epoch is not None
        lnk.view.epoch = (good_epoch[0] + (1 << 40), good_epoch[1])
        await cm.pull_blocks(key, dst, [3], [3])
        assert lnk.statistics().recent[-1].mode != "direct"
        assert lnk.view.epoch == good_epoch  # refreshed from the peer's table
        await cm.pull_blocks(key, dst, [4], [4])
        assert lnk.statistics().recent[-1].mode == "direct"
        for t in range(2):
            assert np.array_equal(dst.tensors[t][1:5], want[t][1:5])
            assert not dst.tensors[t][[0, 5, 6, 7]].any()  # nothing else was written


async def test_one_sided_pulls_reuse_a_prepared_pair_and_it_never_widens_what_they_reach() -> None:
    """Pulls of a few blocks from one cache into another are planned from the pair prepared by
    the first (kept in the link's view of the peer's table): many shuffled pulls land the
    right bytes through one pair. A pair serves only where the peer's selected tensors lie
    whole in what it published; where they do not, each pull is checked on its own, so a
    block outside the published memory still goes to the peer."""
    async with pair("same-host", ra=True) as (p, d):
        shape = (8, 256)
        theirs = await _peer_blocks(p, shape, 53)
        cm = d.cache_manager
        dst = cm.allocate_blocks_cache(dd.CacheDesc(2, list(shape), dd.DataType.DT_UINT8))
        key = dd.BlocksCacheKey(PROMPT, 0)
        want = [expected_tensor(53, t, shape) for t in range(2)]
        rng = np.random.default_rng(7)
        await cm.pull_blocks(key, dst, [0], [0])
        lnk = link_of(d, PROMPT).raw
        [prepared] = lnk.view.pairs.values()
        for _ in range(40):
            k = int(rng.integers(1, 4))
            src, dst_b = rng.permutation(8)[:k].tolist(), rng.permutation(8)[:k].tolist()
            for t in range(2):
                dst.tensors[t][...] = 0
            await cm.pull_blocks(key, dst, src, dst_b)
            assert lnk.statistics().recent[-1].mode == "direct"
            for t in range(2):
                assert np.array_equal(dst.tensors[t][dst_b], want[t][src])
        assert list(lnk.view.pairs.values()) == [prepared]  # the same pair, made once
        # The peer's published memory now covers only the first half of each tensor.
        addrs = sorted(lnk.view.caches[theirs].addrs)
        half = (shape[0] // 2) * shape[1]
        lnk.view.regions = (np.array(addrs, np.uint64), np.array(addrs, np.uint64) + half)
        for t in range(2):
            dst.tensors[t][...] = 0
        await cm.pull_blocks(key, dst, [2], [5])  # inside the published half: one-sided
        assert lnk.statistics().recent[-1].mode == "direct"
        await cm.pull_blocks(key, dst, [6], [1])  # outside it: the peer serves it
        assert lnk.statistics().recent[-1].mode != "direct"
        for t in range(2):
            assert np.array_equal(dst.tensors[t][[5, 1]], want[t][[2, 6]])


@pytest.mark.parametrize("registered", [False, True], ids=["pool", "registered"])
async def test_a_small_one_sided_pull_is_done_when_the_call_returns(registered: bool) -> None:
    """A one-sided pull of at most about a MiB of host memory is copied from the loop within
    the API call: its task is done (no task, no thread) when the call returns, with the right
    bytes; a bigger one runs as a task. Both from the peer's pool and from memory it
    registered itself (process_vm_readv)."""
    async with pair("same-host", ra=True) as (p, d):
        shape = (40, 16 << 10)  # 16 KiB blocks: 32 blocks x 2 tensors = 1 MiB
        await p.request(
            "register" if registered else "alloc",
            kind="blocks",
            remote_accessible=True,
            num_tensors=2,
            shape=list(shape),
            blocks_key=encode_key(dd.BlocksCacheKey(PROMPT, 0)),
            seed=61,
        )
        cm = d.cache_manager
        dst = cm.allocate_blocks_cache(dd.CacheDesc(2, list(shape), dd.DataType.DT_UINT8))
        key = dd.BlocksCacheKey(PROMPT, 0)
        await cm.pull_blocks(key, dst, [0], [0])  # the first fetches the peer's table
        lnk = link_of(d, PROMPT).raw
        want = [expected_tensor(61, t, shape) for t in range(2)]
        src = list(range(1, 33))  # 1 MiB in all, shuffled
        task = cm.pull_blocks(key, dst, src, src[::-1])
        assert task.done()
        await task
        assert lnk.statistics().recent[-1].mode == "direct"
        assert task.statistics().bytes == 1 << 20
        src = list(range(40))  # 1.25 MiB: a task
        task = cm.pull_blocks(key, dst, src, src)
        assert not task.done()
        await task
        assert lnk.statistics().recent[-1].mode == "direct"
        for t in range(2):
            assert np.array_equal(dst.tensors[t], want[t])


@pytest.mark.parametrize("registered", [False, True], ids=["pool", "registered"])
async def test_a_one_sided_pull_of_a_block_of_many_tensors_is_done_when_the_call_returns(
    registered: bool,
) -> None:
    """A block of a many-layer model is a range per tensor (160 for 80 layers of K and V): a
    one-sided pull of one such block is copied from the loop within the call too (it used to
    go to a task and a worker thread past 64 ranges)."""
    async with pair("same-host", ra=True) as (p, d):
        tensors, shape = 160, (8, 4096)
        await p.request(
            "register" if registered else "alloc",
            kind="blocks",
            remote_accessible=True,
            num_tensors=tensors,
            shape=list(shape),
            blocks_key=encode_key(dd.BlocksCacheKey(PROMPT, 0)),
            seed=67,
        )
        cm = d.cache_manager
        dst = cm.allocate_blocks_cache(dd.CacheDesc(tensors, list(shape), dd.DataType.DT_UINT8))
        key = dd.BlocksCacheKey(PROMPT, 0)
        await cm.pull_blocks(key, dst, [0], [0])  # the first fetches the peer's table
        task = cm.pull_blocks(key, dst, [5], [2])
        assert task.done()
        await task
        assert link_of(d, PROMPT).raw.statistics().recent[-1].mode == "direct"
        assert task.statistics().bytes == tensors * shape[1]
        for t in (0, 77, 159):
            assert np.array_equal(dst.tensors[t][2], expected_tensor(67, t, shape)[5])


async def test_a_cache_released_under_a_one_sided_copy_from_the_loop_is_not_kept() -> None:
    """The peer's epoch moves while a small one-sided pull copies from the loop: the copy is
    not reported; the pull goes to the peer, which answers for its caches."""
    async with pair("same-host", ra=True) as (p, d):
        shape = (8, 256)
        await _peer_blocks(p, shape, 67)
        cm = d.cache_manager
        dst = cm.allocate_blocks_cache(dd.CacheDesc(2, list(shape), dd.DataType.DT_UINT8))
        key = dd.BlocksCacheKey(PROMPT, 0)
        await cm.pull_blocks(key, dst, [1], [1])
        lnk = link_of(d, PROMPT).raw
        assert lnk.statistics().recent[-1].mode == "direct"
        access = lnk.access
        assert access is not None
        honest = access.read_word
        reads: list[int] = []

        def moved_after_the_first(addr: int) -> int | None:
            reads.append(addr)
            word = honest(addr)
            return word if word is None or len(reads) == 1 else word + 1

        access.read_word = moved_after_the_first  # type: ignore[method-assign]
        task = cm.pull_blocks(key, dst, [2], [2])
        assert len(reads) == 2  # before and after the copy from the loop
        assert not task.done()  # not reported: a task asks again
        await task
        assert lnk.statistics().recent[-1].mode != "direct"  # the peer served it
        want = [expected_tensor(67, t, shape) for t in range(2)]
        for t in range(2):
            assert np.array_equal(dst.tensors[t][1:3], want[t][1:3])


@pytest.mark.parametrize("transport", ["tcp", "same-host"])
async def test_the_deadline_starts_once_registrations_pages_are_populated(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registration faults a fresh cache's pages in (in a thread); a pull issued right after
    waits for that, and only then does its llm.SyncKvCacheWaitTime start."""
    from llmdd_async import _engine

    original = _engine.populate

    def slow_populate(addrs: Any, nbytes: int) -> int:
        time.sleep(0.6)  # three deadlines' worth: a pull counting it would time out
        return original(addrs, nbytes)

    opts = {**DEFAULT_OPTIONS, "llm.Transport": transport, "llm.SyncKvCacheWaitTime": "200"}
    async with linked_pair(opts) as (prompt, decoder):
        desc = dd.CacheDesc(1, [4, 4096], dd.DataType.DT_UINT8)
        src = np.arange(4 * 4096, dtype=np.uint32).astype(np.uint8).reshape(4, 4096)
        prompt.cache_manager.register_blocks_cache(desc, [src], dd.BlocksCacheKey(1, 0))
        monkeypatch.setattr(_engine, "populate", slow_populate)
        dst = np.zeros((4, 4096), dtype=np.uint8)
        cache = decoder.cache_manager.register_blocks_cache(desc, [dst])
        t0 = time.monotonic()
        await decoder.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), cache, [0, 3], [1, 2])
        assert time.monotonic() - t0 >= 0.6  # it did wait for the population
        assert np.array_equal(dst[[1, 2]], src[[0, 3]])


async def test_a_push_cancelled_while_its_frame_is_gathered_returns_after_the_gather(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A frame of a stream over many ranges is gathered from the source in a worker thread.
    A cancel returns once that worker stopped reading the source (which may be freed right
    after); before, it returned while the worker still read it."""
    from llmdd_async._net.streams import ManyRangesStream

    blocks, block = 16384, 4096  # every other block: 8,192 ranges, 32 MiB (not eager)
    async with pair("tcp", ra=True) as (p, d):
        await p.request(
            "register",
            kind="blocks",
            num_tensors=1,
            shape=[blocks, block],
            blocks_key=encode_key(dd.BlocksCacheKey(PROMPT, 0)),
        )
        cm = d.cache_manager
        src = cm.allocate_blocks_cache(dd.CacheDesc(1, [blocks, block], dd.DataType.DT_UINT8))
        real = ManyRangesStream._move
        entered, release = threading.Event(), threading.Event()
        reading = [False]

        def move(self: Any, buf: Any, offset: int, n: int, gather: bool) -> None:
            if not gather:
                return real(self, buf, offset, n, gather)
            reading[0] = True
            entered.set()
            release.wait(10)
            try:
                return real(self, buf, offset, n, gather)
            finally:
                reading[0] = False

        monkeypatch.setattr(ManyRangesStream, "_move", move)
        every_other = list(range(0, blocks, 2))
        task = cm.push_blocks(dd.BlocksCacheKey(PROMPT, 0), src, every_other, every_other)
        try:
            await wait_until(entered.is_set, 10)
            threading.Timer(0.3, release.set).start()
            task.cancel()
            with anyio.fail_after(10), pytest.raises(dd.TransferCancelled):
                await task
            assert not reading[0], "the cancel returned while a worker still read the source"
        finally:
            release.set()
