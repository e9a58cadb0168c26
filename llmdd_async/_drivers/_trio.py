"""The I/O driver on trio: one reader task per link, parked in ``wait_readable``."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import trio

from . import Driver

__all__ = ["DRIVER", "TrioDriver", "threadsafe_caller"]


class TrioDriver(Driver):
    """The task that runs :meth:`run` is the link's reader: it waits for the socket (bounded
    by the deadline), calls ``on_readable``, and parks on an event while paused."""

    _again = True  # bytes may be buffered before the first wait (the handshake's read-ahead)
    _stopped = False
    _deadline = math.inf
    _wake: trio.Event | None = None
    _scope: trio.CancelScope | None = None
    #: the scope of the wait in progress (its deadline follows set_deadline)
    _waiting: trio.CancelScope | None = None

    async def run(self) -> None:
        with trio.CancelScope() as self._scope:
            while not self._stopped:
                if self.paused:
                    self._wake = trio.Event()
                    with trio.move_on_at(self._deadline) as self._waiting:
                        await self._wake.wait()
                    self._wake = self._waiting = None
                    self._check_deadline()
                    continue
                if self._again:
                    self._again = False
                    await trio.lowlevel.checkpoint()
                else:
                    with trio.move_on_at(self._deadline) as self._waiting:
                        await trio.lowlevel.wait_readable(self.sock)
                    self._waiting = None
                    if self._check_deadline() or self.paused or self._stopped:
                        continue
                if not self.paused and not self._stopped:
                    self._again = self.on_readable()

    def _check_deadline(self) -> bool:
        if trio.current_time() < self._deadline:
            return False
        self._deadline = math.inf
        self.on_deadline()
        return True

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._again = True
        if self._waiting is not None:  # resumed from another task while the reader waits
            self._waiting.cancel()
        self._poke()

    def set_deadline(self, when: float | None) -> None:
        self._deadline = math.inf if when is None else when
        if self._waiting is not None:  # set from another task while the reader waits
            self._waiting.deadline = self._deadline

    def stop(self) -> None:
        self._stopped = True
        self._poke()
        if self._scope is not None:
            self._scope.cancel()


DRIVER = TrioDriver


def threadsafe_caller() -> Callable[[Callable[[], None]], None]:
    """The running trio run's ``TrioToken.run_sync_soon`` (see the package's)."""
    token = trio.lowlevel.current_trio_token()

    def call(fn: Callable[[], None]) -> None:
        with contextlib.suppress(trio.RunFinishedError):  # the run is over: nobody waits
            token.run_sync_soon(fn)

    return call
