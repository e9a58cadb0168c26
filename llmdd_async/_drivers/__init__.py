"""The I/O driver: how a link's socket is watched on the running event loop (DESIGN §3).

One small interface (:class:`Driver`), one file per event-loop backend, found by
:func:`driver_for` (anyio's own backends are built the same way); nothing else in the package
is backend-specific. A driver calls its ``on_readable`` on the loop thread whenever the socket
has bytes, for as long as :meth:`Driver.run` runs, with no task switch, future or reader
registration per frame:

* asyncio and uvloop (``_asyncio``): a persistent ``add_reader`` callback, registered once per
  link. The link keeps its socket (worker threads move bulk payload over it with blocking
  calls), which an asyncio transport would take over: so the reader is the loop's own readiness
  callback around ``recv_into``/``recvmsg_into`` into destination memory, which is what a
  ``BufferedProtocol`` is made of, without the transport.
* trio (``_trio``): one reader task per link over ``trio.lowlevel.wait_readable``.

``on_readable`` reads what the socket has and returns True when it stopped early with work
left (a read budget used up, complete frames still buffered): the driver then calls it again
after letting other tasks run, without waiting for the socket. A reader that must await
something (a worker thread, back-pressure) :meth:`~Driver.pause`\\ s the driver, does it in a
task, and :meth:`~Driver.resume`\\ s it, which calls ``on_readable`` soon whatever the socket
says (bytes may already be buffered). One deadline per driver (:meth:`~Driver.set_deadline`)
calls ``on_deadline`` once it passes: a link bounds a peer that stops mid-frame with it.
"""

from __future__ import annotations

import importlib
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import ModuleType
from typing import Protocol

sniffio: ModuleType | None
try:
    import sniffio
except ImportError:  # anyio does without it; then trio (which needs it) is missing too
    sniffio = None

__all__ = [
    "BACKENDS",
    "Driver",
    "LoopEvent",
    "Wakeup",
    "driver_for",
    "event_factory",
    "loop_clock",
    "soon_caller",
    "threadsafe_caller",
    "wakeup_factory",
]

#: the driver of each event-loop backend (``sniffio`` names), in the module named
BACKENDS: dict[str, str] = {"asyncio": "._asyncio", "trio": "._trio"}


class LoopEvent(Protocol):
    """The backend's own event (``asyncio.Event``, ``trio.Event``): set on the loop thread."""

    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    async def wait(self) -> object: ...


class Wakeup(Protocol):
    """One wake-up of one waiter (:meth:`wait`), whichever comes first: :meth:`wake` from any
    thread (``wait`` returns True) or :meth:`expire` on the loop thread (False). Cancelling
    the waiting task works as for an event; a wake after that, or after the loop is gone,
    does nothing."""

    def wake(self) -> None: ...

    def expire(self) -> None: ...

    async def wait(self) -> bool: ...


class Driver(ABC):
    """Calls ``on_readable`` whenever ``sock`` is readable, from :meth:`run` until it ends."""

    def __init__(
        self,
        sock: socket.socket,
        on_readable: Callable[[], bool],
        on_deadline: Callable[[], None],
    ) -> None:
        self.sock = sock
        self.on_readable = on_readable
        self.on_deadline = on_deadline
        self.paused = False

    @abstractmethod
    async def run(self) -> None:
        """Drive the socket until cancelled (or :meth:`stop`); never raises but cancellation.
        ``on_readable`` and ``on_deadline`` must not raise: a driver does not catch for
        them."""

    @abstractmethod
    def pause(self) -> None:
        """Stop calling ``on_readable`` until :meth:`resume` (call on the loop thread)."""

    @abstractmethod
    def resume(self) -> None:
        """Call ``on_readable`` again, soon and whatever the socket says, then on readiness."""

    @abstractmethod
    def set_deadline(self, when: float | None) -> None:
        """Call ``on_deadline`` once, at ``when`` (``anyio.current_time()``), unless set
        again (None: no deadline) before."""

    @abstractmethod
    def stop(self) -> None:
        """Let go of the socket now (before it is closed): no call comes after this, and
        :meth:`run` returns."""


def _backend() -> ModuleType:
    """The driver module of the running event loop's backend.

    Raises:
        RuntimeError: no event loop runs in this thread, or its backend has no driver.
    """
    backend = "asyncio"  # without sniffio (see the import): anyio runs on asyncio alone
    if sniffio is not None:
        try:
            backend = sniffio.current_async_library()
        except sniffio.AsyncLibraryNotFoundError:
            raise RuntimeError("a link's I/O driver needs a running event loop") from None
    module = BACKENDS.get(backend)
    if module is None:
        raise RuntimeError(f"no I/O driver for the {backend!r} event loop")
    return importlib.import_module(module, __name__)


def driver_for(
    sock: socket.socket, on_readable: Callable[[], bool], on_deadline: Callable[[], None]
) -> Driver:
    """The driver of the running event loop's backend for ``sock``.

    Raises:
        RuntimeError: no event loop runs in this thread, or its backend has no driver.
    """
    cls: type[Driver] = _backend().DRIVER
    return cls(sock, on_readable, on_deadline)


def threadsafe_caller() -> Callable[[Callable[[], None]], None]:
    """A function that, from any thread, has the running loop call ``fn()`` soon (in a loop
    callback: no task), and does nothing once the loop is gone: a layer signalled from the
    model's thread wakes its transfer for the price of a loop callback, not of a task.

    Raises:
        RuntimeError: no event loop runs in this thread, or its backend has no driver.
    """
    caller: Callable[[Callable[[], None]], None] = _backend().threadsafe_caller()
    return caller


def soon_caller() -> Callable[[Callable[[], None]], bool] | None:
    """A function that, on the loop thread, has the running loop call ``fn()`` once what is
    ready to run now has run (a loop callback, no task); it returns False, with nothing
    scheduled, once the loop is gone: a link's writer holds the frames of one loop turn with
    it, to send them together.
    ``loop.call_soon`` on asyncio. None on trio: its only such call, ``run_sync_soon``, writes
    to its wake-up socket and runs in a system task's turn (about 20 µs of CPU here, more
    than holding the frames saves), so frames there go out as they come.

    Raises:
        RuntimeError: no event loop runs in this thread, or its backend has no driver.
    """
    caller: Callable[[Callable[[], None]], bool] | None = _backend().soon_caller()
    return caller


def loop_clock() -> Callable[[], float]:
    """The running loop's clock, ``anyio.current_time``'s, as a plain function: it costs a
    tenth of ``anyio.current_time``, which asks which library runs on every call, and it also
    works in a loop callback that runs in no task.

    Raises:
        RuntimeError: no event loop runs in this thread, or its backend has no driver.
    """
    clock: Callable[[], float] = _backend().loop_clock()
    return clock


def event_factory() -> Callable[[], LoopEvent]:
    """The running backend's own event class, for events made per layer or request: an
    ``anyio.Event`` asks which library runs each time one is made (three times the cost).
    Cancelling a task that waits on one works as for ``anyio.Event``.

    Raises:
        RuntimeError: no event loop runs in this thread, or its backend has no driver.
    """
    factory: Callable[[], LoopEvent] = _backend().EVENT
    return factory


def wakeup_factory() -> Callable[[], Wakeup]:
    """The running backend's :class:`Wakeup` maker: a bare future of the loop on asyncio (an
    event is a waiter list around one, made per wait), what a model's signal of each of its
    layers costs the loop.

    Raises:
        RuntimeError: no event loop runs in this thread, or its backend has no driver.
    """
    factory: Callable[[], Wakeup] = _backend().wakeup_factory()
    return factory
