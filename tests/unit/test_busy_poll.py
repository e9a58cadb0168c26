"""``llm.BusyPoll`` (``llmdd_async._busy_poll``): off by default; with a window, link traffic
keeps the loop turning for that long, then the poller waits for traffic again (an idle
endpoint burns no CPU); a poller whose thread was off the CPU rests. Every test runs on
asyncio, uvloop and trio; the poller's own tests run on clocks they move themselves."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import llmdd_async as dd
from llmdd_async._busy_poll import BusyPoll
from llmdd_async._options import MAX_BUSY_POLL_US, parse_options
from tests import helpers

pytestmark = pytest.mark.anyio


class Clocks:
    """A wall clock and the thread's CPU time, moved by the test: each read of ``now`` moves
    both by ``step`` (a running thread), or only the wall clock (``away``)."""

    def __init__(self, step: float = 1e-6) -> None:
        self.t = self.c = 0.0
        self.step = step
        self.away = False

    def now(self) -> float:
        self.t += self.step
        if not self.away:
            self.c += self.step
        return self.t

    def cpu(self) -> float:
        return self.c


async def _turns(n: int) -> None:
    for _ in range(n):
        await anyio.lowlevel.checkpoint()


async def _until(cond: Any, within_s: float = 5.0) -> None:
    with anyio.fail_after(within_s):
        while not cond():
            await anyio.sleep(0.001)


@contextlib.asynccontextmanager
async def _kicked_poller(window_s: float = 1e-3) -> AsyncIterator[tuple[Clocks, BusyPoll]]:
    """A poller on clocks the test moves, running, kicked once; cancelled on exit."""
    clocks = Clocks()
    poll = BusyPoll(window_s, clocks.now, clocks.cpu)
    async with anyio.create_task_group() as tg:
        tg.start_soon(poll.run)
        await _turns(3)
        assert poll.parked  # no traffic yet: it waits
        poll.kick()
        yield clocks, poll
        tg.cancel_scope.cancel()


async def test_off_the_poller_returns_at_once_and_kicks_do_nothing() -> None:
    poll = BusyPoll(0.0)
    with anyio.fail_after(1):
        await poll.run()
    poll.kick()
    assert not poll.parked


async def test_a_kick_keeps_the_loop_turning_for_the_window_then_it_waits_again() -> None:
    async with _kicked_poller() as (clocks, poll):  # a window of 1000 clock reads
        assert not poll.parked
        start = clocks.t
        await _turns(200)  # the poller reads the clock each pass: still inside its window
        assert not poll.parked and clocks.t > start
        await _until(lambda: poll.parked)  # the window passed with no traffic
        assert 1e-3 <= clocks.t - start < 1.1e-3  # (and no longer)
        read = clocks.t
        await _turns(50)
        assert clocks.t == read  # parked: no pass, no clock read
        poll.kick()  # and traffic wakes it again
        await _turns(3)
        assert not poll.parked and clocks.t > read
        await _until(lambda: poll.parked)
        assert poll.rests == 0
    assert not poll.parked  # (cancelled: not left looking parked)


async def test_kicks_within_the_window_extend_it() -> None:
    async with _kicked_poller() as (clocks, poll):
        start = clocks.t
        while clocks.t - start < 5e-3:  # five windows, kicked well within each
            await _turns(100)
            assert not poll.parked
            poll.kick()
        await _until(lambda: poll.parked)


async def test_a_poller_whose_thread_was_off_the_cpu_rests_and_kicks_do_not_wake_it() -> None:
    async with _kicked_poller() as (clocks, poll):
        poll.rest_s = 1.0
        await _turns(20)
        assert not poll.resting
        clocks.step, clocks.away = 1e-3, True  # a pass whose thread spent 1 ms off the CPU
        await _until(lambda: poll.resting)
        clocks.step, clocks.away = 1e-6, False
        assert poll.rests == 1 and not poll.parked
        read = clocks.t
        poll.kick()  # traffic while it rests: the loop sleeps between events
        await _turns(50)
        assert poll.resting and clocks.t == read
        await _until(lambda: not poll.resting)  # then it polls again for that traffic
        await _until(lambda: poll.parked)
        assert clocks.t - read >= poll.window_s  # (a whole window of it)
        assert poll.rests == 1


async def test_work_done_on_the_loop_between_passes_is_not_taken_for_a_busy_cpu() -> None:
    async with _kicked_poller(window_s=0.1) as (clocks, poll):
        clocks.step = 2e-3  # passes 2 ms apart, all of it this thread's CPU time
        await _turns(20)
        assert not poll.parked  # (20 passes of 2 ms: inside the window still)
        clocks.step = 1e-3
        assert poll.rests == 0 and not poll.resting
        await _until(lambda: poll.parked)


async def test_an_endpoints_poller_reads_a_clock_of_microseconds() -> None:
    """Its window and its look at the CPU need microseconds: uvloop's loop clock counts
    milliseconds, and with it every pass looked like one whose thread was off the CPU."""
    async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
        helpers.endpoint_options("tcp", **{"llm.BusyPoll": "500"})
    ) as d:
        now = d._engine.busy_poll._now
        fine = []
        for _ in range(20):  # (a preempted try reads more: one within the bounds suffices)
            a = now()
            end = time.perf_counter() + 200e-6
            while time.perf_counter() < end:
                pass
            fine.append(150e-6 <= now() - a < 900e-6)
        assert any(fine)


def test_the_option_is_microseconds_off_by_default() -> None:
    base = helpers.endpoint_options()
    assert parse_options(base).busy_poll_s == 0.0
    assert parse_options({**base, "llm.BusyPoll": "250"}).busy_poll_s == 250e-6
    top = str(MAX_BUSY_POLL_US)
    assert parse_options({**base, "llm.BusyPoll": top}).busy_poll_s == MAX_BUSY_POLL_US / 1e6
    for bad in ("-1", str(MAX_BUSY_POLL_US + 1), "50us", "0.5", "", "\u00b2", "\u0663", "0" * 5000):
        with pytest.raises(dd.LLMException) as err:
            parse_options({**base, "llm.BusyPoll": bad})
        assert err.value.status_code == dd.LLMStatusCode.LLM_PARAM_INVALID, bad


async def test_every_way_a_link_sends_or_reads_kicks_its_endpoints_poller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pulls small and big, a layer-wise push and a table fetch kick the poller from each
    place a link sends (send, send_soon, send_stream, send_frame_now) and from its reader."""
    sites: dict[int, set[str]] = {}
    real_kick = BusyPoll.kick

    def kick(self: BusyPoll) -> None:
        sites.setdefault(id(self), set()).add(sys._getframe(1).f_code.co_name)
        real_kick(self)

    monkeypatch.setattr(BusyPoll, "kick", kick)
    window = {"llm.BusyPoll": "200", "llm.SyncKvCacheWaitTime": "20000"}
    opts = helpers.endpoint_options("tcp", ra=True, **window)
    async with (
        dd.LLMDataDist(dd.LLMRole.DECODER, 2).running({**opts, "llm.listenIpInfo": "127.0.0.1:0"})
        as decoder,
        dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as prompt,
    ):  # fmt: skip
        layers, big = 4, 1 << 20
        desc = dd.CacheDesc(2 * layers, [4, big // 2], dd.DataType.DT_UINT8)
        theirs = decoder.cache_manager.allocate_blocks_cache(desc, dd.BlocksCacheKey(2, 0))
        ours = prompt.cache_manager.allocate_blocks_cache(desc)
        for t in ours.tensors:
            t[:] = 9
        assert decoder.listen_address is not None
        await helpers.link(prompt, 2, decoder.listen_address)
        key = dd.BlocksCacheKey(2, 0)
        await prompt.cache_manager.pull_blocks(key, ours, [0], [1])  # 4 MiB: streamed
        await prompt.cache_manager.pull_blocks(
            key, ours, [0], [1], src_layer_range=range(0, 1), dst_layer_range=range(0, 1)
        )  # 1 MiB: served from the reader
        ready = dd.LayerEvents()
        ready.layer_ready(0)
        cfg = dd.TransferWithCacheKeyConfig(key, range(0, layers), range(0, layers))
        task = prompt.cache_manager.transfer_cache_async(ours, ready, [cfg], [2], [3])
        for i in range(1, layers):  # the model's pace: each layer leaves as it is signalled
            await anyio.sleep(0.02)
            ready.layer_ready(i)
        await task
        assert await task.get_results() == [dd.LLMStatusCode.LLM_SUCCESS]
        assert all((t[3] == 9).all() for t in theirs.tensors)
        pk, dk = id(prompt._engine.busy_poll), id(decoder._engine.busy_poll)
    everywhere = sites.get(pk, set()) | sites.get(dk, set())
    assert {"readable", "send", "send_soon", "send_stream", "send_frame_now"} <= everywhere
    assert "readable" in sites[pk] and "readable" in sites[dk]


@pytest.mark.parametrize("transport", ["tcp", "same-host"])
async def test_link_traffic_kicks_the_endpoints_poller_and_it_parks_when_idle(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    window = {"llm.BusyPoll": "10000"}  # 10 ms
    async with (
        dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(
            helpers.endpoint_options(transport, listen=True, **window)
        ) as prompt,
        dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            helpers.endpoint_options(transport, **window)
        ) as decoder,
        dd.LLMDataDist(dd.LLMRole.DECODER, 3).running(helpers.endpoint_options(transport)) as quiet,
    ):
        desc = dd.CacheDesc(1, [8, 64], dd.DataType.DT_UINT8)
        key = dd.BlocksCacheKey(1, 0)
        src = prompt.cache_manager.allocate_blocks_cache(desc, key)
        src.tensors[0][:] = 7
        dst = np.zeros((8, 64), np.uint8)
        cache = decoder.cache_manager.register_blocks_cache(desc, [dst])
        theirs, ours = prompt._engine.busy_poll, decoder._engine.busy_poll
        assert prompt.listen_address is not None
        await helpers.link(decoder, 1, prompt.listen_address)
        await _until(lambda: theirs.parked and ours.parked)  # the link is up: both rest
        kicked = {"n": 0}
        real_kick = BusyPoll.kick

        def counting(self: BusyPoll) -> None:
            kicked["n"] += self is ours
            real_kick(self)

        monkeypatch.setattr(BusyPoll, "kick", counting)
        await decoder.cache_manager.pull_blocks(key, cache, [1, 2], [3, 4])
        assert (dst[3:5] == 7).all() and not dst[:3].any()
        assert kicked["n"] >= 2  # its request out, the answer in
        await _until(lambda: ours.parked and theirs.parked)  # idle again: both wait
        assert quiet._engine.busy_poll.window_s == 0.0  # off unless asked for
        assert not quiet._engine.busy_poll.parked
