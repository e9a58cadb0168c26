"""NIXL as a transport: choosing it, registration, metadata, fallbacks, device memory.

The byte-exact pull / push / layer-wise / timeout / cancel / peer-death semantics run over NIXL
in ``test_remote_transfers.py`` and ``test_layerwise.py`` (their ``nixl`` and ``nixl-tcp``
parameters); these tests cover what only NIXL has. Two endpoints in one process each run an
agent and talk UCX over loopback (``conftest.py`` sets ``UCX_NET_DEVICES=lo``).
"""

from __future__ import annotations

import os
import threading

import anyio
import numpy as np
import pytest
from helpers import cluster, endpoint_options, expected_tensor, link, pool_json

import llmdd_async as dd
from llmdd_async._options import parse_options
from llmdd_async._transports import _nixl_agent as nixl_agent
from llmdd_async._transports import nixl as nixl_mod
from llmdd_async.testing import (
    DEFAULT_OPTIONS,
    PeerProcess,
    encode_key,
    engine_of,
    linked_pair,
    wait_until,
)

pytestmark = pytest.mark.anyio

S = dd.LLMStatusCode
NIXL = {**DEFAULT_OPTIONS, "llm.Transport": "nixl"}
DESC = dd.CacheDesc(2, [16, 1024], dd.DataType.DT_UINT8)

needs_nixl = pytest.mark.skipif(
    not nixl_mod.available() and os.environ.get("CI") != "true",
    reason=f"NIXL is not installed ({nixl_mod.INSTALL_HINT})",
)


def test_without_nixl_asking_for_it_names_the_install_line(monkeypatch) -> None:
    import llmdd_async._transports as transports

    monkeypatch.setattr(transports, "installed", lambda name: False)  # the registry's check
    with pytest.raises(dd.LLMException) as err:
        parse_options({"llm.EnableCacheManager": "1", "llm.Transport": "nixl"})
    assert err.value.status_code == S.LLM_PARAM_INVALID
    assert "pip install --no-deps nixl-cu12" in str(err.value)


def test_unknown_transports_are_still_refused() -> None:
    with pytest.raises(dd.LLMException) as err:
        parse_options({"llm.EnableCacheManager": "1", "llm.Transport": "rdma"})
    assert err.value.status_code == S.LLM_PARAM_INVALID


@needs_nixl
async def test_only_remote_accessible_caches_are_registered_and_published() -> None:
    async with linked_pair(NIXL) as (prompt, _decoder):
        engine = engine_of(prompt)
        ep = engine.transport_endpoint
        cm = prompt.cache_manager
        hidden_mem = [np.zeros((16, 1024), np.uint8) for _ in range(2)]
        shown_mem = [np.zeros((16, 1024), np.uint8) for _ in range(2)]
        hidden = cm.register_blocks_cache(DESC, hidden_mem, remote_accessible=False)
        shown = cm.register_blocks_cache(DESC, shown_mem, remote_accessible=True)
        pooled = cm.allocate_blocks_cache(DESC)  # DEVICE placement: remote accessible
        assert set(ep.caches) == {shown.cache_id, pooled.cache_id}
        table = ep.published_fields()["nixl"]  # what a peer on a NIXL link gets
        assert set(table["mem"]) == {str(shown.cache_id), str(pooled.cache_id)}
        assert table["mem"][str(shown.cache_id)] == ["DRAM", 0]
        gen = table["gen"]
        cm.unregister_cache(shown.cache_id)
        cm.deallocate_blocks_cache(pooled)
        assert ep.caches == {}
        assert ep.published_fields()["nixl"]["gen"] > gen
        cm.unregister_cache(hidden.cache_id)


@needs_nixl
async def test_link_statistics_name_nixl_and_a_cache_outside_nixl_moves_over_the_stream() -> None:
    # Request/response mode: a cache that is not remote accessible may receive a pull.
    async with linked_pair({**NIXL, "llm.EnableRemoteCacheAccessible": "0"}) as (prompt, decoder):
        assert decoder.link_statistics(1).transport == "nixl"
        src = prompt.cache_manager.allocate_blocks_cache(DESC, dd.BlocksCacheKey(1, 0))
        for i, t in enumerate(src.tensors):
            t[:] = np.arange(t.size, dtype=np.uint32).reshape(t.shape).astype(np.uint8) + i
        cm = decoder.cache_manager
        nixl_dst = cm.allocate_blocks_cache(DESC)
        await cm.pull_blocks(dd.BlocksCacheKey(1, 0), nixl_dst, [3, 4, 9], [0, 1, 2])
        assert decoder.link_statistics(1).recent[-1].mode == "local"
        mem = [np.zeros((16, 1024), np.uint8) for _ in range(2)]
        plain = cm.register_blocks_cache(DESC, mem, remote_accessible=False)
        await cm.pull_blocks(dd.BlocksCacheKey(1, 0), plain, [9, 3], [5, 6])
        assert decoder.link_statistics(1).recent[-1].mode == "stream"
        for t in range(2):
            assert np.array_equal(nixl_dst.tensors[t][:3], src.tensors[t][[3, 4, 9]])
            assert np.array_equal(mem[t][5:7], src.tensors[t][[9, 3]])


@needs_nixl
@pytest.mark.parametrize("other", ["auto", "tcp"])
async def test_nixl_only_when_both_ends_ask_for_it(other: str) -> None:
    async with linked_pair(
        NIXL, decoder_options={"llm.Transport": other, "llm.EnableCacheManager": "1"}
    ) as (prompt, decoder):
        assert decoder.link_statistics(1).transport != "nixl"
        assert prompt.link_statistics(2).transport != "nixl"
        src = prompt.cache_manager.allocate_blocks_cache(DESC, dd.BlocksCacheKey(1, 0))
        src.tensors[1][7] = 42
        dst = decoder.cache_manager.allocate_blocks_cache(DESC)
        await decoder.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), dst, [7], [1])
        assert (dst.tensors[1][1] == 42).all()


@needs_nixl
async def test_metadata_travels_on_an_authenticated_link_and_new_caches_are_found() -> None:
    keyed = {**NIXL, "llm.AuthKey": "secret", "llm.EnableRemoteCacheAccessible": "1"}
    async with linked_pair(keyed) as (prompt, decoder):
        cm = decoder.cache_manager
        dst = cm.allocate_blocks_cache(DESC)
        # Registered after the link came up: found through a fresh table over the link.
        src = prompt.cache_manager.allocate_blocks_cache(DESC, dd.BlocksCacheKey(1, 0))
        src.tensors[0][2] = 9
        await cm.pull_blocks(dd.BlocksCacheKey(1, 0), dst, [2], [0])
        assert (dst.tensors[0][0] == 9).all()
        assert decoder.link_statistics(1).recent[-1].mode == "local"


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@needs_nixl
@pytest.mark.skipif(not _cuda(), reason="no CUDA device here: VRAM over NIXL is not tested")
@pytest.mark.parametrize("decoder_memory", ["cuda", "host"])
async def test_cuda_tensors_move_as_vram(decoder_memory: str) -> None:
    import torch

    torch_opts = {**NIXL, "llm.DeviceAdapter": "torch", "llm.TorchDevice": "cuda"}
    desc = dd.CacheDesc(2, [16, 1024], dd.DataType.DT_UINT8)
    src_t = [torch.randint(0, 255, (16, 1024), dtype=torch.uint8, device="cuda") for _ in range(2)]
    async with linked_pair(
        torch_opts,
        decoder_options={} if decoder_memory == "cuda" else {"llm.DeviceAdapter": "host"},
    ) as (prompt, decoder):
        prompt.cache_manager.register_blocks_cache(desc, src_t, dd.BlocksCacheKey(1, 0))
        assert next(iter(engine_of(prompt).transport_endpoint.caches.values())).mem == "VRAM"
        if decoder_memory == "cuda":
            dst_t = [torch.zeros((16, 1024), dtype=torch.uint8, device="cuda") for _ in range(2)]
            dst = decoder.cache_manager.register_blocks_cache(desc, dst_t)
        else:
            dst_t = [torch.zeros((16, 1024), dtype=torch.uint8) for _ in range(2)]
            dst = decoder.cache_manager.register_blocks_cache(desc, dst_t, remote_accessible=True)
        await decoder.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), dst, [4, 0], [1, 2])
        assert decoder.link_statistics(1).recent[-1].mode == "local"
        for s, d in zip(src_t, dst_t, strict=True):
            assert torch.equal(d[1:3].cpu(), s[[4, 0]].cpu())


# ------------------------------------------------------------------ pure helpers (no NIXL)
def _layout(addrs: list[int], tensor_bytes: int, count: int) -> nixl_agent.Layout:
    return nixl_agent.Layout(7, np.array(addrs, np.uint64), tensor_bytes, count, "DRAM", 0)


def test_unit_indices_match_a_per_unit_reference() -> None:
    lay = _layout([1 << 20, 1 << 16, 3 << 20], 8 * 256, 8)  # 3 tensors of 8 blocks, unordered
    rng = np.random.default_rng(0)
    for _ in range(200):
        t = rng.integers(3, size=4)
        first = rng.integers(8, size=4)
        k = np.minimum(rng.integers(1, 4, size=4), 8 - first)
        addrs = lay.addrs[t] + first.astype(np.uint64) * np.uint64(256)
        nbytes = k * 256
        want = np.concatenate([t[i] * 8 + first[i] + np.arange(k[i]) for i in range(4)])
        got = lay.indices(addrs, nbytes)
        assert got is not None and np.array_equal(got, want)
        one = nixl_agent.index1(lay, int(addrs[0]), int(nbytes[0]))
        assert one == t[0] * 8 + first[0]
    base = int(lay.addrs[0])
    for addr, n in [(base + 1, 256), (base, 255), (base + 7 * 256, 512), (base - 256, 256)]:
        assert lay.indices(np.array([addr], np.uint64), np.array([n])) is None
        assert nixl_agent.index1(lay, addr, n) is None


def test_cuts_and_merged_runs() -> None:
    n = np.array([5, 5, 20, 1, 1, 1], np.int64)
    cuts = nixl_agent.cuts(n, 10)
    assert cuts == [(0, 2), (2, 3), (3, 6)]
    runs = nixl_agent.merged_runs(np.array([300, 100, 200, 500], np.uint64), 100)
    assert runs.tolist() == [[100, 300], [500, 100]]
    assert nixl_agent.find1([100, 500], [400, 600], [1, 2], 350, 50) == 1
    assert nixl_agent.find1([100, 500], [400, 600], [1, 2], 350, 51) == -1


@needs_nixl
async def test_relinking_at_once_after_a_force_unlink_keeps_nixl_working() -> None:
    """A 128 MiB pull is in flight when this side force-unlinks and links again at once. The
    old link's NIXL state is dropped only once its pull stopped; that must not drop the peer's
    agent that the new link loaded meanwhile (before: every later pull failed with
    NIXL_ERR_NOT_FOUND)."""
    extra = {"llm.MemPoolConfig": pool_json(160 << 20)}
    shape = [64, 1 << 20]
    async with PeerProcess.start(
        dd.LLMRole.PROMPT, 1, endpoint_options("nixl", listen=True, **extra)
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
            endpoint_options("nixl", **extra)
        ) as d:
            await link(d, 1, p.listen)
            cm = d.cache_manager
            dst = cm.allocate_blocks_cache(dd.CacheDesc(2, shape, dd.DataType.DT_UINT8))
            key, every = dd.BlocksCacheKey(1, 0), list(range(64))
            await cm.pull_blocks(key, dst, every, every)
            task = cm.pull_blocks(key, dst, every, every)
            await anyio.sleep(0.003)
            await d.unlink_clusters([cluster(1)], force=True)
            try:
                await task
            except dd.LLMException as err:
                assert err.status_code == dd.LLMStatusCode.LLM_NOT_YET_LINK, str(err)
            await link(d, 1, p.listen)
            dst.tensors[0][...] = 0
            for _ in range(3):
                await anyio.sleep(0.3)  # the old link lets go of its NIXL state meanwhile
                await cm.pull_blocks(key, dst, every, every)
                assert d.link_statistics(1).transport == "nixl"
            for t in range(2):
                assert np.array_equal(dst.tensors[t], expected_tensor(3, t, tuple(shape)))


class _SlowDropAgent:
    """A stand-in for a NIXL agent that records which peers are loaded; dropping one takes a
    while (UCX closing its endpoints), in the dropping thread."""

    def __init__(self, drop_s: float = 0.2) -> None:
        self.drop_s = drop_s
        #: set: drops end after ``drop_s``; cleared: a drop hangs until it is set again
        self.release = threading.Event()
        self.release.set()
        self.removes = 0
        self.loaded: set[str] = set()
        self.dropping: set[str] = set()
        #: agents added while their drop still ran: lost once it ends, NIXL_ERR_NOT_FOUND
        self.lost: list[str] = []

    def add_remote_agent(self, md: bytes) -> bytes:
        name = md.decode()
        if name in self.dropping:
            self.lost.append(name)
        self.loaded.add(name)
        return md

    def remove_remote_agent(self, name: str) -> None:
        import time

        self.removes += 1
        self.dropping.add(name)
        time.sleep(self.drop_s)
        self.release.wait()
        self.loaded.discard(name)
        self.dropping.discard(name)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}

    def check_xfer_state(self, handle: object) -> str:
        return "DONE"


async def test_two_links_loading_a_peer_while_its_drop_runs_keep_it_loaded() -> None:
    """An old link gave back the last reference to a peer's agent (its drop now runs in a
    thread) and two new links load the same peer at once: both must wait for the drop, so the
    agent is loaded when they are done (before: only the first waited; the second added the
    agent under the running drop, which then removed it: NIXL_ERR_NOT_FOUND ever after)."""
    agent = _SlowDropAgent()
    ep = nixl_mod.NixlEndpoint(None, agent, "self", None, None)  # type: ignore[arg-type]
    try:
        assert await ep.load_peer("peer", b"peer") == "peer"
        ep.forget_peer("peer")  # the old link closes: the drop starts
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(ep.load_peer, "peer", b"peer")
        await anyio.to_thread.run_sync(lambda: [t.join() for t in list(ep._removing.values())])
        assert agent.lost == [], "a link added the agent while its drop ran"
        assert agent.loaded == {"peer"}
        ep.forget_peer("peer")
        assert agent.loaded == {"peer"}, "one of two references given back: still loaded"
        ep.forget_peer("peer")
        await anyio.to_thread.run_sync(lambda: [t.join() for t in list(ep._removing.values())])
        assert agent.loaded == set()
    finally:
        ep.poller.close()


async def test_a_drop_that_does_not_end_fails_the_load_and_gives_its_reference_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A drop UCX does not finish (a disconnect hanging on a dead peer) fails a new load of
    that agent with OSError after ``DROP_WAIT_S``, never hangs it; a load cancelled while it
    waits gives its reference back too, and neither starts another drop. Once the drop ends,
    the agent loads."""
    monkeypatch.setattr(nixl_mod, "DROP_WAIT_S", 0.1)
    agent = _SlowDropAgent(drop_s=0.0)
    ep = nixl_mod.NixlEndpoint(None, agent, "self", None, None)  # type: ignore[arg-type]
    try:
        await ep.load_peer("peer", b"peer")
        agent.release.clear()  # the drop below hangs until released
        ep.forget_peer("peer")
        with pytest.raises(OSError, match="still dropping"):
            await ep.load_peer("peer", b"peer")
        assert ep._peer_refs.get("peer", 0) == 0
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(ep.load_peer, "peer", b"peer")
                await wait_until(lambda: ep._peer_refs.get("peer") == 1, 5)
                scope.cancel()
        assert ep._peer_refs.get("peer", 0) == 0
        agent.release.set()
        await anyio.to_thread.run_sync(lambda: [t.join() for t in list(ep._removing.values())])
        assert agent.removes == 1  # the failed and the cancelled load started no drop
        assert await ep.load_peer("peer", b"peer") == "peer"  # once the drop ended: loads
        assert agent.loaded == {"peer"} and ep._peer_refs["peer"] == 1
    finally:
        agent.release.set()
        ep.poller.close()
