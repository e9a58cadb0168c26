"""Small streamed pulls are served from the link's reader (no task, slot or thread), and stay
byte-exact when the socket takes only part of a frame or the link is keyed."""

from __future__ import annotations

import socket
from typing import Any

import numpy as np
import pytest

import llmdd_async as dd
from llmdd_async._net.link import Link
from llmdd_async.testing import (
    DEFAULT_OPTIONS,
    cache_entries,
    engine_of,
    link_of,
    linked_pair,
    wait_until,
)

pytestmark = pytest.mark.anyio

BLOCK = 64 << 10
BLOCKS = 40  # 40 blocks of 64 KiB: one block is served inline, 32 (2 MiB) are not


def _options(keyed: bool) -> dict[str, str]:
    opts = {**DEFAULT_OPTIONS, "llm.Transport": "tcp"}
    if keyed:
        opts["llm.AuthKey"] = "small-requests-test-key"
    return opts


async def _setup(prompt: dd.LLMDataDist, decoder: dd.LLMDataDist) -> tuple[Any, np.ndarray, Any]:
    src = np.random.default_rng(7).integers(0, 255, (BLOCKS, BLOCK), dtype=np.uint8)
    desc = dd.CacheDesc(1, [BLOCKS, BLOCK], dd.DataType.DT_UINT8)
    prompt.cache_manager.register_blocks_cache(desc, [src], dd.BlocksCacheKey(1, 0))
    dst = np.zeros((BLOCKS, BLOCK), dtype=np.uint8)
    cache = decoder.cache_manager.register_blocks_cache(desc, [dst])
    return cache, src, dst


def _count_serving_tasks(prompt: dd.LLMDataDist, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    server = engine_of(prompt).links.server
    calls: list[int] = []
    original = server.serve_request

    async def counted(link: Any, req: Any, msg: Any) -> None:
        calls.append(msg.req_id)
        await original(link, req, msg)

    monkeypatch.setattr(server, "serve_request", counted)
    return calls


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keyed"])
async def test_a_small_pull_is_served_without_a_task(
    keyed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with linked_pair(_options(keyed)) as (prompt, decoder):
        cache, src, dst = await _setup(prompt, decoder)
        tasks = _count_serving_tasks(prompt, monkeypatch)
        key = dd.BlocksCacheKey(1, 0)
        for s, d in [(3, 5), (39, 0), (0, 39)]:
            await decoder.cache_manager.pull_blocks(key, cache, [s], [d])
            assert np.array_equal(dst[d], src[s])
        assert tasks == []  # all three from the reader
        big = list(range(32))
        await decoder.cache_manager.pull_blocks(key, cache, big, big[::-1])
        assert len(tasks) == 1  # 2 MiB: a serving task, with its worker threads
        assert np.array_equal(dst[big[::-1]], src[big])
        served = link_of(prompt, 2)
        # The pull returned once its bytes landed; the prompt lets go of it when the
        # decoder's DONE arrives, a moment later.
        await wait_until(lambda: not served.serving and served.send_path_free, 5)


async def test_small_pulls_the_socket_takes_in_parts_are_finished_and_queued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with linked_pair(_options(True)) as (prompt, decoder):
        cache, src, dst = await _setup(prompt, decoder)
        served = link_of(prompt, 2)
        # A send buffer far below one frame: the reader's sendmsg takes only part of it.
        served.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        finished: list[int] = []
        original = Link._finish_now

        async def counted(self: Link, bufs: Any, idx: int, done: Any) -> None:
            finished.append(idx)
            await original(self, bufs, idx, done)

        monkeypatch.setattr(Link, "_finish_now", counted)
        writers: list[int] = []
        original_writer = Link._write_outbox

        async def writer(self: Link) -> None:
            writers.append(len(self._outbox))
            await original_writer(self)

        monkeypatch.setattr(Link, "_write_outbox", writer)
        tasks = _count_serving_tasks(prompt, monkeypatch)
        key = dd.BlocksCacheKey(1, 0)
        pulls = [(i, (i * 7) % BLOCKS) for i in range(8)]
        # In flight together: while one frame is being finished, the next requests find the
        # send lock taken and queue for the link's writer; every byte lands where it should.
        running = [decoder.cache_manager.pull_blocks(key, cache, [s], [d]) for s, d in pulls]
        for t in running:
            await t
        for s, d in pulls:
            assert np.array_equal(dst[d], src[s])
        assert finished, "no frame was finished by a task"
        assert writers and sum(writers) > 0, "nothing queued for the writer"
        assert tasks == []  # served by the reader, finished or written by the link
        await decoder.cache_manager.pull_blocks(key, cache, [1], [2])  # the link is fine
        assert np.array_equal(dst[2], src[1])
        assert served.alive and served.send_path_free
        entry = cache_entries(prompt)[0]
        assert entry.pins == 0  # what the reader pinned was let go
