"""Many requests in flight on one link: pulls and pushes side by side stay byte-exact."""

from __future__ import annotations

import base64

import anyio
import numpy as np
import pytest
from helpers import cluster, endpoint_options, expected_tensor, link

import llmdd_async as dd
from llmdd_async.testing import PeerProcess, encode_key

pytestmark = pytest.mark.anyio

SHAPE = (128, 4096)


@pytest.mark.parametrize("transport", ["tcp", "same-host"])
async def test_64_concurrent_mixed_pulls_and_pushes_are_byte_exact(transport: str) -> None:
    opts = endpoint_options(transport, listen=True, ra=True)
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, opts) as p:
        theirs = await p.request(
            "alloc",
            kind="blocks",
            num_tensors=2,
            shape=list(SHAPE),
            blocks_key=encode_key(dd.BlocksCacheKey(1, 0)),
            seed=11,
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            endpoint_options(transport, ra=True)
        ) as d:
            await link(d, 1, p.listen)
            cm = d.cache_manager
            mine = cm.allocate_blocks_cache(dd.CacheDesc(2, list(SHAPE), dd.DataType.DT_UINT8))
            rng = np.random.default_rng(5)
            for t in range(2):
                mine.tensors[t][64:] = rng.integers(0, 256, (64, SHAPE[1]), dtype=np.uint8)
            order = rng.permutation(64).tolist()

            async def pull(b: int) -> None:  # their block b -> our block b
                await cm.pull_blocks(dd.BlocksCacheKey(1, 0), mine, [b], [b])

            async def push(b: int) -> None:  # our block 64 + b -> their block 64 + b
                await cm.push_blocks(dd.BlocksCacheKey(1, 0), mine, [64 + b], [64 + b])

            async with anyio.create_task_group() as tg:
                for i, b in enumerate(order):
                    tg.start_soon(pull if i % 2 else push, b)
            pulled = [b for i, b in enumerate(order) if i % 2]
            pushed = [b for i, b in enumerate(order) if not i % 2]
            for t in range(2):
                want = expected_tensor(11, t, SHAPE)
                assert np.array_equal(mine.tensors[t][pulled], want[pulled])
                got = np.frombuffer(
                    base64.b64decode(await p.request("read", cache_id=theirs, tensor=t)),
                    np.uint8,
                ).reshape(SHAPE)
                assert np.array_equal(
                    got[[64 + b for b in pushed]], mine.tensors[t][[64 + b for b in pushed]]
                )
                untouched = [64 + b for b in pulled]  # never pushed: still the peer's pattern
                assert np.array_equal(got[untouched], want[untouched])


BIG = (32, 2 << 20)  # 32 blocks of 2 MiB: copies long enough to be cut short (and more than
# a one-sided pull copies within the API call, done when the call returns)


@pytest.mark.parametrize("ra", [False, True], ids=["grant", "remote-accessible"])
@pytest.mark.parametrize("transport", ["tcp", "same-host"])
async def test_cancelling_many_requests_in_flight_fences_each_one(transport: str, ra: bool) -> None:
    """32 one-block pulls in flight on one link; every other one is cancelled mid-way. A
    cancelled pull writes nothing once its cancel has returned; the others land byte-exact;
    the link carries on. (Remote-accessible same-host pulls are one-sided: the initiator
    copies alone, so its own fence is all there is.)"""
    pool = {"llm.MemPoolConfig": '{"memory_size": 134217728}'}
    async with PeerProcess.start(
        dd.LLMRole.PROMPT, 1, endpoint_options(transport, listen=True, ra=ra, **pool)
    ) as p:
        await p.request(
            "alloc",
            kind="blocks",
            num_tensors=1,
            shape=list(BIG),
            blocks_key=encode_key(dd.BlocksCacheKey(1, 0)),
            seed=21,
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            endpoint_options(transport, ra=ra, **pool)
        ) as d:
            await link(d, 1, p.listen)
            cm = d.cache_manager
            dst = cm.allocate_blocks_cache(dd.CacheDesc(1, list(BIG), dd.DataType.DT_UINT8))
            dst.tensors[0][...] = 0xEE
            want = expected_tensor(21, 0, BIG)
            key = dd.BlocksCacheKey(1, 0)
            tasks = [cm.pull_blocks(key, dst, [b], [b]) for b in range(BIG[0])]
            await anyio.sleep(0.002)
            for b in range(1, BIG[0], 2):
                tasks[b].cancel()
            cancelled = []
            for b, task in enumerate(tasks):
                try:
                    await task
                except dd.TransferCancelled:
                    assert b % 2, f"block {b} was never cancelled"
                    cancelled.append(b)
                    continue
                assert np.array_equal(dst.tensors[0][b], want[b]), f"block {b} is wrong"
            assert cancelled, "every pull finished before its cancel: the test proved nothing"
            # Fenced: nothing lands in a cancelled pull's block any more, whatever is in flight.
            snapshot = dst.tensors[0][cancelled].copy()
            await anyio.sleep(0.2)
            assert np.array_equal(dst.tensors[0][cancelled], snapshot)
            # The link carries on: every block again, byte-exact.
            await cm.pull_blocks(key, dst, list(range(BIG[0])), list(range(BIG[0])))
            assert np.array_equal(dst.tensors[0], want)


async def test_force_unlink_during_one_sided_pulls_stops_them_before_unmapping() -> None:
    """Remote-accessible same-host pulls copy one-sidedly from the peer's mapped pool. A
    ``force`` unlink while 128 MiB pulls are in flight fails them with LLM_NOT_YET_LINK, and the
    link keeps its mappings until each copy stopped (before, the pool was unmapped under the
    copy and the process crashed)."""
    pool = {"llm.MemPoolConfig": '{"memory_size": 167772160}'}
    shape = [64, 1 << 20]
    async with PeerProcess.start(
        dd.LLMRole.PROMPT, 1, endpoint_options("same-host", listen=True, ra=True, **pool)
    ) as p:
        await p.request(
            "alloc",
            kind="blocks",
            num_tensors=2,
            shape=shape,
            blocks_key=encode_key(dd.BlocksCacheKey(1, 0)),
            seed=3,
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            endpoint_options("same-host", ra=True, **pool)
        ) as d:
            await link(d, 1, p.listen)
            cm = d.cache_manager
            dst = cm.allocate_blocks_cache(dd.CacheDesc(2, shape, dd.DataType.DT_UINT8))
            key, every = dd.BlocksCacheKey(1, 0), list(range(64))
            await cm.pull_blocks(key, dst, every, every)
            assert d.link_statistics(1).recent[-1].mode == "direct"
            interrupted = 0
            for i in range(6):
                task = cm.pull_blocks(key, dst, every, every)
                await anyio.sleep(0.002 + 0.001 * i)
                in_flight = not task.done()
                await d.unlink_clusters([cluster(1)], force=True)
                try:
                    await task
                except dd.LLMException as err:
                    assert err.status_code == dd.LLMStatusCode.LLM_NOT_YET_LINK, str(err)
                    interrupted += in_flight
                await link(d, 1, p.listen)
            assert interrupted, "no pull was in flight at the unlink: the test proved nothing"
            await cm.pull_blocks(key, dst, every, every)
            for t in range(2):
                assert np.array_equal(dst.tensors[t], expected_tensor(3, t, tuple(shape)))
