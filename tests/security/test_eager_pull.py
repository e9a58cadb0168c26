"""A hostile target against a pull planned on this side (``_net/eager.py``): DATA flagged
``FLAG_EAGER`` lands only in the plan this side made, inside its own cache, and only until a
GRANT comes; a GRANT replaces that plan, and flagged bytes after it land nowhere. A pull's
bytes, planned here or granted, come in order: a pull ends only when they cover its plan."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import RawPeer, cluster, endpoint_options, hostile_server, server_identity

import llmdd_async as dd
from llmdd_async._messages import Data, Grant, Mode, Request
from llmdd_async._protocol import MT, Message, encode

pytestmark = pytest.mark.anyio

BLOCK = 64 << 10
THEIRS = 1 << 40  # the hostile peer's one tensor, as its table publishes it


def _table() -> Message:
    cache = {
        "cache_id": 1,
        "addrs": [THEIRS],
        "tensor_bytes": 4 * BLOCK,
        "count": 4,
        "is_blocks": True,
        "placement": 0,
        "remote_accessible": True,
    }
    return Message(MT.TABLE, 0, {"caches": [cache], "blocks_keys": {"0": 1}})


def _data(req_id: int, fill: int, eager: bool, n: int = BLOCK, off: int = 0) -> bytes:
    header = Data(req_id, off, n, to_initiator=True, eager=eager).encode()
    return encode(header) + bytes([fill]) * n


async def _pull_from(
    answer: Callable[[RawPeer, Request], Awaitable[None]],
) -> tuple[np.ndarray, dd.LLMException | None]:
    """Pull block 0 of the hostile peer's cache into block 2 of ours (one tensor of 4 blocks,
    zeros) after ``answer`` answered the XFER_REQ (which must say this side planned it):
    our cache, and what the pull failed with."""
    requests: list[Request] = []

    def serve(h: RawPeer, peer: dict[str, Any]) -> dict[str, Any]:
        return server_identity(1, remote_accessible=True)

    async def after(h: RawPeer) -> None:
        while True:
            msg = await h.frame()
            if msg.type == MT.TABLE_REQ:
                await h.send(_table())
            elif msg.type == MT.XFER_REQ:
                req = Request.decode(msg)
                requests.append(req)
                await answer(h, req)

    serve.after = after  # type: ignore[attr-defined]
    async with hostile_server(1, serve) as addr:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options(ra=True)) as d:
            code, _ = await d.link_clusters([cluster(1, addr)], 3000)
            assert code == dd.LLMStatusCode.LLM_SUCCESS
            ours = np.zeros((4, BLOCK), np.uint8)
            desc = dd.CacheDesc(1, [4, BLOCK], dd.DataType.DT_UINT8)
            cache = d.cache_manager.register_blocks_cache(desc, [ours])
            error = None
            try:
                with anyio.fail_after(10):
                    await d.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), cache, [0], [2])
            except dd.LLMException as exc:
                error = exc
            assert requests and requests[0].eager is not None  # planned here
            return ours, error


@pytest.mark.parametrize("early", [BLOCK, BLOCK // 2], ids=["granted-first", "half-early"])
async def test_a_grant_replaces_the_plan_and_flagged_bytes_after_it_never_land(early: int) -> None:
    # The peer sends flagged bytes (all, or half: they land where we planned), then grants the
    # pull, sends flagged bytes again, then the bytes its GRANT announced in two halves: the
    # pull ends only once those all landed, and they are what it holds.
    async def answer(h: RawPeer, req: Request) -> None:
        local = req.local_addrs[:1] + np.uint64(2 * BLOCK)
        nbytes = np.array([BLOCK], np.uint64)
        grant = Grant(req.req_id, mode=Mode.STREAM, total=BLOCK, local=local, nbytes=nbytes)
        if early < BLOCK:
            await h.send_bytes(_data(req.req_id, 0xAB, eager=True, n=early))
        await h.send(grant.encode())
        await h.send_bytes(_data(req.req_id, 0xAB, eager=True))
        half = BLOCK // 2
        for off in (0, half):
            await h.send_bytes(_data(req.req_id, 0xCD, eager=False, n=half, off=off))

    ours, error = await _pull_from(answer)
    assert error is None
    assert (ours[2] == 0xCD).all()
    assert (ours[[0, 1, 3]] == 0).all()


_SHORT = f"GRANT moves {BLOCK // 2} bytes, but the request selected {BLOCK}"
_TWICE = "GRANT names ranges of our cache more than once"


@pytest.mark.parametrize(
    ("ranges", "why"),
    [
        ([(0, BLOCK // 2)], _SHORT),
        ([(0, BLOCK // 4), (3 * BLOCK // 4, BLOCK // 4)], _SHORT),
        ([(0, BLOCK // 2), (0, BLOCK // 2)], _TWICE),
    ],
    ids=["first-half", "two-quarters", "first-half-twice"],
)
async def test_a_grant_of_less_than_the_selection_breaks_the_link(
    ranges: list[tuple[int, int]], why: str
) -> None:
    # Ranges inside the block asked for, adding up to half of it (or to all of it, the same
    # half twice), and their bytes: taken, the pull ended as a success with half of the block
    # never written.
    async def answer(h: RawPeer, req: Request) -> None:
        base = int(req.local_addrs[0]) + 2 * BLOCK
        local = np.array([base + off for off, _ in ranges], np.uint64)
        nbytes = np.array([n for _, n in ranges], np.uint64)
        total = int(nbytes.sum())
        grant = Grant(req.req_id, mode=Mode.STREAM, total=total, local=local, nbytes=nbytes)
        await h.send(grant.encode())
        await h.send_bytes(_data(req.req_id, 0xCD, eager=False, n=total))

    ours, error = await _pull_from(answer)
    assert error is not None and error.status_code == dd.LLMStatusCode.LLM_LINK_FAILED, error
    assert why in str(error)
    assert (ours == 0).all()


async def test_flagged_bytes_beyond_the_plan_break_the_link_and_land_nowhere() -> None:
    async def answer(h: RawPeer, req: Request) -> None:
        await h.send_bytes(_data(req.req_id, 0xAB, eager=True, n=2 * BLOCK))

    ours, error = await _pull_from(answer)
    assert error is not None and error.status_code == dd.LLMStatusCode.LLM_LINK_FAILED, error
    assert "outside its plan" in str(error)
    assert (ours == 0).all()


async def test_flagged_bytes_of_the_planned_size_land_where_this_side_planned_them() -> None:
    # (what an honest peer does: the pull ends with them, no GRANT, no DONE)
    async def answer(h: RawPeer, req: Request) -> None:
        await h.send_bytes(_data(req.req_id, 0x5A, eager=True))

    ours, error = await _pull_from(answer)
    assert error is None
    assert (ours[2] == 0x5A).all()
    assert (ours[[0, 1, 3]] == 0).all()


@pytest.mark.parametrize("granted", [False, True], ids=["planned-here", "granted"])
async def test_a_pulls_bytes_sent_twice_instead_of_in_full_break_the_link(granted: bool) -> None:
    # Two frames over the first half make as many bytes as the whole block: counted, that
    # ended the pull as a success with half of the block never written.
    async def answer(h: RawPeer, req: Request) -> None:
        if granted:
            local = req.local_addrs[:1] + np.uint64(2 * BLOCK)
            nbytes = np.array([BLOCK], np.uint64)
            grant = Grant(req.req_id, mode=Mode.STREAM, total=BLOCK, local=local, nbytes=nbytes)
            await h.send(grant.encode())
        for fill in (0xAB, 0xCD):
            await h.send_bytes(_data(req.req_id, fill, eager=not granted, n=BLOCK // 2))

    _, error = await _pull_from(answer)
    assert error is not None and error.status_code == dd.LLMStatusCode.LLM_LINK_FAILED, error
    assert "so far end at" in str(error)


async def test_a_second_grant_for_one_request_breaks_the_link() -> None:
    # A checked GRANT was replaced by the next one: under a task that acts on the first (a
    # local copy), a second one in stream mode took the push's path, and the pull sent our
    # destination's stale bytes to the peer, then ended as a success (the RESULT it sent).
    async def answer(h: RawPeer, req: Request) -> None:
        local = req.local_addrs[:1] + np.uint64(2 * BLOCK)
        nbytes = np.array([BLOCK], np.uint64)
        grant = Grant(req.req_id, mode=Mode.STREAM, total=BLOCK, local=local, nbytes=nbytes)
        await h.send(grant.encode())
        await h.send(grant.encode())
        await h.send_bytes(_data(req.req_id, 0xCD, eager=False))

    ours, error = await _pull_from(answer)
    assert error is not None and error.status_code == dd.LLMStatusCode.LLM_LINK_FAILED, error
    assert "a second GRANT for the same request" in str(error)
    assert (ours == 0).all()
