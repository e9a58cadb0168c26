"""The I/O driver on asyncio and uvloop: one ``add_reader`` callback per link, for its life."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
from collections.abc import Callable

from . import Driver, sniffio

__all__ = ["DRIVER", "EVENT", "AsyncioDriver", "loop_clock", "threadsafe_caller"]


#: a loop callback runs in no task, so anyio (through sniffio) could not tell which library
#: runs it where the loop was not started by anyio (the blocking faces' loop thread): the
#: callbacks say so themselves. Without sniffio anyio asks asyncio, which works there.
_LIBRARY = None if sniffio is None else sniffio.current_async_library_cvar


class AsyncioDriver(Driver):
    """``loop.add_reader`` once; ``call_soon`` to come back to work left; ``call_at`` for the
    deadline. Everything runs in the loop's own callbacks: no task wakes per frame."""

    _loop: asyncio.AbstractEventLoop | None = None
    _registered = False
    _running = False
    _stopped = False
    _soon: asyncio.Handle | None = None
    _timer: asyncio.TimerHandle | None = None
    _fd = -1

    async def run(self) -> None:
        if self._stopped:
            return
        loop = self._loop = asyncio.get_running_loop()
        self._running = True
        self._ended: asyncio.Future[None] = loop.create_future()
        if not self.paused:
            self._register()
            # Bytes may have been buffered before the driver started (the handshake's
            # read-ahead): look at them now, not at the next byte.
            self._schedule()
        try:
            await self._ended
        finally:
            self._running = False
            self._halt()

    def _register(self) -> None:
        if not self._registered and self._loop is not None:
            self._fd = self.sock.fileno()
            self._loop.add_reader(self._fd, self._ready)
            self._registered = True

    def _unregister(self) -> None:
        if self._registered and self._loop is not None:
            self._registered = False
            self._loop.remove_reader(self._fd)

    def _schedule(self) -> None:
        if self._soon is None and self._loop is not None:
            self._soon = self._loop.call_soon(self._ready)

    def _ready(self) -> None:
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        if self.paused or not self._running:
            return
        if _LIBRARY is None:
            again = self.on_readable()
        else:
            token = _LIBRARY.set("asyncio")
            try:
                again = self.on_readable()
            finally:
                _LIBRARY.reset(token)
        if again and not self.paused and self._running:
            self._schedule()

    def pause(self) -> None:
        self.paused = True
        self._unregister()
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None

    def resume(self) -> None:
        if self._stopped:
            return
        self.paused = False
        if self._running:
            self._register()
            self._schedule()

    def set_deadline(self, when: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if when is not None and self._loop is not None and not self._stopped:
            # anyio's clock on asyncio is the loop's own (loop.time()).
            self._timer = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self._running:
            if _LIBRARY is None:
                self.on_deadline()
                return
            token = _LIBRARY.set("asyncio")
            try:
                self.on_deadline()
            finally:
                _LIBRARY.reset(token)

    def stop(self) -> None:
        self._stopped = True
        self._halt()
        ended = getattr(self, "_ended", None)
        if ended is not None and not ended.done():
            ended.set_result(None)

    def _halt(self) -> None:
        self.pause()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


DRIVER = AsyncioDriver
EVENT = asyncio.Event


def loop_clock() -> Callable[[], float]:
    """``loop.time`` of the running loop (see the package's)."""
    return asyncio.get_running_loop().time


def threadsafe_caller() -> Callable[[Callable[[], None]], None]:
    """``loop.call_soon_threadsafe`` of the running loop (see the package's). ``fn`` runs in
    a fresh context, neither the calling thread's nor the task's that made the caller (what
    it spawns inherits it: their context variables must not leak into the endpoint's
    tasks), where anyio can tell the library, as in :meth:`AsyncioDriver._ready`."""
    loop = asyncio.get_running_loop()
    ctx = contextvars.Context()
    if _LIBRARY is not None:
        ctx.run(_LIBRARY.set, "asyncio")

    def call(fn: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(fn, context=ctx.copy())

    return call


def soon_caller() -> Callable[[Callable[[], None]], bool]:
    """``loop.call_soon`` of the running loop (see the package's)."""
    loop = asyncio.get_running_loop()

    def call(fn: Callable[[], None]) -> bool:
        try:
            loop.call_soon(fn)
        except RuntimeError:  # the loop is closed (or, in debug mode, this is not its thread)
            return False
        return True

    return call


class _Wakeup:
    """:class:`Wakeup` on asyncio: a future of the loop."""

    __slots__ = ("_fut", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._fut: asyncio.Future[bool] = loop.create_future()

    def _fire(self, value: bool) -> None:
        if not self._fut.done():  # (the waiter may have been cancelled)
            self._fut.set_result(value)

    def wake(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self._loop.call_soon_threadsafe(self._fire, True)

    def expire(self) -> None:
        self._fire(False)

    async def wait(self) -> bool:
        return await self._fut


def wakeup_factory() -> Callable[[], _Wakeup]:
    """:class:`_Wakeup` of the running loop (see the package's)."""
    return functools.partial(_Wakeup, asyncio.get_running_loop())
