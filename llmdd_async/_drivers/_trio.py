"""The I/O driver on trio: one reader task per link, parked in ``wait_readable``."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable

import trio

from . import Driver

__all__ = ["DRIVER", "EVENT", "TrioDriver", "loop_clock", "threadsafe_caller"]


class TrioDriver(Driver):
    """The task that runs :meth:`run` is the link's reader: it waits for the socket, calls
    ``on_readable``, and parks on an event while paused; one cancel scope bounds a stretch
    of such waits by the deadline (a trio cancel scope costs about 9 us: not one per wait)."""

    _again = True  # bytes may be buffered before the first wait (the handshake's read-ahead)
    _stopped = False
    _deadline = math.inf
    _wake: trio.Event | None = None
    _scope: trio.CancelScope | None = None
    #: the scope of the stretch of waits in progress (its deadline follows set_deadline)
    _waiting: trio.CancelScope | None = None

    async def run(self) -> None:
        with trio.CancelScope() as self._scope:
            while not self._stopped:
                with trio.CancelScope(deadline=self._deadline) as self._waiting:
                    await self._drive()
                self._waiting = None
                if not self._stopped:  # (nothing is called once stopped)
                    self._check_deadline()

    async def _drive(self) -> None:
        """Waits and ``on_readable`` calls, until stopped (or the stretch's scope ends)."""
        while not self._stopped:
            if self.paused:
                self._wake = trio.Event()
                try:
                    await self._wake.wait()
                finally:
                    self._wake = None
                continue
            if self._again:
                # Lets other tasks run, and is no cancel point: a deadline that passed is
                # seen at the next wait, once the buffered frames were read.
                await trio.lowlevel.cancel_shielded_checkpoint()
                self._again = False
            else:
                await trio.lowlevel.wait_readable(self.sock)
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
        if self._wake is None and self._waiting is not None:
            self._waiting.cancel()  # (not parked on the event: a new stretch reads at once)
        self._poke()

    def set_deadline(self, when: float | None) -> None:
        self._deadline = math.inf if when is None else when
        if self._waiting is not None:  # (from on_readable, or another task while it waits)
            self._waiting.deadline = self._deadline

    def stop(self) -> None:
        self._stopped = True
        self._poke()
        if self._scope is not None:
            self._scope.cancel()


DRIVER = TrioDriver
EVENT = trio.Event


def loop_clock() -> Callable[[], float]:
    """``trio.current_time`` (see the package's)."""
    return trio.current_time


def threadsafe_caller() -> Callable[[Callable[[], None]], None]:
    """The running trio run's ``TrioToken.run_sync_soon`` (see the package's)."""
    token = trio.lowlevel.current_trio_token()

    def call(fn: Callable[[], None]) -> None:
        with contextlib.suppress(trio.RunFinishedError):  # the run is over: nobody waits
            token.run_sync_soon(fn)

    return call


def soon_caller() -> None:
    """None: trio has no cheap loop callback (see the package's)."""
    return None


class _Wakeup:
    """:class:`Wakeup` on trio: an event and the value it was set with."""

    __slots__ = ("_event", "_token", "_value")

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token
        self._event = trio.Event()
        self._value = False

    def _fire(self, value: bool) -> None:
        if not self._event.is_set():
            self._value = value
            self._event.set()

    def wake(self) -> None:
        with contextlib.suppress(trio.RunFinishedError):  # the run is over: nobody waits
            self._token.run_sync_soon(self._fire, True)

    def expire(self) -> None:
        self._fire(False)

    async def wait(self) -> bool:
        await self._event.wait()
        return self._value


def wakeup_factory() -> Callable[[], _Wakeup]:
    """:class:`_Wakeup` of the running trio run (see the package's)."""
    return functools.partial(_Wakeup, trio.lowlevel.current_trio_token())
