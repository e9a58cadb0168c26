"""The I/O driver of each event-loop backend (``llmdd_async._drivers``), one conformance suite:
every test runs on asyncio, uvloop and trio, over a real socket pair, and checks what a link's
reader relies on: a call per readiness with no task per frame, pause and resume (with bytes
already buffered), the deadline, and a stop that ends every call at once."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import time
from collections.abc import AsyncIterator, Callable

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import sniffio

from llmdd_async._drivers import (
    BACKENDS,
    Driver,
    driver_for,
    event_factory,
    loop_clock,
    soon_caller,
    threadsafe_caller,
    wakeup_factory,
)
from llmdd_async._timers import Timer, Timers

pytestmark = pytest.mark.anyio


class Recorder:
    """An ``on_readable`` that reads what is there and records it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.data = bytearray()
        self.calls = 0
        self.deadlines = 0
        self.again = 0  # how many more times to ask to be called without readiness
        self.hook: Callable[[], None] | None = None

    def readable(self) -> bool:
        self.calls += 1
        with contextlib.suppress(BlockingIOError):
            self.data += self.sock.recv(65536, socket.MSG_DONTWAIT)
        if self.hook is not None:
            self.hook()
        if self.again:
            self.again -= 1
            return True
        return False

    def deadline(self) -> None:
        self.deadlines += 1


async def _wait(cond: Callable[[], bool], within_s: float = 5.0) -> None:
    with anyio.fail_after(within_s):
        while not cond():
            await anyio.sleep(0.001)


async def _started(rec: Recorder) -> None:
    """A driver looks at the socket once as it starts (bytes may be buffered already)."""
    await _wait(lambda: rec.calls == 1)
    rec.calls = 0


@pytest.fixture
async def pair() -> AsyncIterator[tuple[socket.socket, socket.socket, Recorder, Driver]]:
    a, b = socket.socketpair()
    rec = Recorder(b)
    driver = driver_for(b, rec.readable, rec.deadline)
    async with anyio.create_task_group() as tg:
        tg.start_soon(driver.run)
        await _started(rec)
        try:
            yield a, b, rec, driver
        finally:
            driver.stop()
            tg.cancel_scope.cancel()
    a.close()
    b.close()


def test_each_backend_has_a_driver_in_a_file_of_its_own() -> None:
    assert set(BACKENDS) == {"asyncio", "trio"}
    assert len(set(BACKENDS.values())) == len(BACKENDS)


async def test_bytes_are_read_as_they_come(pair: tuple) -> None:
    a, _, rec, _ = pair
    for i in range(20):
        a.send(bytes([i]) * 100)
        await _wait(lambda i=i: len(rec.data) == 100 * (i + 1))
    assert bytes(rec.data) == b"".join(bytes([i]) * 100 for i in range(20))


async def test_asking_again_is_answered_without_new_bytes(pair: tuple) -> None:
    a, _, rec, _ = pair
    rec.again = 3
    a.send(b"x")
    await _wait(lambda: rec.calls >= 4)
    await anyio.sleep(0.05)
    assert rec.calls == 4  # one per "again", then it waits for the socket
    assert rec.data == b"x"


async def test_paused_it_reads_nothing_and_resumed_it_looks_at_once(pair: tuple) -> None:
    a, _, rec, driver = pair
    rec.hook = driver.pause
    a.send(b"1")
    await _wait(lambda: rec.calls == 1)
    rec.hook = None
    a.send(b"2")
    await anyio.sleep(0.05)
    assert rec.calls == 1 and rec.data == b"1"  # paused: the socket is not watched
    driver.resume()
    await _wait(lambda: rec.data == b"12")
    # Resumed with nothing new on the socket: it still looks once (bytes may be buffered).
    calls = rec.calls
    driver.pause()
    driver.resume()
    await _wait(lambda: rec.calls == calls + 1)


async def test_the_deadline_fires_once_and_can_be_moved_or_cleared(pair: tuple) -> None:
    _, _, rec, driver = pair
    driver.set_deadline(anyio.current_time() + 0.05)
    await _wait(lambda: rec.deadlines == 1)
    await anyio.sleep(0.1)
    assert rec.deadlines == 1
    driver.set_deadline(anyio.current_time() + 10)
    driver.set_deadline(anyio.current_time() + 0.02)  # moved earlier
    await _wait(lambda: rec.deadlines == 2, within_s=2)
    driver.set_deadline(anyio.current_time() + 0.02)
    driver.set_deadline(None)
    await anyio.sleep(0.1)
    assert rec.deadlines == 2


async def test_the_deadline_fires_while_paused(pair: tuple) -> None:
    _, _, rec, driver = pair
    driver.pause()
    driver.set_deadline(anyio.current_time() + 0.02)
    await _wait(lambda: rec.deadlines == 1)


async def test_stopped_nothing_more_is_called_and_run_returns() -> None:
    a, b = socket.socketpair()
    rec = Recorder(b)
    driver = driver_for(b, rec.readable, rec.deadline)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(driver.run)
            await _started(rec)
            a.send(b"x")
            await _wait(lambda: rec.calls == 1)
            driver.set_deadline(anyio.current_time() + 0.02)
            driver.stop()
            a.send(b"y")
            await anyio.sleep(0.1)
        # run() returned by itself (the task group did not need a cancel)
    assert rec.calls == 1 and rec.deadlines == 0
    b.close()  # the driver let go of the socket first
    a.close()


async def test_asked_again_as_its_deadline_passes_it_still_reads_before_new_bytes(
    pair: tuple,
) -> None:
    """A read that asks to be called again (frames still buffered) while the deadline passes
    is called again without new bytes, and the deadline fires too (a trio reader once lost
    the call: its deadline cancelled the checkpoint before it)."""
    a, _, rec, driver = pair

    def slow_first_read() -> None:
        rec.hook = None
        driver.set_deadline(anyio.current_time() + 0.01)
        time.sleep(0.03)  # the deadline passes while the read still runs

    rec.hook = slow_first_read
    rec.again = 1
    a.send(b"x")
    await _wait(lambda: rec.calls >= 2 and rec.deadlines == 1)
    await anyio.sleep(0.05)
    assert rec.calls == 2 and rec.deadlines == 1 and rec.data == b"x"


async def test_stopped_from_its_read_past_the_deadline_nothing_more_is_called(
    pair: tuple,
) -> None:
    a, _, rec, driver = pair

    def stop_late() -> None:
        rec.hook = None
        driver.set_deadline(anyio.current_time() + 0.005)
        time.sleep(0.02)  # the deadline passes, then the read stops the driver
        driver.stop()

    rec.hook = stop_late
    a.send(b"x")
    await _wait(lambda: rec.calls == 1)
    a.send(b"y")
    await anyio.sleep(0.1)
    assert rec.calls == 1 and rec.deadlines == 0


async def test_a_driver_of_the_running_loop_reads_without_a_task_switch_per_frame(
    anyio_backend: tuple[str, dict],
) -> None:
    """On asyncio and uvloop no task runs the reader at all (a loop callback); on trio one
    task waits and calls it."""
    a, b = socket.socketpair()
    rec = Recorder(b)
    seen: list[object] = []

    def record_task() -> None:
        try:
            seen.append(anyio.get_current_task().id)
        except Exception:  # no task: a loop callback
            seen.append(None)

    driver = driver_for(b, rec.readable, rec.deadline)
    async with anyio.create_task_group() as tg:
        tg.start_soon(driver.run)
        await _started(rec)
        rec.hook = record_task
        for i in range(3):
            a.send(b"z")
            await _wait(lambda i=i: len(seen) > i)
        driver.stop()
    a.close()
    b.close()
    if anyio_backend[0] == "asyncio":
        assert seen == [None, None, None]  # the loop's own callback: no task at all
    else:
        assert len(set(seen)) == 1 and seen[0] is not None  # the one reader task


@contextlib.asynccontextmanager
async def _running(timers: Timers) -> AsyncIterator[None]:
    """``timers`` run by a task of their own for the block, stopped after it."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(timers.run)
        await anyio.lowlevel.checkpoint()
        yield
        tg.cancel_scope.cancel()


async def test_timers_run_in_order_once_and_cancelled_ones_never() -> None:
    timers = Timers()
    ran: list[str] = []
    async with _running(timers):
        now = anyio.current_time()
        timers.call_at(now + 0.06, lambda: ran.append("late"))
        gone = timers.call_at(now + 0.03, lambda: ran.append("cancelled"))
        timers.call_at(now + 0.01, lambda: ran.append("early"))  # earlier than the sleep
        timers.cancel(gone)
        await _wait(lambda: len(ran) == 2)
        await anyio.sleep(0.05)
    assert ran == ["early", "late"]


def _live_timers() -> int:
    gc.collect()
    return sum(type(o) is Timer for o in gc.get_objects())


async def test_many_cancelled_timers_do_not_pile_up() -> None:
    before = _live_timers()  # (any other test's still alive)
    timers = Timers()
    async with _running(timers):
        far = anyio.current_time() + 3600
        timers.call_at(far - 1, lambda: None)  # live, on top: those below wait for a compaction
        for _ in range(20_000):
            timers.cancel(timers.call_at(far, lambda: None))
        assert len(timers) < 10_000
        # Nor are the ones a compaction dropped kept alive elsewhere (before: the sleeping
        # runner held the list it woke with, cancelled timers and all: ~4,100 more here).
        assert _live_timers() - before <= len(timers)


async def test_timers_cancelled_in_the_order_they_were_set_leave_at_once() -> None:
    """Every transfer sets a timer for its deadline and cancels it when it ends, mostly in the
    order they were set: kept until a compaction, each would outlive the collector's young
    passes (and their numbers set off its full ones)."""
    timers = Timers()
    far = anyio.current_time() + 3600
    for _ in range(1000):  # one transfer after another
        timers.cancel(timers.call_at(far, lambda: None))
        assert len(timers) == 0
    first, second = timers.call_at(far, lambda: None), timers.call_at(far + 1, lambda: None)
    timers.cancel(second)  # (under a live timer: it waits for it, or for a compaction)
    assert len(timers) == 2
    timers.cancel(first)
    assert len(timers) == 0


async def test_a_timer_after_the_earliest_runs_on_time_when_that_one_is_cancelled() -> None:
    """The runner sleeps until the earliest timer; cancelled, it leaves the heap at once, and
    the next one still runs when due (not before, not never)."""
    timers = Timers()
    ran: list[float] = []
    async with _running(timers):
        now = anyio.current_time()
        first = timers.call_at(now + 0.03, lambda: ran.append(-1.0))
        await anyio.sleep(0.005)  # the runner sleeps until it
        timers.call_at(now + 0.08, lambda: ran.append(anyio.current_time()))
        timers.cancel(first)
        assert len(timers) == 1
        await _wait(lambda: bool(ran))
    assert len(ran) == 1 and ran[0] >= now + 0.08


async def test_the_loop_clock_is_anyios_clock() -> None:
    clock = loop_clock()
    before = anyio.current_time()
    now = clock()
    assert before <= now <= anyio.current_time()
    await anyio.sleep(0.02)
    assert clock() - now >= 0.015  # the same clock, not a copy of its time


async def test_timers_on_the_loop_clock_run_when_due() -> None:
    timers = Timers()
    timers.now = loop_clock()
    ran: list[float] = []
    async with _running(timers):
        t0 = anyio.current_time()
        timers.call_later(0.03, lambda: ran.append(anyio.current_time()))
        await _wait(lambda: bool(ran))
    assert ran[0] - t0 >= 0.025


async def test_a_backend_event_set_from_another_thread_wakes_its_waiter() -> None:
    event = event_factory()()
    call = threadsafe_caller()
    assert not event.is_set()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, lambda: (time.sleep(0.02), call(event.set)))
            await event.wait()
    assert event.is_set()


async def test_a_call_soon_runs_after_what_is_ready_now_with_no_task() -> None:
    call = soon_caller()
    if sniffio.current_async_library() == "trio":
        assert call is None  # (no cheap loop callback there)
        return
    assert call is not None
    ran: list[str] = []
    assert call(lambda: ran.append("soon"))
    ran.append("now")  # (the caller goes on first: nothing runs inside call)
    await _wait(lambda: len(ran) == 2)
    assert ran == ["now", "soon"]


async def test_a_task_waiting_on_a_backend_event_is_cancelled_like_on_anyios() -> None:
    event = event_factory()()
    with anyio.move_on_after(0.05) as scope:
        await event.wait()
    assert scope.cancelled_caught
    async with anyio.create_task_group() as tg:
        tg.start_soon(event.wait)
        await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert not event.is_set()


async def test_a_wakeup_woken_from_another_thread_returns_true() -> None:
    wakeup = wakeup_factory()()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, lambda: (time.sleep(0.02), wakeup.wake()))
            assert await wakeup.wait() is True


async def test_a_wakeup_expired_returns_false_and_the_first_of_the_two_counts() -> None:
    expired = wakeup_factory()()
    expired.expire()
    expired.wake()  # (too late: the expiry came first)
    assert await expired.wait() is False
    woken = wakeup_factory()()
    woken.wake()  # (from the loop thread too: it is run as a loop callback)
    await anyio.sleep(0.01)
    woken.expire()  # (too late)
    assert await woken.wait() is True


async def test_a_task_waiting_on_a_wakeup_is_cancelled_and_a_late_wake_does_nothing() -> None:
    errors: list[object] = []
    if sniffio.current_async_library() == "asyncio":  # (on trio such an error ends the run)
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
    wakeup = wakeup_factory()()
    with anyio.move_on_after(0.05) as scope:
        await wakeup.wait()
    assert scope.cancelled_caught
    wakeup.wake()  # a wake after the waiter left: no error in the loop's callback
    wakeup.expire()
    await anyio.sleep(0.01)
    assert errors == []


async def test_a_threadsafe_call_runs_in_the_loops_context_where_anyio_knows_the_library() -> None:
    """What a model thread's signal has the loop run (a layer handed on, frames sent, tasks
    spawned) runs in a fresh context, neither the signalling thread's nor that of the task
    that made the caller, and anyio calls work there as in a task."""
    import contextvars
    import threading

    import anyio

    from llmdd_async._drivers import threadsafe_caller

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="loop")
    seen: list[object] = []
    done = anyio.Event()
    token = var.set("the task that made the caller")  # (an endpoint's user's, say)
    call = threadsafe_caller()
    var.reset(token)

    def on_loop() -> None:
        seen.append(var.get())
        seen.append(anyio.current_time() > 0)
        done.set()

    def thread() -> None:
        var.set("model thread")
        call(on_loop)

    threading.Thread(target=thread).start()
    with anyio.fail_after(5):
        await done.wait()
    assert seen == ["loop", True]
