"""``LayerEvents`` across threads: a forward pass signals from one thread, upstream-style code
blocks in ``synchronize_layer`` in others (no event loop: the blocking synchronizer)."""

from __future__ import annotations

import threading
import time

import pytest

import llmdd_async as dd


class _Blocked(threading.Thread):
    """A thread blocked in ``synchronize_layer``; ``outcome`` is what it returned or raised."""

    def __init__(self, events: dd.LayerEvents, layer: int) -> None:
        super().__init__(daemon=True)
        self.events, self.layer = events, layer
        self.outcome: object = None

    def run(self) -> None:
        try:
            self.outcome = self.events.synchronize_layer(self.layer, 10_000)
        except BaseException as exc:  # (reported to the test)
            self.outcome = exc

    def settle(self) -> object:
        self.join(20)
        assert not self.is_alive(), f"layer {self.layer}: still blocked"
        return self.outcome


def _start_blocked(events: dd.LayerEvents, *layers: int) -> list[_Blocked]:
    threads = [_Blocked(events, layer) for layer in layers]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    # (counted under the lock that their wait releases: a signal after that has to wake them)
    while events._sleepers < len(threads):
        assert time.monotonic() < deadline, "the threads never blocked"
        time.sleep(0.001)
    return threads


def test_threads_blocked_on_layers_wake_as_each_is_signalled() -> None:
    events = dd.LayerEvents()
    early, late = _start_blocked(events, 2, 5)
    events.layer_ready(5)
    assert late.settle() is True
    assert early.is_alive()  # (another layer's signal is not its)
    events.layer_ready(2)
    assert early.settle() is True
    assert events.synchronize_layer(5, 0) is True  # ready stays ready


@pytest.mark.parametrize("error", [None, RuntimeError("forward pass failed")])
def test_an_abort_wakes_every_blocked_thread(error: BaseException | None) -> None:
    events = dd.LayerEvents()
    threads = _start_blocked(events, 0, 7)
    events.abort(error)
    for t in threads:
        assert t.settle() is (False if error is None else error)


def test_a_signal_with_nobody_blocked_is_kept_for_the_next_wait() -> None:
    events = dd.LayerEvents(num_layers=3)
    events.layer_ready(1)
    (waiter,) = _start_blocked(events, 2)
    events.layer_ready(2)
    assert waiter.settle() is True
    assert events.synchronize_layer(1, 0) is True
    with pytest.raises(TimeoutError):
        events.synchronize_layer(0, 1)
