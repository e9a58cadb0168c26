"""A pull of a cache the initiator may not reach (not remote accessible) on the same host: the
target copies it straight into the initiator's destination (``Mode.WRITTEN``), one copy and no
stream, where the initiator offered it; a cancel waits until the target stopped writing; a
peer that writes unasked breaks the link."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import anyio
import numpy as np
import pytest
from helpers import endpoint_options, link, raw_link

import llmdd_async as dd
from llmdd_async._messages import Grant, Mode
from llmdd_async._protocol import MT
from llmdd_async.testing import PeerProcess, encode_key, pattern

pytestmark = pytest.mark.anyio

S = dd.LLMStatusCode
PROMPT, DECODER = 1, 2
KEY = dd.BlocksCacheKey(PROMPT, 0)


@contextlib.asynccontextmanager
async def pair(
    transport: str, blocks: int, block: int, **extra: str
) -> AsyncIterator[tuple[PeerProcess, dd.LLMDataDist]]:
    """A prompt process holding a host cache (not remote accessible) of ``blocks`` blocks
    filled with ``pattern(9, ...)``, and a local decoder linked to it (default mode)."""
    async with PeerProcess.start(
        dd.LLMRole.PROMPT, PROMPT, endpoint_options(transport, listen=True, **extra)
    ) as p:
        await p.request(
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
            yield p, d


@pytest.mark.parametrize(("transport", "mode"), [("same-host", "written"), ("tcp", "stream")])
async def test_a_pull_of_a_private_cache_is_written_by_the_target_on_the_same_host(
    transport: str, mode: str
) -> None:
    blocks, block = 64, 1 << 16
    async with pair(transport, blocks, block) as (_, d):
        dst = np.zeros((blocks, block), np.uint8)
        cache = d.cache_manager.register_blocks_cache(
            dd.CacheDesc(1, [blocks, block], dd.DataType.DT_UINT8), [dst]
        )
        order = [int(b) for b in np.random.default_rng(4).permutation(blocks)]
        src = list(range(blocks))
        for chosen in (src, src[:1]):  # bulk, and one block
            dst[:] = 0
            await d.cache_manager.pull_blocks(KEY, cache, chosen, order[: len(chosen)])
            want = pattern(9, blocks * block).reshape(blocks, block)
            assert np.array_equal(dst[order[: len(chosen)]], want[chosen])
            assert not dst[order[len(chosen) :]].any()
            assert d.link_statistics(PROMPT).recent[-1].mode == mode


async def test_a_cancelled_written_pull_lands_nothing_after_the_cancel_returns() -> None:
    blocks, block = 1024, 1 << 18  # 256 MiB: the target's copy takes tens of ms
    async with pair("same-host", blocks, block, **{"llm.SyncKvCacheWaitTime": "30000"}) as (
        _,
        d,
    ):
        dst = np.zeros((blocks, block), np.uint8)
        cache = d.cache_manager.register_blocks_cache(
            dd.CacheDesc(1, [blocks, block], dd.DataType.DT_UINT8), [dst]
        )
        src = list(range(blocks))
        await d.cache_manager.pull_blocks(KEY, cache, src, src)  # it is written, and warm
        assert d.link_statistics(PROMPT).recent[-1].mode == "written"
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
        # the link is fine, and so is the next pull
        await d.cache_manager.pull_blocks(KEY, cache, src[:4], src[:4])
        assert np.array_equal(dst[:4], pattern(9, 4 * block).reshape(4, block))


async def test_a_peer_that_writes_unasked_breaks_the_link() -> None:
    """Over TCP nothing is offered: a WRITTEN grant there claims a copy into our memory that
    we never allowed (or bytes that never came)."""
    async with dd.LLMDataDist(dd.LLMRole.DECODER, DECODER).running(
        endpoint_options("tcp", listen=True)
    ) as d:
        assert d.listen_address is not None
        peer = await raw_link(d.listen_address, PROMPT)
        try:
            dst = np.zeros((4, 4096), np.uint8)
            cache = d.cache_manager.register_blocks_cache(
                dd.CacheDesc(1, [4, 4096], dd.DataType.DT_UINT8), [dst]
            )
            task = d.cache_manager.pull_blocks(KEY, cache, [0], [1])
            req = await peer.recv(MT.XFER_REQ)
            assert "target_writes" not in (req.fields.get("caps") or {})
            base = cache.tensor_addrs[0] + 4096
            grant = Grant(
                req.req_id,
                mode=Mode.WRITTEN,
                total=4096,
                done=False,
                local=np.array([base], np.uint64),
                nbytes=np.array([4096], np.uint64),
            )
            t0 = time.monotonic()
            await peer.send(grant.encode())
            with pytest.raises(dd.LLMException) as err:
                await task
            assert err.value.status_code == S.LLM_LINK_FAILED
            assert "unasked" in str(err.value)
            assert time.monotonic() - t0 < 5  # at once, not at its deadline
            assert not dst.any()
        finally:
            peer.close()
