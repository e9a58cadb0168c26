"""Per-link limits (README "Security model"): each test is one hostile peer over real sockets
on 127.0.0.1 (raw protocol frames from this test, or a child process) against a real
endpoint, checking that the peer can spend only its own link's share of the endpoint.

Before these limits (commit c5c8efd): every link's data workers took threads from anyio's
process-wide default limiter (40), a peer's requested deadline was taken as given (up to
1800 s), a link queued any number of requests, a frame's JSON fields could be as big as its
meta (256 MiB), and work interrupted by ``unlink_clusters`` mostly failed with
LLM_LINK_FAILED.
"""

from __future__ import annotations

import base64
import contextlib
import os
import random
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import helpers
import numpy as np
import pytest
from helpers import RawPeer, blocks_request, cluster, endpoint_options, link

import llmdd_async as dd
from llmdd_async._messages import Abort, Done, Grant, wire_status
from llmdd_async._protocol import MT, Message, encode
from llmdd_async._transports.tcp import INLINE_BYTES
from llmdd_async.testing import (
    PeerProcess,
    cache_entry,
    has_link,
    link_of,
    linked_pair,
    links_of,
    populated,
    wait_link_down,
    wait_until,
)

pytestmark = pytest.mark.anyio

S = dd.LLMStatusCode
MiB = 1 << 20


# ---------------------------------------------------------------------------- a raw peer
def raw_link(address: tuple[str, int], cluster_id: int, rcvbuf: int = 0) -> Any:
    """A hand-made peer linked as ``cluster_id``, with remote-accessible mode as the endpoints
    here use it."""
    return helpers.raw_link(address, cluster_id, rcvbuf, remote_accessible=True)


def pull_request(
    req_id: int, cache_id: int, tensor_bytes: int, timeout_ms: int = 600_000, **extra: Any
) -> Message:
    """An XFER_REQ pulling slot 0 of the endpoint's cache ``cache_id`` (one tensor) over the
    stream; ``timeout_ms`` is the deadline the peer asks for."""
    fields: dict[str, Any] = {
        "op": "pull",
        "target": {"by": "cache_id", "cache_id": cache_id, "index": 0},
        "shape": "slot",
        "layout": [tensor_bytes, 1, False],
        "local_slot": 0,
        "size": -1,
        "src_offset": 0,
        "dst_offset": 0,
        "src_range": None,
        "dst_range": None,
        "tnpl": 2,
        "dst_block_bytes": None,
        "raw": [0, 1, False],
        "caps": {},  # nothing reachable directly: the bytes come as DATA frames
        "timeout_ms": timeout_ms,
        **extra,
    }
    return Message(MT.XFER_REQ, req_id, fields, {"local_addrs": np.array([1 << 20], "<u8")})


def _u8(shape: list[int]) -> dd.CacheDesc:
    return dd.CacheDesc(1, shape, dd.DataType.DT_UINT8)


def _server_options(**extra: str) -> dict[str, str]:
    return endpoint_options("tcp", listen=True, ra=True, **extra)


def _client_options() -> dict[str, str]:
    return endpoint_options("tcp", ra=True)


async def _legit_pulls(d: dd.LLMDataDist, cache_id: int, n: int = 4) -> None:
    """``n`` small pulls by a well-behaved peer; each must succeed (within its deadline)."""
    cm = d.cache_manager
    mine = cm.allocate_cache(_u8([1, 64 << 10]))
    try:
        for i in range(n):
            mine.tensors[0][...] = 0
            await cm.pull_cache(dd.CacheKeyByIdAndIndex(1, cache_id, 0), mine)
            assert (mine.tensors[0] == 7).all(), i
    finally:
        cm.deallocate_cache(mine)


async def _stall(
    server: dd.LLMDataDist | None, address: tuple[str, int], cache_id: int, n: int, base: int
) -> list[RawPeer]:
    """``n`` hostile links (cluster ids ``base``...), each pulling the big cache ``cache_id``
    with a 600 s deadline and never reading a byte of it. With ``server`` in this process,
    returns once each link's data worker is blocked in a send."""
    peers: list[RawPeer] = []
    try:
        for i in range(n):  # every link first: then the pulls all stall at once
            peers.append(await raw_link(address, base + i, rcvbuf=4096))
        for peer in peers:
            await peer.send(pull_request(1, cache_id, BIG))
        if server is not None:
            await wait_until(
                lambda: all(
                    has_link(server, base + i) and link_of(server, base + i, alive=False).streaming
                    for i in range(n)
                ),
                10,
                0.01,
            )
    except BaseException:
        for p in peers:
            p.close()
        raise
    return peers


BIG = 8 * MiB


@contextlib.asynccontextmanager
async def _stall_server(**extra: str) -> AsyncIterator[tuple[dd.LLMDataDist, int, int]]:
    """An endpoint (cluster 1, TCP) with a big cache to stall on and a small one to pull."""
    # 6 s: the budget of a stalled pull here. On uvloop 42 blocked workers slow the loop
    # down a lot (the stalls take ~2 s to set up, a legit pull ~300 ms instead of 2 ms).
    opts = _server_options(**{"llm.SyncKvCacheWaitTime": "6000", **extra})
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        big = p.cache_manager.allocate_cache(_u8([1, BIG]))
        small = p.cache_manager.allocate_cache(_u8([1, 64 << 10]))
        small.tensors[0][...] = 7
        for c in (big, small):  # registration's page population runs in a default thread
            await populated(p, c.cache_id)
        yield p, big.cache_id, small.cache_id


# ---------------------------------------------------------------------------- 1. threads
async def test_stalled_pulls_on_many_links_do_not_starve_a_legit_peer() -> None:
    """42 hostile links each pull 8 MiB and never read: each holds one data worker, blocked in
    a send. Before, those workers came from anyio's default limiter (40 threads for the whole
    process) and were held for the 600 s the peer asked for: the legit peer's pull waited for
    a thread and timed out. Now each link has its own limiter (``llm.LinkThreads``) and a
    peer's deadline is capped by this side's budget (``llm.SyncKvCacheWaitTime`` per layer)."""
    async with _stall_server() as (p, big, small):
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            endpoint_options("tcp", ra=True, **{"llm.SyncKvCacheWaitTime": "10000"})
        ) as d:
            await link(d, 1, p.listen_address)
            assert d.link_statistics(1).transport == "tcp"
            hostile = await _stall(p, p.listen_address, big, 42, base=100)
            try:
                await _legit_pulls(d, small)
                links = links_of(p)
                # ...while every stalled pull was still held (the point of the test).
                assert all(links[100 + i].serving for i in range(42))
                # The stalled pulls end at this side's budget (6 s), not the peer's 600 s.
                await wait_until(
                    lambda: not any(links[100 + i].serving for i in range(42)), 15, 0.05
                )
                await _legit_pulls(d, small, 1)
            finally:
                for h in hostile:
                    h.close()


async def test_one_link_holds_at_most_link_threads_workers() -> None:
    """``llm.LinkThreads`` bounds the workers of one link (here 1): its limiter is the one
    the data workers take, not the process-wide default."""
    async with _stall_server(**{"llm.LinkThreads": "1"}) as (p, big, _small):
        (h,) = await _stall(p, p.listen_address, big, 1, base=100)
        try:
            lnk = link_of(p, 100, alive=False)
            assert lnk.threads.total_tokens == 1 and lnk.threads.borrowed_tokens == 1
            assert anyio.to_thread.current_default_thread_limiter().borrowed_tokens == 0
        finally:
            h.close()


# ---------------------------------------------------------------------------- 2. meta cap
async def test_oversized_json_fields_break_only_that_link() -> None:
    """An XFER_REQ whose JSON fields are 2 MB (a junk string field) breaks its link: the
    endpoint closes it. Before, fields were bounded only by the 256 MiB meta cap and were
    parsed (the request then got an error GRANT). Other links are unaffected."""
    async with _stall_server() as (p, _big, small):
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            endpoint_options("tcp", ra=True)
        ) as d:
            await link(d, 1, p.listen_address)
            evil = await raw_link(p.listen_address, 66)
            try:
                await evil.send(Message(MT.PING))
                assert (await evil.frame()).type == MT.PONG  # a working link so far
                await evil.send(pull_request(1, small, 64 << 10, junk="x" * (2 * MiB)))
                assert await evil.closed_by_peer(), "the endpoint kept the link"
            finally:
                evil.close()
            broken = link_of(p, 66, alive=False).broken
            assert "JSON fields of" in str(broken) and "exceed" in str(broken)
            await _legit_pulls(d, small, 2)
            assert link_of(p, 2, alive=False).alive


async def test_link_max_meta_lowers_the_meta_cap() -> None:
    """A frame with a 200 KB array: accepted under the default cap (64 MiB), refused (the link
    closed) by an endpoint with ``llm.LinkMaxMeta`` = 65536. Before, the option did not exist
    and every link accepted 256 MiB of meta."""
    arrays = {"junk": np.zeros(25_000, "<u8")}  # 200 000 bytes
    for cap, refused in ((None, False), ("65536", True)):
        extra = {} if cap is None else {"llm.LinkMaxMeta": cap}
        async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(_server_options(**extra)) as p:
            peer = await raw_link(p.listen_address, 66)
            try:
                small = Message(MT.PING, 0, {}, {"junk": np.zeros(1000, "<u8")})
                await peer.send(small)  # 8 KB: under either cap
                assert (await peer.frame()).type == MT.PONG
                await peer.send(Message(MT.PING, 0, {}, arrays))
                if refused:
                    assert await peer.closed_by_peer(), "a 200 KB meta passed a 64 KiB cap"
                    assert "exceeds 65536" in str(link_of(p, 66, alive=False).broken)
                else:
                    assert (await peer.frame()).type == MT.PONG
            finally:
                peer.close()


def test_link_limits_are_validated() -> None:
    from llmdd_async._options import parse_options

    base = endpoint_options()
    for key, bad in (
        ("llm.LinkMaxMeta", "1000"),  # under 64 KiB
        ("llm.LinkServing", "0"),
        ("llm.LinkQueue", "-1"),
        ("llm.LinkThreads", "many"),
        ("llm.ServeTimeout", "0"),
        ("llm.LinkHeartbeat", "1999"),  # under 2 s: a busy peer's host would look dead
        ("llm.LinkHeartbeat", "10s"),
    ):
        with pytest.raises(dd.LLMException) as err:
            parse_options({**base, key: bad})
        assert err.value.status_code == S.LLM_PARAM_INVALID, key
    with pytest.raises(dd.LLMException):  # a queue shorter than what is served
        parse_options({**base, "llm.LinkServing": "4", "llm.LinkQueue": "2"})
    limits = parse_options({**base, "llm.LinkQueue": "2", "llm.LinkServing": "1"}).limits
    assert (limits.queued, limits.serving, limits.threads) == (2, 1, 8)
    assert limits.heartbeat_s == 0.0  # unset: the stall timeout (tests/unit/test_tcp_helpers)
    assert parse_options({**base, "llm.LinkHeartbeat": "4000"}).limits.heartbeat_s == 4.0


@pytest.mark.parametrize(
    ("options", "want_ms"),
    [
        ({}, 10_000),  # the stall timeout: at least 10 s
        ({"llm.SyncKvCacheWaitTime": "60000"}, 60_000),  # a slow receiver is still waited for
        ({"llm.SyncKvCacheWaitTime": "60000", "llm.LinkHeartbeat": "4000"}, 4_000),
    ],
)
async def test_the_kernel_heartbeat_of_a_link_is_the_stall_timeout_unless_set(
    options: dict[str, str], want_ms: int
) -> None:
    """Unset, ``llm.LinkHeartbeat`` is the stall timeout: the kernel (TCP_USER_TIMEOUT, which
    also ends a link whose peer leaves its window shut) must not break a link the library
    would still wait for; set, each side's link sockets use it."""
    async with linked_pair({**endpoint_options(), **options}) as (prompt, decoder):
        for ep, peer in ((decoder, 1), (prompt, 2)):
            sock = link_of(ep, peer)._link.sock
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == want_ms


# ---------------------------------------------------------------------------- 3. queue cap
async def test_requests_over_the_queue_are_refused_busy() -> None:
    """``llm.LinkQueue`` = 2, ``llm.LinkServing`` = 1: a peer that sends 10 pushes and never
    their DATA gets request 1 served (GRANT ok; held until its bytes come), request 2 queued,
    and GRANT LLM_LINK_BUSY for requests 3..10. Before, every request was queued (memory and
    tasks without bound) and none was refused. (Pushes: a streamed pull is done once its
    bytes are sent, so it holds no slot the peer could keep.)"""
    opts = _server_options(**{"llm.LinkQueue": "2", "llm.LinkServing": "1"})
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        cache = p.cache_manager.allocate_cache(_u8([1, 256]))
        peer = await raw_link(p.listen_address, 66)
        try:
            for rid in range(1, 11):
                await peer.send(pull_request(rid, cache.cache_id, 256, op="push"))
            grants: dict[int, Message] = {}
            with anyio.fail_after(10):
                while len(grants) < 9:
                    msg = await peer.frame()
                    if msg.type == MT.GRANT:
                        grants[msg.req_id] = msg
            assert sorted(grants) == [1, *range(3, 11)]
            assert wire_status(grants[1]) == S.LLM_SUCCESS
            for rid in range(3, 11):
                assert wire_status(grants[rid]) == S.LLM_LINK_BUSY, grants[rid].fields
                assert "queued" in grants[rid].fields["message"]
            assert link_of(p, 66, alive=False).serving == 2
            # Finishing request 1 (its bytes) lets the queued request 2 in.
            await peer.send(Message(MT.DATA, 1, {"off": 0}, payload_len=256))
            await peer.send_bytes(bytes(256))
            with anyio.fail_after(10):
                while True:
                    msg = await peer.frame()
                    if msg.type == MT.GRANT:
                        break
                    assert msg.type == MT.RESULT and msg.req_id == 1
            assert msg.req_id == 2 and wire_status(msg) == S.LLM_SUCCESS
            assert link_of(p, 66, alive=False).alive
        finally:
            peer.close()


async def test_requests_that_arrive_together_are_queued_not_refused() -> None:
    """Requests read in one go are answered in one go (the reader corks the link's writer);
    what it holds meanwhile is not a queue: with ``llm.LinkQueue`` = 2 and ``llm.LinkServing``
    = 1, two pushes sent together get request 1 served and request 2 queued, as when they come
    one by one (counted as queued, the GRANT held for request 1 refused request 2)."""
    opts = _server_options(**{"llm.LinkQueue": "2", "llm.LinkServing": "1"})
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        cache = p.cache_manager.allocate_cache(_u8([1, 256]))
        peer = await raw_link(p.listen_address, 66)
        try:
            both = b"".join(
                encode(pull_request(rid, cache.cache_id, 256, op="push")) for rid in (1, 2)
            )
            await peer.send_bytes(both)
            grant = await peer.recv(MT.GRANT)
            assert grant.req_id == 1 and wire_status(grant) == S.LLM_SUCCESS
            await wait_until(lambda: link_of(p, 66, alive=False).serving == 2, 5)
            with anyio.move_on_after(0.3):  # request 2 waits for the slot: no answer yet
                msg = await peer.frame()
                raise AssertionError(f"request 2 was answered: {msg.type} {msg.fields}")
        finally:
            peer.close()


@contextlib.asynccontextmanager
async def _one_slot(queue: int) -> AsyncIterator[tuple[dd.LLMDataDist, Any, RawPeer]]:
    """An endpoint serving one request of a link at a time (``llm.LinkServing`` = 1) with a
    queue of ``queue``, a one-tensor cache of it, and a raw peer linked as cluster 66."""
    opts = _server_options(**{"llm.LinkQueue": str(queue), "llm.LinkServing": "1"})
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        cache = p.cache_manager.allocate_cache(_u8([1, 256]))
        peer = await raw_link(p.listen_address, 66)
        try:
            yield p, cache, peer
        finally:
            peer.close()


async def _push_holding_the_slot(p: dd.LLMDataDist, peer: RawPeer, cache_id: int) -> Any:
    """With ``llm.LinkServing`` = 1: the peer's push 1 granted (holding the one slot until its
    bytes come), push 2 parked behind it; returns the link."""
    for rid in (1, 2):
        await peer.send(pull_request(rid, cache_id, 256, op="push"))
    grant = await peer.recv(MT.GRANT)
    assert grant.req_id == 1 and wire_status(grant) == S.LLM_SUCCESS
    lnk = link_of(p, 66, alive=False)
    await wait_until(lambda: lnk.serving == 2, 5)
    return lnk


@pytest.mark.parametrize("stop", ["abort", "done"])
async def test_a_parked_request_its_peer_aborts_leaves_the_queue_unserved(stop: str) -> None:
    """A request waiting for a serving slot is parked in the link's queue. Its peer aborts it
    (or says it is done with it, unasked): it leaves the queue (its place and its bytes) and
    is never granted; the next request takes its place, and is granted once the slot is
    freed."""
    async with _one_slot(2) as (p, cache, peer):
        lnk = await _push_holding_the_slot(p, peer, cache.cache_id)
        queued = lnk._link.queued_bytes
        assert queued > 0
        if stop == "abort":
            await peer.send(Abort(2, S.LLM_TIMEOUT, "gave up", to_initiator=False).encode())
        else:
            await peer.send(Done(2, S.LLM_SUCCESS).encode())
        await wait_until(lambda: lnk.serving == 1, 5)
        assert lnk._link.queued_bytes == 0
        router = lnk._link.router
        assert not router._waiting and not router._parked  # nothing of it is held
        await peer.send(pull_request(3, cache.cache_id, 256, op="push"))  # not refused
        await wait_until(lambda: lnk.serving == 2, 5)
        await peer.send(Message(MT.DATA, 1, {"off": 0}, payload_len=256))
        await peer.send_bytes(bytes(256))
        seen: list[tuple[int, MT]] = []
        with anyio.fail_after(10):
            while len(seen) < 2:
                msg = await peer.frame()
                seen.append((msg.req_id, msg.type))
        assert seen == [(1, MT.RESULT), (3, MT.GRANT)]
        assert wire_status(msg) == S.LLM_SUCCESS
        with anyio.move_on_after(0.3):  # nothing for the aborted request, ever
            msg = await peer.frame()
            raise AssertionError(f"answered: {msg.req_id} {msg.type} {msg.fields}")
        assert lnk.alive and lnk.serving == 1


async def test_parked_requests_that_cannot_be_served_are_each_refused() -> None:
    """Parked requests are planned only once a slot is free: those that name no cache of ours
    are then refused (LLM_KV_CACHE_NOT_EXIST), each one, in order, and the link serves on."""
    async with _one_slot(8) as (p, cache, peer):
        lnk = await _push_holding_the_slot(p, peer, cache.cache_id)
        for rid in range(3, 7):
            await peer.send(pull_request(rid, 1 << 40, 256, op="push"))
        await wait_until(lambda: lnk.serving == 6, 5)
        answers: list[tuple[int, MT, Any]] = []
        for rid, n in ((1, 2), (2, 7)):  # each push's bytes, and what follows them
            await peer.send(Message(MT.DATA, rid, {"off": 0}, payload_len=256))
            await peer.send_bytes(bytes(256))
            with anyio.fail_after(10):
                while len(answers) < n:
                    msg = await peer.frame()
                    answers.append((msg.req_id, msg.type, wire_status(msg)))
        ok, gone = S.LLM_SUCCESS, S.LLM_KV_CACHE_NOT_EXIST
        assert answers == [
            (1, MT.RESULT, ok), (2, MT.GRANT, ok), (2, MT.RESULT, ok),
            *[(rid, MT.GRANT, gone) for rid in range(3, 7)],
        ]  # fmt: skip
        await wait_until(lambda: lnk.serving == 0, 5)
        assert lnk.alive


async def _answers(peer: RawPeer, n: int) -> list[tuple[int, MT, Any]]:
    """The next ``n`` frames of the peer: request id, type and status."""
    got: list[tuple[int, MT, Any]] = []
    with anyio.fail_after(10):
        while len(got) < n:
            msg = await peer.frame()
            got.append((msg.req_id, msg.type, wire_status(msg)))
    return got


async def _data(peer: RawPeer, rid: int, n: int) -> None:
    await peer.send(Message(MT.DATA, rid, {"off": 0}, payload_len=n))
    await peer.send_bytes(bytes(n))


async def test_requests_a_task_serves_wait_behind_parked_ones() -> None:
    """Requests served by a task (of many ranges, or refused) take a serving slot too: one
    that comes while others are parked waits behind them, never ahead."""
    async with _one_slot(8) as (p, cache, peer):
        lnk = await _push_holding_the_slot(p, peer, cache.cache_id)
        big = pull_request(3, cache.cache_id, 256)  # more tensors than INLINE_PIECES
        big.arrays["local_addrs"] = np.arange(1 << 14 | 1, dtype="<u8") << np.uint64(20)
        await peer.send(big)
        await peer.send(pull_request(4, 1 << 40, 256))  # no such cache
        await wait_until(lambda: lnk.serving == 4, 5)
        await _data(peer, 1, 256)
        ok = S.LLM_SUCCESS
        assert await _answers(peer, 2) == [(1, MT.RESULT, ok), (2, MT.GRANT, ok)]
        await _data(peer, 2, 256)
        got = await _answers(peer, 3)
        assert [g[:2] for g in got] == [(2, MT.RESULT), (3, MT.GRANT), (4, MT.GRANT)]
        assert got[1][2] != ok and got[2][2] == S.LLM_KV_CACHE_NOT_EXIST
        await wait_until(lambda: lnk.serving == 0, 5)
        assert lnk.alive


async def test_a_request_a_task_serves_keeps_its_place_ahead_of_the_next_one() -> None:
    """A slot free, a request a task serves (here refused: no such cache) then a push, in
    one write: the task takes the slot as it is handed the request, so the push waits for
    it, and the answers come in order."""
    async with _one_slot(8) as (p, cache, peer):
        await peer.send_bytes(
            encode(pull_request(1, 1 << 40, 256, op="push"))
            + encode(pull_request(2, cache.cache_id, 256, op="push"))
        )
        assert await _answers(peer, 2) == [
            (1, MT.GRANT, S.LLM_KV_CACHE_NOT_EXIST),
            (2, MT.GRANT, S.LLM_SUCCESS),
        ]
        lnk = link_of(p, 66, alive=False)
        assert lnk._link.serving_limiter.borrowed_tokens == 1  # (push 2's)
        await _data(peer, 2, 256)
        assert await _answers(peer, 1) == [(2, MT.RESULT, S.LLM_SUCCESS)]
        await wait_until(lambda: lnk.serving == 0, 5)
        assert lnk._link.serving_limiter.borrowed_tokens == 0


async def test_a_drain_of_parked_requests_serves_no_more_than_the_free_slots() -> None:
    """Parked pushes of thousands of ranges each (more than the reader streams: their tasks
    move them): a freed slot lets one of them in at a time, not every one at once (each is
    planned on the loop when let in)."""
    opts = _server_options(**{"llm.LinkQueue": "16", "llm.LinkServing": "1"})
    blocks, size = 5000, 64
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        cache = p.cache_manager.allocate_blocks_cache(_u8([blocks, size]))
        peer = await raw_link(p.listen_address, 66)
        try:
            await peer.send(blocks_request("push", 1, cache.cache_id, [0], [0], 1, size, blocks))
            grant = await peer.recv(MT.GRANT)
            assert grant.req_id == 1 and wire_status(grant) == S.LLM_SUCCESS
            lnk = link_of(p, 66, alive=False)
            served: list[list[int]] = []
            router, server = lnk._link.router, lnk._link.server
            drain, serve_now = router.serve_parked, server.serve_now

            def counted_drain() -> None:
                served.append([])
                drain()

            def counted(link: Any, request: Any) -> Any:
                if served:
                    served[-1].append(request.req_id)
                return serve_now(link, request)

            router.serve_parked, server.serve_now = counted_drain, counted
            order = np.random.default_rng(5).permutation(blocks)
            for rid in range(2, 8):
                await peer.send(
                    blocks_request("push", rid, cache.cache_id, order, order, 1, size, blocks)
                )
            await wait_until(lambda: lnk.serving == 7, 5)
            await _data(peer, 1, size)
            assert (await _answers(peer, 1))[0][:2] == (1, MT.RESULT)
            for rid in range(2, 8):  # in order; each let go by its peer once granted
                assert await _answers(peer, 1) == [(rid, MT.GRANT, S.LLM_SUCCESS)]
                await peer.send(Abort(rid, S.LLM_TIMEOUT, "enough", to_initiator=False).encode())
            await wait_until(lambda: lnk.serving == 0, 5)
            assert max(len(s) for s in served) == 1, served
        finally:
            peer.close()


async def test_a_parked_request_keeps_its_deadline() -> None:
    """The time a request waited parked counts against its deadline: one that runs out while
    parked is not granted afresh once let in; its initiator is told it ran past its budget."""
    async with _one_slot(4) as (p, cache, peer):
        await peer.send(pull_request(1, cache.cache_id, 256, op="push"))
        assert (await _answers(peer, 1))[0][:2] == (1, MT.GRANT)
        await peer.send(pull_request(2, cache.cache_id, 256, timeout_ms=200, op="push"))
        lnk = link_of(p, 66, alive=False)
        await wait_until(lambda: lnk.serving == 2, 5)
        await anyio.sleep(0.4)
        await _data(peer, 1, 256)
        got = await _answers(peer, 2)
        assert got == [(1, MT.RESULT, S.LLM_SUCCESS), (2, MT.ABORT, S.LLM_TIMEOUT)], got
        await wait_until(lambda: lnk.serving == 0, 5)
        assert lnk._link.queued_bytes == 0


async def test_a_peer_that_parks_and_aborts_requests_again_and_again_holds_no_more() -> None:
    """Aborted parked requests leave the queue at once; what is left of them is dropped as the
    queue goes, so a peer that parks and aborts requests without end grows nothing."""
    async with _one_slot(4) as (p, cache, peer):
        lnk = await _push_holding_the_slot(p, peer, cache.cache_id)
        await peer.send(Abort(2, S.LLM_TIMEOUT, "no", to_initiator=False).encode())
        router = lnk._link.router
        for rid in range(3, 203):
            await peer.send(pull_request(rid, cache.cache_id, 256, op="push"))
            await peer.send(Abort(rid, S.LLM_TIMEOUT, "no", to_initiator=False).encode())
        await wait_until(lambda: lnk.serving == 1, 5)
        await peer.send(pull_request(203, cache.cache_id, 256, op="push"))
        await wait_until(lambda: lnk.serving == 2, 5)
        assert len(router._parked) <= 18, len(router._parked)
        await _data(peer, 1, 256)
        got = await _answers(peer, 2)
        assert got == [(1, MT.RESULT, S.LLM_SUCCESS), (203, MT.GRANT, S.LLM_SUCCESS)]
        assert lnk._link.queued_bytes == 0 and lnk.alive


def _mixed_request(rng: random.Random, rid: int, cache_id: int) -> tuple[str, Message]:
    """A push (some with a deadline of milliseconds), a push naming no cache (refused by a
    task), a request of more ranges than the reader plans (a task's) or a small pull."""
    kind = rng.choice(["push", "push", "nocache", "big", "pull"])
    if kind == "push":
        timeout = rng.choice([600_000, 600_000, rng.randint(1, 30)])
        return kind, pull_request(rid, cache_id, 256, op="push", timeout_ms=timeout)
    if kind == "nocache":
        return kind, pull_request(rid, 1 << 40, 256, op="push")
    msg = pull_request(rid, cache_id, 256)
    if kind == "big":
        msg.arrays["local_addrs"] = np.arange(1 << 14 | 1, dtype="<u8") << np.uint64(20)
    return kind, msg


@pytest.mark.parametrize(("serving", "seed"), [(1, 0), (1, 1), (3, 2)])
async def test_a_peer_that_mixes_requests_and_aborts_gets_each_answered_in_order(
    serving: int, seed: int
) -> None:
    """Bursts of pushes, refusals, requests a task serves and small pulls, some aborted by the
    peer at any point, some out of time while they wait: every request not aborted is
    answered once (at most one GRANT), those that need a serving slot are granted in the
    order they came (one slot), and the link ends with nothing held (slots, queue, bytes)."""
    rng = random.Random(seed)
    opts = _server_options(**{"llm.LinkQueue": "64", "llm.LinkServing": str(serving)})
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        cache = p.cache_manager.allocate_cache(_u8([1, 256]))
        peer = await raw_link(p.listen_address, 66)
        kinds: dict[int, str] = {}
        aborted: set[int] = set()
        grants: list[int] = []
        answers: dict[int, list[tuple[MT, Any]]] = {}

        def settled(rid: int) -> bool:
            return any(a != (MT.GRANT, S.LLM_SUCCESS) for a in answers.get(rid, []))

        async def read() -> None:
            while True:
                msg = await peer.frame()
                rid, status = msg.req_id, wire_status(msg)
                answers.setdefault(rid, []).append((msg.type, status))
                if msg.type == MT.GRANT:
                    grants.append(rid)
                    if status == S.LLM_SUCCESS and kinds[rid] == "push" and rid not in aborted:
                        await _data(peer, rid, 256)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                rid = 0
                for _ in range(40):
                    for _ in range(rng.randint(1, 6)):
                        rid += 1
                        kinds[rid], msg = _mixed_request(rng, rid, cache.cache_id)
                        await peer.send(msg)
                    open_ = [r for r in kinds if r not in aborted and not settled(r)]
                    if open_ and rng.random() < 0.5:
                        gone = rng.choice(open_)
                        aborted.add(gone)
                        await peer.send(Abort(gone, S.LLM_TIMEOUT, "x").encode())
                    await anyio.sleep(rng.random() * 0.003)
                lnk = link_of(p, 66, alive=False)
                await wait_until(lambda: lnk.serving == 0, 10)
                await anyio.sleep(0.2)  # (any late frame would show)
                tg.cancel_scope.cancel()
            link = lnk._link
            assert lnk.alive and link.serving_limiter.borrowed_tokens == 0
            assert not link.router._waiting and not link.router._parked
            assert link.queued_bytes == 0
            for rid, kind in kinds.items():
                if rid not in aborted:
                    got = answers.get(rid)
                    assert got and (kind == "pull" or settled(rid)), (rid, kind, got)
            assert len(grants) == len(set(grants))
            if serving == 1:
                slotted = [
                    r
                    for r in grants
                    if kinds[r] != "pull"
                    and r not in aborted
                    and answers[r][0][1] != S.LLM_LINK_BUSY
                ]
                assert slotted == sorted(slotted)
        finally:
            peer.close()


async def test_parked_requests_of_a_link_that_fails_hold_nothing() -> None:
    """A peer that parks requests behind one holding the slot, then hangs up: the link's queue
    empties, with nothing pinned and no bytes counted."""
    opts = _server_options(**{"llm.LinkQueue": "4", "llm.LinkServing": "1"})
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        cache = p.cache_manager.allocate_cache(_u8([1, 256]))
        peer = await raw_link(p.listen_address, 66)
        try:
            lnk = await _push_holding_the_slot(p, peer, cache.cache_id)
            await peer.send(pull_request(3, cache.cache_id, 256, op="push"))
            await wait_until(lambda: lnk.serving == 3, 5)
        finally:
            peer.close()
        await wait_until(lambda: not lnk.alive, 10)
        await wait_until(lambda: lnk.serving == 0, 10)
        assert lnk._link.queued_bytes == 0
        assert cache_entry(p, cache.cache_id).pins == 0


async def test_a_streamed_pull_is_one_round_trip_and_holds_nothing_after() -> None:
    """A pull served over the stream is done on the serving side once its bytes are sent: the
    GRANT says no DONE is expected, and the request holds no slot (nor pin) after its DATA,
    even from a peer that never answers."""
    opts = _server_options(**{"llm.LinkServing": "1"})
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        cache = p.cache_manager.allocate_cache(_u8([1, 256]))
        peer = await raw_link(p.listen_address, 66)
        try:
            for rid in range(1, 6):  # one served at a time: each must finish without a DONE
                await peer.send(pull_request(rid, cache.cache_id, 256))
            seen: list[tuple[int, str]] = []
            with anyio.fail_after(10):
                while len(seen) < 10:
                    msg = await peer.frame()
                    seen.append((msg.req_id, msg.type.name))
                    if msg.type == MT.GRANT:
                        assert wire_status(msg) == S.LLM_SUCCESS
                        assert Grant.decode(msg).done is False
            assert sorted(seen) == [(r, t) for r in range(1, 6) for t in ("DATA", "GRANT")]
            lnk = link_of(p, 66, alive=False)
            await wait_until(lambda: not lnk.serving, 5, 0.001)
            assert cache_entry(p, cache.cache_id).pins == 0
        finally:
            peer.close()


async def test_small_pulls_of_a_peer_that_never_reads_queue_within_the_link_queue() -> None:
    """Small pulls are answered from the reader; once a peer stops reading, their frames
    queue for the link's writer, and those count against ``llm.LinkQueue`` as served
    requests do: a flood of them gets LLM_LINK_BUSY (which the reader then stops owing), holds
    at most that many requests' pins (and one batch being written), leaves a legit peer on
    another link alone, and ends with the stall timeout, every pin let go."""
    opts = _server_options(
        **{"llm.LinkQueue": "8", "llm.LinkServing": "4", "llm.SyncKvCacheWaitTime": "2000"}
    )
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        cache = p.cache_manager.allocate_cache(_u8([1, 64 << 10]))
        cache.tensors[0][...] = 7
        entry = cache_entry(p, cache.cache_id)
        peer = await raw_link(p.listen_address, 66, rcvbuf=4096)
        try:
            with anyio.move_on_after(3):  # the server stops reading us at some point
                for rid in range(1, 400):
                    await peer.send(pull_request(rid, cache.cache_id, 64 << 10))
            lnk = link_of(p, 66, alive=False)
            await wait_until(lambda: lnk.outbox, 10, 0.01)
            assert lnk.outbox + lnk.serving <= 8
            # The queued ones, and the batch being written: what one read brought, sent in
            # one go, at most about INLINE_BYTES (16 of these pulls).
            assert entry.pins <= 8 + INLINE_BYTES // (64 << 10)
            async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
                endpoint_options("tcp", ra=True)
            ) as d:
                await link(d, 1, p.listen_address)
                await _legit_pulls(d, cache.cache_id)
            # The writer waits for the stall timeout (10 s here), then the link breaks.
            await wait_until(lambda: not (lnk.alive or lnk.outbox or entry.pins), 30, 0.05)
        finally:
            peer.close()


# ---------------------------------------------------------------------------- 4. unlink
_POOL_80M = {"llm.MemPoolConfig": '{"memory_size": 83886080}'}


async def _pull_in_flight(d: dd.LLMDataDist, cache_id: int, mine: dd.Cache) -> dd.CacheTask:
    """Start pulling the peer's cache ``cache_id`` into ``mine``; return once the pull was
    granted (its bytes are on their way)."""
    lnk = link_of(d, 1)
    task = d.cache_manager.pull_cache(dd.CacheKeyByIdAndIndex(1, cache_id, 0), mine)
    await wait_until(lambda: lnk.granted, 10, 0.0005)
    return task


async def test_unlink_with_a_pull_in_flight_fails_it_with_not_yet_link() -> None:
    """A 32 MiB pull over TCP is in flight when this side unlinks: it fails with exactly
    LLM_NOT_YET_LINK, every round. Odd rounds: ``force``, the peer (another process) live
    and streaming. Even rounds: no ``force``, the peer paused right after the grant (it can
    neither finish the pull nor acknowledge the unlink; the unlink times out after 200 ms).
    (These two orders were already right before the change; the order that was not, the peer
    acknowledging and hanging up, is the next test's.)"""
    size = 32 * MiB
    opts = _server_options(**{"llm.MemPoolConfig": '{"memory_size": 67108864}'})
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, opts) as p:
        theirs = await p.request("alloc", kind="cache", num_tensors=1, shape=[1, size], seed=1)
        assert p.listen is not None
        for rnd in range(8):
            # A fresh initiator each round: the paused peer learns of the last unlink late.
            async with dd.LLMDataDist(dd.LLMRole.DECODER, 10 + rnd).running(
                endpoint_options("tcp", ra=True, **_POOL_80M)
            ) as d:
                await link(d, 1, p.listen)
                task = await _pull_in_flight(
                    d, theirs, d.cache_manager.allocate_cache(_u8([1, size]))
                )
                force = rnd % 2 == 1
                try:
                    if not force:
                        p.pause()
                    await d.unlink_clusters([cluster(1)], 200, force)
                    with anyio.fail_after(10), pytest.raises(dd.LLMException) as err:
                        await task
                finally:
                    p.resume()
                assert err.value.status_code == S.LLM_NOT_YET_LINK, (rnd, str(err.value))
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            endpoint_options("tcp", ra=True)
        ) as d:
            await link(d, 1, p.listen)  # the peer is fine: it only lost those links


async def test_unlink_acknowledged_by_a_peer_that_hangs_up_is_not_a_link_failure() -> None:
    """A 64 MiB pull over TCP (two DATA frames) is in flight when this side unlinks without
    ``force``; the peer acknowledges and closes its end at once. The pull must fail with
    exactly LLM_NOT_YET_LINK, and a clean unlink leaves no link failure behind.

    Before the change the pull failed with LLM_LINK_FAILED ("cluster 1 closed the
    connection") in every round (16 of 16), and ``link_failure(1)`` said "peer closed the
    connection" after every clean unlink."""
    size = 64 * MiB
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(_server_options(**_POOL_80M)) as p:
        theirs = p.cache_manager.allocate_cache(_u8([1, size]))
        pattern = np.arange(size, dtype=np.uint64).astype(np.uint8)
        theirs.tensors[0].reshape(-1)[:] = pattern
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            endpoint_options("tcp", ra=True, **_POOL_80M)
        ) as d:
            mine = d.cache_manager.allocate_cache(_u8([1, size]))
            codes = []
            failures = []
            finished = 0
            # A pull whose last bytes were already on the wire when the UNLINK was read
            # legitimately completes; such a round must deliver every byte, and is not counted.
            for _ in range(32):
                mine.tensors[0].reshape(-1)[:] = 0
                await link(d, 1, p.listen_address)
                task = await _pull_in_flight(d, theirs.cache_id, mine)
                code, _ = await d.unlink_clusters([cluster(1)], 2000)
                assert code == S.LLM_SUCCESS
                try:
                    with anyio.fail_after(10):
                        await task
                except dd.LLMException as err:
                    codes.append(err.status_code)
                else:
                    finished += 1
                    assert np.array_equal(mine.tensors[0].reshape(-1), pattern)
                failures.append(d.link_failure(1))
                # the peer noticed (before the next link)
                await wait_link_down(p, 2, 10)
                if len(codes) == 8:
                    break
            assert codes == [S.LLM_NOT_YET_LINK] * 8, (codes, finished)
            assert failures == [None] * len(failures), failures


# ---------------------------------------------------------------------------- 5. soak
def _proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _proc_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


async def _settle_fds(pid: int, at_most: int, timeout_s: float = 30) -> int:
    with anyio.move_on_after(timeout_s):
        while _proc_fds(pid) > at_most:
            await anyio.sleep(0.05)
    return _proc_fds(pid)


async def _link_and_hang_up(address: tuple[str, int], ids: range, parallel: int = 16) -> None:
    """Each id: a raw peer links (full handshake) and closes its socket at once."""
    it = iter(ids)

    async def worker() -> None:
        for cid in it:
            (await raw_link(address, cid)).close()

    async with anyio.create_task_group() as tg:
        for _ in range(parallel):
            tg.start_soon(worker)


async def _flood_pings(address: tuple[str, int], cluster_id: int) -> tuple[float, int]:
    """Send PINGs without reading a byte; ``(seconds, bytes)`` until the endpoint stopped
    reading (its backpressure), bounded at 20 s / 1 GiB."""
    peer = await raw_link(address, cluster_id)
    s = peer.sock
    chunk = encode(Message(MT.PING)) * 4096
    pending = memoryview(b"")
    sent = 0
    t0 = time.monotonic()
    try:
        with anyio.fail_after(20):
            while sent < 1 << 30:
                if not pending:
                    pending = memoryview(chunk)
                with anyio.move_on_after(1) as wait:
                    await anyio.wait_writable(s)
                if wait.cancelled_caught:
                    return time.monotonic() - t0 - 1, sent  # stuck: the endpoint stopped
                try:
                    n = s.send(pending, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                pending, sent = pending[n:], sent + n
        raise AssertionError(f"the endpoint read {sent} bytes of PINGs and kept reading")
    finally:
        peer.close()


@pytest.mark.slow
def test_soak_hang_ups_idle_links_floods_and_stalls() -> None:
    """One backend (asyncio here; the server child runs asyncio too), bounded in count and
    time: 1000 peers that link and hang up leave the server's fds at baseline and its RSS
    near it; 300 idle links cost little memory each; a PING flood is refused by backpressure;
    42 stalled pulls leave a legit peer's pulls working. Figures go to stdout (``-s``)."""
    anyio.run(_soak)


async def _soak() -> None:
    opts = _server_options(**{"llm.SyncKvCacheWaitTime": "3000"})
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, opts) as p:
        assert p.listen is not None
        pid = p.process.pid
        big = await p.request("alloc", kind="cache", num_tensors=1, shape=[1, BIG])
        small = await p.request("alloc", kind="cache", num_tensors=1, shape=[1, 64 << 10])
        await p.request("fill", cache_id=small, seed=0)
        expect = np.frombuffer(
            base64.b64decode(await p.request("read", cache_id=small, tensor=0)),
            np.uint8,
        )
        await _link_and_hang_up(p.listen, range(10_000, 10_050))  # warm-up
        fd0 = await _settle_fds(pid, 0, timeout_s=1)
        rss0 = _proc_rss(pid)
        print(f"\n[soak] baseline: fds={fd0} rss={rss0 / MiB:.1f} MiB")

        # 1000 peers that link and hang up.
        t0 = time.monotonic()
        await _link_and_hang_up(p.listen, range(20_000, 21_000))
        t_links = time.monotonic() - t0
        fd1 = await _settle_fds(pid, fd0)
        rss1 = _proc_rss(pid)
        print(
            f"[soak] 1000 link+hang-up in {t_links:.2f} s: fds={fd1} (baseline {fd0}), "
            f"rss={rss1 / MiB:.1f} MiB (+{(rss1 - rss0) / MiB:.1f})"
        )
        assert fd1 <= fd0
        assert rss1 - rss0 < 64 * MiB

        # 300 idle established links.
        idle: list[RawPeer] = []
        try:
            for i in range(300):
                idle.append(await raw_link(p.listen, 30_000 + i))
            await anyio.sleep(0.5)
            fd2, rss2 = _proc_fds(pid), _proc_rss(pid)
            print(
                f"[soak] 300 idle links: fds={fd2} (+{fd2 - fd1}), rss={rss2 / MiB:.1f} MiB "
                f"(+{(rss2 - rss1) / MiB:.1f}, {(rss2 - rss1) / 300 / 1024:.1f} KiB per link)"
            )
            assert (rss2 - rss1) / 300 < 512 << 10  # before: ~4 MiB each (a scratch buffer)
        finally:
            for h in idle:
                h.close()
        fd3 = await _settle_fds(pid, fd1)
        print(f"[soak] idle links closed: fds={fd3}, rss={_proc_rss(pid) / MiB:.1f} MiB")
        assert fd3 <= fd1

        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            endpoint_options("tcp", ra=True, **{"llm.SyncKvCacheWaitTime": "5000"})
        ) as d:
            await link(d, 1, p.listen)
            cm = d.cache_manager
            mine = cm.allocate_cache(_u8([1, 64 << 10]))

            async def legit(n: int) -> float:
                t = time.monotonic()
                for _ in range(n):
                    mine.tensors[0][...] = 0
                    await cm.pull_cache(dd.CacheKeyByIdAndIndex(1, small, 0), mine)
                    assert (mine.tensors[0].reshape(-1) == expect).all()
                return (time.monotonic() - t) / n

            # A flood of PINGs that are never read.
            t_flood, flooded = await _flood_pings(p.listen, 40_000)
            print(
                f"[soak] PING flood: endpoint stopped reading after {flooded / MiB:.1f} MiB "
                f"in {t_flood:.2f} s; rss={_proc_rss(pid) / MiB:.1f} MiB"
            )
            print(f"[soak] legit pull after the flood: {await legit(4) * 1000:.1f} ms each")

            # 42 stalled pulls next to the legit peer.
            fd_before = _proc_fds(pid)
            t0 = time.monotonic()
            hostile = await _stall(None, p.listen, big, 42, base=50_000)
            try:
                await anyio.sleep(0.5)  # let the endpoint's workers block in their sends
                per_pull = await legit(8)
                print(
                    f"[soak] 42 stalled pulls: legit pulls {per_pull * 1000:.1f} ms each; "
                    f"fds={_proc_fds(pid)}, rss={_proc_rss(pid) / MiB:.1f} MiB"
                )
                # The stalled pulls end at the endpoint's budget (3 s): it gives up on them
                # and closes their sockets, though the hostile side still holds its own.
                fd5 = await _settle_fds(pid, fd_before, 20)
                print(
                    f"[soak] stalled links dropped after {time.monotonic() - t0:.2f} s: "
                    f"fds={fd5} (before the stall {fd_before})"
                )
                assert fd5 <= fd_before
            finally:
                for h in hostile:
                    h.close()
            await legit(2)
        fd4 = await _settle_fds(pid, fd0)
        rss4 = _proc_rss(pid)
        print(
            f"[soak] end: fds={fd4} (baseline {fd0}), rss={rss4 / MiB:.1f} MiB "
            f"(+{(rss4 - rss0) / MiB:.1f} over baseline)"
        )
        assert fd4 <= fd0
        assert rss4 - rss0 < 64 * MiB


# ---------------------------------------------------------------------------- the reader
@pytest.fixture
def short_stall(monkeypatch: pytest.MonkeyPatch) -> float:
    """A stall timeout of 3 s (at least 10 s otherwise): how long a peer may stop mid-frame
    or stop reading before its link breaks. Only the bound's length changes."""
    from llmdd_async._engine import Engine

    monkeypatch.setattr(Engine, "stall_timeout_s", property(lambda self: 3.0))
    return 3.0


async def test_a_peer_that_stops_in_a_frame_right_behind_a_payload_loses_only_its_link(
    short_stall: float,
) -> None:
    """A payload's last read also takes what follows it: a peer that sends a whole push and
    then the first bytes of a next frame, and nothing more, is read to where it stopped
    (the push lands and is answered) and its link breaks at the stall timeout."""
    from llmdd_async._protocol import HEADER

    size = 64 << 10  # past the reader's read-ahead: the payload's rest is read on its own
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(_server_options()) as p:
        cache = p.cache_manager.allocate_cache(_u8([1, size]))
        peer = await raw_link(p.listen_address, 66)
        try:
            await peer.send(pull_request(1, cache.cache_id, size, op="push", timeout_ms=60_000))
            grant = await peer.recv(MT.GRANT)
            assert wire_status(grant) == S.LLM_SUCCESS
            await peer.send(Message(MT.DATA, 1, {"off": 0}, payload_len=size))
            await peer.send_bytes(b"\x77" * size + b"\x00" * (HEADER.size // 2))
            t0 = time.monotonic()
            result = await peer.recv(MT.RESULT)
            assert wire_status(result) == S.LLM_SUCCESS
            await wait_until(lambda: not link_of(p, 66, alive=False).alive, 10)
            waited = time.monotonic() - t0
            broken = str(link_of(p, 66, alive=False).broken)
            assert "middle of a frame" in broken, broken
            assert waited < 2 * short_stall + 2, waited
            assert (cache.tensors[0] == 0x77).all()
        finally:
            peer.close()


async def _served_until_the_stall_breaks(p: dd.LLMDataDist, cache_id: int) -> tuple[float, str]:
    """While peer 66 stalls in a frame: a legit peer's pulls of ``cache_id`` are served (the
    loop is not held), then 66's link breaks. Returns the seconds that took and why it broke."""
    t0 = time.monotonic()
    async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(_client_options()) as d:
        await link(d, 1, p.listen_address)
        await _legit_pulls(d, cache_id)
    await wait_until(lambda: not link_of(p, 66, alive=False).alive, 10)
    return time.monotonic() - t0, str(link_of(p, 66, alive=False).broken)


async def test_a_peer_that_stops_in_the_middle_of_a_payload_loses_only_its_link(
    short_stall: float,
) -> None:
    """A small push is granted and served from the link's reader; the peer sends its DATA
    header and part of the payload, then nothing. The reader does not wait for the rest on
    the loop: others are served meanwhile, and the link breaks at the stall timeout, letting
    go of the cache."""
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(_server_options()) as p:
        cache = p.cache_manager.allocate_cache(_u8([1, 4096]))
        other = p.cache_manager.allocate_cache(_u8([1, 64 << 10]))
        other.tensors[0][...] = 7
        peer = await raw_link(p.listen_address, 66)
        try:
            await peer.send(pull_request(1, cache.cache_id, 4096, op="push", timeout_ms=60_000))
            grant = await peer.recv(MT.GRANT)
            assert wire_status(grant) == S.LLM_SUCCESS
            await peer.send(Message(MT.DATA, 1, {"off": 0}, payload_len=4096))
            await peer.send_bytes(b"\x77" * 1000)  # and not one byte more
            waited, broken = await _served_until_the_stall_breaks(p, other.cache_id)
            assert "middle of a frame" in broken, broken
            assert waited < 2 * short_stall + 2, waited
            assert cache_entry(p, cache.cache_id).pins == 0
            assert (cache.tensors[0][1000:] == 0).all()  # nothing past what was sent
        finally:
            peer.close()


@pytest.mark.parametrize("ranges", [64, 256], ids=["on-the-loop", "in-a-worker"])
async def test_a_peer_that_stops_in_a_frame_received_straight_into_memory_loses_its_link(
    short_stall: float, monkeypatch: pytest.MonkeyPatch, ranges: int
) -> None:
    """A push of more than ``VIEWS_INLINE`` big ranges (shuffled blocks of 16 KiB) is received
    straight into the cache, a view per range (made in a worker thread), on the loop for a
    frame of up to ``INLINE_BYTES``, in a worker beyond. The peer sends a DATA header and part
    of its payload, then nothing: others are served meanwhile, the link breaks at the stall
    timeout saying why, the cache is let go, and only the bytes sent landed, where the stream
    puts them."""
    from llmdd_async._net import streams

    straight: list[int] = []
    views = streams.ManyRangesStream._views

    def spied(self: Any, offset: int, n: int) -> list[memoryview]:
        straight.append(n)
        return views(self, offset, n)

    monkeypatch.setattr(streams.ManyRangesStream, "_views", spied)
    blocks, bb = streams.VIEWS_INLINE + 64, streams.DIRECT_BYTES
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(_server_options()) as p:
        mem = np.zeros((blocks, bb), np.uint8)
        desc = dd.CacheDesc(1, [blocks, bb], dd.DataType.DT_UINT8)
        cache = p.cache_manager.register_blocks_cache(desc, [mem])
        other = p.cache_manager.allocate_cache(_u8([1, 64 << 10]))
        other.tensors[0][...] = 7
        dst = np.random.default_rng(3).permutation(blocks)
        peer = await raw_link(p.listen_address, 66)
        try:
            req = helpers.blocks_request(
                "push", 1, cache.cache_id, np.arange(blocks), dst, 1, bb, blocks
            )
            await peer.send(req)
            assert wire_status(await peer.recv(MT.GRANT)) == S.LLM_SUCCESS
            sent = 6 * bb + 1000
            await peer.send(Message(MT.DATA, 1, {"off": 0}, payload_len=ranges * bb))
            await peer.send_bytes(b"\x77" * sent)  # and not one byte more
            waited, broken = await _served_until_the_stall_breaks(p, other.cache_id)
            said = ("stopped in the middle of a frame", "moved no byte", "did not finish a receive")
            assert any(why in broken for why in said), broken
            assert waited < 2 * short_stall + 2, waited
            assert straight == [ranges * bb]  # (the frame went straight into memory)
            assert cache_entry(p, cache.cache_id).pins == 0
            assert (mem[dst[:6]] == 0x77).all() and (mem[dst[6], :1000] == 0x77).all()
            assert not mem[dst[6], 1000:].any() and not mem[dst[7:]].any()
        finally:
            peer.close()


@pytest.mark.parametrize(
    "lie",
    ["past_the_plan", "past_a_frame", "past_the_meta"],
)
async def test_a_peer_that_lies_about_sizes_loses_its_link_before_a_byte_lands(
    lie: str,
) -> None:
    """A DATA frame of a granted push that claims more than the plan, more than a frame may
    carry (``CHUNK_BYTES``), or a header whose meta is longer than the link allows: the link
    breaks at the header, and not one payload byte lands in the cache."""
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(_server_options()) as p:
        cache = p.cache_manager.allocate_cache(_u8([1, 4096]))
        peer = await raw_link(p.listen_address, 66)
        try:
            await peer.send(pull_request(1, cache.cache_id, 4096, op="push", timeout_ms=60_000))
            assert wire_status(await peer.recv(MT.GRANT)) == S.LLM_SUCCESS
            if lie == "past_the_plan":
                header = encode(Message(MT.DATA, 1, {"off": 0}, payload_len=4096 + 4096))
            elif lie == "past_a_frame":
                header = encode(Message(MT.DATA, 1, {"off": 0}, payload_len=64 << 20))
            else:
                header = encode(Message(MT.DATA, 1, {"off": 0}, payload_len=4096))
                # the header's meta length (offset 16, after magic, version, type and id)
                header = header[:16] + (200 << 20).to_bytes(4, "little") + header[20:]
            await peer.send_bytes(header + b"\x66" * 4096)
            await wait_until(lambda: not link_of(p, 66, alive=False).alive, 5)
            assert "protocol error" in str(link_of(p, 66, alive=False).broken)
            assert (cache.tensors[0] == 0).all()
            assert cache_entry(p, cache.cache_id).pins == 0
        finally:
            peer.close()
