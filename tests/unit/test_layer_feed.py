"""A layer-wise request's feed (``llmdd_async._scheduler._Feed``), on each event loop: a layer
that comes at the model's pace while the sender waits leaves at once from where it is handed
over, but only in its turn on the link (FIFO with pulls: never past one that holds or queues
for the phase lock), holding the link until it is all out; the request ends early when the
producer stops, and goes on when its last layer left that way."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from llmdd_async._layer_channel import LayerChannel
from llmdd_async._phase_lock import PhaseLock
from llmdd_async._scheduler import _Feed

pytestmark = pytest.mark.anyio

PER = 4096


class _Link:
    def __init__(self) -> None:
        self.transfer_lock = PhaseLock()


class _Dest:
    def __init__(self) -> None:
        self.link = _Link()


class _Ctl:
    def now(self) -> float:
        return time.monotonic()


class Rig:
    """A feed of ``run`` over a real channel and phase lock; what it reported sent, and the
    layers its sender sent at once."""

    def __init__(self, run: range) -> None:
        self.dest = _Dest()
        self.lock = self.dest.link.transfer_lock
        self.channel = LayerChannel(8, anyio.Event)
        self.started_at: dict[int, float] = {}
        self.reported: list[range] = []
        self.feed = _Feed(
            self.dest,  # type: ignore[arg-type]
            self.channel,
            run,
            1.0,
            _Ctl(),  # type: ignore[arg-type]
            self.started_at,
            lambda layers, nbytes: self.reported.append(layers),
            anyio.Event,
        )
        self.at_once: list[int] = []
        #: whether a layer sent at once is all out at once (else its end is left to the test)
        self.whole = True

    def now(self, i: int) -> bool:
        self.at_once.append(i)
        if self.whole:
            self.feed.sent(range(i, i + 1), PER)
        return True

    async def next_in_task(self, out: list[Any]) -> None:
        out.append(await self.feed.next(self.now))

    @contextlib.asynccontextmanager
    async def waiting(self) -> AsyncIterator[list[Any]]:
        """The feed's sender waits in ``next`` (what it returns goes in the list) while the
        body hands layers over; it has returned once the body is done."""
        got: list[Any] = []
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.next_in_task, got)
                await _settle()
                yield got


async def _settle() -> None:
    for _ in range(5):
        await anyio.lowlevel.checkpoint()


async def test_layers_at_the_models_pace_leave_at_once_and_the_last_lets_the_sender_on() -> None:
    rig = Rig(range(10, 12))
    async with rig.waiting() as got:
        assert rig.channel.hand_nowait(10, True) and rig.channel.hand_nowait(11, True)
    assert rig.at_once == [0, 1]
    assert rig.reported == [range(10, 11), range(11, 12)]
    assert got == [range(0)]  # nothing left to send: the request goes on to its RESULT
    assert set(rig.started_at) == {10, 11}
    assert rig.lock.try_take(False)  # the link was given back


async def test_a_layer_waits_its_turn_behind_a_pull_that_holds_the_link() -> None:
    rig = Rig(range(0, 2))
    assert rig.lock.try_take(False)  # a pull holds the link
    async with rig.waiting() as got:
        assert rig.channel.hand_nowait(0, True)
        await _settle()
        assert rig.at_once == []  # not past the pull: handed over instead
        assert got == []  # and its sender waits for the link
        rig.lock.give(False)  # the pull is done
    assert got == [range(0, 1)]
    assert rig.started_at.keys() == {0}


async def test_a_layer_sent_at_once_holds_the_link_until_it_is_all_out() -> None:
    rig = Rig(range(0, 3))
    rig.whole = False
    async with rig.waiting() as got:
        assert rig.channel.hand_nowait(0, True)
        assert rig.at_once == [0]
        assert not rig.lock.try_take(False)  # a pull must wait: layer 0 is still going out
        assert rig.channel.hand_nowait(1, True)  # not at once while layer 0 is out
        await _settle()
        assert rig.at_once == [0] and got == []  # its sender waits for layer 0 to be out
        rig.feed.sent(range(0, 1), PER)  # layer 0's last byte is out
    assert got == [range(1, 2)]
    assert rig.reported == [range(0, 1)]


async def test_the_producer_stopping_after_layers_left_at_once_ends_the_request_early() -> None:
    rig = Rig(range(0, 3))
    async with rig.waiting() as got:
        assert rig.channel.hand_nowait(0, True)
        rig.channel.finish()  # the synchronizer failed: no layer 1
    assert rig.at_once == [0]
    assert got == [None] and rig.feed.ended_early


async def test_a_layer_ready_early_is_handed_over_not_sent_at_once() -> None:
    rig = Rig(range(0, 2))
    async with rig.waiting() as got:
        assert rig.channel.hand_nowait(0) and rig.channel.hand_nowait(1)
    assert rig.at_once == []
    assert got == [range(0, 2)]  # together, in one frame
