"""``llm.BusyPoll`` (``llmdd_async._busy_poll``): off by default; with a window, link traffic
keeps the loop turning for that long, then the poller waits for traffic again (an idle
endpoint burns no CPU). Every test runs on asyncio, uvloop and trio."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import llmdd_async as dd
from llmdd_async._busy_poll import BusyPoll
from llmdd_async._drivers import loop_clock
from llmdd_async._options import parse_options
from tests import helpers

pytestmark = pytest.mark.anyio


async def _until_parked(poll: BusyPoll, within_s: float = 5.0) -> None:
    with anyio.fail_after(within_s):
        while not poll.parked:
            await anyio.sleep(0.001)


async def test_off_the_poller_returns_at_once_and_kicks_do_nothing() -> None:
    poll = BusyPoll(0.0)
    with anyio.fail_after(1):
        await poll.run()
    poll.kick()
    assert not poll.parked


async def test_a_kick_keeps_the_loop_turning_for_the_window_then_it_waits_again() -> None:
    poll = BusyPoll(0.2, loop_clock())
    async with anyio.create_task_group() as tg:
        tg.start_soon(poll.run)
        await _until_parked(poll)  # no traffic yet: it waits
        poll.kick()
        assert not poll.parked
        turns = 0
        for _ in range(50):  # the loop keeps turning: nothing here sleeps, the poller runs
            await anyio.lowlevel.checkpoint()
            turns += 1
            assert not poll.parked
        assert turns == 50
        await _until_parked(poll)  # the window passed with no traffic: it waits again
        poll.kick()  # and traffic wakes it once more
        await anyio.sleep(0.01)
        assert not poll.parked
        await _until_parked(poll)
        tg.cancel_scope.cancel()


async def test_kicks_within_the_window_extend_it() -> None:
    poll = BusyPoll(0.1, loop_clock())
    async with anyio.create_task_group() as tg:
        tg.start_soon(poll.run)
        await _until_parked(poll)
        start = anyio.current_time()
        poll.kick()
        while anyio.current_time() - start < 0.3:  # three windows, a kick every 20 ms
            await anyio.sleep(0.02)
            assert not poll.parked
            poll.kick()
        await _until_parked(poll)
        tg.cancel_scope.cancel()


def test_the_option_is_microseconds_off_by_default() -> None:
    base = helpers.endpoint_options()
    assert parse_options(base).busy_poll_s == 0.0
    assert parse_options({**base, "llm.BusyPoll": "250"}).busy_poll_s == 250e-6
    assert parse_options({**base, "llm.BusyPoll": "1000000"}).busy_poll_s == 1.0
    for bad in ("-1", "1000001", "50us", "0.5", ""):
        with pytest.raises(dd.LLMException) as err:
            parse_options({**base, "llm.BusyPoll": bad})
        assert err.value.status_code == dd.LLMStatusCode.LLM_PARAM_INVALID, bad


@pytest.mark.parametrize("transport", ["tcp", "same-host"])
async def test_link_traffic_kicks_the_endpoints_poller_and_it_rests_when_idle(
    transport: str,
) -> None:
    window = {"llm.BusyPoll": "300000"}  # 0.3 s: long enough to see from here
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
        await _until_parked(theirs)  # the link's setup is over: both rest
        await _until_parked(ours)
        await decoder.cache_manager.pull_blocks(key, cache, [1, 2], [3, 4])
        assert (dst[3:5] == 7).all() and not dst[:3].any()
        assert not ours.parked  # (its request and the answer kicked it: 0.3 s from then)
        assert not theirs.parked
        await _until_parked(ours)  # idle again: both rest
        await _until_parked(theirs)
        assert quiet._engine.busy_poll.window_s == 0.0  # off unless asked for
        assert not quiet._engine.busy_poll.parked
