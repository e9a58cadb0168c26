"""The per-link phase lock: shared holders together, exclusive alone, FIFO, cancel-safe."""

from __future__ import annotations

import anyio
import pytest

from llmdd_async._phase_lock import PhaseLock

pytestmark = pytest.mark.anyio


async def test_shared_holders_run_together_and_exclusive_alone() -> None:
    lock = PhaseLock()
    log: list[str] = []
    peak = {"shared": 0}

    release = anyio.Event()

    async def shared(name: str) -> None:
        async with lock.hold(False):
            log.append(f"+{name}")
            peak["shared"] = max(peak["shared"], lock.holders)
            await release.wait()
            log.append(f"-{name}")

    async def exclusive(name: str) -> None:
        async with lock.hold(True):
            assert lock.holders == 1
            log.append(f"+{name}")
            await anyio.sleep(0.02)
            log.append(f"-{name}")

    async with anyio.create_task_group() as tg:
        # Each arrives once the ones before it hold the lock or wait in its queue.
        tg.start_soon(shared, "a")
        tg.start_soon(shared, "b")
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(exclusive, "X")
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(shared, "c")  # arrives after X: waits for it (FIFO), no starvation
        await anyio.wait_all_tasks_blocked()
        release.set()
    assert peak["shared"] == 2
    x_in, x_out = log.index("+X"), log.index("-X")
    assert log.index("-a") < x_in and log.index("-b") < x_in  # X waited for a and b
    assert log[x_in + 1] == "-X"  # nothing inside X
    assert log.index("+c") > x_out  # c queued behind X


async def test_a_waiter_cancelled_in_the_queue_leaves_no_trace() -> None:
    lock = PhaseLock()
    got: list[str] = []

    async with anyio.create_task_group() as tg:
        release = anyio.Event()
        gave_up = anyio.Event()

        async def holder() -> None:
            async with lock.hold(False):
                await release.wait()

        async def excl() -> None:
            with anyio.CancelScope() as scope:
                give_up.append(scope)
                async with lock.hold(True):
                    got.append("never")
            gave_up.set()

        async def later() -> None:
            await gave_up.wait()
            async with lock.hold(False):  # not held back by the cancelled exclusive waiter
                got.append("shared")
            release.set()

        give_up: list[anyio.CancelScope] = []
        tg.start_soon(holder)
        await anyio.wait_all_tasks_blocked()  # the holder holds
        tg.start_soon(excl)
        tg.start_soon(later)
        await anyio.wait_all_tasks_blocked()  # the exclusive one waits in the queue
        give_up[0].cancel()
    assert got == ["shared"]
    assert lock.holders == 0
    async with lock.hold(True):  # free again
        assert lock.holders == 1
