"""The staging memory a peer's requests make us hold: a stream over many ranges (more than
4,096) moves through a staging buffer of up to 32 MiB, gathered before its frame is sent.

Before: each such stream kept a buffer of its own for as long as it lived, so a peer that
sent ``llm.LinkServing`` (16) pulls of 8,192 ranges and never read made the victim hold 16
of them, 512 MiB on one link. Now a link's frames take their buffers from the link, two at a
time for sending (one on the wire, one being gathered) and one for receiving.
"""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest
from helpers import blocks_request, endpoint_options, raw_link

import llmdd_async as dd
from llmdd_async._protocol import MT
from llmdd_async.testing import PeerProcess

pytestmark = pytest.mark.anyio

MiB = 1 << 20
BLOCK = 4 << 10
#: the victim's cache: 16,384 blocks of 4 KiB (64 MiB); each pull takes every other block,
#: 8,192 ranges of ours (a stream over many ranges) and 32 MiB (one full frame)
BLOCKS = 16384
PULLS = 16


def _loop(backend: Any) -> str:
    name, opts = backend
    return "trio" if name == "trio" else "uvloop" if opts.get("use_uvloop") else "asyncio"


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    raise AssertionError(f"no {field}")


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # the peak RSS (VmHWM) starts again from here


async def test_a_peer_that_never_reads_many_range_pulls_holds_two_staging_buffers(
    anyio_backend: Any,
) -> None:
    opts = endpoint_options("tcp", listen=True, ra=True, **{"llm.SyncKvCacheWaitTime": "60000"})
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, opts, loop=_loop(anyio_backend)) as victim:
        assert victim.listen is not None
        pid = victim.process.pid
        cache_id = await victim.request(
            "register", kind="blocks", num_tensors=1, shape=[BLOCKS, BLOCK], seed=3
        )
        src = np.arange(0, BLOCKS, 2)
        dst = np.arange(len(src))
        # A first pull, read in full: the code paths are loaded, the cache's pages touched.
        warm = await raw_link(victim.listen, 98, remote_accessible=True)
        try:
            await warm.send(blocks_request("pull", 1, cache_id, src, dst, 1, BLOCK, len(src)))
            got = 0
            with anyio.fail_after(30):
                while got < len(src) * BLOCK:
                    msg = await warm.frame()
                    if msg.type == MT.DATA:
                        got += msg.payload_len
        finally:
            warm.close()
        await anyio.sleep(0.3)
        base = _status(pid, "VmRSS")
        _reset_peak(pid)
        peer = await raw_link(victim.listen, 99, rcvbuf=4096, remote_accessible=True)
        try:
            for i in range(PULLS):
                await peer.send(
                    blocks_request("pull", 10 + i, cache_id, src, dst, 1, BLOCK, len(src))
                )
            # Not reading: before, every pull gathered its 32 MiB while the first frame
            # waited for the socket (the victim's RSS grew by 16 of them).
            with anyio.move_on_after(3):
                while _status(pid, "VmHWM") - base < (PULLS // 2) * 32 * MiB:
                    await anyio.sleep(0.05)
            # Then every byte is read: each pull is served in full.
            got_by: dict[int, int] = {}
            with anyio.fail_after(60):
                while sum(got_by.values()) < PULLS * len(src) * BLOCK:
                    msg = await peer.frame()
                    assert msg.type in (MT.GRANT, MT.DATA), (msg.type, msg.fields)
                    if msg.type == MT.DATA:
                        got_by[msg.req_id] = got_by.get(msg.req_id, 0) + msg.payload_len
            assert sorted(got_by) == list(range(10, 10 + PULLS))
        finally:
            peer.close()
        peak = _status(pid, "VmHWM") - base
        assert peak <= 128 * MiB, f"the victim held {peak / MiB:.0f} MiB more at its peak"
