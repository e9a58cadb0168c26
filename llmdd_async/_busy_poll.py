"""``llm.BusyPoll``: keep the event loop polling for a while after link traffic.

An endpoint whose loop sleeps between a request and its answer is woken by the kernel when
the answer comes: on a machine whose idle CPUs halt (most VMs), that wake-up interrupts an
idle CPU and the woken process runs with cold caches, which costs about as much as the
Python work of a small request. With a window set, each frame sent or received keeps the
loop polling (``epoll`` with no timeout, between whatever else runs) for that long after
it: the next frame is picked up by a running loop. It trades a busy core while traffic flows
for latency, as NIXL's and Mooncake's polling threads do; it is off by default.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.lowlevel

__all__ = ["BusyPoll"]


class BusyPoll:
    """The poller of one endpoint: :meth:`kick` on link traffic, :meth:`run` in its task
    group. With a window of 0 :meth:`run` returns at once and :meth:`kick` does nothing."""

    __slots__ = ("_now", "_parked", "_seen", "_until", "window_s")

    def __init__(self, window_s: float, now: Callable[[], float] = anyio.current_time) -> None:
        #: seconds the loop keeps polling after the last kick (0: off)
        self.window_s = window_s
        self._now = now
        #: traffic since the poller last looked (it then moves the end of its window)
        self._seen = False
        self._until = 0.0
        #: set while the poller waits for traffic (a kick wakes it)
        self._parked: anyio.Event | None = None

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
        now, window = self._now, self.window_s
        while True:
            if self._seen:
                self._seen = False
                self._until = now() + window
            if now() < self._until:
                # Each pass is one turn of the loop: its I/O is polled with no timeout while
                # something is ready to run, and this is.
                await anyio.lowlevel.checkpoint()
                continue
            parked = self._parked = anyio.Event()
            await parked.wait()
