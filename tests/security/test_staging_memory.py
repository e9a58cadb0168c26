"""The staging memory a peer's requests make us hold: a stream over many ranges (more than
4,096) moves through a staging buffer of up to 32 MiB, gathered before its frame is sent.

Before: each such stream kept a buffer of its own for as long as it lived, so a peer that
sent ``llm.LinkServing`` (16) pulls of 8,192 ranges and never read made the victim hold 16
of them, 512 MiB on one link. Now a link's frames take their buffers from the link, two at a
time for sending (one on the wire, one being gathered) and one for receiving.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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


async def _pull_all(
    address: tuple[str, int],
    cache_id: int,
    src: np.ndarray,
    dst: np.ndarray,
    req_ids: Iterable[int],
    held: Callable[[], int] | None = None,
) -> None:
    """Pull blocks ``src`` of the victim's cache once per id over a new raw link, then read
    every byte (each pull must be served in full). With ``held`` (the victim's memory over
    its base), nothing is read at first: for 2 s, or until half the pulls' bytes are held."""
    ids = list(req_ids)
    total = len(src) * BLOCK
    peer = await raw_link(address, 90 + ids[0], rcvbuf=4096, remote_accessible=True)
    try:
        for i in ids:
            await peer.send(blocks_request("pull", i, cache_id, src, dst, 1, BLOCK, len(src)))
        if held is not None:
            with anyio.move_on_after(2):
                while held() < len(ids) // 2 * total:
                    await anyio.sleep(0.05)
        got: dict[int, int] = {}
        with anyio.fail_after(60):
            while sum(got.values()) < len(ids) * total:
                msg = await peer.frame()
                assert msg.type in (MT.GRANT, MT.DATA), (msg.type, msg.fields)
                if msg.type == MT.DATA:
                    got[msg.req_id] = got.get(msg.req_id, 0) + msg.payload_len
        assert sorted(got) == ids
    finally:
        peer.close()


async def _peak_of_pulls_not_read(
    victim: PeerProcess, cache_id: int, src: np.ndarray, dst: np.ndarray
) -> int:
    """How much the victim's peak RSS grows while a peer makes ``PULLS`` pulls of ``src`` and
    reads nothing at first (after a first pull that loads the code paths and the pages)."""
    assert victim.listen is not None
    pid = victim.process.pid
    await _pull_all(victim.listen, cache_id, src, dst, [1])
    await anyio.sleep(0.3)
    base = _status(pid, "VmRSS")
    _reset_peak(pid)
    held = lambda: _status(pid, "VmHWM") - base  # noqa: E731
    await _pull_all(victim.listen, cache_id, src, dst, range(10, 10 + PULLS), held)
    return held()


async def test_a_peer_that_never_reads_many_range_pulls_holds_two_staging_buffers(
    anyio_backend: Any,
) -> None:
    opts = endpoint_options("tcp", listen=True, ra=True, **{"llm.SyncKvCacheWaitTime": "60000"})
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, opts, loop=_loop(anyio_backend)) as victim:
        assert victim.listen is not None
        cache_id = await victim.request(
            "register", kind="blocks", num_tensors=1, shape=[BLOCKS, BLOCK], seed=3
        )
        src = np.arange(0, BLOCKS, 2)  # every other block: ranges that do not merge
        # Before, every pull gathered its 32 MiB while the first frame waited for the socket.
        peak = await _peak_of_pulls_not_read(victim, cache_id, src, np.arange(len(src)))
        assert peak <= 128 * MiB, f"the victim held {peak / MiB:.0f} MiB more at its peak"


async def test_a_peer_that_never_reads_pulls_of_device_memory_holds_two_staging_buffers(
    anyio_backend: Any,
) -> None:
    # Device memory (the torch adapter on CPU tensors: exactly an accelerator's code path)
    # moves through host staging buffers, pinned on CUDA: each stream kept one of 32 MiB for
    # its whole life, so 16 pulls of a 32 MiB cache that the peer never read held 512 MiB.
    pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
    opts = endpoint_options(
        "tcp",
        listen=True,
        ra=True,
        **{
            "llm.SyncKvCacheWaitTime": "60000",
            "llm.DeviceAdapter": "torch",
            "llm.TorchDevice": "cpu",
        },
    )
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, opts, loop=_loop(anyio_backend)) as victim:
        assert victim.listen is not None
        blocks = 32 * MiB // BLOCK
        cache_id = await victim.request(
            "alloc", kind="blocks", num_tensors=1, shape=[blocks, BLOCK]
        )
        peak = await _peak_of_pulls_not_read(victim, cache_id, np.arange(blocks), np.arange(blocks))
        assert peak <= 128 * MiB, f"the victim held {peak / MiB:.0f} MiB more at its peak"
