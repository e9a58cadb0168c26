"""Condition waits for tests: poll a predicate until it holds or a deadline passes.

Tests wait for what they need, never for a fixed time: a loaded machine makes a fixed sleep
too short, an idle one makes it waste time.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

__all__ = ["wait_until"]


async def wait_until(
    predicate: Callable[[], object], timeout_s: float = 10, poll_s: float = 0.005
) -> None:
    """Return once ``predicate()`` is true, checking every ``poll_s`` seconds.

    Raises:
        TimeoutError: still false after ``timeout_s`` seconds.
    """
    with anyio.fail_after(timeout_s):
        # Polling is the point: the condition is another task's or process's state, which
        # signals nobody.
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(poll_s)
