"""Small requests over TCP in remote-accessible mode, planned by the initiator from the peer's
table (``_net/eager.py``). A push takes one round trip: its bytes follow its request at once,
and the target lands them only where its own plan of the push is the one the initiator sent
them by; otherwise it grants the push as always, the early bytes are discarded, and they come
again under the GRANT. A pull's DATA comes with no GRANT before it where the target plans it
as the initiator did, and lands where the initiator planned it; otherwise the GRANT says
where, as always."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from helpers import endpoint_options, raw_link

import llmdd_async as dd
from llmdd_async._messages import (
    FLAG_EAGER,
    Address,
    By,
    Data,
    Grant,
    Op,
    Ping,
    Request,
    Result,
    Shape,
)
from llmdd_async._net import exchange
from llmdd_async._net.eager import EAGER_BYTES, stream_digest
from llmdd_async._planner import Plan
from llmdd_async._protocol import MT, encode
from llmdd_async.testing import (
    DEFAULT_OPTIONS,
    engine_of,
    link_of,
    linked_pair,
    populated,
    wait_until,
)

pytestmark = pytest.mark.anyio

BLOCK = 64 << 10
BLOCKS = 24  # 1.5 MiB: more than an eager push carries
OPTIONS = {**DEFAULT_OPTIONS, "llm.Transport": "tcp", "llm.EnableRemoteCacheAccessible": "1"}


class _Tensors:
    """A cache's tensors (user arrays), indexed as one ``(tensor, block, byte)`` array."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays

    def __getitem__(self, index: Any) -> np.ndarray:
        return np.stack(self.arrays)[index]

    def add(self, blocks: list[int], value: int) -> None:
        for a in self.arrays:
            a[blocks] += np.uint8(value)


async def _pair_caches(
    prompt: dd.LLMDataDist, decoder: dd.LLMDataDist
) -> tuple[Any, _Tensors, _Tensors]:
    desc = dd.CacheDesc(2, [BLOCKS, BLOCK], dd.DataType.DT_UINT8)
    theirs = [np.zeros((BLOCKS, BLOCK), np.uint8) for _ in range(2)]
    prompt.cache_manager.register_blocks_cache(desc, theirs, dd.BlocksCacheKey(1, 0))
    rng = np.random.default_rng(3)
    ours = [rng.integers(0, 255, (BLOCKS, BLOCK), dtype=np.uint8) for _ in range(2)]
    cache = decoder.cache_manager.register_blocks_cache(desc, ours)
    return cache, _Tensors(ours), _Tensors(theirs)


async def test_a_small_push_goes_with_its_request_and_a_large_one_waits_for_its_grant() -> None:
    async with linked_pair(OPTIONS) as (prompt, decoder):
        cache, ours, theirs = await _pair_caches(prompt, decoder)
        cm, key = decoder.cache_manager, dd.BlocksCacheKey(1, 0)
        await cm.push_blocks(key, cache, [0], [0])  # the first fetches the peer's table
        await cm.push_blocks(key, cache, [3, 7], [9, 1])
        assert np.array_equal(theirs[:, [9, 1]], ours[:, [3, 7]])
        assert decoder.link_statistics(1).recent[-1].mode == "eager"
        big = list(range(BLOCKS))
        assert 2 * BLOCKS * BLOCK > EAGER_BYTES
        await cm.push_blocks(key, cache, big, big[::-1])
        assert np.array_equal(theirs[:, big[::-1]], ours[:, big])
        assert decoder.link_statistics(1).recent[-1].mode == "stream"


async def test_pushes_of_a_few_blocks_are_planned_from_one_prepared_pair() -> None:
    """Shuffled pushes of a few blocks between the same two caches are planned from the pair
    the first prepared (kept in the link's view of the peer's table): every one goes with its
    request, as the target plans it, and lands exactly."""
    async with linked_pair(OPTIONS) as (prompt, decoder):
        cache, ours, theirs = await _pair_caches(prompt, decoder)
        cm, key = decoder.cache_manager, dd.BlocksCacheKey(1, 0)
        await cm.push_blocks(key, cache, [0], [0])  # the first fetches the peer's table
        view = link_of(decoder, 1).raw.view
        rng = np.random.default_rng(11)
        for i in range(30):
            k = int(rng.integers(1, 5))
            src, dst = rng.permutation(BLOCKS)[:k].tolist(), rng.permutation(BLOCKS)[:k].tolist()
            ours.add(src, 1)  # (bytes the target does not hold yet)
            await cm.push_blocks(key, cache, src, dst)
            assert np.array_equal(theirs[:, dst], ours[:, src])
            assert decoder.link_statistics(1).recent[-1].mode == "eager"
            if i == 0:
                [prepared] = view.pairs.values()
        assert list(view.pairs.values()) == [prepared]


@pytest.mark.parametrize("op", ["push", "pull"])
async def test_a_request_planned_otherwise_than_the_target_plans_it_goes_by_its_grant(
    monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    # As if the peer's table no longer said what it holds: our plan takes the blocks in
    # another order. The target's digest differs and it grants the request: a push's bytes
    # are sent again under the GRANT, a pull's land where the GRANT says (ours would have
    # swapped the two blocks).
    name = "eager_plan" if op == "push" else "eager_pull_plan"
    planned = getattr(exchange, name)

    def stale(*args: Any) -> Plan | None:
        plan = planned(*args)
        if plan is None:
            return None
        return Plan(plan.src[::-1].copy(), plan.dst[::-1].copy(), plan.nbytes[::-1].copy())

    monkeypatch.setattr(exchange, name, stale)
    async with linked_pair(OPTIONS) as (prompt, decoder):
        cache, ours, theirs = await _pair_caches(prompt, decoder)
        cm, key = decoder.cache_manager, dd.BlocksCacheKey(1, 0)
        src, dst = (ours, theirs) if op == "push" else (theirs, ours)
        move = cm.push_blocks if op == "push" else cm.pull_blocks
        for _ in range(3):
            src.add([3, 7], 1)  # (each round: bytes the destination does not hold yet)
            await move(key, cache, [3, 7], [9, 1])
            assert np.array_equal(dst[:, [9, 1]], src[:, [3, 7]])
            assert decoder.link_statistics(1).recent[-1].mode == "stream"


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of every push sent behind its request from now on."""
    sent: list[int] = []
    planned = exchange.eager_plan

    def spied(*args: Any) -> Plan | None:
        plan = planned(*args)
        if plan is not None:
            sent.append(plan.total_bytes)
        return plan

    monkeypatch.setattr(exchange, "eager_plan", spied)
    return sent


async def test_a_push_of_a_layer_window_goes_with_its_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The target's quick bound before planning counted every tensor of the initiator's cache,
    # not those of the layer window: such pushes were sent twice.
    sent = _spy(monkeypatch)
    async with linked_pair(OPTIONS) as (prompt, decoder):
        desc = dd.CacheDesc(32, [8, BLOCK], dd.DataType.DT_UINT8)  # 16 layers: 32 MiB
        theirs = [np.zeros((8, BLOCK), np.uint8) for _ in range(32)]
        prompt.cache_manager.register_blocks_cache(desc, theirs, dd.BlocksCacheKey(1, 0))
        ours = [np.full((8, BLOCK), t + 1, np.uint8) for t in range(32)]
        cache = decoder.cache_manager.register_blocks_cache(desc, ours)
        cm, key = decoder.cache_manager, dd.BlocksCacheKey(1, 0)
        await cm.push_blocks(key, cache, [0], [0])  # the first fetches the peer's table
        sent.clear()
        before = prompt.link_statistics(2).bytes
        layer = range(3, 4)
        await cm.push_blocks(key, cache, [3], [5], src_layer_range=layer, dst_layer_range=layer)
        assert (theirs[6][5] == 7).all() and (theirs[7][5] == 8).all()
        assert (theirs[5][5] == 0).all() and (theirs[8][5] == 0).all()
        assert sent == [2 * BLOCK]
        assert prompt.link_statistics(2).bytes - before == 2 * BLOCK  # once
        assert decoder.link_statistics(1).recent[-1].mode == "eager"


async def test_a_layer_window_of_a_many_tensor_cache_goes_with_its_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 160 tensors of 128 blocks: every tensor times every block is more ranges than the target
    # plans from its reader, one layer's are not (its bound of the ranges counts the window).
    sent = _spy(monkeypatch)
    tensors, blocks, block = 160, 128, 1024
    async with linked_pair(OPTIONS) as (prompt, decoder):
        desc = dd.CacheDesc(tensors, [blocks, block], dd.DataType.DT_UINT8)
        theirs = [np.zeros((blocks, block), np.uint8) for _ in range(tensors)]
        prompt.cache_manager.register_blocks_cache(desc, theirs, dd.BlocksCacheKey(1, 0))
        ours = [np.full((blocks, block), t % 250 + 1, np.uint8) for t in range(tensors)]
        cache = decoder.cache_manager.register_blocks_cache(desc, ours)
        cm, key = decoder.cache_manager, dd.BlocksCacheKey(1, 0)
        layer = range(3, 4)
        await cm.push_blocks(key, cache, [0], [0], src_layer_range=layer, dst_layer_range=layer)
        sent.clear()
        every = list(range(blocks))
        await cm.push_blocks(key, cache, every, every, src_layer_range=layer, dst_layer_range=layer)
        assert (theirs[6] == 7).all() and (theirs[7] == 8).all() and (theirs[8] == 0).all()
        assert sent == [2 * blocks * block]
        assert decoder.link_statistics(1).recent[-1].mode == "eager"


@pytest.mark.parametrize("op", ["push", "pull"])
async def test_a_request_of_device_memory_on_the_target_waits_for_its_grant(
    monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    # The target stages device memory from a task, which grants: the initiator sees that in
    # the peer's table and neither sends a push's bytes twice nor plans a pull's landing.
    torch = pytest.importorskip("torch")
    sent = _spy(monkeypatch)
    pulls: list[Plan | None] = []
    planned = exchange.eager_pull_plan

    def spied(*args: Any) -> Plan | None:
        pulls.append(planned(*args))
        return pulls[-1]

    monkeypatch.setattr(exchange, "eager_pull_plan", spied)
    device = {"llm.DeviceAdapter": "torch", "llm.TorchDevice": "cpu"}
    async with linked_pair(OPTIONS, prompt_options=device) as (prompt, decoder):
        desc = dd.CacheDesc(2, [8, BLOCK], dd.DataType.DT_UINT8)
        theirs = [torch.full((8, BLOCK), 3, dtype=torch.uint8) for _ in range(2)]
        prompt.cache_manager.register_blocks_cache(desc, theirs, dd.BlocksCacheKey(1, 0))
        ours = [np.full((8, BLOCK), 9, np.uint8) for _ in range(2)]
        cache = decoder.cache_manager.register_blocks_cache(desc, ours)
        cm, key = decoder.cache_manager, dd.BlocksCacheKey(1, 0)
        move = cm.push_blocks if op == "push" else cm.pull_blocks
        await move(key, cache, [0], [0])
        before = prompt.link_statistics(2).bytes
        await move(key, cache, [3], [5])
        if op == "push":
            assert all((t[5] == 9).all() for t in theirs)
        else:
            assert all((o[5] == 3).all() for o in ours)
            assert pulls and all(plan is None for plan in pulls)
        assert sent == []
        assert prompt.link_statistics(2).bytes - before == 2 * BLOCK
        assert decoder.link_statistics(1).recent[-1].mode == "stream"


async def test_small_pushes_behind_a_large_one_on_a_slow_socket_all_succeed() -> None:
    # The writer runs a batch's completions once the whole batch is out: a RESULT may come
    # before a push that the batch carried hears its bytes left. That is not the peer lying.
    async with linked_pair({**OPTIONS, "llm.SyncKvCacheWaitTime": "20000"}) as (prompt, decoder):
        n = 128
        desc = dd.CacheDesc(2, [n, BLOCK], dd.DataType.DT_UINT8)
        theirs = [np.zeros((n, BLOCK), np.uint8) for _ in range(2)]
        prompt.cache_manager.register_blocks_cache(desc, theirs, dd.BlocksCacheKey(1, 0))
        ours = [np.full((n, BLOCK), 7, np.uint8) for _ in range(2)]
        cache = decoder.cache_manager.register_blocks_cache(desc, ours)
        cm, key = decoder.cache_manager, dd.BlocksCacheKey(1, 0)
        await cm.push_blocks(key, cache, [0], [0])
        for side in (decoder, prompt):
            for lnk in engine_of(side).links.links.values():
                lnk.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)
                lnk.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
        pushed = {0}
        for _ in range(5):
            big = list(range(64, 96))  # 4 MiB: it holds the socket while the others queue
            pushed.update(big)
            tasks = [cm.push_blocks(key, cache, big, big)]
            await anyio.lowlevel.checkpoint()
            for i in range(8):
                blocks = [i] if i % 2 == 0 else [8 + i, 20 + i, 30 + i, 40 + i, 50 + i]
                pushed.update(blocks)
                tasks.append(cm.push_blocks(key, cache, blocks, blocks))
            for task in tasks:
                await task  # none fails (it broke the link: "RESULT before the push's DATA")
            assert engine_of(decoder).links.links[1].alive
        done = sorted(pushed)
        assert all((t[done] == 7).all() for t in theirs)


# ---------------------------------------------------------------------- pulls
async def test_a_small_pull_comes_with_no_grant_and_a_large_one_after_its_grant() -> None:
    async with linked_pair(OPTIONS) as (prompt, decoder):
        cache, ours, theirs = await _pair_caches(prompt, decoder)
        theirs.add(list(range(BLOCKS)), 7)
        cm, key = decoder.cache_manager, dd.BlocksCacheKey(1, 0)
        await cm.pull_blocks(key, cache, [0], [0])  # the first fetches the peer's table
        await cm.pull_blocks(key, cache, [3, 7], [9, 1])
        assert np.array_equal(ours[:, [9, 1]], theirs[:, [3, 7]])
        assert decoder.link_statistics(1).recent[-1].mode == "eager"
        big = list(range(BLOCKS))
        assert 2 * BLOCKS * BLOCK > EAGER_BYTES
        theirs.add(big, 1)
        await cm.pull_blocks(key, cache, big, big[::-1])
        assert np.array_equal(ours[:, big[::-1]], theirs[:, big])
        assert decoder.link_statistics(1).recent[-1].mode == "stream"


async def test_shuffled_pulls_of_a_few_blocks_land_exactly_with_no_grant() -> None:
    async with linked_pair(OPTIONS) as (prompt, decoder):
        cache, ours, theirs = await _pair_caches(prompt, decoder)
        cm, key = decoder.cache_manager, dd.BlocksCacheKey(1, 0)
        await cm.pull_blocks(key, cache, [0], [0])  # the first fetches the peer's table
        rng = np.random.default_rng(12)
        for _ in range(30):
            k = int(rng.integers(1, 9))
            src, dst = rng.permutation(BLOCKS)[:k].tolist(), rng.permutation(BLOCKS)[:k].tolist()
            theirs.add(src, 1)  # (bytes we do not hold yet)
            await cm.pull_blocks(key, cache, src, dst)
            assert np.array_equal(ours[:, dst], theirs[:, src])
            assert decoder.link_statistics(1).recent[-1].mode == "eager"


async def test_a_pull_of_many_ranges_planned_in_full_comes_with_no_grant() -> None:
    # More tensors x blocks than a prepared pair plans: planned in full, and checked to land in
    # our own cache, on this side.
    tensors, blocks, block = 8, 32, 1024
    async with linked_pair(OPTIONS) as (prompt, decoder):
        desc = dd.CacheDesc(tensors, [blocks, block], dd.DataType.DT_UINT8)
        rng = np.random.default_rng(5)
        theirs = [rng.integers(0, 255, (blocks, block), dtype=np.uint8) for _ in range(tensors)]
        prompt.cache_manager.register_blocks_cache(desc, theirs, dd.BlocksCacheKey(1, 0))
        ours = [np.zeros((blocks, block), np.uint8) for _ in range(tensors)]
        cache = decoder.cache_manager.register_blocks_cache(desc, ours)
        cm, key = decoder.cache_manager, dd.BlocksCacheKey(1, 0)
        await cm.pull_blocks(key, cache, [0], [0])
        src, dst = rng.permutation(blocks)[:20].tolist(), rng.permutation(blocks)[:20].tolist()
        await cm.pull_blocks(key, cache, src, dst)
        assert all(np.array_equal(o[dst], t[src]) for o, t in zip(ours, theirs, strict=True))
        assert decoder.link_statistics(1).recent[-1].mode == "eager"


# ---------------------------------------------------------------------- a hand-made initiator
PEER_TENSOR = 1 << 40  # the raw peer's one tensor (its bytes are sent by hand)


@pytest.fixture
async def target() -> AsyncIterator[tuple[Any, np.ndarray, int]]:
    """An endpoint in remote-accessible mode with one blocks cache, linked to a hand-made
    peer: ``(raw peer, the cache's array, its cache id)``."""
    opts = endpoint_options(
        "tcp",
        listen=True,
        **{"llm.EnableRemoteCacheAccessible": "1", "llm.SyncKvCacheWaitTime": "2000"},
    )
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        assert p.listen_address is not None
        peer = await raw_link(p.listen_address, 66, remote_accessible=True)
        try:
            await wait_until(lambda: 66 in engine_of(p).links.links, 5)
            arr = np.zeros((4, BLOCK), np.uint8)
            cache = p.cache_manager.register_blocks_cache(
                dd.CacheDesc(1, [4, BLOCK], dd.DataType.DT_UINT8), [arr]
            )
            await populated(p, cache.cache_id)
            yield peer, arr, cache.cache_id
        finally:
            peer.close()


def _push(
    req_id: int, cache_id: int, eager: tuple[int, int] | None, op: Op = Op.PUSH, **fields: Any
) -> bytes:
    """A push of the peer's block 0 into block 2 of ``cache_id`` (a pull with ``op``: of its
    block 0 into the peer's block 2; ``fields``: the request's other fields)."""
    return encode(
        Request(
            req_id,
            op,
            Address(By.CACHE_ID, cache_id=cache_id),
            Shape.BLOCKS,
            (4 * BLOCK, 4, True),
            np.array([PEER_TENSOR], np.uint64),
            src_blocks=np.array([0], np.uint64),
            dst_blocks=np.array([2], np.uint64),
            eager=eager,
            **fields,
        ).encode()
    )


def _data(req_id: int, fill: int, eager: bool) -> bytes:
    return encode(Data(req_id, 0, BLOCK, eager=eager).encode()) + bytes([fill]) * BLOCK


async def _settled(peer: Any) -> None:
    """Everything the peer sent so far was read and acted on (frames are read in order)."""
    await peer.send(Ping().encode())
    with anyio.fail_after(5):
        await peer.recv(MT.PONG)


RIGHT = (BLOCK, stream_digest(np.array([PEER_TENSOR], np.uint64), np.array([BLOCK], np.uint64)))


async def test_bytes_that_follow_the_request_as_the_target_plans_it_land_with_no_grant(
    target: tuple[Any, np.ndarray, int],
) -> None:
    peer, arr, cache_id = target
    await peer.send_bytes(_push(1, cache_id, RIGHT) + _data(1, 0xAB, eager=True))
    with anyio.fail_after(5):
        answer = await peer.frame()
    assert answer.type == MT.RESULT and Result.decode(answer).ok, answer
    assert (arr[2] == 0xAB).all() and (arr[[0, 1, 3]] == 0).all()


@pytest.mark.parametrize(
    "eager",
    [(BLOCK, RIGHT[1] ^ 1), (2 * BLOCK, RIGHT[1]), None],
    ids=["other-digest", "other-total", "not-eager"],
)
async def test_early_bytes_the_target_did_not_take_never_land(
    target: tuple[Any, np.ndarray, int], eager: tuple[int, int] | None
) -> None:
    # A plan that is not the target's (or a request that sent no early bytes, whose DATA
    # still says it is early): the target grants the push, the flagged bytes go nowhere,
    # and only the bytes sent under the GRANT land.
    peer, arr, cache_id = target
    await peer.send_bytes(_push(1, cache_id, eager) + _data(1, 0xAB, eager=True))
    with anyio.fail_after(5):
        grant = Grant.decode(await peer.recv(MT.GRANT))
    assert grant.ok and grant.local is not None and grant.nbytes is not None
    assert grant.local.tolist() == [PEER_TENSOR] and grant.nbytes.tolist() == [BLOCK]
    await _settled(peer)
    assert (arr == 0).all()
    await peer.send_bytes(_data(1, 0xCD, eager=False))
    with anyio.fail_after(5):
        assert Result.decode(await peer.recv(MT.RESULT)).ok
    assert (arr[2] == 0xCD).all() and (arr[[0, 1, 3]] == 0).all()


async def test_late_bytes_for_a_push_taken_as_sent_never_land(
    target: tuple[Any, np.ndarray, int],
) -> None:
    # A push the target took as sent takes only early bytes: a DATA frame that says it was
    # sent under a grant (none was given) is discarded.
    peer, arr, cache_id = target
    await peer.send_bytes(_push(1, cache_id, RIGHT) + _data(1, 0xCD, eager=False))
    await _settled(peer)
    assert (arr == 0).all()
    await peer.send_bytes(_data(1, 0xAB, eager=True))
    with anyio.fail_after(5):
        assert Result.decode(await peer.recv(MT.RESULT)).ok
    assert (arr[2] == 0xAB).all()


@pytest.mark.parametrize("window", [range(0, 1 << 63), range(-(1 << 62), 1 << 62)])
async def test_a_layer_window_longer_than_python_can_count_is_refused(
    target: tuple[Any, np.ndarray, int], window: range
) -> None:
    # (len() of such a range raises OverflowError: it broke the link, from the reader)
    peer, arr, cache_id = target
    req = _push(1, cache_id, None, src_range=window, dst_range=range(0, 1), tensor_num_per_layer=1)
    await peer.send_bytes(req)
    with anyio.fail_after(5):
        assert not Grant.decode(await peer.recv(MT.GRANT)).ok
    await _settled(peer)  # the link is up
    assert (arr == 0).all()


@pytest.mark.parametrize("op", [Op.PULL, Op.PUSH])
@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("layout", (4 * BLOCK, 0, True), "0 slots or blocks"),
        ("dst_block_bytes", 0, "destination blocks of 0 bytes"),
    ],
    ids=["no-blocks", "empty-blocks"],
)
async def test_a_request_of_empty_blocks_is_refused_clearly(
    target: tuple[Any, np.ndarray, int], op: Op, field: str, value: Any, said: str
) -> None:
    # A peer's layout of 0 blocks, or blocks of 0 bytes, used to reach the planner, which
    # divided by it: the refusal said "integer division or modulo by zero".
    peer, arr, cache_id = target
    fields: dict[str, Any] = {"layout": (4 * BLOCK, 4, True), field: value}
    bad = Request(
        1,
        op,
        Address(By.CACHE_ID, cache_id=cache_id),
        Shape.BLOCKS,
        local_addrs=np.array([PEER_TENSOR], np.uint64),
        src_blocks=np.array([0], np.uint64),
        dst_blocks=np.array([2], np.uint64),
        **fields,
    )
    await peer.send_bytes(encode(bad.encode()))
    with anyio.fail_after(5):
        grant = Grant.decode(await peer.recv(MT.GRANT))
    assert grant.status == dd.LLMStatusCode.LLM_PARAM_INVALID, grant
    assert said in (grant.message or ""), grant.message
    await peer.send_bytes(_push(2, cache_id, None))  # the link goes on
    with anyio.fail_after(5):
        assert Grant.decode(await peer.recv(MT.GRANT)).ok
    await peer.send_bytes(_data(2, 0xEF, eager=False))
    with anyio.fail_after(5):
        assert Result.decode(await peer.recv(MT.RESULT)).ok
    assert (arr[2] == 0xEF).all() and (arr[[0, 1, 3]] == 0).all()


async def test_a_pull_planned_as_the_target_plans_it_gets_its_data_with_no_grant(
    target: tuple[Any, np.ndarray, int],
) -> None:
    # Only the digest of the target's own plan of where the stream lands makes it send the
    # DATA alone (flagged); any other gets the GRANT first, and unflagged DATA.
    peer, arr, cache_id = target
    arr[0] = 0x5C
    landing = np.array([PEER_TENSOR + 2 * BLOCK], np.uint64)
    right = (BLOCK, stream_digest(landing, np.array([BLOCK], np.uint64)))
    cases = [(right, True), ((BLOCK, right[1] ^ 1), False), ((2 * BLOCK, right[1]), False)]
    for req_id, (eager, alone) in enumerate([*cases, (None, False)], 1):
        await peer.send_bytes(_push(req_id, cache_id, eager, Op.PULL))
        with anyio.fail_after(5):
            first = await peer.frame()
            if not alone:
                grant = Grant.decode(first)
                assert grant.ok and grant.local is not None
                assert grant.local.tolist() == landing.tolist()
                first = await peer.frame()
        assert first.type == MT.DATA and first.req_id == req_id
        assert bool(first.flags & FLAG_EAGER) is alone
        assert first.payload_len == BLOCK
