"""How a layer-wise request's layers leave (``Exchange._send_layers``), on each event loop:
each layer's send is bounded by the feed's per-layer timeout (``llm.SyncKvCacheWaitTime``),
the wait for the model's next layer is not, and each layer is reported sent (or not) once.
The exchange around it is stood in for by the few attributes the method reads."""

from __future__ import annotations

import types

import anyio
import numpy as np
import pytest

from llmdd_async._errors import CopyCancelled
from llmdd_async._net.exchange import Exchange
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

    async def next(self) -> range | None:
        if self.due == len(self.delays):
            return None
        await anyio.sleep(self.delays[self.due])
        self.due += 1
        return range(self.due - 1, self.due)

    def sent(self, run: range, nbytes: int | None) -> None:
        self.reported.append((run, nbytes))


def exchange(feed: Feed) -> types.SimpleNamespace:
    layers = len(feed.delays)
    grant = types.SimpleNamespace(nbytes=np.full(layers, LAYER_BYTES, np.uint64), mode=None)
    return types.SimpleNamespace(
        feed=feed,
        _spans=list(range(layers + 1)),
        _grant=grant,
        spec=types.SimpleNamespace(op=types.SimpleNamespace(value="push")),
        engine=types.SimpleNamespace(timers=Timers()),
        link=types.SimpleNamespace(history=[]),
    )


async def test_a_pause_of_the_model_between_layers_is_not_a_send_timeout() -> None:
    feed = Feed([0, 3 * TIMEOUT_S, 0])  # the second layer comes long after the timeout
    sends: list[tuple[int, int]] = []

    async def send(a: int, b: int) -> None:
        await anyio.sleep(0)  # a send that yields, as one the socket holds up would
        sends.append((a, b))

    ex = exchange(feed)
    with anyio.fail_after(5):
        await Exchange._send_layers(ex, send)  # type: ignore[arg-type]
    assert sends == [(0, 1), (1, 2), (2, 3)]
    assert feed.reported == [(range(i, i + 1), LAYER_BYTES) for i in range(3)]
    assert [r.nbytes for r in ex.link.history] == [LAYER_BYTES] * 3


async def test_a_layer_whose_send_outlasts_the_timeout_fails_it() -> None:
    feed = Feed([0, 0, 0])
    sends: list[int] = []

    async def send(a: int, b: int) -> None:
        if a == 1:
            await anyio.sleep(3 * TIMEOUT_S)  # the socket holds this layer up
        sends.append(a)

    ex = exchange(feed)
    t0 = anyio.current_time()
    with anyio.fail_after(5), pytest.raises(TimeoutError):
        await Exchange._send_layers(ex, send)  # type: ignore[arg-type]
    assert anyio.current_time() - t0 < 2 * TIMEOUT_S + 0.1
    assert sends == [0]
    assert feed.reported == [(range(0, 1), LAYER_BYTES), (range(1, 2), None)]
    assert len(ex.link.history) == 1


async def test_each_layer_has_its_own_timeout() -> None:
    """Layers that each take most of the timeout do not add up to a failure."""
    feed = Feed([0] * 4)

    async def send(a: int, b: int) -> None:
        await anyio.sleep(0.6 * TIMEOUT_S)

    ex = exchange(feed)
    with anyio.fail_after(5):
        await Exchange._send_layers(ex, send)  # type: ignore[arg-type]
    assert feed.reported == [(range(i, i + 1), LAYER_BYTES) for i in range(4)]


async def test_a_feed_that_ends_early_aborts_the_request() -> None:
    feed = Feed([0, 0])
    feed.delays = feed.delays[:1]  # the producer stops after the first layer
    ex = exchange(feed)
    ex._spans = [0, 1, 2]
    ex._grant.nbytes = np.full(2, LAYER_BYTES, np.uint64)

    async def send(a: int, b: int) -> None:
        pass

    with pytest.raises(CopyCancelled):
        await Exchange._send_layers(ex, send)  # type: ignore[arg-type]
    assert feed.reported == [(range(0, 1), LAYER_BYTES)]
