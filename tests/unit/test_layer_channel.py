"""How a layer-wise transfer's producer hands layers to a destination
(``llmdd_async._layer_channel.LayerChannel``), on each event loop: in order, at most a window
unseen, and, a layer that came at the model's pace while the consumer waits with nothing handed
over, straight to its ``direct`` send (a layer it takes is never queued; one it refuses is),
with a ``nudge`` waking it when layers left that way; layers ready early queue, to leave
together."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from llmdd_async._layer_channel import LayerChannel

pytestmark = pytest.mark.anyio


def _channel(window: int = 4) -> LayerChannel:
    return LayerChannel(window, anyio.Event)


async def test_a_layer_handed_while_the_consumer_waits_goes_to_its_direct_send() -> None:
    ch = _channel()
    taken: list[int] = []

    def direct(layer: int) -> bool:
        taken.append(layer)
        return layer != 2  # layer 2 cannot leave at once: it must queue

    ch.direct = direct
    assert ch.hand_nowait(0, True) and ch.hand_nowait(1, True)
    assert taken == [0, 1]
    assert ch.ready() == 0  # taken at once: never queued
    assert ch.hand_nowait(2, True)
    assert ch.hand_nowait(3, True)  # behind a queued layer: no direct send (order)
    assert taken == [0, 1, 2]
    ch.direct = None
    assert await ch.wait()
    assert [ch.take_nowait(), ch.take_nowait()] == [2, 3]


async def test_a_layer_ready_early_queues_to_leave_with_others() -> None:
    ch = _channel()
    ch.direct = lambda layer: pytest.fail("only a layer that came at the model's pace")
    assert ch.hand_nowait(0) and ch.hand_nowait(1)
    assert ch.take_through(1) == 1


async def test_without_a_direct_send_layers_queue_in_order_within_the_window() -> None:
    ch = _channel(window=2)
    assert ch.hand_nowait(0) and ch.hand_nowait(1)
    assert not ch.hand_nowait(2)  # the window is full
    assert ch.ready() == 2  # seen: room again
    assert ch.hand_nowait(2)
    assert ch.take_through(1) == 1
    assert await ch.take() == 2


async def test_a_nudge_wakes_a_waiting_consumer_with_no_layer_handed_over() -> None:
    ch = _channel()
    woke: list[bool] = []

    async def consumer() -> None:
        woke.append(await ch.wait())

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            await anyio.sleep(0.01)
            assert woke == []
            ch.nudge()
    assert woke == [True]
    assert ch.ready() == 0


async def test_a_nudge_is_not_a_layer_once_the_producer_finished() -> None:
    ch = _channel()
    ch.nudge()
    ch.finish()
    assert await ch.wait() is False
    assert await ch.take() is None


async def test_a_layer_is_dropped_once_the_consumer_left() -> None:
    ch = _channel(window=1)
    ch.direct = lambda layer: pytest.fail("a consumer that left sends nothing")
    ch.leave()
    assert ch.hand_nowait(0, True) and ch.hand_nowait(1, True)
    assert ch.ready() == 0
