"""transfer_cache_async: validation, synchronizers, pipelining, fan-out, fencing, exclusivity.

This process is the prompt (it runs the "forward pass" and signals layers); decode endpoints
run in child processes.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from helpers import (
    TRANSPORTS,
    cluster,
    endpoint_options,
    expected_tensor,
    library_logs_enabled,
    link,
    register_blocks_at,
)

import llmdd_async as dd
from llmdd_async._net.link import Link
from llmdd_async.testing import PeerProcess, encode_key, link_of, wait_until

pytestmark = pytest.mark.anyio

S = dd.LLMStatusCode
PROMPT = 1


@contextlib.asynccontextmanager
async def decoders(
    transport: str, n: int = 1, ra: bool = True, **extra: str
) -> AsyncIterator[tuple[list[PeerProcess], dd.LLMDataDist]]:
    """``n`` decode processes (cluster ids 2, 3, ...) and a local prompt linked to them."""
    async with contextlib.AsyncExitStack() as stack:
        peers = []
        for i in range(n):
            peers.append(
                await stack.enter_async_context(
                    PeerProcess.start(
                        dd.LLMRole.DECODER,
                        2 + i,
                        endpoint_options(transport, listen=True, ra=ra, **extra),
                    )
                )
            )
        prompt = await stack.enter_async_context(
            dd.LLMDataDist(dd.LLMRole.PROMPT, PROMPT).running(
                endpoint_options(transport, ra=ra, **extra)
            )
        )
        for i, p in enumerate(peers):
            await link(prompt, 2 + i, p.listen)
        yield peers, prompt


def fill_src(cache: dd.Cache, seed: int) -> None:
    for t, arr in enumerate(cache.tensors):
        arr.reshape(-1).view(np.uint8)[:] = expected_tensor(seed, t, (arr.nbytes,))


async def peer_tensor(p: PeerProcess, cache_id: int, t: int, shape: tuple[int, ...]) -> np.ndarray:
    raw = base64.b64decode(await p.request("read", cache_id=cache_id, tensor=t))
    return np.frombuffer(raw, np.uint8).reshape(shape)


class Always(dd.LayerSynchronizer):
    def __init__(self) -> None:
        self.calls: list[int] = []
        self.threads: set[int] = set()

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.calls.append(layer_index)
        self.threads.add(threading.get_ident())
        return True


# ------------------------------------------------------------------ data paths
async def test_keyed_blocks_with_shifted_layer_ranges(transport) -> None:
    """src layers 2..3 -> dst layers 0..1: upstream's absolute-index bug, fixed."""
    shape = (16, 512)
    async with decoders(transport) as ([dec], prompt):
        dst = await register_blocks_at(dec, 8, shape)
        cm = prompt.cache_manager
        src = cm.allocate_blocks_cache(dd.CacheDesc(8, list(shape), dd.DataType.DT_UINT8))
        fill_src(src, 60)
        sync = Always()
        cfg = dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2, 0), range(2, 4), range(0, 2))
        task = cm.transfer_cache_async(src, sync, [cfg], [0, 1, 2, 9], [5, 6, 7, 1])
        await task
        assert await task.get_results() == [S.LLM_SUCCESS]
        assert sync.calls == [2, 3]
        assert threading.get_ident() not in sync.threads  # ran in worker threads
        for t in range(8):
            got = await peer_tensor(dec, dst, t, shape)
            if t < 4:
                want = expected_tensor(60, t + 4, shape)
                assert np.array_equal(got[[5, 6, 7, 1]], want[[0, 1, 2, 9]])
                assert not got[[0, 2, 3, 4]].any()
            else:
                assert not got.any()
        stats = task.statistics()
        assert [lt.layer for lt in stats.layers] == [2, 3]
        assert stats.bytes == 4 * 4 * 512
        assert all(lt.ready <= lt.started <= lt.finished for lt in stats.layers)


async def test_keyed_contiguous_by_id_and_contiguous_to_blocks(transport) -> None:
    async with decoders(transport) as ([dec], prompt):
        cont = await dec.request("register", kind="cache", num_tensors=4, shape=[3, 300])
        blocks = await dec.request(
            "register",
            kind="blocks",
            num_tensors=4,
            shape=[8, 128],
            blocks_key=encode_key(dd.BlocksCacheKey(2, 1)),
        )
        cm = prompt.cache_manager
        src = cm.allocate_cache(dd.CacheDesc(4, [2, 300], dd.DataType.DT_UINT8))
        fill_src(src, 61)
        cfg = dd.TransferWithCacheKeyConfig(
            dd.CacheKeyByIdAndIndex(2, cont, 2), range(0, 2), range(0, 2), src_batch_index=1
        )
        await cm.transfer_cache_async(src, Always(), [cfg])
        for t in range(4):
            got = await peer_tensor(dec, cont, t, (3, 300))
            assert np.array_equal(got[2], expected_tensor(61, t, (2, 300))[1])
            assert not got[:2].any()
        # contiguous slot -> blocks, pieces of dst_block_memory_size
        cfg = dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2, 1), range(1, 2), range(1, 2))
        await cm.transfer_cache_async(src, Always(), [cfg], None, [4, 2, 6], 128)
        for t in (2, 3):
            got = await peer_tensor(dec, blocks, t, (8, 128))
            slot = expected_tensor(61, t, (2, 300))[0]
            assert np.array_equal(np.concatenate([got[4], got[2], got[6][:44]]), slot)


async def test_raw_addresses_in_request_response_mode(transport) -> None:
    async with decoders(transport, ra=False) as ([dec], prompt):
        cont = await dec.request("register", kind="cache", num_tensors=4, shape=[4, 256])
        addrs = await dec.request("addrs", cache_id=cont)
        cm = prompt.cache_manager
        src = cm.allocate_cache(dd.CacheDesc(4, [4, 256], dd.DataType.DT_UINT8))
        fill_src(src, 62)
        # Destination slot 3: the caller offsets the raw addresses itself (as upstream).
        cfg = dd.TransferConfig(2, [a + 3 * 256 for a in addrs], range(0, 2), src_batch_index=1)
        task = cm.transfer_cache_async(src, dd.LayerEvents(), [cfg])
        ev = dd.LayerEvents()
        task.cancel()
        with pytest.raises(dd.TransferCancelled):
            await task
        task = cm.transfer_cache_async(src, ev, [cfg])
        ev.layer_ready(0)
        ev.layer_ready(1)
        await task
        for t in range(4):
            got = await peer_tensor(dec, cont, t, (4, 256))
            assert np.array_equal(got[3], expected_tensor(62, t, (4, 256))[1])
            assert not got[:3].any()
        # An address outside what the peer registered is refused by the peer.
        bad = dd.TransferConfig(2, [addrs[0] + 4 * 256 - 100, addrs[1]], range(0, 1))
        task = cm.transfer_cache_async(src, Always(), [bad])
        with pytest.raises(dd.LLMException) as err:
            await task
        assert err.value.status_code == S.LLM_PARAM_INVALID
        assert await task.get_results() == [S.LLM_PARAM_INVALID]


async def test_keyed_transfers_after_the_first_ask_for_no_table(monkeypatch) -> None:
    """A link's first keyed transfer fetches the peer's table (its snapshot for the link's
    life); later ones resolve their keys in it with no fetch at all."""
    async with decoders("tcp") as ([dec], prompt):
        dst = await register_blocks_at(dec, 4, (8, 256))
        cm = prompt.cache_manager
        src = cm.allocate_blocks_cache(dd.CacheDesc(4, [8, 256], dd.DataType.DT_UINT8))
        fill_src(src, 64)
        cfg = dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2, 0), range(0, 2), range(0, 2))
        for i in range(3):
            sync = dd.LayerEvents()
            sync.layer_ready(0)
            sync.layer_ready(1)
            task = cm.transfer_cache_async(src, sync, [cfg], [i], [i + 1])
            await task
            assert await task.get_results() == [S.LLM_SUCCESS]
            if i == 0:

                async def no_fetch(timeout_s: float, turns: Any = None) -> Any:
                    raise AssertionError("the table was fetched again")

                monkeypatch.setattr(link_of(prompt, 2).raw.view, "fetch_table", no_fetch)
        for t in range(4):
            got = await peer_tensor(dec, dst, t, (8, 256))
            assert np.array_equal(got[1:4], expected_tensor(64, t, (8, 256))[0:3])


async def test_fan_out_to_two_decoders_and_shared_result_slots(transport) -> None:
    async with decoders(transport, n=2) as (decs, prompt):
        ids = [
            await d.request(
                "register",
                kind="blocks",
                num_tensors=4,
                shape=[8, 256],
                blocks_key=encode_key(dd.BlocksCacheKey(2 + i, 0)),
            )
            for i, d in enumerate(decs)
        ]
        cm = prompt.cache_manager
        src = cm.allocate_blocks_cache(dd.CacheDesc(4, [8, 256], dd.DataType.DT_UINT8))
        fill_src(src, 63)
        cfgs = [
            dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2, 0), range(0, 1), range(0, 1)),
            dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(3, 0), range(0, 2), range(0, 2)),
            dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2, 0), range(1, 2), range(1, 2)),
        ]
        task = cm.transfer_cache_async(src, dd.LayerEvents(), cfgs, [3], [4])
        events = task
        sync = dd.LayerEvents()
        task = cm.transfer_cache_async(src, sync, cfgs, [3], [4])
        sync.layer_ready(0)
        sync.layer_ready(1)
        await task
        await anyio.lowlevel.checkpoint()
        events.cancel()
        with pytest.raises(dd.TransferCancelled):
            await events
        assert await task.get_results() == [S.LLM_SUCCESS] * 3
        for dec, cid in zip(decs, ids, strict=True):
            for t in range(4):
                got = await peer_tensor(dec, cid, t, (8, 256))
                assert np.array_equal(got[4], expected_tensor(63, t, (8, 256))[3])


# ------------------------------------------------------------------ synchronizers
async def test_false_aborts_and_unstarted_configs_report_none() -> None:
    async with decoders("tcp", n=2) as (decs, prompt):
        for i, d in enumerate(decs):
            await d.request(
                "register",
                kind="blocks",
                num_tensors=4,
                shape=[4, 64],
                blocks_key=encode_key(dd.BlocksCacheKey(2 + i, 0)),
            )
        cm = prompt.cache_manager
        src = cm.allocate_blocks_cache(dd.CacheDesc(4, [4, 64], dd.DataType.DT_UINT8))

        class NoAtOne(dd.LayerSynchronizer):
            def synchronize_layer(self, layer_index, timeout_in_millis):
                return layer_index != 1

        cfgs = [
            dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2, 0), range(0, 1), range(0, 1)),
            dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(3, 0), range(1, 2), range(1, 2)),
        ]
        task = cm.transfer_cache_async(src, NoAtOne(), cfgs, [0], [0])
        with pytest.raises(dd.LLMException) as err:
            await task
        assert err.value.status_code == S.LLM_PARAM_INVALID
        assert await task.get_results() == [S.LLM_SUCCESS, S.LLM_PARAM_INVALID]
        assert await task.synchronize() == S.LLM_PARAM_INVALID
        # A config whose layers never started reports None.
        cfgs = [
            dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2, 0), range(1, 2), range(1, 2)),
            dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(3, 0), range(0, 1), range(0, 1)),
        ]
        ev = dd.LayerEvents()
        task = cm.transfer_cache_async(src, ev, cfgs, [0], [0])
        ev.abort()  # layer 0 fails: config 0 (layer 1) never starts
        with pytest.raises(dd.LLMException):
            await task
        assert await task.get_results() == [None, S.LLM_PARAM_INVALID]


class AsyncGate(dd.AsyncLayerSynchronizer):
    def __init__(self) -> None:
        self.calls: list[int] = []
        self.open = anyio.Event()

    async def synchronize_layer(self, layer_index, timeout_in_millis):
        self.calls.append(layer_index)
        if layer_index == 2:
            raise RuntimeError("the forward pass crashed")
        return True


@pytest.mark.parametrize("transport", ["tcp", TRANSPORTS[2]], indirect=True)
async def test_async_synchronizer_and_exceptions(transport) -> None:
    async with decoders(transport) as ([dec], prompt):
        await register_blocks_at(dec, 6, [4, 64])
        cm = prompt.cache_manager
        src = cm.allocate_blocks_cache(dd.CacheDesc(6, [4, 64], dd.DataType.DT_UINT8))
        gate = AsyncGate()
        cfg = dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2, 0), range(0, 3), range(0, 3))
        task = cm.transfer_cache_async(src, gate, [cfg], [0], [0])
        with pytest.raises(dd.LLMException) as err:
            await task
        assert err.value.status_code == S.LLM_FAILED
        assert "crashed" in str(err.value)
        assert gate.calls == [0, 1, 2]
        assert task.layers_done == 2


async def _one_layer_to(
    dec: PeerProcess, prompt: dd.LLMDataDist
) -> tuple[dd.CacheManager, dd.Cache, dd.TransferWithCacheKeyConfig]:
    """A one-layer (two-tensor) blocks cache on each side, and the config that pushes it."""
    await register_blocks_at(dec, 2, [4, 64])
    cm = prompt.cache_manager
    src = cm.allocate_blocks_cache(dd.CacheDesc(2, [4, 64], dd.DataType.DT_UINT8))
    cfg = dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2, 0), range(0, 1), range(0, 1))
    return cm, src, cfg


async def test_layer_sync_timeout() -> None:
    async with decoders("tcp", **{"llm.LayerSyncTimeout": "100"}) as ([dec], prompt):
        cm, src, cfg = await _one_layer_to(dec, prompt)
        task = cm.transfer_cache_async(src, dd.LayerEvents(), [cfg], [0], [0])  # never ready
        with anyio.fail_after(5), pytest.raises(dd.LLMException) as err:
            await task
        assert err.value.status_code == S.LLM_TIMEOUT
        assert "llm.LayerSyncTimeout" in str(err.value)
        assert await task.get_results() == [S.LLM_TIMEOUT]


class _BlockingGate(dd.LayerSynchronizer):
    """A user's blocking synchronizer, released from the test."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.timeouts: list[int | None] = []

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.timeouts.append(timeout_in_millis)
        return self.go.wait(30)


@pytest.mark.parametrize("kind", ["layer_events", "blocking"])
async def test_a_long_layer_wait_is_logged_then_the_transfer_goes_on(
    kind: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A layer whose signal does not come says so (``transfer.layer_wait``, once, naming the
    layer and the option that bounds it) instead of hanging silently; once it comes, the
    transfer completes."""
    import logging

    from llmdd_async import _layer_gate

    library_logs_enabled(monkeypatch)
    monkeypatch.setattr(_layer_gate, "LAYER_WAIT_WARN_S", 0.2)
    async with decoders("tcp") as ([dec], prompt):
        cm, src, cfg = await _one_layer_to(dec, prompt)
        events = dd.LayerEvents()
        gate = _BlockingGate()
        sync = events if kind == "layer_events" else gate
        with caplog.at_level(logging.WARNING, logger="llmdd_async.engine"):
            task = cm.transfer_cache_async(src, sync, [cfg], [0], [0])

            def waits() -> list[logging.LogRecord]:
                return [r for r in caplog.records if r.getMessage().startswith("transfer.layer")]

            await wait_until(lambda: bool(waits()), 10)
            assert not task.done()
            events.layer_ready(0)
            gate.go.set()
            with anyio.fail_after(10):
                await task
        assert await task.get_results() == [S.LLM_SUCCESS]
        (record,) = waits()
        assert record.levelno == logging.WARNING
        assert record.layer == 0  # type: ignore[attr-defined]
        assert "llm.LayerSyncTimeout" in record.getMessage()
        # upstream passes the synchronizer None; the bound is the scheduler's own
        assert gate.timeouts == ([None] if kind == "blocking" else [])


async def test_a_layer_wait_that_was_logged_still_ends_at_its_bound(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The warning comes first, and the bound (``llm.LayerSyncTimeout``) still ends the wait
    after it, with LLM_TIMEOUT."""
    import logging

    from llmdd_async import _layer_gate

    library_logs_enabled(monkeypatch)
    monkeypatch.setattr(_layer_gate, "LAYER_WAIT_WARN_S", 0.1)
    async with decoders("tcp", **{"llm.LayerSyncTimeout": "500"}) as ([dec], prompt):
        cm, src, cfg = await _one_layer_to(dec, prompt)
        with caplog.at_level(logging.WARNING, logger="llmdd_async.engine"):
            task = cm.transfer_cache_async(src, dd.LayerEvents(), [cfg], [0], [0])  # never
            with anyio.fail_after(10), pytest.raises(dd.LLMException) as err:
                await task
        assert err.value.status_code == S.LLM_TIMEOUT
        assert "within 500 ms (llm.LayerSyncTimeout)" in str(err.value)
        waits = [r for r in caplog.records if r.getMessage().startswith("transfer.layer_wait")]
        assert len(waits) == 1


async def test_an_unsignalled_layer_fails_at_the_default_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without ``llm.LayerSyncTimeout`` a layer that never comes still ends the transfer, at
    ``DEFAULT_LAYER_SYNC_TIMEOUT_MS`` (600 s; shortened here), with LLM_TIMEOUT."""
    from llmdd_async import _layer_gate
    from llmdd_async._options import DEFAULT_LAYER_SYNC_TIMEOUT_MS

    assert DEFAULT_LAYER_SYNC_TIMEOUT_MS == 600_000  # what README's option table says
    monkeypatch.setattr(_layer_gate, "DEFAULT_LAYER_SYNC_TIMEOUT_MS", 300)
    async with decoders("tcp") as ([dec], prompt):
        cm, src, cfg = await _one_layer_to(dec, prompt)
        task = cm.transfer_cache_async(src, dd.LayerEvents(), [cfg], [0], [0])  # never ready
        with anyio.fail_after(10), pytest.raises(dd.LLMException) as err:
            await task
        assert err.value.status_code == S.LLM_TIMEOUT
        assert "within 300 ms (llm.LayerSyncTimeout)" in str(err.value)


async def test_layer_events_from_a_compute_thread(transport) -> None:
    layers = 6
    async with decoders(transport) as ([dec], prompt):
        dst = await register_blocks_at(dec, 2 * layers, [8, 4096])
        cm = prompt.cache_manager
        src = cm.allocate_blocks_cache(dd.CacheDesc(2 * layers, [8, 4096], dd.DataType.DT_UINT8))
        ev = dd.LayerEvents()
        cfg = dd.TransferWithCacheKeyConfig(
            dd.BlocksCacheKey(2, 0), range(0, layers), range(0, layers)
        )
        task = cm.transfer_cache_async(src, ev, [cfg], [1, 2], [3, 4])

        def forward() -> None:
            for layer in range(layers):
                for t in (2 * layer, 2 * layer + 1):  # "compute" the layer's K and V
                    src.tensors[t][...] = expected_tensor(64, t, (8, 4096))
                ev.layer_ready(layer)

        await anyio.to_thread.run_sync(forward)
        await task
        for t in range(2 * layers):
            got = await peer_tensor(dec, dst, t, (8, 4096))
            assert np.array_equal(got[[3, 4]], expected_tensor(64, t, (8, 4096))[[1, 2]])


async def test_layers_at_the_models_pace_leave_from_their_signal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layer the model signals while its transfer waits for it is sent from where the
    signal is handled (``Link.send_frame_now``: no wake-up of the transfer's sender): in
    order, byte-exact, each layer counted in the statistics."""
    sent_now: list[tuple[int, tuple[int, int]]] = []
    real = Link.send_frame_now

    def spy(self: Link, req: Any, stream: Any, to_initiator: bool, span: Any, then: Any) -> bool:
        ok = real(self, req, stream, to_initiator, span, then)
        if ok:
            sent_now.append((req.req_id, span))
        return ok

    monkeypatch.setattr(Link, "send_frame_now", spy)
    layers, shape = 8, (8, 4096)
    async with decoders("tcp", **{"llm.SyncKvCacheWaitTime": "20000"}) as ([dec], prompt):
        dst = await register_blocks_at(dec, 2 * layers, shape)
        cm = prompt.cache_manager
        src = cm.allocate_blocks_cache(dd.CacheDesc(2 * layers, list(shape), dd.DataType.DT_UINT8))
        ev = dd.LayerEvents()
        cfg = dd.TransferWithCacheKeyConfig(
            dd.BlocksCacheKey(2, 0), range(0, layers), range(0, layers)
        )
        task = cm.transfer_cache_async(src, ev, [cfg], [1, 2], [3, 4])

        def forward() -> None:
            for layer in range(layers):
                time.sleep(0.02)  # the model computes the layer
                for t in (2 * layer, 2 * layer + 1):
                    src.tensors[t][...] = expected_tensor(65, t, shape)
                ev.layer_ready(layer)

        await anyio.to_thread.run_sync(forward)
        await task
        assert await task.get_results() == [S.LLM_SUCCESS]
        # Layers that came while the sender waited left at once (the first of a request goes
        # once it is granted), in order.
        assert len(sent_now) >= layers // 2
        assert sent_now == sorted(sent_now)  # (each request's stream, in order)
        for t in range(2 * layers):
            got = await peer_tensor(dec, dst, t, shape)
            assert np.array_equal(got[[3, 4]], expected_tensor(65, t, shape)[[1, 2]])
        stats = task.statistics()
        assert [lt.layer for lt in stats.layers] == list(range(layers))
        assert [lt.nbytes for lt in stats.layers] == [2 * 2 * shape[1]] * layers


async def test_the_next_layer_is_awaited_while_one_is_in_flight() -> None:
    """With the decoder frozen no layer can land, yet the synchronizer keeps being called --
    up to the window, and no further."""
    window = 2
    async with decoders(
        "tcp", **{"llm.LayerWindow": str(window), "llm.SyncKvCacheWaitTime": "20000"}
    ) as ([dec], prompt):
        await register_blocks_at(dec, 20, [4, 64])
        cm = prompt.cache_manager
        src = cm.allocate_blocks_cache(dd.CacheDesc(20, [4, 64], dd.DataType.DT_UINT8))
        sync = Always()
        cfg = dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2, 0), range(0, 10), range(0, 10))
        await cm.transfer_cache_async(src, Always(), [cfg], [0], [0])  # snapshot the table
        dec.pause()
        try:
            task = cm.transfer_cache_async(src, sync, [cfg], [0], [0])
            await anyio.sleep(0.5)
            # layer 0 is being sent, `window` layers wait in the channel, one is handed over
            assert len(sync.calls) >= 2  # pipelined: later layers awaited before 0 landed
            assert len(sync.calls) <= window + 2  # bounded
            assert task.layers_done == 0
        finally:
            dec.resume()
        await task
        assert sync.calls == list(range(10))


@pytest.mark.parametrize("transport", ["tcp", "same-host"], indirect=True)
async def test_a_layerwise_transfer_is_one_request_per_destination(transport) -> None:
    """A request costs round trips whatever its size: a destination's layers all go in one
    request, granted once, each layer's bytes leaving when it is ready (each recorded on the
    link on its own), byte-exact, each still counted in the statistics."""
    layers, shape = 10, (8, 1024)
    async with decoders(
        transport, **{"llm.LayerWindow": "16", "llm.SyncKvCacheWaitTime": "20000"}
    ) as ([dec], prompt):
        dst = await register_blocks_at(dec, 2 * layers, shape)
        cm = prompt.cache_manager
        desc = dd.CacheDesc(2 * layers, list(shape), dd.DataType.DT_UINT8)
        src = cm.allocate_blocks_cache(desc)
        fill_src(src, 68)
        cfg = dd.TransferWithCacheKeyConfig(
            dd.BlocksCacheKey(2, 0), range(0, layers), range(0, layers)
        )
        await cm.transfer_cache_async(src, Always(), [cfg], [0], [0])  # snapshot the table
        before = len(prompt.link_statistics(2).recent)
        requests_before = prompt.link_statistics(2).transfers
        ready = dd.LayerEvents()
        for i in range(layers):
            ready.layer_ready(i)
        dec.pause()  # the request stalls; every layer queues meanwhile
        try:
            task = cm.transfer_cache_async(src, ready, [cfg], [1, 2, 3], [6, 5, 4])
            await anyio.sleep(0.3)
        finally:
            dec.resume()
        await task
        assert await task.get_results() == [S.LLM_SUCCESS]
        stats = prompt.link_statistics(2)
        # One request per run of layers that queued (two, three here) before; one now.
        assert stats.transfers - requests_before == 1
        pushes = [r for r in stats.recent[before:] if r.op == "push"]
        # Every layer was handed over before the grant came: they leave together, one record.
        assert len(pushes) == 1
        assert sum(r.nbytes for r in pushes) == 2 * layers * 3 * shape[1]
        for t in range(2 * layers):
            got = await peer_tensor(dec, dst, t, shape)
            want = expected_tensor(68, t, shape)
            assert np.array_equal(got[[6, 5, 4]], want[[1, 2, 3]])
            assert not got[[1, 2, 3, 7]].any()  # (block 0: the snapshot transfer)
        stats = task.statistics()
        assert [lt.layer for lt in stats.layers] == list(range(layers))
        assert [lt.nbytes for lt in stats.layers] == [2 * 3 * shape[1]] * layers
        assert stats.bytes == 2 * layers * 3 * shape[1]


# ------------------------------------------------------------------ fencing and links
@pytest.mark.parametrize("transport", ["tcp", TRANSPORTS[2]], indirect=True)
async def test_cancel_fences_a_layerwise_transfer(transport) -> None:
    async with decoders(transport) as ([dec], prompt):
        dst = await register_blocks_at(dec, 4, [4, 64])
        cm = prompt.cache_manager
        src = cm.allocate_blocks_cache(dd.CacheDesc(4, [4, 64], dd.DataType.DT_UINT8))
        fill_src(src, 65)
        ev = dd.LayerEvents()
        cfg = dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2, 0), range(0, 2), range(0, 2))
        task = cm.transfer_cache_async(src, ev, [cfg], [0], [0])
        ev.layer_ready(0)
        await wait_until(lambda: task.layers_done >= 1, 5, 0.005)
        task.cancel()
        with pytest.raises(dd.TransferCancelled):
            await task
        ev.layer_ready(1)  # too late: nothing more may arrive
        await anyio.sleep(0.2)
        got = [await peer_tensor(dec, dst, t, (4, 64)) for t in range(4)]
        assert np.array_equal(got[0][0], expected_tensor(65, 0, (4, 64))[0])
        assert not got[2].any() and not got[3].any()
        assert await task.get_results() == [S.LLM_FAILED]
        # the link is still fine
        await cm.transfer_cache_async(src, Always(), [cfg], [0], [0])


@pytest.mark.parametrize("transport", ["tcp", "same-host"], indirect=True)
@pytest.mark.parametrize("gap_ms", [5, 300])
async def test_a_request_takes_the_layers_to_come_only_at_a_pace_the_target_allows(
    transport, gap_ms: int
) -> None:
    """Layers signalled one by one: a fast model's layers go in one or two requests (each
    layer's bytes leave as soon as it is ready); a model slower than the target's bound per
    layer (llm.SyncKvCacheWaitTime) gets a request per layer, so no request outlives that
    bound on the target: the transfer succeeds either way, byte-exact."""
    layers, shape = 6, (4, 512)
    async with decoders(transport, **{"llm.SyncKvCacheWaitTime": "200"}) as ([dec], prompt):
        srcs, cfgs, dsts = await _layerwise_setup(dec, prompt, layers, shape)
        cm = prompt.cache_manager
        requests_before = prompt.link_statistics(2).transfers
        ready = dd.LayerEvents()
        task = cm.transfer_cache_async(srcs[0], ready, cfgs, [1, 2], [3, 0])
        for i in range(layers):
            ready.layer_ready(i)
            await anyio.sleep(gap_ms / 1000)
        await task
        assert await task.get_results() == [S.LLM_SUCCESS]
        requests = prompt.link_statistics(2).transfers - requests_before
        if gap_ms == 5:  # the layers ready at the call, one more to learn the pace, the rest
            assert requests <= 3
        else:  # a layer every 300 ms: a request of n layers would outlive n x 200 ms
            assert requests >= 3
        for t in range(2 * layers):
            got = await peer_tensor(dec, dsts[0], t, shape)
            want = expected_tensor(80, t, shape)
            assert np.array_equal(got[[3, 0]], want[[1, 2]])


async def _layerwise_setup(
    dec: PeerProcess, prompt: dd.LLMDataDist, layers: int, shape: tuple[int, int], keys: int = 1
) -> tuple[list[dd.Cache], list[dd.TransferWithCacheKeyConfig], list[int]]:
    """``keys`` destination caches on ``dec`` and as many sources, their tables snapshot."""
    cm = prompt.cache_manager
    desc = dd.CacheDesc(2 * layers, list(shape), dd.DataType.DT_UINT8)
    srcs, cfgs, dsts = [], [], []
    for m in range(keys):
        dsts.append(
            await dec.request(
                "register",
                kind="blocks",
                num_tensors=2 * layers,
                shape=list(shape),
                blocks_key=encode_key(dd.BlocksCacheKey(2, m)),
            )
        )
        srcs.append(cm.allocate_blocks_cache(desc))
        fill_src(srcs[-1], 80 + m)
        cfgs.append(
            dd.TransferWithCacheKeyConfig(
                dd.BlocksCacheKey(2, m), range(0, layers), range(0, layers)
            )
        )
    for src, cfg in zip(srcs, cfgs, strict=True):
        await cm.transfer_cache_async(src, Always(), [cfg], [0], [0])  # (the first: the table)
    return srcs, cfgs, dsts


@pytest.mark.parametrize("transport", ["tcp", "same-host"], indirect=True)
async def test_layerwise_transfers_waiting_for_a_grant_hold_no_link(transport) -> None:
    """With one serving slot on the target, a second layer-wise transfer's request waits there
    until the first one ended: it must not hold the link meanwhile, which the first one
    needs for its next layers (that would deadlock both until the target's bound)."""
    layers, shape = 6, (4, 512)
    extra = {"llm.LinkServing": "1", "llm.SyncKvCacheWaitTime": "2000"}
    async with decoders(transport, **extra) as ([dec], prompt):
        srcs, cfgs, dsts = await _layerwise_setup(dec, prompt, layers, shape, keys=2)
        cm = prompt.cache_manager
        events = [dd.LayerEvents(), dd.LayerEvents()]
        tasks = []
        for ev, src, cfg in zip(events, srcs, cfgs, strict=True):
            ev.layer_ready(0)
            ev.layer_ready(1)
            tasks.append(cm.transfer_cache_async(src, ev, [cfg], [1, 2], [3, 0]))
            await anyio.sleep(0.05)
        t0 = anyio.current_time()
        for i in range(2, layers):
            for ev in events:
                ev.layer_ready(i)
            await anyio.sleep(0.01)
        for task in tasks:
            await task
            assert await task.get_results() == [S.LLM_SUCCESS]
        assert anyio.current_time() - t0 < 1.5  # well within the target's bound (2 s a layer)
        for m, dst in enumerate(dsts):
            for t in range(2 * layers):
                got = await peer_tensor(dec, dst, t, shape)
                want = expected_tensor(80 + m, t, shape)
                assert np.array_equal(got[[3, 0]], want[[1, 2]])


async def test_a_layerwise_transfer_to_a_silent_peer_ends_at_its_deadline() -> None:
    """The peer never answers the request: the transfer ends with LLM_TIMEOUT (its budget is
    sync_kv_timeout per layer of the request), and the link serves pulls again."""
    layers, shape = 2, (4, 512)
    async with decoders("tcp", **{"llm.SyncKvCacheWaitTime": "200"}) as ([dec], prompt):
        srcs, cfgs, _ = await _layerwise_setup(dec, prompt, layers, shape)
        cm = prompt.cache_manager
        dec.pause()
        try:
            task = cm.transfer_cache_async(srcs[0], Always(), cfgs, [1], [2])
            with anyio.fail_after(3):
                with pytest.raises(dd.LLMException) as err:
                    await task
            assert err.value.status_code == S.LLM_TIMEOUT
        finally:
            dec.resume()
        desc = dd.CacheDesc(2 * layers, list(shape), dd.DataType.DT_UINT8)
        local = cm.allocate_blocks_cache(desc)
        await cm.pull_blocks(dd.BlocksCacheKey(2, 0), local, [1], [1])


@pytest.mark.parametrize("transport", ["tcp", "same-host"], indirect=True)
async def test_a_model_that_pauses_after_its_first_layers_still_transfers(transport) -> None:
    """Layers ready at the call say nothing of the model's pace: the request takes those, not
    the layers still to come, so a pause longer than the target's bound on a request of every
    layer (6 x 200 ms) fails nothing."""
    layers, shape = 6, (4, 512)
    async with decoders(transport, **{"llm.SyncKvCacheWaitTime": "200"}) as ([dec], prompt):
        srcs, cfgs, dsts = await _layerwise_setup(dec, prompt, layers, shape)
        ev = dd.LayerEvents()
        ev.layer_ready(0)
        ev.layer_ready(1)
        task = prompt.cache_manager.transfer_cache_async(srcs[0], ev, cfgs, [1], [2])
        await anyio.sleep(1.5)
        for i in range(2, layers):
            ev.layer_ready(i)
        await task
        assert await task.get_results() == [S.LLM_SUCCESS]
        for t in range(2 * layers):
            got = await peer_tensor(dec, dsts[0], t, shape)
            assert np.array_equal(got[2], expected_tensor(80, t, shape)[1])


@pytest.mark.parametrize("transport", ["tcp", "same-host"], indirect=True)
async def test_a_request_the_target_stops_serving_fails_at_once(transport) -> None:
    """A model that stalls in the middle of a request for longer than the target's bound on
    it (llm.ServeTimeout): the target stops serving it, and the transfer fails with
    LLM_TIMEOUT then, not when the next layer comes; the link keeps working."""
    layers, shape = 8, (4, 512)
    extra = {"llm.ServeTimeout": "300", "llm.SyncKvCacheWaitTime": "2000"}
    async with decoders(transport, **extra) as ([dec], prompt):
        srcs, cfgs, _ = await _layerwise_setup(dec, prompt, layers, shape)
        ev = dd.LayerEvents()
        task = prompt.cache_manager.transfer_cache_async(srcs[0], ev, cfgs, [1], [2])
        for i in range(4):  # a pace of 5 ms a layer: the rest goes in the request of layer 1
            ev.layer_ready(i)
            await anyio.sleep(0.005)
        with anyio.move_on_after(1.5):
            with pytest.raises(dd.LLMException) as err:
                await task
        assert task.done()  # before the model went on
        assert err.value.status_code == S.LLM_TIMEOUT
        for i in range(4, layers):
            ev.layer_ready(i)
        await prompt.cache_manager.transfer_cache_async(srcs[0], Always(), cfgs, [0], [0])


@pytest.mark.parametrize("transport", ["tcp", TRANSPORTS[2]], indirect=True)
async def test_pulls_and_layerwise_on_one_link_never_interleave(transport) -> None:
    shape = (64, 16384)
    async with decoders(transport, **{"llm.SyncKvCacheWaitTime": "20000"}) as ([dec], prompt):
        await dec.request(
            "register",
            kind="blocks",
            num_tensors=4,
            shape=list(shape),
            blocks_key=encode_key(dd.BlocksCacheKey(2, 0)),
            seed=66,
        )
        cm = prompt.cache_manager
        src = cm.allocate_blocks_cache(dd.CacheDesc(4, list(shape), dd.DataType.DT_UINT8))
        fill_src(src, 67)
        local = [
            cm.allocate_blocks_cache(dd.CacheDesc(4, list(shape), dd.DataType.DT_UINT8))
            for _ in range(3)
        ]
        cfg = dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2, 0), range(0, 2), range(0, 2))
        blocks = list(range(32))
        await cm.pull_blocks(dd.BlocksCacheKey(2, 0), local[0], [0], [0])  # table snapshot
        before = len(prompt.link_statistics(2).recent)
        ready = dd.LayerEvents()
        ready.layer_ready(0)
        ready.layer_ready(1)
        # The decoder is frozen so the first pull holds the link; the others queue behind it
        # in the order they are issued.
        dec.pause()
        try:
            tasks = [cm.pull_blocks(dd.BlocksCacheKey(2, 0), local[0], blocks, blocks)]
            await anyio.sleep(0.05)
            tasks.append(
                cm.transfer_cache_async(src, ready, [cfg], blocks, [b + 32 for b in blocks])
            )
            for dst in local[1:]:
                await anyio.sleep(0.05)
                tasks.append(cm.pull_blocks(dd.BlocksCacheKey(2, 0), dst, blocks, blocks))
            await anyio.sleep(0.05)
        finally:
            dec.resume()
        for t in tasks:
            await t
        for dst in local:
            for t in range(4):
                assert np.array_equal(dst.tensors[t][:32], expected_tensor(66, t, shape)[:32])
        recent = sorted(prompt.link_statistics(2).recent[before:], key=lambda r: r.started)
        # The first pull first. The layer-wise transfer takes the link for its layers once its
        # request is granted (never while it waits for the grant, which the peer may hold
        # back for the link's other layer-wise requests): the pulls issued meanwhile, side by
        # side, may go first. Both layers were ready at the call: they leave together, or
        # layer 1 after layer 0 if it was handed over only once layer 0 was on its way.
        ops = [r.op for r in recent]
        assert ops[0] == "pull"
        assert ops.count("pull") == 3 and 1 <= ops.count("push") <= 2
        assert sum(r.nbytes for r in recent if r.op == "push") == 2 * 2 * 32 * shape[1]
        for a, b in itertools.pairwise(recent):
            if "push" in (a.op, b.op):
                assert b.started >= a.finished  # a layer has the link to itself


async def test_two_links_proceed_independently() -> None:
    async with decoders("tcp", n=2, **{"llm.SyncKvCacheWaitTime": "20000"}) as (decs, prompt):
        for i, d in enumerate(decs):
            await d.request(
                "register",
                kind="blocks",
                num_tensors=2,
                shape=[4, 64],
                blocks_key=encode_key(dd.BlocksCacheKey(2 + i, 0)),
            )
        cm = prompt.cache_manager
        src = cm.allocate_blocks_cache(dd.CacheDesc(2, [4, 64], dd.DataType.DT_UINT8))
        cfg = [
            dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2 + i, 0), range(0, 1), range(0, 1))
            for i in range(2)
        ]
        decs[0].pause()  # the link to cluster 2 hangs...
        try:
            slow = cm.transfer_cache_async(src, Always(), [cfg[0]], [0], [0])
            fast = cm.transfer_cache_async(src, Always(), [cfg[1]], [0], [0])
            with anyio.fail_after(5):
                await fast  # ...while cluster 3 is served
            assert not slow.done()
        finally:
            decs[0].resume()
        await slow


# ------------------------------------------------------------------ statistics
class SlowLayers(dd.AsyncLayerSynchronizer):
    """A forward pass whose layers come 0.2 s apart."""

    async def synchronize_layer(self, layer_index, timeout_in_millis):
        if layer_index:
            await anyio.sleep(0.2)
        return True


async def test_gbps_counts_the_time_bytes_moved_not_the_wait_for_layers() -> None:
    async with decoders("tcp") as ([dec], prompt):
        await register_blocks_at(dec, 8, [16, 4096])
        cm = prompt.cache_manager
        src = cm.allocate_blocks_cache(dd.CacheDesc(8, [16, 4096], dd.DataType.DT_UINT8))
        cfg = dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2, 0), range(0, 4), range(0, 4))
        task = cm.transfer_cache_async(src, SlowLayers(), [cfg], list(range(16)), list(range(16)))
        await task
        stats = task.statistics()
    assert stats.bytes == 8 * 16 * 4096
    assert [lt.layer for lt in stats.layers] == [0, 1, 2, 3]
    # One destination: its layers go out one after the other, so their intervals are disjoint
    # and the busy time is their sum; the wall time also holds the 3 x 0.2 s waits for layers.
    moving = sum(lt.finished - lt.started for lt in stats.layers)
    assert stats.busy_seconds == pytest.approx(moving)
    assert stats.busy_seconds < stats.seconds
    assert stats.gbps == pytest.approx(stats.bytes / stats.busy_seconds / 1e9)
    assert stats.wall_gbps == pytest.approx(stats.bytes / stats.seconds / 1e9)
    assert stats.gbps > stats.wall_gbps


def test_busy_time_is_the_union_of_intervals() -> None:
    from llmdd_async._task import busy_time

    assert busy_time([]) == 0
    assert busy_time([(0.0, 1.0), (2.0, 3.0)]) == 2.0
    assert busy_time([(2.0, 3.0), (0.0, 1.5), (1.0, 2.5)]) == 3.0  # overlaps count once
    assert busy_time([(0.0, 4.0), (1.0, 2.0)]) == 4.0  # nested


# ------------------------------------------------------------------ validation
async def test_validation_rules_raise_at_the_call() -> None:
    async with decoders("tcp") as (_, prompt):
        cm = prompt.cache_manager
        blocks = cm.allocate_blocks_cache(dd.CacheDesc(4, [4, 64], dd.DataType.DT_UINT8))
        cont = cm.allocate_cache(dd.CacheDesc(4, [2, 64], dd.DataType.DT_UINT8))
        odd = cm.allocate_blocks_cache(dd.CacheDesc(3, [4, 64], dd.DataType.DT_UINT8))
        host = cm.allocate_blocks_cache(
            dd.CacheDesc(4, [4, 64], dd.DataType.DT_UINT8, dd.Placement.HOST)
        )
        key = dd.BlocksCacheKey(2, 0)
        ok = dd.TransferWithCacheKeyConfig(key, range(0, 2), range(0, 2))
        sync = Always()
        rows = [
            (lambda: cm.transfer_cache_async(host, sync, [ok], [0], [0]), S.LLM_PARAM_INVALID),
            (lambda: cm.transfer_cache_async(odd, sync, [ok], [0], [0]), S.LLM_PARAM_INVALID),
            (lambda: cm.transfer_cache_async(blocks, sync, [ok], [0], None), S.LLM_PARAM_INVALID),
            (lambda: cm.transfer_cache_async(blocks, sync, [ok], [0, 1], [0]), S.LLM_PARAM_INVALID),
            (lambda: cm.transfer_cache_async(blocks, sync, [ok], None, [0]), S.LLM_PARAM_INVALID),
            (lambda: cm.transfer_cache_async(cont, sync, [ok], None, [0]), S.LLM_PARAM_INVALID),
            (
                lambda: cm.transfer_cache_async(cont, sync, [ok], None, None, 64),
                S.LLM_PARAM_INVALID,
            ),
            (lambda: cm.transfer_cache_async(blocks, sync, [ok], [4], [0]), S.LLM_PARAM_INVALID),
            (lambda: cm.transfer_cache_async(blocks, sync, [], [0], [0]), S.LLM_PARAM_INVALID),
            (
                lambda: cm.transfer_cache_async(
                    blocks,
                    sync,
                    [dd.TransferWithCacheKeyConfig(key, range(1, 3), range(0, 2))],
                    [0],
                    [0],
                ),
                S.LLM_PARAM_INVALID,
            ),
            (
                lambda: cm.transfer_cache_async(
                    cont,
                    sync,
                    [
                        dd.TransferWithCacheKeyConfig(
                            dd.CacheKeyByIdAndIndex(2, 1, 0),
                            range(0, 1),
                            range(0, 1),
                            src_batch_index=2,
                        )
                    ],
                ),
                S.LLM_PARAM_INVALID,
            ),
            (
                lambda: cm.transfer_cache_async(
                    blocks,
                    sync,
                    [
                        dd.TransferWithCacheKeyConfig(
                            dd.BlocksCacheKey(9, 0), range(0, 1), range(0, 1)
                        )
                    ],
                    [0],
                    [0],
                ),
                S.LLM_NOT_YET_LINK,
            ),
            (
                lambda: cm.transfer_cache_async(
                    blocks,
                    sync,
                    [
                        dd.TransferWithCacheKeyConfig(
                            dd.BlocksCacheKey(PROMPT, 0), range(0, 1), range(0, 1)
                        )
                    ],
                    [0],
                    [0],
                ),
                S.LLM_PARAM_INVALID,
            ),
        ]
        for i, (call, code) in enumerate(rows):
            with pytest.raises(dd.LLMException) as err:
                call()
            assert err.value.status_code == code, i
        with pytest.raises(TypeError):  # wrong config class for remote-accessible mode
            cm.transfer_cache_async(blocks, sync, [dd.TransferConfig(2, [1, 2])], [0], [0])
        with pytest.raises(TypeError):
            cm.transfer_cache_async(blocks, object(), [ok], [0], [0])
        with pytest.raises(TypeError):
            cm.transfer_cache_async(blocks, sync, ok, [0], [0])
        with pytest.raises(TypeError):
            cm.transfer_cache_async(blocks, sync, [ok], ["0"], [0])
        with pytest.raises(ValueError):
            cm.transfer_cache_async(blocks, sync, [ok], [0], [0], -1)


async def test_transfer_config_rules_in_request_response_mode() -> None:
    async with decoders("tcp", ra=False) as (_, prompt):
        cm = prompt.cache_manager
        blocks = cm.allocate_blocks_cache(dd.CacheDesc(4, [4, 64], dd.DataType.DT_UINT8))
        with pytest.raises(dd.LLMException) as err:  # 2 layers need 4 addresses
            cm.transfer_cache_async(blocks, Always(), [dd.TransferConfig(2, [1, 2, 3])], [0], [0])
        assert err.value.status_code == S.LLM_PARAM_INVALID
        with pytest.raises(dd.LLMException) as err:
            cm.transfer_cache_async(
                blocks, Always(), [dd.TransferConfig(2, [1, 2], range(0, 1), 1)], [0], [0]
            )
        assert err.value.status_code == S.LLM_PARAM_INVALID
        with pytest.raises(TypeError):
            cm.transfer_cache_async(
                blocks,
                Always(),
                [dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2), range(0, 1), range(0, 1))],
                [0],
                [0],
            )
        await prompt.unlink_clusters([cluster(2)], force=True)
