"""Python's cyclic garbage collector paused around a peer's big data being turned into objects.

A peer's table or other big JSON fields become tens of thousands of lists, dicts and records.
Each 700 of them set off a young collection, every ten of those an older one, and every few
such frames a full one: the whole heap's, 15-41 ms in a small process here, in the middle of
the parse on the loop or of the table's build in a worker thread (which holds the GIL for it).
Paused, they cost one young collection when the collector runs again, and full collections
come about a tenth as often (``benchmarks/loop_lag.py --attacks peertable``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off for the block, if it was on (as the application left it otherwise).

    The switch is the process's: a thread that turns the collector off meanwhile finds it on
    again after; one that turns it on meanwhile gets what it asked for at once. Keep the block
    bounded (a parse or a build whose size the decoder bounds)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
