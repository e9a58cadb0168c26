"""Small streamed pulls and pushes are served from the link's reader on both sides (no task,
slot or thread), and stay byte-exact when the socket takes only part of a frame or the link
is keyed; without a task they still end at their deadline and are fenced by a cancel."""

from __future__ import annotations

import gc
import socket
import types
from collections.abc import AsyncIterator
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import cyclic_garbage, endpoint_options, raw_link

import llmdd_async as dd
from llmdd_async._messages import Data, Grant, Mode, Ping
from llmdd_async._net.host import Served
from llmdd_async._net.writer import LinkWriter
from llmdd_async._protocol import MT
from llmdd_async.testing import (
    DEFAULT_OPTIONS,
    cache_entries,
    engine_of,
    link_of,
    linked_pair,
    populated,
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


async def _eight_pulls_in_flight(
    decoder: dd.LLMDataDist, cache: Any, src: np.ndarray, dst: np.ndarray
) -> None:
    """Eight one-block pulls of the prompt's blocks key in flight together; each lands where
    it should."""
    key = dd.BlocksCacheKey(1, 0)
    pulls = [(s, (s * 7) % BLOCKS) for s in range(8)]
    running = [decoder.cache_manager.pull_blocks(key, cache, [s], [d]) for s, d in pulls]
    for t in running:
        await t
    for s, d in pulls:
        assert np.array_equal(dst[d], src[s])


def _count_serving_tasks(prompt: dd.LLMDataDist, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    server = engine_of(prompt).links.server
    calls: list[int] = []
    original = server.serve_request

    async def counted(link: Any, req: Any, msg: Any) -> None:
        calls.append(msg.req_id)
        await original(link, req, msg)

    monkeypatch.setattr(server, "serve_request", counted)
    return calls


def _record_outcomes(prompt: dd.LLMDataDist, monkeypatch: pytest.MonkeyPatch) -> list[Served]:
    """What the reader did with each request of the prompt's peers (:class:`Served`)."""
    server = engine_of(prompt).links.server
    outcomes: list[Served] = []
    serve_now = server.serve_now

    def recorded(link: Any, request: Any) -> Served:
        outcomes.append(serve_now(link, request))
        return outcomes[-1]

    monkeypatch.setattr(server, "serve_now", recorded)
    return outcomes


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
        original = LinkWriter._finish_now

        async def counted(self: LinkWriter, bufs: Any, idx: int, done: Any) -> None:
            finished.append(idx)
            await original(self, bufs, idx, done)

        monkeypatch.setattr(LinkWriter, "_finish_now", counted)
        writers: list[int] = []
        original_writer = LinkWriter._write_outbox

        async def writer(self: LinkWriter) -> None:
            writers.append(self.outbox_frames)
            await original_writer(self)

        monkeypatch.setattr(LinkWriter, "_write_outbox", writer)
        tasks = _count_serving_tasks(prompt, monkeypatch)
        # In flight together: the requests one read brings are answered in one sendmsg; while
        # a frame is being finished, the next ones find the send lock taken and queue for the
        # link's writer; every byte lands where it should.
        await _eight_pulls_in_flight(decoder, cache, src, dst)
        assert finished, "no frame was finished by a task"
        # What one read brought is answered in one go (the reader corks the writer), so the
        # frames went out together with a task finishing them, or queued for the writer.
        assert len(finished) + sum(writers) < 8 or sum(writers) > 0
        assert tasks == []  # served by the reader, finished or written by the link
        key = dd.BlocksCacheKey(1, 0)
        await decoder.cache_manager.pull_blocks(key, cache, [1], [2])  # the link is fine
        assert np.array_equal(dst[2], src[1])
        assert served.alive and served.send_path_free
        entry = cache_entries(prompt)[0]
        assert entry.pins == 0  # what the reader pinned was let go


# ---------------------------------------------------------------------------- the initiator
def _count_tasks(endpoint: dd.LLMDataDist, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    engine = engine_of(endpoint)
    started: list[str] = []
    original = engine.start_task

    def counted(task: Any, body: Any, deadline_s: float | None = None) -> Any:
        started.append(task.kind)
        return original(task, body, deadline_s)

    monkeypatch.setattr(engine, "start_task", counted)
    return started


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keyed"])
async def test_a_small_pull_or_push_runs_without_a_task_on_the_initiator(
    keyed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CacheTask of a pull or push that need not wait for anything first is completed by
    the link's reader: no task is spawned for it (the first pull, which fetches the peer's
    table, gets one)."""
    opts = {**_options(keyed), "llm.EnableRemoteCacheAccessible": "1"}
    async with linked_pair(opts) as (prompt, decoder):
        cache, src, dst = await _setup(prompt, decoder)
        started = _count_tasks(decoder, monkeypatch)
        cm = decoder.cache_manager
        key = dd.BlocksCacheKey(1, 0)
        await cm.pull_blocks(key, cache, [4], [9])  # the first fetches the peer's table
        assert started == ["pull_blocks"]
        started.clear()
        for s, d in [(3, 5), (39, 0), (0, 39)]:
            await cm.pull_blocks(key, cache, [s], [d])
            assert np.array_equal(dst[d], src[s])
        dst[7] = 0x5A
        await cm.push_blocks(key, cache, [7], [8])
        assert (src[8] == 0x5A).all()
        big = list(range(32))
        await cm.pull_blocks(key, cache, big, big[::-1])  # 2 MiB: its DATA in worker threads
        assert np.array_equal(dst[big[::-1]], src[big])
        assert started == []
        assert cache_entries(decoder)[0].pins == 0


def _our_garbage() -> int:
    """How many objects of ours (instances of our classes, our functions) the collector finds
    in reference cycles now. Only ours: what other threads of the test process leave (a
    library's, an earlier test's) is not this test's business."""
    ours = 0
    for o in cyclic_garbage():
        module = o.__module__ if isinstance(o, types.FunctionType) else type(o).__module__
        ours += str(module).startswith("llmdd_async")
    return ours


@pytest.mark.parametrize(
    ("mode", "op"),
    [("remote-accessible", "pull"), ("remote-accessible", "push"), ("default", "pull")],
)
async def test_small_requests_leave_no_garbage_for_the_collector(mode: str, op: str) -> None:
    """What a small pull or push makes, on either end, is freed by reference counting when it
    ends: none of it is left in reference cycles, which only the cyclic garbage collector
    frees (its pauses then land in requests' latency, and freed memory waits for it). Nor
    does any of it stay behind, its deadline's timer included: what every request left would
    outlive the collector's young passes and set off its full ones, tens of milliseconds each
    on the loop (a cancelled timer was kept until 4,096 of them piled up)."""
    opts = _options(False)
    if mode == "remote-accessible":
        opts["llm.EnableRemoteCacheAccessible"] = "1"
    async with linked_pair(opts) as (prompt, decoder):
        cache, src, dst = await _setup(prompt, decoder)
        cm = decoder.cache_manager
        move = cm.pull_blocks if op == "pull" else cm.push_blocks
        key = dd.BlocksCacheKey(1, 0)
        requests = 50
        for i in range(requests):  # the first ones fetch the peer's table, make views' types
            await move(key, cache, [i % 4], [(i + 1) % 4])
        found = []
        for _ in range(3):  # the least of three rounds: on a loaded box a frame may now and
            gc.collect()  # then be finished by a task, whose machinery leaves cycles
            gc.disable()
            try:
                for i in range(requests):
                    await move(key, cache, [i % 4], [(i + 1) % 4])
                found.append(_our_garbage())
            finally:
                gc.enable()
        # (a closure cycle per request left about 20 of our objects each for the collector:
        # its task, request, exchange and the closures' functions)
        assert min(found) < requests // 10, f"of ours in reference cycles: {found}"
        for d in (prompt, decoder):
            assert len(engine_of(d).timers) <= 2
        last = requests - 1  # (its bytes moved)
        if op == "pull":
            assert np.array_equal(dst[(last + 1) % 4], src[last % 4])
        else:
            assert np.array_equal(src[(last + 1) % 4], dst[last % 4])


@pytest.fixture
async def hostile_target() -> AsyncIterator[tuple[dd.LLMDataDist, Any, Any, np.ndarray]]:
    """An endpoint (default mode, 300 ms transfer deadline) linked to a hand-made peer that
    answers its requests as the test says: ``(endpoint, raw peer, cache, its array)``."""
    opts = endpoint_options("tcp", listen=True, **{"llm.SyncKvCacheWaitTime": "300"})
    async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(opts) as d:
        assert d.listen_address is not None
        peer = await raw_link(d.listen_address, 66)
        try:
            await wait_until(lambda: 66 in engine_of(d).links.links, 5)
            arr = np.zeros((4, BLOCK), np.uint8)
            cache = d.cache_manager.register_blocks_cache(
                dd.CacheDesc(1, [4, BLOCK], dd.DataType.DT_UINT8), [arr]
            )
            await populated(d, cache.cache_id)  # (a pull waits for that in a task)
            yield d, peer, cache, arr
        finally:
            peer.close()


def _grant_to_block_2(req: Any, **fields: Any) -> Grant:
    """A GRANT of one block that lands in block 2 of the hostile target's cache."""
    base = int(np.frombuffer(req.arrays["local_addrs"], "<u8")[0])
    local, nbytes = np.array([base + 2 * BLOCK], np.uint64), np.array([BLOCK], np.uint64)
    return Grant(req.req_id, total=BLOCK, local=local, nbytes=nbytes, **fields)


async def test_a_request_the_peer_never_answers_ends_at_its_deadline(
    hostile_target: tuple[dd.LLMDataDist, Any, Any, np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No task waits for a small pull; its deadline still ends it (LLM_TIMEOUT), the peer
    hears an ABORT, the cache is unpinned and the link's turn is given back."""
    d, peer, cache, _ = hostile_target
    key = dd.BlocksCacheKey(66, 0)
    started = _count_tasks(d, monkeypatch)
    task = d.cache_manager.pull_blocks(key, cache, [1], [2])
    assert started == []
    req = await peer.recv(MT.XFER_REQ)
    with anyio.fail_after(5):
        with pytest.raises(dd.LLMException) as err:
            await task
    assert err.value.status_code == dd.LLMStatusCode.LLM_TIMEOUT
    abort = await peer.recv(MT.ABORT)
    assert abort.req_id == req.req_id
    assert cache_entries(d)[0].pins == 0
    lnk = link_of(d, 66)
    assert lnk.alive and lnk.raw.transfer_lock.holders == 0
    d.cache_manager.pull_blocks(key, cache, [1], [2]).cancel()  # the next one goes out
    assert (await peer.recv(MT.XFER_REQ)).req_id == req.req_id + 1


async def test_a_cancelled_small_pull_is_fenced_at_once(
    hostile_target: tuple[dd.LLMDataDist, Any, Any, np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancelled with half of its DATA landed, a pull returns at once, and nothing of its
    frame lands after the cancel returned (the rest goes to scratch); the link serves the
    next pull."""
    d, peer, cache, arr = hostile_target
    key = dd.BlocksCacheKey(66, 0)

    async def grant_and_data(first: bytes, rest: bytes | None) -> int:
        req = await peer.recv(MT.XFER_REQ)
        base = int(np.frombuffer(req.arrays["local_addrs"], "<u8")[0])
        addr = base + 2 * BLOCK  # its dst_blocks: [2]
        grant = Grant(
            req.req_id,
            mode=Mode.STREAM,
            total=BLOCK,
            done=False,
            local=np.array([addr], np.uint64),
            nbytes=np.array([BLOCK], np.uint64),
        )
        await peer.send(grant.encode())
        await peer.send(Data(req.req_id, 0, BLOCK, to_initiator=True).encode())
        await peer.send_bytes(first)
        if rest is not None:
            await peer.send_bytes(rest)
        return req.req_id

    half = BLOCK // 2
    started = _count_tasks(d, monkeypatch)
    task = d.cache_manager.pull_blocks(key, cache, [1], [2])
    assert started == []
    await grant_and_data(b"\xaa" * half, None)
    await wait_until(lambda: (arr[2, :half] == 0xAA).all(), 5)
    task.cancel()
    with anyio.fail_after(1), pytest.raises(dd.LLMException):
        await task
    arr[...] = 0x11  # the application reuses the buffer at once
    await peer.send_bytes(b"\xbb" * half)  # the rest of the cancelled frame
    assert (await peer.recv(MT.ABORT)).req_id >= 1
    await peer.send(Ping().encode())  # read in order: once answered, the rest was read too
    await peer.recv(MT.PONG)
    assert (arr == 0x11).all(), "bytes of the cancelled frame landed after the cancel"
    # The next pull is served on the same link, byte-exact.
    task = d.cache_manager.pull_blocks(key, cache, [1], [2])
    await grant_and_data(b"\xcc" * half, b"\xdd" * half)
    await task
    assert (arr[2, :half] == 0xCC).all() and (arr[2, half:] == 0xDD).all()
    assert (arr[[0, 1, 3]] == 0x11).all()
    assert link_of(d, 66).alive


async def test_bytes_that_land_after_the_deadline_are_not_acknowledged(
    hostile_target: tuple[dd.LLMDataDist, Any, Any, np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last bytes of a pull that come after its deadline go to scratch, and the pull
    fails: it sends no DONE (which would let the target consume a key for bytes not kept),
    even where its timer has not run yet."""
    d, peer, cache, arr = hostile_target
    timers = engine_of(d).timers
    call_at = timers.call_at
    monkeypatch.setattr(timers, "call_at", lambda when, fn: call_at(when + 5, fn))  # late
    task = d.cache_manager.pull_blocks(dd.BlocksCacheKey(66, 0), cache, [1], [2])
    req = await peer.recv(MT.XFER_REQ)
    await anyio.sleep(0.5)  # past its 300 ms deadline
    await peer.send(_grant_to_block_2(req, mode=Mode.STREAM, done=True).encode())
    await peer.send(Data(req.req_id, 0, BLOCK, to_initiator=True).encode())
    await peer.send_bytes(b"\xee" * BLOCK)
    with anyio.fail_after(5), pytest.raises(dd.LLMException) as err:
        await task
    assert err.value.status_code == dd.LLMStatusCode.LLM_TIMEOUT
    answer = await peer.frame()
    assert answer.type == MT.ABORT, answer.type  # not DONE
    assert not (arr[2] == 0xEE).any()


@pytest.mark.parametrize("split", [0, 3, 35], ids=["whole", "header-split", "meta-split"])
async def test_frames_that_follow_a_payload_in_its_last_read_are_read_on(
    hostile_target: tuple[dd.LLMDataDist, Any, Any, np.ndarray], split: int
) -> None:
    """The last read of a payload also takes what follows it (no read that would fail, a
    syscall a request): a frame right behind the payload is answered at once, and one cut
    part-way is finished by the bytes that come later."""
    from llmdd_async._protocol import encode

    d, peer, cache, arr = hostile_target
    task = d.cache_manager.pull_blocks(dd.BlocksCacheKey(66, 0), cache, [1], [2])
    req = await peer.recv(MT.XFER_REQ)
    grant = _grant_to_block_2(req, mode=Mode.STREAM, done=False)
    payload = np.random.default_rng(3).integers(0, 255, BLOCK, dtype=np.uint8).tobytes()
    ping = encode(Ping().encode())
    head = encode(grant.encode()) + encode(Data(req.req_id, 0, BLOCK, to_initiator=True).encode())
    cut = split or len(ping)
    assert 0 < cut <= len(ping) and (not split or cut < len(ping))
    await peer.send_bytes(head + payload + ping[:cut])  # one write: one read takes them all
    with anyio.fail_after(5):
        await task
        if split:
            await anyio.sleep(0.05)  # the rest of the PING comes later
            await peer.send_bytes(ping[cut:])
        await peer.recv(MT.PONG)
    assert arr[2].tobytes() == payload
    assert (arr[[0, 1, 3]] == 0).all()


async def test_a_local_grant_for_a_request_that_asked_for_the_stream_breaks_the_link(
    hostile_target: tuple[dd.LLMDataDist, Any, Any, np.ndarray],
) -> None:
    """A request that claimed no direct access gets the stream from an honest peer; a grant
    that tells it to copy from the peer's memory itself is the peer's lie: the link breaks and
    nothing is copied."""
    d, peer, cache, arr = hostile_target
    task = d.cache_manager.pull_blocks(dd.BlocksCacheKey(66, 0), cache, [1], [2])
    req = await peer.recv(MT.XFER_REQ)
    base = int(np.frombuffer(req.arrays["local_addrs"], "<u8")[0])
    remote = np.array([base], np.uint64)  # (our own memory, named as the peer's)
    await peer.send(_grant_to_block_2(req, mode=Mode.LOCAL, remote=remote).encode())
    with anyio.fail_after(5), pytest.raises(dd.LLMException):
        await task
    broken = str(link_of(d, 66, alive=False).broken)
    assert "asked for the stream" in broken, broken
    assert (arr == 0).all()


async def test_a_layerwise_grant_out_of_layer_order_breaks_the_link_and_sends_nothing() -> None:
    """A layer-wise push sends each layer's ranges of its grant when that layer is ready, so
    the grant must be in layer order: one that puts layer 1's ranges where layer 0's are due
    (each range still inside what was selected) is the peer's lie. The link breaks and not a
    byte of the cache goes out."""
    opts = endpoint_options("tcp", listen=True, **{"llm.SyncKvCacheWaitTime": "2000"})
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        assert p.listen_address is not None
        peer = await raw_link(p.listen_address, 66)
        try:
            await wait_until(lambda: 66 in engine_of(p).links.links, 5)
            arrays = [np.full((4, BLOCK), t + 1, np.uint8) for t in range(4)]  # 2 layers, K+V
            src = p.cache_manager.register_blocks_cache(
                dd.CacheDesc(4, [4, BLOCK], dd.DataType.DT_UINT8), arrays
            )
            await populated(p, src.cache_id)
            ready = dd.LayerEvents()
            ready.layer_ready(0)
            ready.layer_ready(1)
            theirs = [(1 << 40) + t * (4 << 20) for t in range(4)]  # the peer's raw tensors
            cfg = dd.TransferConfig(66, theirs, range(0, 2))
            task = p.cache_manager.transfer_cache_async(src, ready, [cfg], [1], [2])
            req = await peer.recv(MT.XFER_REQ)
            addrs = np.frombuffer(req.arrays["local_addrs"], "<u8").astype(np.uint64)
            block1 = addrs + np.uint64(BLOCK)  # block 1 of each tensor, tensor order
            grant = Grant(
                req.req_id,
                mode=Mode.STREAM,
                total=4 * BLOCK,
                done=True,
                local=block1[[2, 3, 0, 1]],  # layer 1 first
                nbytes=np.full(4, BLOCK, np.uint64),
            )
            await peer.send(grant.encode())
            with anyio.fail_after(5), pytest.raises(dd.LLMException):
                await task
            broken = str(link_of(p, 66, alive=False).broken)
            assert "layer order" in broken, broken
            types = []
            with anyio.fail_after(5):
                try:
                    while True:
                        types.append((await peer.frame()).type)
                except (EOFError, OSError):
                    pass
            assert MT.DATA not in types, types
        finally:
            peer.close()


@pytest.mark.parametrize("transport", ["tcp", "same-host"])
async def test_pushes_in_flight_past_the_serving_slots_are_parked_and_land(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Remote-accessible mode: a push holds one of the target's serving slots until its bytes
    land (over TCP) or the initiator's DONE (same host). Eight in flight while the one slot
    is held: they are parked, not given tasks; a parked push's early bytes (sent behind its
    request, before any GRANT) are discarded and sent again under its GRANT; once the slot
    is freed, every block lands where it should."""
    opts = {**DEFAULT_OPTIONS, "llm.Transport": transport, "llm.LinkServing": "1"}
    async with linked_pair(opts) as (prompt, decoder):
        theirs = np.zeros((BLOCKS, BLOCK), np.uint8)
        desc = dd.CacheDesc(1, [BLOCKS, BLOCK], dd.DataType.DT_UINT8)
        prompt.cache_manager.register_blocks_cache(desc, [theirs], dd.BlocksCacheKey(1, 0))
        mine = np.random.default_rng(3).integers(0, 255, (BLOCKS, BLOCK), dtype=np.uint8)
        cache = decoder.cache_manager.register_blocks_cache(desc, [mine])
        tasks = _count_serving_tasks(prompt, monkeypatch)
        outcomes = _record_outcomes(prompt, monkeypatch)
        key = dd.BlocksCacheKey(1, 0)
        served = link_of(prompt, 2)
        slots = served._link.serving_limiter
        holder = object()  # the slot held, as by a push whose bytes are slow to come
        slots.acquire_on_behalf_of_nowait(holder)
        moves = [(s, (s * 7) % BLOCKS) for s in range(8)]
        running = [decoder.cache_manager.push_blocks(key, cache, [s], [d]) for s, d in moves]
        await wait_until(lambda: served.serving == 8, 5)  # all parked, early bytes discarded
        assert not theirs.any()
        slots.release_on_behalf_of(holder)
        served._link.router.serve_parked()
        for t in running:
            await t
        for s, d in moves:
            assert np.array_equal(theirs[d], mine[s])
        assert Served.NO_SLOT in outcomes, "no push waited for the one slot"
        assert tasks == []
        await wait_until(lambda: not served.serving, 5)
        assert served._link.queued_bytes == 0


async def test_a_local_grant_waiting_for_a_serving_slot_is_parked_and_planned_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Same host, default mode: a local grant holds one of the link's serving slots until the
    initiator's DONE. With every slot taken, a small request is parked (no task: with many in
    flight a task each cost the target twice the CPU), and planned and granted from the
    reader once a slot is freed, in the order the requests came; the reader does not plan it
    first for nothing."""
    from llmdd_async._net import target

    plans: list[int] = []
    real = target.resolve_and_plan

    def counted(engine: Any, link: Any, request: Any) -> Any:
        plans.append(request.req_id)
        return real(engine, link, request)

    monkeypatch.setattr(target, "resolve_and_plan", counted)
    opts = {**DEFAULT_OPTIONS, "llm.Transport": "same-host", "llm.LinkServing": "1"}
    async with linked_pair(opts) as (prompt, decoder):
        cache, src, dst = await _setup(prompt, decoder)
        tasks = _count_serving_tasks(prompt, monkeypatch)
        outcomes = _record_outcomes(prompt, monkeypatch)
        await _eight_pulls_in_flight(decoder, cache, src, dst)
        assert Served.NO_SLOT in outcomes, "no request waited for the one slot"
        assert tasks == []
        assert plans == sorted(set(plans)) and len(plans) == 8  # once each, in order
        served = link_of(prompt, 2)
        await wait_until(lambda: not served.serving, 5)
        assert served._link.queued_bytes == 0
