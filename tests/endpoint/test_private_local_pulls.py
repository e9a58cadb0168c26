"""A same-host pull by key of a cache that is not remote accessible: the initiator copies the
ranges the key grants itself (a local grant) where the kernel proved the peer to be of its own
user, instead of the stream; by id such a cache stays out of reach, a key is consumed only
by a pull that succeeded, and a cancel lands nothing after it returns."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import numpy as np
import pytest
from helpers import endpoint_options, expected_tensor, link

import llmdd_async as dd
from llmdd_async.testing import PeerProcess, encode_key, pattern

pytestmark = pytest.mark.anyio

S = dd.LLMStatusCode
PROMPT, DECODER = 1, 2
KEY = dd.BlocksCacheKey(PROMPT, 0)


@contextlib.asynccontextmanager
async def pair(
    transport: str, blocks: int, block: int, **extra: str
) -> AsyncIterator[tuple[PeerProcess, dd.LLMDataDist, int]]:
    """A prompt process holding a registered host cache (not remote accessible) of
    ``blocks`` blocks filled with ``pattern(9, ...)``, and a local decoder linked to it
    (default mode); also the cache's id."""
    async with PeerProcess.start(
        dd.LLMRole.PROMPT, PROMPT, endpoint_options(transport, listen=True, **extra)
    ) as p:
        cid = await p.request(
            "register",
            kind="blocks",
            num_tensors=1,
            shape=[blocks, block],
            blocks_key=encode_key(KEY),
            seed=9,
            remote_accessible=False,
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, DECODER).running(
            endpoint_options(transport, **extra)
        ) as d:
            assert p.listen is not None
            await link(d, PROMPT, p.listen)
            yield p, d, int(cid)


@contextlib.asynccontextmanager
async def keyed_pair(
    shape: tuple[int, int], req_ids: list[int], seed: int
) -> AsyncIterator[dd.LLMDataDist]:
    """A prompt process holding an allocated host cache (not remote accessible) of
    ``shape`` x 2 tensors, its slots keyed ``CacheKey(PROMPT, r)``, filled from ``seed``; and
    a local decoder linked to it over ``same-host`` (default mode)."""
    async with PeerProcess.start(
        dd.LLMRole.PROMPT, PROMPT, endpoint_options("same-host", listen=True)
    ) as p:
        await p.request(
            "alloc",
            kind="cache",
            num_tensors=2,
            shape=list(shape),
            placement="HOST",  # not remote accessible
            keys=[encode_key(dd.CacheKey(PROMPT, r)) for r in req_ids],
            seed=seed,
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, DECODER).running(
            endpoint_options("same-host")
        ) as d:
            assert p.listen is not None
            await link(d, PROMPT, p.listen)
            yield d


def _blocks_cache(d: dd.LLMDataDist, blocks: int, block: int) -> tuple[dd.Cache, np.ndarray]:
    dst = np.zeros((blocks, block), np.uint8)
    desc = dd.CacheDesc(1, [blocks, block], dd.DataType.DT_UINT8)
    return d.cache_manager.register_blocks_cache(desc, [dst]), dst


@pytest.mark.parametrize(("transport", "mode"), [("same-host", "local"), ("tcp", "stream")])
async def test_a_pull_by_key_of_a_private_cache_is_copied_by_the_initiator_on_the_same_host(
    transport: str, mode: str
) -> None:
    blocks, block = 64, 1 << 16
    async with pair(transport, blocks, block) as (_, d, cid):
        cache, dst = _blocks_cache(d, blocks, block)
        order = [int(b) for b in np.random.default_rng(4).permutation(blocks)]
        src = list(range(blocks))
        want = pattern(9, blocks * block).reshape(blocks, block)
        for chosen in (src, src[:1]):  # bulk, and one block
            dst[:] = 0
            await d.cache_manager.pull_blocks(KEY, cache, chosen, order[: len(chosen)])
            assert np.array_equal(dst[order[: len(chosen)]], want[chosen])
            assert not dst[order[len(chosen) :]].any()
            assert d.link_statistics(PROMPT).recent[-1].mode == mode
        # By id the cache stays out of reach (only a key grants it).
        with pytest.raises(dd.LLMException) as err:
            await d.cache_manager.pull_blocks(
                dd.CacheKeyByIdAndIndex(PROMPT, cid, 0), cache, (), [0]
            )
        assert err.value.status_code == S.LLM_PARAM_INVALID
        assert "not remote accessible" in str(err.value)


async def test_a_request_key_is_consumed_only_by_a_local_pull_that_succeeded() -> None:
    shape = (2, 4096)
    async with keyed_pair(shape, [7, 8], seed=40) as d:
        cm = d.cache_manager
        dst = cm.allocate_cache(dd.CacheDesc(2, list(shape), dd.DataType.DT_UINT8))
        # A pull that fails on our side (a size past the slot) leaves the key pullable.
        with pytest.raises(dd.LLMException):
            await cm.pull_cache(dd.CacheKey(PROMPT, 8), dst, batch_index=1, size=1 << 20)
        await cm.pull_cache(dd.CacheKey(PROMPT, 8), dst, batch_index=1)
        assert d.link_statistics(PROMPT).recent[-1].mode == "local"
        for t in range(2):
            assert np.array_equal(dst.tensors[t][1], expected_tensor(40, t, shape)[1])
        with pytest.raises(dd.LLMException) as err:
            await cm.pull_cache(dd.CacheKey(PROMPT, 8), dst, batch_index=0)
        assert err.value.status_code == S.LLM_KV_CACHE_NOT_EXIST


async def test_a_cancelled_local_pull_lands_nothing_after_the_cancel_returns() -> None:
    blocks, block = 1024, 1 << 18  # 256 MiB: the copy takes tens of ms
    async with pair("same-host", blocks, block, **{"llm.SyncKvCacheWaitTime": "30000"}) as (
        _,
        d,
        _cid,
    ):
        cache, dst = _blocks_cache(d, blocks, block)
        src = list(range(blocks))
        await d.cache_manager.pull_blocks(KEY, cache, src, src)  # local, and warm
        assert d.link_statistics(PROMPT).recent[-1].mode == "local"
        for delay in (0.0, 0.002, 0.005, 0.01, 0.02):
            dst[:] = 0
            task = d.cache_manager.pull_blocks(KEY, cache, src, src)
            await anyio.sleep(delay)
            task.cancel()
            with contextlib.suppress(dd.TransferCancelled):
                await task
            landed = dst.copy()
            await anyio.sleep(0.1)  # a copy the cancel did not wait for would go on here
            assert np.array_equal(dst, landed), f"bytes landed after the cancel ({delay} s)"
        await d.cache_manager.pull_blocks(KEY, cache, src[:4], src[:4])
        assert np.array_equal(dst[:4], pattern(9, 4 * block).reshape(4, block))


async def test_an_initiator_that_does_not_take_such_grants_gets_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An initiator of an earlier release claims ``pvr`` but not ``key_reads``: it would
    refuse a local grant of memory the peer does not publish (and break the link), so it
    gets the stream."""
    from llmdd_async._net import exchange

    real_caps = exchange.Cap

    class OldCaps:  # what an earlier release's initiator knew
        PVR, INPROC = real_caps.PVR, real_caps.INPROC
        KEY_READS = "not_sent"

    blocks, block = 8, 4096
    async with pair("same-host", blocks, block) as (_, d, _cid):
        cache, dst = _blocks_cache(d, blocks, block)
        monkeypatch.setattr(exchange, "Cap", OldCaps)
        await d.cache_manager.pull_blocks(KEY, cache, [1, 2], [3, 4])
        assert d.link_statistics(PROMPT).recent[-1].mode == "stream"
        monkeypatch.undo()
        await d.cache_manager.pull_blocks(KEY, cache, [5], [6])
        assert d.link_statistics(PROMPT).recent[-1].mode == "local"
        want = pattern(9, blocks * block).reshape(blocks, block)
        assert np.array_equal(dst[[3, 4, 6]], want[[1, 2, 5]])


async def test_a_failed_copy_of_what_a_key_grants_falls_back_to_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Memory ``process_vm_readv`` cannot reach (a mapping the kernel cannot pin) fails the
    copy: the request is aborted there, unconsumed, and streamed instead."""
    from llmdd_async._transports.same_host import SameHostAccess

    shape = (2, 4096)
    failures: list[int] = []
    real_read = SameHostAccess.read

    real_copy_now = SameHostAccess.copy_now

    async def read_fails_once(self: SameHostAccess, *args: object) -> int:
        if not failures:
            failures.append(1)
            raise OSError(14, "process_vm_readv: Bad address")
        return await real_read(self, *args)  # type: ignore[arg-type]

    def copy_now_fails_once(self: SameHostAccess, *args: object) -> int | None:
        # (a small copy runs on the loop, through copy_now; a big one through read)
        if not failures:
            failures.append(1)
            raise OSError(14, "process_vm_readv: Bad address")
        return real_copy_now(self, *args)  # type: ignore[arg-type]

    async with keyed_pair(shape, [7], seed=41) as d:
        monkeypatch.setattr(SameHostAccess, "read", read_fails_once)
        monkeypatch.setattr(SameHostAccess, "copy_now", copy_now_fails_once)
        cm = d.cache_manager
        dst = cm.allocate_cache(dd.CacheDesc(2, list(shape), dd.DataType.DT_UINT8))
        await cm.pull_cache(dd.CacheKey(PROMPT, 7), dst)
        assert failures == [1]
        assert d.link_statistics(PROMPT).recent[-1].mode == "stream"
        for t in range(2):
            assert np.array_equal(dst.tensors[t][0], expected_tensor(41, t, shape)[0])
        with pytest.raises(dd.LLMException) as err:  # consumed once, by the stream
            await cm.pull_cache(dd.CacheKey(PROMPT, 7), dst)
        assert err.value.status_code == S.LLM_KV_CACHE_NOT_EXIST


async def test_a_tcp_peer_that_claims_it_reads_our_memory_gets_the_stream() -> None:
    """Over TCP (nothing proven) the caps a peer claims count for nothing: it never gets a
    local grant, nor the addresses it would name."""
    from helpers import raw_link

    from llmdd_async._messages import Address, By, Cap, Grant, Mode, Op, Request, Shape
    from llmdd_async._protocol import MT

    async with dd.LLMDataDist(dd.LLMRole.PROMPT, PROMPT).running(
        endpoint_options("tcp", listen=True)
    ) as p:
        src = np.full((4, 4096), 5, np.uint8)
        p.cache_manager.register_blocks_cache(
            dd.CacheDesc(1, [4, 4096], dd.DataType.DT_UINT8), [src], KEY, remote_accessible=False
        )
        assert p.listen_address is not None
        peer = await raw_link(p.listen_address, DECODER)
        try:
            request = Request(
                1,
                Op.PULL,
                Address(By.BLOCKS_KEY, model_id=0),
                Shape.BLOCKS,
                (4 * 4096, 4, True),
                np.array([1 << 30], np.uint64),
                caps=frozenset({Cap.PVR, Cap.INPROC, Cap.POOLS, Cap.KEY_READS}),
                src_blocks=np.array([1], np.uint64),
                dst_blocks=np.array([2], np.uint64),
            )
            await peer.send(request.encode())
            grant = Grant.decode(await peer.recv(MT.GRANT))
            assert grant.ok and grant.mode is Mode.STREAM and grant.remote is None
        finally:
            peer.close()
