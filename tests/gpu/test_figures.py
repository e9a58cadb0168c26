"""Figures of the torch path, recorded (``figures`` fixture, JSON summary) and never asserted:

- ``staged_pull_gbps``: a pull of the peer's device memory into host memory here (the peer
  stages device -> pinned host -> socket), bytes / busy time, best of 3;
- ``torch_d2h_copy_gbps``: ``Tensor.copy_`` of as many bytes from device memory into pinned
  host memory, on the same device, best of 3 (the ceiling of the staging step);
- ``one_block_pull_p50_ms`` (and p90): one block pulled device -> device, again and again.

Every pull is still checked byte for byte, so a figure never comes from a wrong transfer.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import anyio
import numpy as np
import pytest
from helpers import cm_options, link

import llmdd_async as dd

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

from gpu_kit import (  # noqa: E402 - after the importorskip
    LOCAL,
    PEER,
    TorchPeer,
    as_rows,
    endpoint_options,
    reference,
    sync,
)

pytestmark = pytest.mark.anyio


def _sizes(device: str) -> tuple[int, int, int]:
    """(blocks, block bytes, one-block repeats): big on a GPU, small for CPU CI."""
    if device == "cuda":
        return 64, 4 << 20, 200  # 256 MiB
    return 8, 1 << 20, 20  # 8 MiB


def _torch_copy_gbps(device: str, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    dst.copy_(src)  # warm-up
    best = float("inf")
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=device == "cuda")
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


async def test_staged_pull_and_one_block_latency(
    device: str, peer: TorchPeer, figures: Callable[..., None]
) -> None:
    nb, blk, repeats = _sizes(device)
    figures("torch_d2h_copy_gbps", _torch_copy_gbps(device, nb * blk), "GB/s")
    async with peer.endpoint("tcp") as ep:
        await ep.register("plain", nb, [blk], 1, model_id=0, seed=800)
        await ep.register("plain", 64, [32 * 1024], 2, model_id=1, seed=810)

        # device (peer) -> host (here): this endpoint keeps the host adapter
        host_opts = cm_options(
            **{
                "llm.Transport": "tcp",
                "llm.EnableRemoteCacheAccessible": "1",
                "llm.SyncKvCacheWaitTime": "60000",
            }
        )
        async with dd.LLMDataDist(dd.LLMRole.MIX, LOCAL).running(host_opts) as d:
            await link(d, PEER, ep.listen)
            host = np.zeros((nb, blk), np.uint8)
            cache = d.cache_manager.register_blocks_cache(
                dd.CacheDesc(1, [nb, blk], dd.DataType.DT_UINT8), [host]
            )
            want = reference(800, 0, nb, blk)
            best = 0.0
            for _ in range(3):
                host[:] = 0
                task = d.cache_manager.pull_blocks(
                    dd.BlocksCacheKey(PEER, 0), cache, list(range(nb)), list(range(nb))
                )
                with anyio.fail_after(120):
                    await task
                assert np.array_equal(host, want)
                best = max(best, task.statistics().gbps)
            figures("staged_pull_gbps", best, "GB/s")
            figures("staged_pull_bytes", float(nb * blk), "B")

        # one block, device -> device
        async with dd.LLMDataDist(dd.LLMRole.MIX, LOCAL).running(
            endpoint_options(device, "tcp")
        ) as d:
            await link(d, PEER, ep.listen)
            kv = [torch.zeros([64, 32 * 1024], dtype=torch.uint8, device=device) for _ in range(2)]
            cache = d.cache_manager.register_blocks_cache(
                dd.CacheDesc(2, [64, 32 * 1024], dd.DataType.DT_UINT8), kv
            )
            times = []
            for i in range(repeats + 3):
                b = i % 64
                t0 = time.perf_counter()
                await d.cache_manager.pull_blocks(dd.BlocksCacheKey(PEER, 1), cache, [b], [b])
                if i >= 3:  # after warm-up
                    times.append(time.perf_counter() - t0)
            pulled = sorted({i % 64 for i in range(repeats + 3)})
            for t in range(2):
                want = reference(810, t, 64, 32 * 1024)[pulled]
                assert np.array_equal(as_rows(kv[t])[pulled], want)
            times.sort()
            figures("one_block_pull_p50_ms", statistics.median(times) * 1e3, "ms")
            figures("one_block_pull_p90_ms", times[int(0.9 * (len(times) - 1))] * 1e3, "ms")
            figures("one_block_bytes", 2.0 * 32 * 1024, "B")
