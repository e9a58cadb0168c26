"""A loop-lag probe: how long the event loop was held away from a task that only sleeps."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import anyio

__all__ = ["LoopLagProbe"]


class LoopLagProbe:
    """A task that sleeps ``interval_s`` in a loop and records by how much each wake-up came
    late: the largest overshoot is the longest stretch some other code held the event loop.

    ::

        async with LoopLagProbe().running() as probe:
            ...  # the work under test
        print(probe.max_lag_s)

    Works on asyncio (with or without uvloop) and trio. ``max_lag_s`` is wall time: it
    includes the operating system's scheduling and waits for the GIL, so on a loaded machine it
    is an upper bound. ``max_busy_s`` is the CPU time the loop's thread spent in the longest of
    those stretches: the work other code did on the loop at a stretch, whatever the load.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        """Raises ValueError for an interval that is not > 0."""
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        #: the largest overshoot seen since the last :meth:`reset`, in seconds
        self.max_lag_s = 0.0
        #: the CPU time of the loop's thread in its busiest overshooting sleep, in seconds
        self.max_busy_s = 0.0
        #: wake-ups seen since the last :meth:`reset`
        self.samples = 0

    @property
    def max_lag_ms(self) -> float:
        return self.max_lag_s * 1e3

    @property
    def max_busy_ms(self) -> float:
        return self.max_busy_s * 1e3

    def reset(self) -> None:
        """Forget what was measured so far (e.g. after a warm-up)."""
        self.max_lag_s = 0.0
        self.max_busy_s = 0.0
        self.samples = 0

    async def run(self) -> None:
        """Measure until cancelled."""
        while True:
            before, cpu = time.perf_counter(), time.thread_time()
            await anyio.sleep(self.interval_s)
            lag = time.perf_counter() - before - self.interval_s
            busy = time.thread_time() - cpu
            self.samples += 1
            if lag > self.max_lag_s:
                self.max_lag_s = lag
            if lag > 0 and busy > self.max_busy_s:
                self.max_busy_s = busy

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[LoopLagProbe]:
        """Run the probe in a task for the duration of the ``async with`` block."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.run)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()
