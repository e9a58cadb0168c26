"""Python's cyclic garbage collector paused around a peer's big data being turned into objects.

A peer's table or other big JSON fields become tens of thousands of lists, dicts and records.
Each 700 of them set off a young collection, every ten of those an older one, and every few
such frames a full one: the whole heap's, 15-41 ms in a small process here, in the middle of
the parse on the loop or of the table's build in a worker thread (which holds the GIL for it).
Paused, they cost one young collection when the collector runs again, and full collections
come far less often (``benchmarks/loop_lag.py --attacks peertable``).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["collector_paused"]

# The collector's switch is the process's: pauses that overlap (the loop parsing a frame
# while a worker builds a table) share one, and the last to end turns it back on.
_lock = threading.Lock()
_pauses = 0
_turned_off = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off for the block, if it was on; back on once the last block that
    overlaps it ends. One the application turned off before stays off. Keep the block
    bounded (a parse or a build whose size the decoder bounds).

    The switch is the process's: an application thread that turns the collector off while a
    block runs finds it on again after it."""
    global _pauses, _turned_off
    with _lock:
        if not _pauses and gc.isenabled():
            gc.disable()
            _turned_off = True
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if not _pauses and _turned_off:
                _turned_off = False
                gc.enable()
