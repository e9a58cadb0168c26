"""A FIFO-fair phase lock: many holders in the shared phase, one in the exclusive phase.

One per link: pulls and pushes (shared) run side by side, each layer of a layer-wise transfer
(exclusive) is sent alone, and neither starves the other: a request queues behind every earlier
one that it cannot run with.
"""

from __future__ import annotations

import collections

import anyio

__all__ = ["PhaseLock"]


class _Waiter:
    __slots__ = ("event", "exclusive", "granted")

    def __init__(self, exclusive: bool) -> None:
        self.exclusive = exclusive
        self.event = anyio.Event()
        self.granted = False


class PhaseLock:
    """``async with lock.hold(exclusive): ...``; FIFO between the two kinds of holder."""

    def __init__(self) -> None:
        self._queue: collections.deque[_Waiter] = collections.deque()
        self._shared = 0
        self._exclusive = False

    @property
    def holders(self) -> int:
        return self._shared + int(self._exclusive)

    def _fits(self, exclusive: bool) -> bool:
        if self._exclusive:
            return False
        return self._shared == 0 if exclusive else True

    def _take(self, exclusive: bool) -> None:
        if exclusive:
            self._exclusive = True
        else:
            self._shared += 1

    def _release(self, exclusive: bool) -> None:
        if exclusive:
            self._exclusive = False
        else:
            self._shared -= 1
        self._wake()

    def _wake(self) -> None:
        while self._queue and self._fits(self._queue[0].exclusive):
            w = self._queue.popleft()
            self._take(w.exclusive)
            w.granted = True
            w.event.set()

    def try_take(self, exclusive: bool) -> bool:
        """Take the lock at once if nobody queues and the phase allows (then :meth:`give`
        it back); False, with nothing taken, otherwise."""
        if self._queue or not self._fits(exclusive):
            return False
        self._take(exclusive)
        return True

    def give(self, exclusive: bool) -> None:
        """Give back what :meth:`try_take` or :meth:`acquire` took."""
        self._release(exclusive)

    def hold(self, exclusive: bool) -> _Hold:
        """Hold the lock in one phase (``async with``). Cancellation while queued leaves no
        trace."""
        return _Hold(self, exclusive)

    async def acquire(self, exclusive: bool) -> None:
        """Take the lock in one phase, queueing FIFO (then :meth:`give` it back). Cancellation
        while queued leaves no trace."""
        if not self._queue and self._fits(exclusive):
            self._take(exclusive)
            return
        w = _Waiter(exclusive)
        self._queue.append(w)
        try:
            await w.event.wait()
        except BaseException:
            if w.granted:
                self._release(exclusive)  # granted as we were cancelled: pass it on
            else:
                self._queue.remove(w)
                self._wake()  # a queued exclusive may have held shared ones back
            raise


class _Hold:
    """One hold of a :class:`PhaseLock` (a class, not a generator: it is on every request's
    path)."""

    __slots__ = ("_exclusive", "_lock")

    def __init__(self, lock: PhaseLock, exclusive: bool) -> None:
        self._lock = lock
        self._exclusive = exclusive

    async def __aenter__(self) -> None:
        await self._lock.acquire(self._exclusive)

    async def __aexit__(self, *exc_info: object) -> None:
        self._lock._release(self._exclusive)
