"""``llm.BusyPoll``: keep the event loop polling for a while after link traffic.

An endpoint whose loop sleeps between a request and its answer is woken by the kernel when
the answer comes: on a machine whose idle CPUs halt (most VMs), that wake-up interrupts an
idle CPU and the woken process runs with cold caches, which costs about as much as the
Python work of a small request. With a window set, each frame a link sends or receives keeps
the loop polling (``epoll`` with a zero timeout, between whatever else runs) for that long
after it: the next frame is picked up by a running loop. It trades a busy core while traffic
flows for latency, as NIXL's and Mooncake's polling threads do; it is off by default.

Polling only pays while the CPU is otherwise idle. A poller that finds its thread was off the
CPU between two passes (another process ran there, or another thread held the GIL) rests:
there a poller only takes turns from them and, being always runnable, loses the priority the
scheduler gives a woken process, which costs milliseconds, not microseconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import anyio.lowlevel

__all__ = ["BusyPoll"]

#: a pass whose thread was off the CPU this long ran on a busy machine (or waited for the GIL)
AWAY_S = 500e-6
#: how long the poller then rests (the loop sleeps between events, as with polling off)
REST_S = 0.05


class BusyPoll:
    """The poller of one endpoint: :meth:`kick` on link traffic, :meth:`run` in its task
    group. With a window of 0 :meth:`run` returns at once and :meth:`kick` costs nothing
    else. ``now`` is a wall clock and ``cpu`` this thread's CPU time (seconds), both precise
    to the microsecond: not the loop's clock (uvloop's counts milliseconds)."""

    __slots__ = (
        "_cpu",
        "_now",
        "_parked",
        "_seen",
        "away_s",
        "rest_s",
        "resting",
        "rests",
        "window_s",
    )

    def __init__(
        self,
        window_s: float,
        now: Callable[[], float] = time.perf_counter,
        cpu: Callable[[], float] = time.thread_time,
    ) -> None:
        #: seconds the loop keeps polling after the last kick (0: off)
        self.window_s = window_s
        self.away_s = AWAY_S
        self.rest_s = REST_S
        self._now = now
        self._cpu = cpu
        #: traffic since the poller last looked (it then moves the end of its window)
        self._seen = False
        #: set while the poller waits for traffic (a kick wakes it)
        self._parked: anyio.Event | None = None
        #: resting after its thread was found off the CPU (kicks do not wake it)
        self.resting = False
        #: rests so far
        self.rests = 0

    @property
    def parked(self) -> bool:
        """The poller waits for traffic (the loop sleeps between events as it would without
        it)."""
        return self._parked is not None

    def kick(self) -> None:
        """Link traffic: poll for another window from now. Costs an attribute write (no
        clock read): the poller moves its window when it next runs."""
        self._seen = True
        parked = self._parked
        if parked is not None:
            self._parked = None
            parked.set()

    async def run(self) -> None:
        """Poll while traffic keeps coming, wait for it otherwise; until cancelled."""
        if self.window_s <= 0:
            return
        try:
            while True:
                if not self._seen:
                    parked = self._parked = anyio.Event()
                    await parked.wait()
                await self._poll()
        finally:
            self._parked = None
            self.resting = False

    async def _poll(self) -> None:
        """Keep the loop turning until a window passes with no kick, or rest."""
        now, cpu = self._now, self._cpu
        self._seen = False
        t, c = now(), cpu()
        until = t + self.window_s
        while True:
            # One pass is one turn of the loop: its I/O is polled with a zero timeout while
            # something is ready to run, and this is.
            await anyio.lowlevel.checkpoint()
            t2, c2 = now(), cpu()
            if (t2 - t) - (c2 - c) > self.away_s:
                self.rests += 1
                self.resting = True
                try:
                    await anyio.sleep(self.rest_s)
                finally:
                    self.resting = False
                return  # (traffic meanwhile: polled again at once)
            t, c = t2, c2
            if self._seen:
                self._seen = False
                until = t + self.window_s
            elif t >= until:
                return
