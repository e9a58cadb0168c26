"""Layer readiness waits for the compute stream, not for the Python call.

On CUDA a kernel writes layer *i* only after a delay (``torch.cuda._sleep`` queued before the
write on the compute stream), and readiness is recorded on that stream
(``TorchLayerEvents.record``, as ``save_kv_layer`` does). The Python calls return at once, long
before the device wrote anything: the peer must receive the late values, never the stale ones.
A control run takes readiness at the Python call instead (plain ``LayerEvents``) and must see
stale bytes, which shows the first test can fail.

On CPU there is no asynchronous stream, so an emulated one (a thread running queued work in
order) stands in for it: the test queues "write layer i late, then signal readiness", exactly
the shape of the CUDA run, and the transfer must wait for the signal. The CPU control takes
readiness at the queueing call and holds the emulated stream until the transfer ended: stale
bytes, deterministically.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import link

import llmdd_async as dd

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

from gpu_kit import (  # noqa: E402 - after the importorskip
    CPU_ONLY,
    CUDA_ONLY,
    LOCAL,
    PEER,
    PeerEndpoint,
    TorchPeer,
    endpoint_options,
    reference,
    shuffled,
    sync,
    write_bytes,
)

pytestmark = pytest.mark.anyio

LAYERS, NB, BLK = 3, 16, 64 * 1024
STALE, LATE = 700, 710
#: how long the CUDA compute stream is held before it writes each layer
DELAY_S = 0.2


class EmulatedStream:
    """A CPU stand-in for a device stream: callables run in order on one thread, after the
    call that queued them returned. ``hold()`` keeps queued work from starting until
    ``release()``."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._gate = threading.Event()
        self._gate.set()
        self._thread = threading.Thread(target=self._run, daemon=True, name="emulated-stream")
        self._thread.start()

    def _run(self) -> None:
        while (fn := self._work.get()) is not None:
            self._gate.wait()
            fn()

    def enqueue(self, fn: Callable[[], None]) -> None:
        self._work.put(fn)

    def hold(self) -> None:
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def close(self) -> None:
        self.release()
        self._work.put(None)
        self._thread.join(30)


def _cycles_per_second() -> float:
    """``torch.cuda._sleep`` cycles per second of this GPU, measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / (start.elapsed_time(end) / 1000)


async def _setup(ep: PeerEndpoint, d: dd.LLMDataDist, device: str) -> tuple[Any, list[Any], int]:
    """Our source cache (tensors holding the stale bytes) and the peer's destination."""
    dst_id = await ep.register("plain", NB, [BLK], 2 * LAYERS, model_id=1)
    await link(d, PEER, ep.listen)
    kv = [torch.zeros([NB, BLK], dtype=torch.uint8, device=device) for _ in range(2 * LAYERS)]
    cache = d.cache_manager.register_blocks_cache(
        dd.CacheDesc(2 * LAYERS, [NB, BLK], dd.DataType.DT_UINT8), kv
    )
    return cache, kv, dst_id


def _late(device: str) -> list[Any]:
    """The late values of each tensor, already on the device (only the copy is late)."""
    return [torch.from_numpy(reference(LATE, t, NB, BLK)).to(device) for t in range(2 * LAYERS)]


def _stale(kv: list[Any], device: str) -> None:
    for t, tensor in enumerate(kv):
        write_bytes(tensor, reference(STALE, t, NB, BLK))
    sync(device)


async def _received(ep: PeerEndpoint, dst_id: int, src: list[int], dst: list[int]) -> list[str]:
    """Per tensor: ``late``, ``stale`` or ``other`` for what the peer holds in ``dst``."""
    out = []
    for t in range(2 * LAYERS):
        got = (await ep.rows(dst_id, t, NB))[dst]
        if np.array_equal(got, reference(LATE, t, NB, BLK)[src]):
            out.append("late")
        elif np.array_equal(got, reference(STALE, t, NB, BLK)[src]):
            out.append("stale")
        else:
            out.append("other")
    return out


def _cfg() -> dd.TransferWithCacheKeyConfig:
    return dd.TransferWithCacheKeyConfig(
        dd.BlocksCacheKey(PEER, 1), range(0, LAYERS), range(0, LAYERS)
    )


async def _warm_up(cm: Any, cache: Any, src: list[int], dst: list[int]) -> None:
    """One layer-wise transfer of the same shape first: staging buffers (pinned host memory
    on CUDA, whose allocation may synchronise the device) exist before the timed run."""
    ev = dd.LayerEvents()
    task = cm.transfer_cache_async(cache, ev, [_cfg()], src, dst)
    for layer in range(LAYERS):
        ev.layer_ready(layer)
    with anyio.fail_after(60):
        await task


@pytest.mark.parametrize("device", CUDA_ONLY, indirect=True)
async def test_cuda_readiness_waits_for_the_compute_stream(
    device: str, peer: TorchPeer, figures: Callable[..., None]
) -> None:
    from llmdd_async.torch import TorchLayerEvents

    cycles = int(_cycles_per_second() * DELAY_S)
    async with peer.endpoint("tcp") as ep:
        async with dd.LLMDataDist(dd.LLMRole.MIX, LOCAL).running(
            endpoint_options(device, "tcp")
        ) as d:
            cache, kv, dst_id = await _setup(ep, d, device)
            src, dst = shuffled(NB, 12, seed=8)
            await _warm_up(d.cache_manager, cache, src, dst)
            late = _late(device)
            _stale(kv, device)
            events = TorchLayerEvents()
            task = d.cache_manager.transfer_cache_async(cache, events, [_cfg()], src, dst)
            t0 = time.perf_counter()
            for layer in range(LAYERS):  # the "forward pass": queued, returns at once
                torch.cuda._sleep(cycles)
                for t in (2 * layer, 2 * layer + 1):
                    kv[t].copy_(late[t])
                events.record(layer)
            queued_s = time.perf_counter() - t0
            with anyio.fail_after(60):
                await task
            done_s = time.perf_counter() - t0
            figures("python_calls_s", queued_s, "s")
            figures("transfer_done_after_s", done_s, "s")
            figures("device_delay_total_s", LAYERS * DELAY_S, "s")
            assert await _received(ep, dst_id, src, dst) == ["late"] * (2 * LAYERS)


@pytest.mark.parametrize("device", CUDA_ONLY, indirect=True)
async def test_cuda_control_readiness_at_the_python_call_sees_stale_bytes(
    device: str, peer: TorchPeer
) -> None:
    """The control of the test above: readiness taken when Python queued the layer."""
    cycles = int(_cycles_per_second() * DELAY_S)
    async with peer.endpoint("tcp") as ep:
        async with dd.LLMDataDist(dd.LLMRole.MIX, LOCAL).running(
            endpoint_options(device, "tcp")
        ) as d:
            cache, kv, dst_id = await _setup(ep, d, device)
            src, dst = shuffled(NB, 12, seed=9)
            await _warm_up(d.cache_manager, cache, src, dst)
            late = _late(device)
            _stale(kv, device)
            events = dd.LayerEvents()
            task = d.cache_manager.transfer_cache_async(cache, events, [_cfg()], src, dst)
            for layer in range(LAYERS):
                torch.cuda._sleep(cycles)
                for t in (2 * layer, 2 * layer + 1):
                    kv[t].copy_(late[t])
                events.layer_ready(layer)  # wrong on purpose: the device is not there yet
            with anyio.fail_after(60):
                await task
            torch.cuda.synchronize()
            got = await _received(ep, dst_id, src, dst)
            assert "stale" in got, f"readiness at the Python call still got {got}"


def _writer(pairs: list[tuple[Any, Any]]) -> Callable[[], None]:
    def write() -> None:
        for dst, src in pairs:
            dst.copy_(src)

    return write


class WatchedEvents(dd.LayerEvents):
    """``LayerEvents`` that note which layers the transfer asked about (any way of asking)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: set[int] = set()

    def is_layer_ready(self, layer_index: int) -> bool:
        self.asked.add(layer_index)
        return super().is_layer_ready(layer_index)

    def add_waker(self, layer_index: int, wake: Callable[[], None]) -> bool:
        self.asked.add(layer_index)
        return super().add_waker(layer_index, wake)

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.asked.add(layer_index)
        return super().synchronize_layer(layer_index, timeout_in_millis)


@pytest.mark.parametrize("device", CPU_ONLY, indirect=True)
@pytest.mark.parametrize("control", [False, True], ids=["stream", "control"])
async def test_cpu_readiness_waits_for_the_stream(
    device: str, peer: TorchPeer, control: bool
) -> None:
    """The emulated stream is held while the transfer runs ahead as far as it can: waiting
    for layer 0 (right) or done (control). Only then does the "device" write the layers."""
    async with peer.endpoint("tcp") as ep:
        async with dd.LLMDataDist(dd.LLMRole.MIX, LOCAL).running(
            endpoint_options(device, "tcp")
        ) as d:
            cache, kv, dst_id = await _setup(ep, d, device)
            src, dst = shuffled(NB, 12, seed=10)
            late = _late(device)
            _stale(kv, device)
            events = WatchedEvents()
            stream = EmulatedStream()
            try:
                stream.hold()  # the "device" is behind the Python calls
                task = d.cache_manager.transfer_cache_async(cache, events, [_cfg()], src, dst)
                for layer in range(LAYERS):
                    # "launch" the layer: its write runs later, on the emulated stream
                    stream.enqueue(_writer([(kv[t], late[t]) for t in (2 * layer, 2 * layer + 1)]))
                    if control:  # wrong on purpose: ready at the Python call
                        events.layer_ready(layer)
                    else:  # right: ready once the stream passed the write
                        stream.enqueue(lambda i=layer: events.layer_ready(i))
                with anyio.fail_after(60):  # as far as the transfer gets without the device
                    while not task.done() and 0 not in events.asked:
                        await anyio.sleep(0.001)
                if not control:
                    assert task.layers_done == 0  # nothing went out before the stream got there
                    assert not task.done()
                else:
                    with anyio.fail_after(60):
                        await task.synchronize()
                stream.release()
                with anyio.fail_after(60):
                    await task
            finally:
                stream.close()
            got = await _received(ep, dst_id, src, dst)
            assert got == (["stale"] if control else ["late"]) * (2 * LAYERS)
