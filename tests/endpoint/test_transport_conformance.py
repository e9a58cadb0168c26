"""What every transport must do (trio's ``check_two_way_stream`` idea): one suite, run over
each of them — tcp, same-host, in-process and NIXL.

Each case links a *near* endpoint (this process, the decoder: it makes the API calls) to a
*far* one (the prompt): a child process for tcp, same-host and NIXL, a second endpoint of this
process for in-process. The cases:

* pulls and pushes of shuffled blocks land byte-exact (both in request/response and in
  remote-accessible mode);
* a cancelled pull is fenced: once the cancel returns, no late byte lands (the destination is
  overwritten and checked after the link has served another request);
* a pull that cannot finish within ``llm.SyncKvCacheWaitTime`` fails with LLM_TIMEOUT within
  that bound, and the link stays up;
* a far end that dies mid-transfer fails it with LLM_LINK_FAILED, promptly (same-host and
  in-process copy by themselves once granted, from memory the far end's death leaves in
  place: there the far end dies before it could grant);
* a grant naming memory outside what the request selected is refused before a byte lands.

NIXL is skipped where it is not installed, except under ``CI=true``, where it must run.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import endpoint_options, link, mooncake_params, nixl_params

import llmdd_async as dd
from llmdd_async._net import grant_checks
from llmdd_async.testing import PeerProcess, encode_key, link_of, pattern, wait_until

pytestmark = pytest.mark.anyio

S = dd.LLMStatusCode
FAR, NEAR = 1, 2
BLOCKS, BLOCK = 32, 4096
#: ``llm.Transport`` of each case's endpoints, and the transport the link must end up with.
CONFORMANCE = {
    "tcp": ("tcp", "tcp"),
    "same-host": ("same-host", "same-host"),
    "in-process": ("auto", "in-process"),
    "nixl": ("nixl", "nixl"),
    "mooncake": ("mooncake", "mooncake"),
}


class Far:
    """The far end of the link under test, whatever the transport."""

    async def blocks(self, seed: int | None, blocks: int = BLOCKS, tensors: int = 2) -> int:
        """Register a blocks cache of ``tensors`` x ``blocks`` x ``BLOCK`` bytes under
        ``BlocksCacheKey(FAR, 0)``, tensor ``t`` filled with ``pattern(seed + t)``."""
        raise NotImplementedError

    async def read(self, cache_id: int, tensor: int) -> np.ndarray:
        """The bytes of tensor ``tensor`` of cache ``cache_id``, as ``(blocks, BLOCK)``."""
        raise NotImplementedError

    def die(self) -> None:
        """The far end goes away without a word."""
        raise NotImplementedError


class FarProcess(Far):
    """A far endpoint in a child process (its death: SIGKILL)."""

    def __init__(self, peer: PeerProcess) -> None:
        self.peer = peer

    async def blocks(self, seed: int | None, blocks: int = BLOCKS, tensors: int = 2) -> int:
        cache_id: int = await self.peer.request(
            "register",
            kind="blocks",
            num_tensors=tensors,
            shape=[blocks, BLOCK],
            blocks_key=encode_key(dd.BlocksCacheKey(FAR, 0)),
            seed=seed,
        )
        return cache_id

    async def read(self, cache_id: int, tensor: int) -> np.ndarray:
        raw = base64.b64decode(await self.peer.request("read", cache_id=cache_id, tensor=tensor))
        return np.frombuffer(raw, np.uint8).reshape(-1, BLOCK)

    def die(self) -> None:
        self.peer.kill()


class FarLocal(Far):
    """A far endpoint in this process (in-process transport). It cannot die apart from this
    process: its death is its side of the link hanging up."""

    def __init__(self, far: dd.LLMDataDist) -> None:
        self.far = far
        self.arrays: dict[int, list[np.ndarray]] = {}

    async def blocks(self, seed: int | None, blocks: int = BLOCKS, tensors: int = 2) -> int:
        arrays = [np.zeros((blocks, BLOCK), np.uint8) for _ in range(tensors)]
        if seed is not None:
            for t, a in enumerate(arrays):
                a.reshape(-1)[:] = pattern(seed + t, a.size)
        desc = dd.CacheDesc(tensors, [blocks, BLOCK], dd.DataType.DT_UINT8)
        cache = self.far.cache_manager.register_blocks_cache(
            desc, arrays, dd.BlocksCacheKey(FAR, 0)
        )
        self.arrays[cache.cache_id] = arrays
        return cache.cache_id

    async def read(self, cache_id: int, tensor: int) -> np.ndarray:
        return self.arrays[cache_id][tensor].copy()

    def die(self) -> None:
        import socket

        link_of(self.far, NEAR).sock.shutdown(socket.SHUT_RDWR)


#: Transports whose granted copy runs on this side alone, from memory that outlives the far end.
COPIES_ALONE = ("same-host", "in-process")
#: one-sided engines: a request's last bytes can be on their way before a death is seen
ONE_SIDED = ("nixl", "mooncake")


@pytest.fixture(params=["tcp", "same-host", "in-process", *nixl_params()[:1], *mooncake_params()])
def conformance(request: pytest.FixtureRequest) -> str:
    """The transport under test."""
    return str(request.param)


@contextlib.asynccontextmanager
async def linked(
    name: str, *, ra: bool = False, **extra: str
) -> AsyncIterator[tuple[Far, dd.LLMDataDist]]:
    """``(far, near)`` linked over transport ``name``; asserts the link uses it."""
    option, expect = CONFORMANCE[name]
    far_opts = endpoint_options(option, listen=True, ra=ra)
    near_opts = endpoint_options(option, ra=ra, **extra)
    async with contextlib.AsyncExitStack() as stack:
        if name == "in-process":
            far_dd = await stack.enter_async_context(
                dd.LLMDataDist(dd.LLMRole.PROMPT, FAR).running(far_opts)
            )
            far: Far = FarLocal(far_dd)
            address = far_dd.listen_address
        else:
            peer = await stack.enter_async_context(
                PeerProcess.start(dd.LLMRole.PROMPT, FAR, far_opts)
            )
            far, address = FarProcess(peer), peer.listen
        assert address is not None
        near = await stack.enter_async_context(
            dd.LLMDataDist(dd.LLMRole.DECODER, NEAR).running(near_opts)
        )
        await link(near, FAR, address)
        assert near.link_statistics(FAR).transport == expect
        yield far, near


def local_blocks(near: dd.LLMDataDist, seed: int | None, blocks: int = BLOCKS) -> list[np.ndarray]:
    """Two ``(blocks, BLOCK)`` arrays, filled with ``pattern(seed + t)`` (zeros for None)."""
    arrays = [np.zeros((blocks, BLOCK), np.uint8) for _ in range(2)]
    if seed is not None:
        for t, a in enumerate(arrays):
            a.reshape(-1)[:] = pattern(seed + t, a.size)
    return arrays


def register(near: dd.LLMDataDist, arrays: list[np.ndarray]) -> dd.Cache:
    blocks = arrays[0].shape[0]
    desc = dd.CacheDesc(len(arrays), [blocks, BLOCK], dd.DataType.DT_UINT8)
    return near.cache_manager.register_blocks_cache(desc, arrays)


def expected(seed: int, tensor: int, blocks: int = BLOCKS) -> np.ndarray:
    return pattern(seed + tensor, blocks * BLOCK).reshape(blocks, BLOCK)


# ---------------------------------------------------------------------------- byte-exact
@pytest.mark.parametrize("ra", [False, True], ids=["request", "remote-accessible"])
async def test_shuffled_pulls_and_pushes_are_byte_exact(conformance: str, ra: bool) -> None:
    async with linked(conformance, ra=ra) as (far, near):
        theirs = await far.blocks(seed=40)
        dst = local_blocks(near, None)
        cache = register(near, dst)
        rng = np.random.default_rng(4)
        src_blocks = rng.permutation(BLOCKS)[:20].tolist()
        dst_blocks = rng.permutation(BLOCKS)[:20].tolist()
        key = dd.BlocksCacheKey(FAR, 0)
        await near.cache_manager.pull_blocks(key, cache, src_blocks, dst_blocks)
        for t in range(2):
            want = np.zeros((BLOCKS, BLOCK), np.uint8)
            want[dst_blocks] = expected(40, t)[src_blocks]
            assert np.array_equal(dst[t], want), t
        if not ra:
            return  # pushes are for remote-accessible mode
        src = local_blocks(near, 50)
        mine = register(near, src)
        push_src = rng.permutation(BLOCKS)[:12].tolist()
        push_dst = rng.permutation(BLOCKS)[:12].tolist()
        await near.cache_manager.push_blocks(key, mine, push_src, push_dst)
        for t in range(2):
            want = expected(40, t).copy()
            want[push_dst] = src[t][push_src]
            got = await far.read(theirs, t)
            assert np.array_equal(got, want), t


# ---------------------------------------------------------------------------- cancel fence
async def test_a_cancelled_pull_writes_nothing_after_the_cancel_returns(conformance: str) -> None:
    big = 8 * BLOCKS  # 1 MiB a tensor
    async with linked(conformance) as (far, near):
        await far.blocks(seed=60, blocks=big)
        dst = local_blocks(near, None, big)
        cache = register(near, dst)
        probe = register(near, local_blocks(near, None, 1))
        key = dd.BlocksCacheKey(FAR, 0)
        for turns in (0, 1, 10):  # cancelled at different points of the transfer
            task = near.cache_manager.pull_blocks(key, cache, list(range(big)), list(range(big)))
            for _ in range(turns):
                await anyio.lowlevel.checkpoint()
            task.cancel()
            with contextlib.suppress(dd.TransferCancelled):
                await task  # (it may have finished before the cancel)
            for a in dst:  # whatever landed so far: overwritten...
                a[...] = 0xEE
            # ...and still so once the link served another request after the cancelled one.
            await near.cache_manager.pull_blocks(key, probe, [0], [0])
            assert all((a == 0xEE).all() for a in dst), "a byte landed after the cancel"
        # The link still works, and a fresh pull gets every byte.
        await near.cache_manager.pull_blocks(key, cache, list(range(big)), list(range(big)))
        for t in range(2):
            assert np.array_equal(dst[t], expected(60, t, big)), t


# ---------------------------------------------------------------------------- deadline
async def test_a_pull_past_its_deadline_times_out_within_the_bound(conformance: str) -> None:
    huge = 16 * 1024  # 64 MiB a tensor: no transport moves 128 MiB in 5 ms
    deadline_ms = 5
    async with linked(conformance, **{"llm.SyncKvCacheWaitTime": str(deadline_ms)}) as (
        far,
        near,
    ):
        await far.blocks(seed=None, blocks=huge)
        dst = local_blocks(near, None, huge)
        cache = register(near, dst)
        task = near.cache_manager.pull_blocks(
            dd.BlocksCacheKey(FAR, 0), cache, list(range(huge)), list(range(huge))
        )
        t0 = anyio.current_time()
        with anyio.fail_after(deadline_ms / 1000 + 5), pytest.raises(dd.LLMException) as err:
            await task
        assert err.value.status_code == S.LLM_TIMEOUT, err.value
        assert "llm.SyncKvCacheWaitTime" in str(err.value)  # names the option to raise
        assert anyio.current_time() - t0 < deadline_ms / 1000 + 5
        assert link_of(near, FAR).alive  # a timeout is the request's, not the link's


# ---------------------------------------------------------------------------- peer death
async def test_the_far_end_dying_mid_transfer_fails_it_promptly(conformance: str) -> None:
    big = 256 * BLOCKS  # 32 MiB a tensor
    # A deadline well past the 5 s allowed: the death, not the clock, must end the transfer.
    async with linked(conformance, **{"llm.SyncKvCacheWaitTime": "30000"}) as (far, near):
        await far.blocks(seed=None, blocks=big)
        dst = local_blocks(near, None, big)
        cache = register(near, dst)
        lnk = link_of(near, FAR)
        for _ in range(8):
            task = near.cache_manager.pull_blocks(
                dd.BlocksCacheKey(FAR, 0), cache, list(range(big)), list(range(big))
            )
            if conformance not in COPIES_ALONE:
                # Under way: bytes moved (or, one-sided, a moment to start).
                with anyio.move_on_after(0.05):
                    await wait_until(lambda t=task: lnk.bytes_moved > 0 or t.done(), 0.05, 0.0005)
            if not task.done():
                break
            await task  # a fast transport finished before the death: legal; again
        far.die()
        with anyio.fail_after(5):
            try:
                await task
            except dd.LLMException as err:
                assert err.status_code == S.LLM_LINK_FAILED, err
            else:
                # Its last bytes were already on their way (a fast one-sided engine): legal,
                # as long as the death is still noticed at once (below).
                assert conformance in ONE_SIDED, "finished after the far end died"
        await wait_until(lambda: not lnk.alive, 5)
        with pytest.raises(dd.LLMException) as again:
            await near.cache_manager.pull_blocks(dd.BlocksCacheKey(FAR, 0), cache, [0], [0])
        assert again.value.status_code == S.LLM_LINK_FAILED  # the link is down, and says why


# ---------------------------------------------------------------------------- hostile grant
async def test_a_grant_outside_the_request_is_refused(
    conformance: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The far end's grant is shifted past the destination blocks the request selected (what
    a hostile or broken peer would send); the initiator's check refuses it and nothing
    lands."""
    checked: list[bool] = []
    real = grant_checks.grant_within_selection

    def hostile(spec: Any, local: np.ndarray, nbytes: np.ndarray) -> bool:
        ok = real(spec, local + np.uint64(4 * BLOCK), nbytes)
        checked.append(ok)
        return ok

    async with linked(conformance) as (far, near):
        await far.blocks(seed=70)
        dst = local_blocks(near, None)
        cache = register(near, dst)
        monkeypatch.setattr(grant_checks, "grant_within_selection", hostile)
        with anyio.fail_after(10), pytest.raises(dd.LLMException) as err:
            await near.cache_manager.pull_blocks(
                dd.BlocksCacheKey(FAR, 0), cache, [0, 1], [BLOCKS - 2, BLOCKS - 1]
            )
        assert checked == [False]  # the check saw the grant and refused it
        assert err.value.status_code == S.LLM_LINK_FAILED, err.value
        assert "GRANT points outside" in str(err.value), err.value
        assert not any(a.any() for a in dst)  # not a byte landed
