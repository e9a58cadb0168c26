"""Frames handed to a link's writer in one loop turn (``LinkWriter.send_soon``: a burst of
requests issued together) leave in a few ``sendmsg``, not one each: the first at once, the rest
held until the turn ends, at most ``_TURN_BATCH`` together (on asyncio; trio has no cheap loop
callback to end the turn with, and sends them as they come). What is held still goes out before
any frame sent another way after it (a request before its ABORT)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import sniffio

from llmdd_async._messages import Done, Result
from llmdd_async._net import writer as writer_module
from llmdd_async._net.link import Link
from llmdd_async._protocol import MT, Message
from llmdd_async.testing import DEFAULT_OPTIONS, link_of, linked_pair, wait_until

pytestmark = pytest.mark.anyio

#: request ids the peer never made: it ignores RESULT and DONE frames for them
BASE = 1 << 40


def _record(peer: Link) -> list[tuple[MT, int]]:
    """What the peer's reader hands its router from now on, in order."""
    seen: list[tuple[MT, int]] = []
    dispatch = peer.router.dispatch_now

    def record(msg: Message) -> int:
        seen.append((msg.type, msg.req_id))
        return dispatch(msg)

    peer.router.dispatch_now = record  # type: ignore[method-assign]
    return seen


def _count_sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per non-blocking ``sendmsg`` the writer makes from now on."""
    calls: list[int] = []
    send_nowait = writer_module.send_nowait

    def counted(*args: Any) -> int:
        calls.append(1)
        return send_nowait(*args)

    monkeypatch.setattr(writer_module, "send_nowait", counted)
    return calls


def _nothing() -> None:
    pass


async def test_frames_handed_over_in_one_loop_turn_leave_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = 20
    async with linked_pair({**DEFAULT_OPTIONS, "llm.Transport": "tcp"}) as (prompt, decoder):
        link, peer = link_of(prompt, 2).raw, link_of(decoder, 1).raw
        seen = _record(peer)
        calls = _count_sends(monkeypatch)
        for i in range(n):  # one loop turn: no await in between
            assert link.send_soon([Result(BASE + i).encode()], [], _nothing)
        # The first went at once, then each full batch; the rest waits for the turn's end.
        batch = writer_module._TURN_BATCH if sniffio.current_async_library() != "trio" else 1
        assert len(calls) == 1 + (n - 1) // batch
        await wait_until(lambda: len(seen) >= n)
        assert seen == [(MT.RESULT, BASE + i) for i in range(n)]
        assert len(calls) == 1 + math.ceil((n - 1) / batch)


async def test_a_frame_sent_another_way_goes_after_what_the_turn_holds() -> None:
    async with linked_pair({**DEFAULT_OPTIONS, "llm.Transport": "tcp"}) as (prompt, decoder):
        link, peer = link_of(prompt, 2).raw, link_of(decoder, 1).raw
        seen = _record(peer)
        assert link.send_soon([Result(BASE).encode()], [], _nothing)  # at once
        assert link.send_soon([Result(BASE + 1).encode()], [], _nothing)  # held
        await link.send(Done(BASE + 2).encode())  # a task's control frame, the lock free
        await wait_until(lambda: len(seen) >= 3)
        assert seen == [(MT.RESULT, BASE), (MT.RESULT, BASE + 1), (MT.DONE, BASE + 2)]
