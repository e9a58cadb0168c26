"""Mooncake Transfer Engine as a transport: choosing it, registration, its table entry, where
its sessions go, fallbacks.

The byte-exact pull / push / layer-wise / timeout / cancel / peer-death semantics run over
Mooncake in ``test_remote_transfers.py``, ``test_layerwise.py`` and the conformance suite
(their ``mooncake`` parameter), across hosts in ``test_multihost.py``; these tests cover what
only Mooncake has. Two endpoints in one process each run an engine (Mooncake's TCP protocol
over loopback).
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

import llmdd_async as dd
from llmdd_async._errors import CopyCancelled
from llmdd_async._memory import CancelToken
from llmdd_async._messages import Cap
from llmdd_async._options import parse_options
from llmdd_async._planner import check_within
from llmdd_async._transports import NO_CAPS
from llmdd_async._transports import mooncake as mooncake_mod
from llmdd_async.testing import DEFAULT_OPTIONS, engine_of, linked_pair

pytestmark = pytest.mark.anyio

S = dd.LLMStatusCode
MOONCAKE = {**DEFAULT_OPTIONS, "llm.Transport": "mooncake"}
DESC = dd.CacheDesc(2, [16, 1024], dd.DataType.DT_UINT8)

needs_mooncake = pytest.mark.skipif(
    not mooncake_mod.available() and os.environ.get("CI") != "true",
    reason=f"Mooncake is not installed ({mooncake_mod.INSTALL_HINT})",
)


def test_without_mooncake_asking_for_it_names_the_install_line(monkeypatch) -> None:
    import llmdd_async._transports as transports

    monkeypatch.setattr(transports, "installed", lambda name: False)  # the registry's check
    with pytest.raises(dd.LLMException) as err:
        parse_options({"llm.EnableCacheManager": "1", "llm.Transport": "mooncake"})
    assert err.value.status_code == S.LLM_PARAM_INVALID
    assert "mooncake-transfer-engine-non-cuda" in str(err.value)


class FakeEngine:
    """Records Mooncake batches; ``cancel_after``: trips ``token`` after that many."""

    def __init__(self, token: CancelToken | None = None, cancel_after: int = 0) -> None:
        self.batches: list[list[tuple[int, int, int]]] = []
        self.token, self.cancel_after = token, cancel_after

    def batch_transfer_sync_read(self, session, local, remote, sizes) -> int:
        self.batches.append(list(zip(local, remote, sizes, strict=True)))
        if self.token is not None and len(self.batches) == self.cancel_after:
            self.token.cancel()
        return 0


def _pump_endpoint(engine: FakeEngine) -> mooncake_mod.MooncakeEndpoint:
    ep = object.__new__(mooncake_mod.MooncakeEndpoint)
    ep.engine = engine
    return ep


def test_a_request_moves_in_batches_that_split_its_ranges_and_stop_at_a_cancel() -> None:
    kib = 1 << 10
    sizes = np.array([300 * kib, 10 * kib, 1000 * kib, 5], dtype=np.int64)
    local = np.array([1 << 20, 8 << 20, 16 << 20, 32 << 20], dtype=np.uint64)
    remote = local + np.uint64(1 << 30)
    engine = FakeEngine()
    moved = _pump_endpoint(engine).pump("READ", "s", local, remote, sizes, CancelToken())
    assert moved == int(sizes.sum())
    assert sum(n for _, _, n in engine.batches[0]) == mooncake_mod.CHUNK_MIN_BYTES
    assert max(sum(n for *_, n in b) for b in engine.batches) <= mooncake_mod.CHUNK_BYTES
    # Batches grow at most fourfold, however fast the last one ran (this engine: at once).
    sums = [sum(n for *_, n in b) for b in engine.batches]
    assert all(b <= a * mooncake_mod.BATCH_GROWTH for a, b in itertools.pairwise(sums))
    assert sums[1] == sums[0] * mooncake_mod.BATCH_GROWTH
    # Joined again, the pieces are exactly the ranges, in order.
    assert _joined(engine.batches) == _ranges(local, remote, sizes)
    token = CancelToken()
    engine = FakeEngine(token, cancel_after=1)
    with pytest.raises(CopyCancelled):
        _pump_endpoint(engine).pump("READ", "s", local, remote, sizes, token)
    assert len(engine.batches) == 1  # the batch in flight finished; no other started
    # Many small ranges: no batch holds more than Mooncake's queue takes.
    many = np.full(5000, 512, dtype=np.int64)
    addrs = np.arange(5000, dtype=np.uint64) * np.uint64(4096)
    engine = FakeEngine()
    _pump_endpoint(engine).pump("READ", "s", addrs, addrs, many, CancelToken())
    assert max(len(b) for b in engine.batches) <= mooncake_mod.CHUNK_MAX_RANGES
    # (a batch's size follows how fast the last ran: on a busy box one may end mid-range)
    assert _joined(engine.batches) == _ranges(addrs, addrs, many)


def _joined(batches: list[list[tuple[int, int, int]]]) -> list[list[int]]:
    """The batches' pieces, those that continue one another joined."""
    joined: list[list[int]] = []
    for lo, ro, n in (p for b in batches for p in b):
        if joined and joined[-1][0] + joined[-1][2] == lo and joined[-1][1] + joined[-1][2] == ro:
            joined[-1][2] += n
        else:
            joined.append([lo, ro, n])
    return joined


def _ranges(local: np.ndarray, remote: np.ndarray, sizes: np.ndarray) -> list[list[int]]:
    return [[int(a), int(b), int(c)] for a, b, c in zip(local, remote, sizes, strict=True)]


@needs_mooncake
async def test_a_pull_of_thousands_of_small_blocks_is_byte_exact() -> None:
    # 4096 blocks x 2 tensors in one request: more ranges than Mooncake's default per-peer
    # queue, which refuses such a batch and then fails the session's later ones.
    desc = dd.CacheDesc(2, [4096, 64], dd.DataType.DT_UINT8)
    # (what is checked is the bytes, not the time: the default 1 s deadline failed it once
    # on a CI run of a loaded 2-CPU box)
    async with linked_pair({**MOONCAKE, "llm.SyncKvCacheWaitTime": "60000"}) as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(desc, dd.BlocksCacheKey(1, 0))
        _fill(src)
        dst = decoder.cache_manager.allocate_blocks_cache(desc)
        order = list(np.random.default_rng(3).permutation(4096))
        await decoder.cache_manager.pull_blocks(
            dd.BlocksCacheKey(1, 0), dst, order, list(range(4096))
        )
        assert decoder.link_statistics(1).recent[-1].mode == "local"
        for t in range(2):
            assert np.array_equal(dst.tensors[t], src.tensors[t][order])


def _fill(cache: dd.Cache) -> None:
    for i, t in enumerate(cache.tensors):
        t[:] = (np.arange(t.size, dtype=np.uint32).reshape(t.shape) * 7 + i).astype(np.uint8)


@needs_mooncake
async def test_only_remote_accessible_caches_are_registered_and_published() -> None:
    async with linked_pair(MOONCAKE) as (prompt, _decoder):
        ep = engine_of(prompt).transport_endpoint
        assert isinstance(ep, mooncake_mod.MooncakeEndpoint)
        cm = prompt.cache_manager
        hidden = cm.register_blocks_cache(
            DESC, [np.zeros((16, 1024), np.uint8) for _ in range(2)], remote_accessible=False
        )
        shown = cm.register_blocks_cache(
            DESC, [np.zeros((16, 1024), np.uint8) for _ in range(2)], remote_accessible=True
        )
        pooled = cm.allocate_blocks_cache(DESC)  # DEVICE placement: remote accessible
        assert set(ep.caches) == {shown.cache_id, pooled.cache_id}
        entry = ep.table_entry()
        assert entry is not None and set(entry["caches"]) == {shown.cache_id, pooled.cache_id}
        assert entry["host"] == "127.0.0.1" and entry["port"] > 0
        gen = entry["gen"]
        cm.unregister_cache(shown.cache_id)
        cm.deallocate_blocks_cache(pooled)
        assert ep.caches == {}
        after = ep.table_entry()
        assert after is not None and after["gen"] > gen and after["caches"] == []
        cm.unregister_cache(hidden.cache_id)


@needs_mooncake
async def test_pulls_move_over_mooncake_and_a_cache_outside_it_over_the_stream() -> None:
    # Request/response mode: a cache that is not remote accessible may receive a pull.
    mixed = {**MOONCAKE, "llm.EnableRemoteCacheAccessible": "0"}
    async with linked_pair(mixed) as (prompt, decoder):
        assert decoder.link_statistics(1).transport == "mooncake"
        src = prompt.cache_manager.allocate_blocks_cache(DESC, dd.BlocksCacheKey(1, 0))
        _fill(src)
        cm = decoder.cache_manager
        dst = cm.allocate_blocks_cache(DESC)
        await cm.pull_blocks(dd.BlocksCacheKey(1, 0), dst, [3, 4, 9], [0, 1, 2])
        assert decoder.link_statistics(1).recent[-1].mode == "local"  # one-sided, Mooncake's
        mem = [np.zeros((16, 1024), np.uint8) for _ in range(2)]
        plain = cm.register_blocks_cache(DESC, mem, remote_accessible=False)
        await cm.pull_blocks(dd.BlocksCacheKey(1, 0), plain, [9, 3], [5, 6])
        assert decoder.link_statistics(1).recent[-1].mode == "stream"
        for t in range(2):
            assert np.array_equal(dst.tensors[t][:3], src.tensors[t][[3, 4, 9]])
            assert np.array_equal(mem[t][5:7], src.tensors[t][[9, 3]])


@needs_mooncake
@pytest.mark.parametrize("other", ["auto", "tcp"])
async def test_mooncake_only_when_both_ends_ask_for_it(other: str) -> None:
    async with linked_pair(
        MOONCAKE, decoder_options={"llm.Transport": other, "llm.EnableCacheManager": "1"}
    ) as (prompt, decoder):
        assert decoder.link_statistics(1).transport != "mooncake"
        assert prompt.link_statistics(2).transport != "mooncake"
        src = prompt.cache_manager.allocate_blocks_cache(DESC, dd.BlocksCacheKey(1, 0))
        src.tensors[1][7] = 42
        dst = decoder.cache_manager.allocate_blocks_cache(DESC)
        await decoder.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), dst, [7], [1])
        assert (dst.tensors[1][1] == 42).all()


@needs_mooncake
async def test_a_peer_that_does_not_listen_is_pushed_to_over_the_stream() -> None:
    # Mooncake opens its data connections to the host an engine names itself by: an endpoint
    # without llm.listenIpInfo has no such address, so what its peers send it moves over the
    # link's stream, and what it initiates still moves over Mooncake.
    async with linked_pair(MOONCAKE) as (prompt, decoder):
        ep = engine_of(decoder).transport_endpoint
        assert isinstance(ep, mooncake_mod.MooncakeEndpoint)
        assert ep.table_entry() is None
        dst = decoder.cache_manager.allocate_blocks_cache(DESC, dd.BlocksCacheKey(2, 0))
        src = prompt.cache_manager.allocate_blocks_cache(DESC, dd.BlocksCacheKey(1, 0))
        _fill(src)
        await prompt.cache_manager.push_blocks(dd.BlocksCacheKey(2, 0), src, [1, 5], [2, 0])
        # over the link's stream (a small push: its bytes right behind its request)
        assert prompt.link_statistics(2).recent[-1].mode == "eager"
        for t in range(2):
            assert np.array_equal(dst.tensors[t][[2, 0]], src.tensors[t][[1, 5]])
        back = decoder.cache_manager.allocate_blocks_cache(DESC)
        await decoder.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), back, [4], [0])
        assert decoder.link_statistics(1).recent[-1].mode == "local"
        assert all(np.array_equal(back.tensors[t][0], src.tensors[t][4]) for t in range(2))
        # A peer that claims Mooncake in its request anyway is served over the stream: this
        # endpoint published no engine (its caches are registered: its own pulls need them).
        assert ep.registered(engine_of(decoder).registry.get(dst.cache_id))
        start = np.array([dst.tensors[0].ctypes.data], dtype=np.uint64)
        claim = {**dict(NO_CAPS), Cap.MOONCAKE.value: True}
        assert ep.serves(claim, start, np.array([64], dtype=np.uint64)) is False


@needs_mooncake
async def test_keyed_links_carry_the_entry_and_caches_made_later_are_found() -> None:
    keyed = {**MOONCAKE, "llm.AuthKey": "secret"}
    async with linked_pair(keyed) as (prompt, decoder):
        cm = decoder.cache_manager
        dst = cm.allocate_blocks_cache(DESC)
        # Registered after the link came up: found through a fresh table over the link.
        src = prompt.cache_manager.allocate_blocks_cache(DESC, dd.BlocksCacheKey(1, 0))
        src.tensors[0][2] = 9
        await cm.pull_blocks(dd.BlocksCacheKey(1, 0), dst, [2], [0])
        assert (dst.tensors[0][0] == 9).all()
        assert decoder.link_statistics(1).recent[-1].mode == "local"


@needs_mooncake
async def test_a_peer_naming_another_host_for_its_engine_is_never_reached_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A hostile peer publishes an engine on a host that is not where its link is: a Mooncake
    # session there would make this endpoint move bytes to or from a third party on the
    # peer's word. 127.0.0.2 reaches the peer's own engine (Mooncake listens on every
    # address), so without the check the pull below would succeed over Mooncake there.
    real = mooncake_mod.MooncakeEndpoint.table_entry

    def elsewhere(self: mooncake_mod.MooncakeEndpoint) -> dict[str, object] | None:
        entry = real(self)
        return None if entry is None else {**entry, "host": "127.0.0.2"}

    monkeypatch.setattr(mooncake_mod.MooncakeEndpoint, "table_entry", elsewhere)
    async with linked_pair(MOONCAKE) as (prompt, decoder):
        access = engine_of(decoder).links.get(1).access
        assert isinstance(access, mooncake_mod.MooncakeAccess)
        src = prompt.cache_manager.allocate_blocks_cache(DESC, dd.BlocksCacheKey(1, 0))
        _fill(src)
        dst = decoder.cache_manager.allocate_blocks_cache(DESC)
        await decoder.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), dst, [6, 2], [0, 1])
        assert access.session is None  # no session was opened where the peer said
        # Its bytes came over our own stream (planned here: with no GRANT before them).
        assert decoder.link_statistics(1).recent[-1].mode == "eager"
        for t in range(2):
            assert np.array_equal(dst.tensors[t][:2], src.tensors[t][[6, 2]])
        with pytest.raises(OSError, match="refused"):
            await access.refresh(5)


@needs_mooncake
async def test_the_accesss_refresh_updates_the_whole_view_of_the_peer() -> None:
    """The Mooncake access fetches the peer's table itself: the link's view (regions, caches,
    epoch) adopts that same copy (before: only its regions, so the caches a one-sided pull
    plans with came from an older copy than the regions it checks against)."""
    async with linked_pair(MOONCAKE) as (prompt, decoder):
        link = engine_of(decoder).links.get(1)
        access = link.access
        assert isinstance(access, mooncake_mod.MooncakeAccess)
        await access.refresh(5)
        later = prompt.cache_manager.allocate_blocks_cache(DESC)
        assert later.cache_id not in link.view.caches
        await access.refresh(5)
        assert link.view.caches[later.cache_id].addrs == tuple(later.tensor_addrs)
        addrs = np.array(later.tensor_addrs, dtype=np.uint64)
        assert check_within(addrs, np.full(len(addrs), 16 * 1024, np.uint64), *link.view.regions)
