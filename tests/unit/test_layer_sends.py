"""How a layer-wise request's layers leave (``_net.feed.send_layers``), on each event loop:
each layer's send is bounded by the feed's per-layer timeout (``llm.SyncKvCacheWaitTime``),
the wait for the model's next layer is not, and each layer is reported sent (or not) once."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel
import pytest

from llmdd_async._errors import CopyCancelled
from llmdd_async._net.feed import send_layers
from llmdd_async._timers import Timers

pytestmark = pytest.mark.anyio

LAYER_BYTES = 4096
TIMEOUT_S = 0.1


class Feed:
    """Hands layers over one at a time, each after its own delay (the model's pace)."""

    def __init__(self, delays: list[float]) -> None:
        self.timeout_s = TIMEOUT_S
        self.delays = delays
        self.due = 0
        self.reported: list[tuple[range, int | None]] = []

    async def next(self, now: Callable[[int], bool] | None = None) -> range | None:
        if self.due == len(self.delays):
            return None
        await anyio.sleep(self.delays[self.due])
        self.due += 1
        return range(self.due - 1, self.due)

    def sent(self, run: range, nbytes: int | None) -> None:
        self.reported.append((run, nbytes))


class OfferingFeed(Feed):
    """As the scheduler's: a layer that comes while :meth:`next` waits is offered to ``now``
    first (it then left); only one that ``now`` refuses is handed over."""

    def __init__(self, delays: list[float]) -> None:
        super().__init__(delays)
        self.offered: list[int] = []

    async def next(self, now: Callable[[int], bool] | None = None) -> range | None:
        while self.due < len(self.delays):
            await anyio.sleep(self.delays[self.due])
            layer, self.due = self.due, self.due + 1
            if now is None:
                return range(layer, layer + 1)
            self.offered.append(layer)
            if not now(layer):
                return range(layer, layer + 1)
        return range(0)  # the last layers left at once


class Request:
    """What the exchange around ``send_layers`` keeps: the runs that left."""

    def __init__(
        self,
        feed: Feed,
        send: Callable[[int, int], Awaitable[None]],
        send_now: Callable[[int, int, Callable[[bool], None]], bool] | None = None,
    ) -> None:
        self.feed, self.send, self.send_now = feed, send, send_now
        self.spans = list(range(len(feed.delays) + 1))
        self.records: list[int] = []

    async def run(self) -> None:
        def record(started: float, layers: int) -> None:
            self.records.append(layers * LAYER_BYTES)

        timers = Timers()  # the endpoint's, as the exchange passes them
        failed: list[BaseException] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(timers.run)
            try:
                await send_layers(
                    self.feed, self.spans, LAYER_BYTES, timers, self.send, record, self.send_now
                )
            except Exception as exc:  # raised as is, not in the task group's group
                failed.append(exc)
            tg.cancel_scope.cancel()
        if failed:
            raise failed[0]


async def test_a_pause_of_the_model_between_layers_is_not_a_send_timeout() -> None:
    feed = Feed([0, 3 * TIMEOUT_S, 0])  # the second layer comes long after the timeout
    sends: list[tuple[int, int]] = []

    async def send(a: int, b: int) -> None:
        await anyio.lowlevel.checkpoint()  # a send that yields, as a held-up socket's would
        sends.append((a, b))

    req = Request(feed, send)
    with anyio.fail_after(5):
        await req.run()
    assert sends == [(0, 1), (1, 2), (2, 3)]
    assert feed.reported == [(range(i, i + 1), LAYER_BYTES) for i in range(3)]
    assert req.records == [LAYER_BYTES] * 3


async def test_a_layer_whose_send_outlasts_the_timeout_fails_it() -> None:
    feed = Feed([0, 0, 0])
    sends: list[int] = []

    async def send(a: int, b: int) -> None:
        if a == 1:
            await anyio.sleep(3 * TIMEOUT_S)  # the socket holds this layer up
        sends.append(a)

    req = Request(feed, send)
    t0 = anyio.current_time()
    with anyio.fail_after(5), pytest.raises(TimeoutError):
        await req.run()
    assert anyio.current_time() - t0 < 2 * TIMEOUT_S + 0.1
    assert sends == [0]
    assert feed.reported == [(range(0, 1), LAYER_BYTES), (range(1, 2), None)]
    assert req.records == [LAYER_BYTES]


async def test_each_layer_has_its_own_timeout() -> None:
    """Layers that each take most of the timeout do not add up to a failure."""
    feed = Feed([0] * 4)

    async def send(a: int, b: int) -> None:
        await anyio.sleep(0.6 * TIMEOUT_S)

    with anyio.fail_after(5):
        await Request(feed, send).run()
    assert feed.reported == [(range(i, i + 1), LAYER_BYTES) for i in range(4)]


async def test_a_feed_that_ends_early_aborts_the_request() -> None:
    async def send(a: int, b: int) -> None:
        pass

    feed = Feed([0, 0])
    req = Request(feed, send)
    feed.delays = feed.delays[:1]  # the producer stops after the first of two layers
    with pytest.raises(CopyCancelled):
        await req.run()
    assert feed.reported == [(range(0, 1), LAYER_BYTES)]


async def test_layers_handed_over_out_of_order_are_a_bug_not_a_send() -> None:
    class Skipping(Feed):
        async def next(self, now: Callable[[int], bool] | None = None) -> range | None:
            self.due += 1
            return range(1, 2)  # layer 0 was due

    sends: list[int] = []

    async def send(a: int, b: int) -> None:
        sends.append(a)

    with pytest.raises(RuntimeError, match="where layer 0 was due"):
        await Request(Skipping([0, 0]), send).run()
    assert sends == []


async def test_a_shielded_send_past_its_timeout_counts_and_the_next_wait_is_unbounded() -> None:
    """A frame once started is finished (its send is shielded): if the layer's deadline
    passes meanwhile the layer still left, and the wait for the model's next layer, longer
    than the timeout, is not cut short by that deadline."""
    feed = Feed([0, 3 * TIMEOUT_S, 3 * TIMEOUT_S])

    async def send(a: int, b: int) -> None:
        if a == 0:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(2 * TIMEOUT_S)

    req = Request(feed, send)
    with anyio.fail_after(5):
        await req.run()
    assert feed.reported == [(range(i, i + 1), LAYER_BYTES) for i in range(3)]
    assert req.records == [LAYER_BYTES] * 3


async def test_layers_that_come_while_none_is_due_leave_at_once_in_order() -> None:
    """With a way to send at once, a layer the model signals while the sender waits leaves
    from there (counted, recorded, reported sent); one it cannot send at once (the link
    busy) is handed over and sent as before, and the order holds."""
    feed = OfferingFeed([0.01] * 4)
    events: list[tuple[str, int]] = []

    async def send(a: int, b: int) -> None:
        events.append(("send", a))

    def send_now(a: int, b: int, then: Callable[[bool], None]) -> bool:
        if a == 2:
            return False  # the link is not free for it: it is handed over
        events.append(("now", a))
        then(True)
        return True

    req = Request(feed, send, send_now)
    with anyio.fail_after(5):
        await req.run()
    assert events == [("now", 0), ("now", 1), ("send", 2), ("now", 3)]
    assert feed.offered == [0, 1, 2, 3]
    assert feed.reported == [(range(i, i + 1), LAYER_BYTES) for i in range(4)]
    assert req.records == [LAYER_BYTES] * 4


async def test_a_layer_offered_out_of_turn_is_not_sent_at_once() -> None:
    """Only the layer due may leave at once: another one offered is refused (the feed then
    hands it over, which is a bug the check of the run catches)."""

    class OutOfTurn(OfferingFeed):
        async def next(self, now: Callable[[int], bool] | None = None) -> range | None:
            assert now is not None
            self.offered.append(1)
            assert not now(1)  # layer 0 is due
            return await super().next(now)

    sends: list[int] = []

    def send_now(a: int, b: int, then: Callable[[bool], None]) -> bool:
        sends.append(a)
        then(True)
        return True

    async def send(a: int, b: int) -> None:
        pytest.fail("every layer in turn leaves at once here")

    feed = OutOfTurn([0, 0])
    with anyio.fail_after(5):
        await Request(feed, send, send_now).run()
    assert sends == [0, 1]
    assert feed.reported == [(range(0, 1), LAYER_BYTES), (range(1, 2), LAYER_BYTES)]


async def test_without_a_way_to_send_at_once_the_feed_is_offered_none() -> None:
    feed = OfferingFeed([0, 0])
    sends: list[int] = []

    async def send(a: int, b: int) -> None:
        sends.append(a)

    with anyio.fail_after(5):
        await Request(feed, send).run()
    assert sends == [0, 1]
    assert feed.offered == []


async def test_a_layer_sent_at_once_is_recorded_and_reported_once_it_is_all_out() -> None:
    """A layer whose frame the socket did not take at once is reported sent (and recorded)
    only when its last byte is out, and not at all if it could not be (the link failed)."""
    feed = OfferingFeed([0, 0, 0])
    pending: list[Callable[[bool], None]] = []

    def send_now(a: int, b: int, then: Callable[[bool], None]) -> bool:
        pending.append(then)  # still going out
        return True

    async def send(a: int, b: int) -> None:
        pytest.fail("every layer leaves at once here")

    req = Request(feed, send, send_now)
    with anyio.fail_after(5):
        await req.run()
    assert feed.reported == [] and req.records == []
    pending[0](True)
    pending[1](False)
    pending[2](True)
    assert feed.reported == [
        (range(0, 1), LAYER_BYTES),
        (range(1, 2), None),
        (range(2, 3), LAYER_BYTES),
    ]
    assert req.records == [LAYER_BYTES, LAYER_BYTES]
