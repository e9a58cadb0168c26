"""The wait for a ``LayerEvents`` layer (``llmdd_async._layer_gate.wait_for_layer``), on each
event loop: its signal hops to the loop, so a signal or an abort made as the wait's bound
passes (the bound's expiry seen first) still counts as what it is, not as a timeout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import llmdd_async as dd
from llmdd_async._errors import SynchronizerAborted
from llmdd_async._layer_gate import wait_for_layer

pytestmark = pytest.mark.anyio


class _Expired:
    """A wake-up whose bound passed before the signal's hop arrived; ``meanwhile`` is what
    the model did just before."""

    def __init__(self, meanwhile: Callable[[], None]) -> None:
        self.meanwhile = meanwhile

    def wake(self) -> None:
        pass  # (the hop to the loop is still on its way)

    def expire(self) -> None:
        pass

    async def wait(self) -> bool:
        self.meanwhile()
        return False


class _Timers:
    def now(self) -> float:
        return 0.0

    def call_at(self, when: float, fn: Callable[[], None]) -> object:
        return object()

    def call_later(self, delay: float, fn: Callable[[], None]) -> object:
        return object()

    def cancel(self, timer: Any) -> None:
        pass


class _Engine:
    def __init__(self, meanwhile: Callable[[], None]) -> None:
        self.timers = _Timers()
        self.meanwhile = meanwhile

    def wakeup(self) -> _Expired:
        return _Expired(self.meanwhile)


async def test_a_signal_as_the_bound_passes_is_a_ready_layer() -> None:
    ev = dd.LayerEvents()
    await wait_for_layer(_Engine(lambda: ev.layer_ready(0)), ev, 0, 1000)  # type: ignore[arg-type]


async def test_an_abort_as_the_bound_passes_is_an_abort() -> None:
    ev = dd.LayerEvents()
    with pytest.raises(SynchronizerAborted) as info:
        await wait_for_layer(_Engine(ev.abort), ev, 0, 1000)  # type: ignore[arg-type]
    assert info.value.status_code != dd.LLMStatusCode.LLM_TIMEOUT


async def test_no_signal_by_the_bound_is_a_timeout() -> None:
    ev = dd.LayerEvents()
    with pytest.raises(SynchronizerAborted) as info:
        await wait_for_layer(_Engine(lambda: None), ev, 0, 1000)  # type: ignore[arg-type]
    assert info.value.status_code == dd.LLMStatusCode.LLM_TIMEOUT


class _Recording(_Timers):
    """Timers that keep what was armed: ``(delay from now, fn)``."""

    def __init__(self) -> None:
        self.armed: list[tuple[float, Callable[[], None]]] = []

    def call_at(self, when: float, fn: Callable[[], None]) -> object:
        self.armed.append((when - self.now(), fn))
        return object()

    def call_later(self, delay: float, fn: Callable[[], None]) -> object:
        self.armed.append((delay, fn))
        return object()


class _Waiting:
    def wake(self) -> None:
        pass

    def expire(self) -> None:
        pass

    async def wait(self) -> bool:
        return False  # the bound passed


@pytest.mark.parametrize("waited", [2.0, 7.0])
async def test_a_wait_that_began_before_is_bounded_from_its_start(
    waited: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal pump hands a long wait to the task with its start: the warning (after
    LAYER_WAIT_WARN_S, from the endpoint's timers) and the bound count from then, not again
    from the task's wait."""
    import time

    from llmdd_async import _layer_gate
    from llmdd_async._layer_gate import LAYER_WAIT_WARN_S

    warned: list[int] = []
    monkeypatch.setattr(_layer_gate, "_warn_waiting", lambda e, layer, *a: warned.append(layer))
    timers = _Recording()
    engine = _Engine(lambda: None)
    engine.timers = timers
    engine.wakeup = _Waiting  # type: ignore[assignment,method-assign]
    ev = dd.LayerEvents()
    since = time.monotonic() - waited
    with pytest.raises(SynchronizerAborted):
        await wait_for_layer(engine, ev, 0, 10_000, since=since)  # type: ignore[arg-type]
    ((delay, warn),) = timers.armed
    want = max(0.0, LAYER_WAIT_WARN_S - waited)
    assert want - 0.5 < delay <= want
    assert not warned  # (the timers warn: a logging failure there fails no transfer)
    warn()
    assert warned == [0]
    (bound, _) = timers.armed[1]
    assert 10.0 - waited - 0.5 < bound <= 10.0 - waited


class _PumpEngine:
    """What a :class:`SignalPump` uses of an engine, on the running loop."""

    def __init__(self, timers: Any) -> None:
        from llmdd_async._drivers import event_factory

        self.timers = timers
        self.new_event = event_factory()


async def _pump(
    layers: list[int], timeout_ms: int, step: Callable[[int, float], list[Any]]
) -> tuple[Any, Any, Any]:
    from llmdd_async._drivers import loop_clock, threadsafe_caller
    from llmdd_async._layer_gate import SignalPump
    from llmdd_async._timers import Timers

    timers = Timers()
    timers.now = loop_clock()  # (as the engine's: it works in a loop callback)
    ev = dd.LayerEvents()
    pump = SignalPump(
        _PumpEngine(timers),
        ev,
        layers,
        timeout_ms,
        threadsafe_caller(),
        step,
        timers.now,  # type: ignore[arg-type]
    )
    return pump, ev, timers


async def _run(pump: Any, i: int) -> tuple[int, list[Any]]:
    j, full = await pump.run(i)
    return j, list(full)


async def test_a_signal_pump_hands_on_each_layer_from_where_its_signal_lands() -> None:
    """Layers signalled from the model's thread are handed on in order, on the loop's thread,
    while the producer's task sleeps: it wakes once, at the end."""
    import threading
    import time

    import anyio

    loop_thread = threading.get_ident()
    stepped: list[tuple[int, int]] = []

    def step(layer: int, t_wait: float) -> list[Any]:
        stepped.append((layer, threading.get_ident()))
        return []

    pump, ev, timers = await _pump([0, 1, 2, 3, 4], 10_000, step)

    def model() -> None:
        for i in range(5):
            time.sleep(0.005)
            ev.layer_ready(i)

    async with anyio.create_task_group() as tg:
        tg.start_soon(timers.run)
        ev.layer_ready(0)  # ready at the call: handed on before the first wait
        thread = threading.Thread(target=model)
        thread.start()
        assert await _run(pump, 0) == (5, [])
        thread.join()
        tg.cancel_scope.cancel()
    assert stepped == [(i, loop_thread) for i in range(5)]


async def test_a_signal_pump_gives_the_task_a_full_window_an_abort_and_a_long_wait() -> None:
    import anyio

    full: list[int] = []

    def step(layer: int, t_wait: float) -> list[Any]:
        return ["channel"] if layer in full else []

    pump, ev, timers = await _pump([0, 1, 2, 3], 200, step)
    async with anyio.create_task_group() as tg:
        tg.start_soon(timers.run)
        full.append(1)
        ev.layer_ready(0)
        ev.layer_ready(1)
        # layer 1 went to some destinations only: the task hands it to the rest
        assert await _run(pump, 0) == (2, ["channel"])
        # layer 2 never comes: after the bound (200 ms, under the warning's 5 s) the task
        # waits on, from when the pump began waiting
        t0 = anyio.current_time()
        assert await _run(pump, 2) == (2, [])
        assert pump.since is not None and anyio.current_time() - t0 >= 0.19
        ev.layer_ready(2)
        pump_task = anyio.Event()

        async def run_then_set() -> None:
            assert await _run(pump, 3) == (3, [])  # aborted while it waited: the task's
            pump_task.set()

        tg.start_soon(run_then_set)
        await anyio.sleep(0.01)
        ev.abort()
        await pump_task.wait()
        tg.cancel_scope.cancel()


async def test_a_signal_pump_cancelled_while_it_waits_leaves_no_waker() -> None:
    """A waker left with the synchronizer would hold the whole transfer until its layer comes
    (maybe never: a forward pass that failed)."""
    import anyio

    pump, ev, timers = await _pump([0, 1], 10_000, lambda layer, t_wait: [])
    async with anyio.create_task_group() as tg:
        tg.start_soon(timers.run)
        with anyio.move_on_after(0.05):
            await pump.run(0)
        assert ev._wakers == {}
        tg.cancel_scope.cancel()


async def test_a_signal_pumps_long_wait_counts_from_the_layer_it_waits_for() -> None:
    """The pump's one timer, armed while it waited for an earlier layer, does not cut the
    wait for a later one short: that wait runs its whole bound from its own start."""
    import anyio

    pump, ev, timers = await _pump([0, 1], 200, lambda layer, t_wait: [])
    async with anyio.create_task_group() as tg:
        tg.start_soon(timers.run)
        t0 = anyio.current_time()

        async def signal_later() -> None:
            await anyio.sleep(0.15)
            ev.layer_ready(0)

        tg.start_soon(signal_later)
        assert await _run(pump, 0) == (1, [])  # layer 1 waited for its bound
        assert anyio.current_time() - t0 >= 0.34
        tg.cancel_scope.cancel()


async def test_a_wait_that_ends_at_its_bound_leaves_no_waker() -> None:
    """A task's own wait for a layer (trio, or after a pump) that times out forgets its
    waker: a reused synchronizer whose layer never comes keeps none."""
    import anyio

    from llmdd_async._timers import Timers

    class Engine:
        def __init__(self) -> None:
            from llmdd_async._drivers import wakeup_factory

            self.timers = Timers()
            self.wakeup = wakeup_factory()

    engine = Engine()
    ev = dd.LayerEvents()
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.timers.run)
        with pytest.raises(SynchronizerAborted):
            await wait_for_layer(engine, ev, 0, 20)  # type: ignore[arg-type]
        tg.cancel_scope.cancel()
    assert ev._wakers == {}
