"""An asyncio event loop in a daemon thread, handed work from other threads.

Two users: the blocking facade (one loop per process, uvloop when installed:
:meth:`LoopThread.get`; blocking calls from any thread wait for their result there, and the
engine itself only ever runs on that thread) and the vLLM connector (a private loop per worker,
:meth:`LoopThread.submit` / :meth:`LoopThread.call_soon` / :meth:`LoopThread.stop`, so no
vLLM hook blocks on the endpoint).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")

#: how long :meth:`LoopThread.stop` lets the tasks it cancels unwind before the loop closes
_CLOSE_WAIT_S = 2.0


def _new_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class LoopThread:
    """An event loop running in its own daemon thread.

    :meth:`get` gives the process's facade loop, started on first use and kept for the
    process's life; a direct ``LoopThread(...)`` is a private one, ended with :meth:`stop`.
    """

    _instance: LoopThread | None = None
    _lock = threading.Lock()

    def __init__(self, name: str = "llmdd-sync-loop", use_uvloop: bool = True) -> None:
        """Start the loop (uvloop when ``use_uvloop`` and installed) in a thread ``name``;
        returns once it runs."""
        self.loop = _new_loop(use_uvloop)
        self._ready = threading.Event()
        self._stopping = False
        self._stop_lock = threading.Lock()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()

    @classmethod
    def get(cls) -> LoopThread:
        with cls._lock:
            if cls._instance is None or not cls._instance.thread.is_alive():
                cls._instance = cls()
            return cls._instance

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            self._close()

    def _close(self) -> None:
        """Close the stopped loop on its own thread: what still runs there is cancelled (and
        given ``_CLOSE_WAIT_S`` to unwind), then the loop is closed. A stopped loop that is
        not closed keeps its descriptors, and an unclosed uvloop loop is never freed (the
        garbage collector finds it again at every pass)."""
        loop = self.loop
        try:
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in tasks:
                t.cancel()
            if tasks:
                loop.run_until_complete(asyncio.wait(tasks, timeout=_CLOSE_WAIT_S))
            # (bounded too: a generator's finally may await for ever)
            loop.run_until_complete(
                asyncio.wait([loop.create_task(loop.shutdown_asyncgens())], timeout=_CLOSE_WAIT_S)
            )
        finally:
            loop.close()

    def _check_caller(self) -> None:
        if threading.current_thread() is self.thread:
            raise RuntimeError(
                "the blocking llmdd_async.sync API was called from its own event loop thread "
                "(inside a callback); use the async API there"
            )

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Await ``fn(*args, **kwargs)`` on the loop and block for its result.

        Raises:
            BaseException: whatever the coroutine raised.
            RuntimeError: called from the loop thread itself.
        """
        self._check_caller()

        async def call() -> T:
            return await fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result()

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run plain ``fn(*args, **kwargs)`` on the loop thread and block for its result."""

        async def call() -> T:
            return fn(*args, **kwargs)

        return self.run(call)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop, in a fresh context, without waiting for it.

        A fresh context: the caller's (its sniffio library, say) must not leak into the
        loop's tasks, which anyio inspects.
        """
        return contextvars.Context().run(asyncio.run_coroutine_threadsafe, coro, self.loop)

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """``fn(*args)`` on the loop thread, soon, in a fresh context (as :meth:`submit`);
        never blocks. Nothing happens once the loop was stopped."""
        with contextlib.suppress(RuntimeError):  # (closed: stopped)
            self.loop.call_soon_threadsafe(fn, *args, context=contextvars.Context())

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop, cancel what still runs on it and close it; wait up to ``timeout``
        seconds for its thread to end. Stopping it again does nothing."""
        with self._stop_lock:
            # Once: a second loop.stop would cut the close's unwinding short.
            stopping, self._stopping = self._stopping, True
        if not stopping:
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
