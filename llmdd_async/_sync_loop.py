"""The blocking facade's event loop: one background thread per process (uvloop when installed).

Blocking calls from any thread are handed to this loop and wait for their result; the engine
itself only ever runs on the loop thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """The process's facade loop, started on first use and kept for the process's life."""

    _instance: LoopThread | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name="llmdd-sync-loop", daemon=True)
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
        self.loop.run_forever()

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
