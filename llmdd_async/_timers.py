"""Callbacks at given times on the event loop, from one task per endpoint.

A transfer that runs without a task of its own (a small pull or push the link's reader
finishes) still has a deadline: :meth:`Timers.call_at` schedules its expiry at the cost of a
heap push, and :meth:`Timers.cancel` (it finished first) of an attribute write, and a heap pop
where it was the earliest. One task sleeps until the earliest timer; a timer earlier than that
moves its cancel scope's deadline.
Backend-neutral (anyio), so asyncio, uvloop and trio share it; :attr:`Timers.now` is the
loop's clock as a plain function.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

import anyio

from ._log import get_logger

__all__ = ["Timer", "Timers"]

_log = get_logger("engine")

#: a heap holding more cancelled timers than this (and than live ones) is rebuilt
_COMPACT_AT = 4096


class Timer:
    """One scheduled callback; :meth:`cancel` before it runs and it never will."""

    __slots__ = ("fn", "when")

    def __init__(self, when: float, fn: Callable[[], None] | None) -> None:
        self.when = when
        self.fn = fn

    def cancel(self) -> None:
        self.fn = None

    @property
    def cancelled(self) -> bool:
        return self.fn is None


class Timers:
    """``call_at(when, fn)`` runs ``fn()`` on the loop at ``when`` (``anyio.current_time()``)
    once :meth:`run` runs (an exception of ``fn`` is logged)."""

    def __init__(self) -> None:
        #: the loop's clock (``anyio.current_time``'s); the endpoint sets the running
        #: backend's own (``_drivers.loop_clock``), a tenth of the cost
        self.now: Callable[[], float] = anyio.current_time
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._scope: anyio.CancelScope | None = None
        self._sleeping_until = math.inf
        self._dead = 0

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer:
        """``call_at(now + delay, fn)``."""
        return self.call_at(self.now() + delay, fn)

    def call_at(self, when: float, fn: Callable[[], None]) -> Timer:
        timer = Timer(when, fn)
        heapq.heappush(self._heap, (when, next(self._seq), timer))
        if when < self._sleeping_until and self._scope is not None:
            self._sleeping_until = when
            self._scope.deadline = when
        return timer

    def cancel(self, timer: Timer) -> None:
        """Cancel ``timer``: it leaves the heap now with every cancelled one above it (timers
        mostly end in the order they were set), else at a compaction, once many cancelled
        ones pile up."""
        if timer.fn is None:
            return
        timer.cancel()
        self._dead += 1
        # Kept until a compaction, every transfer's timer would outlive the collector's young
        # passes and set off its full ones (tens of ms on the loop).
        heap = self._heap
        while heap and heap[0][2].fn is None:
            heapq.heappop(heap)
            # (one cancelled through Timer.cancel was never counted)
            self._dead = max(0, self._dead - 1)
        if self._dead > _COMPACT_AT and self._dead * 2 > len(heap):
            self._heap = [item for item in self._heap if not item[2].cancelled]
            heapq.heapify(self._heap)
            self._dead = 0

    def __len__(self) -> int:
        """Timers scheduled and not yet run or dropped (cancelled ones included)."""
        return len(self._heap)

    async def run(self) -> None:
        """Run timers as they come due, until cancelled."""
        while True:
            now = self.now()
            while self._heap and self._heap[0][0] <= now:
                _, _, timer = heapq.heappop(self._heap)
                fn = timer.fn
                if fn is None:
                    self._dead = max(0, self._dead - 1)
                    continue
                timer.fn = None
                try:
                    fn()
                except Exception:  # one deadline's failure must not stop every other one
                    _log.exception("timer.failed")
            # (no local name for the heap while asleep: it would keep a list that a compaction
            # replaced, cancelled timers and all, until the next wake-up)
            self._sleeping_until = self._heap[0][0] if self._heap else math.inf
            with anyio.CancelScope(deadline=self._sleeping_until) as scope:
                self._scope = scope
                try:
                    await anyio.sleep_forever()
                finally:
                    self._scope = None
