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

    async def shared(name: str) -> None:
        async with lock.hold(False):
            log.append(f"+{name}")
            peak["shared"] = max(peak["shared"], lock.holders)
            await anyio.sleep(0.02)
            log.append(f"-{name}")

    async def exclusive(name: str) -> None:
        async with lock.hold(True):
            assert lock.holders == 1
            log.append(f"+{name}")
            await anyio.sleep(0.02)
            log.append(f"-{name}")

    async with anyio.create_task_group() as tg:
        tg.start_soon(shared, "a")
        tg.start_soon(shared, "b")
        await anyio.sleep(0.005)
        tg.start_soon(exclusive, "X")
        await anyio.sleep(0.005)
        tg.start_soon(shared, "c")  # arrives after X: waits for it (FIFO), no starvation
    assert peak["shared"] == 2
    x_in, x_out = log.index("+X"), log.index("-X")
    assert log.index("-a") < x_in and log.index("-b") < x_in  # X waited for a and b
    assert log[x_in + 1] == "-X"  # nothing inside X
    assert log.index("+c") > x_out  # c queued behind X


async def test_a_waiter_cancelled_in_the_queue_leaves_no_trace() -> None:
    lock = PhaseLock()
    got: list[str] = []

    async with anyio.create_task_group() as tg:

        async def holder() -> None:
            async with lock.hold(False):
                await anyio.sleep(0.05)

        async def excl() -> None:
            with anyio.move_on_after(0.01):
                async with lock.hold(True):
                    got.append("never")

        async def later() -> None:
            await anyio.sleep(0.02)
            async with lock.hold(False):  # not held back by the cancelled exclusive waiter
                got.append("shared")

        tg.start_soon(holder)
        await anyio.sleep(0.001)
        tg.start_soon(excl)
        tg.start_soon(later)
    assert got == ["shared"]
    assert lock.holders == 0
    async with lock.hold(True):  # free again
        assert lock.holders == 1
