"""The loop thread of the blocking facade and the vLLM connector: a private one, once
stopped, is closed and freed (its descriptors too), whatever still ran on it cancelled."""

from __future__ import annotations

import asyncio
import gc
import os

import pytest

from llmdd_async._sync_loop import LoopThread


def _stray_loops() -> int:
    """Event loops the garbage collector finds unreachable now (and cannot free)."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
    finally:
        gc.set_debug(0)
    garbage, gc.garbage[:] = list(gc.garbage), []
    return sum(isinstance(o, asyncio.AbstractEventLoop) for o in garbage)


@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_a_stopped_loop_thread_is_closed_and_freed(use_uvloop: bool) -> None:
    if use_uvloop:
        pytest.importorskip("uvloop")
    LoopThread(use_uvloop=use_uvloop).stop()  # (the first may open what a library keeps)
    _stray_loops()
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(4):
        lt = LoopThread(name="test-loop", use_uvloop=use_uvloop)
        running = lt.submit(asyncio.sleep(3600))
        lt.stop()
        assert lt.loop.is_closed()
        assert not lt.thread.is_alive()
        assert running.cancelled()  # what still ran was cancelled, not left pending for ever
        lt.call_soon(print, "never")  # once stopped: nothing happens, nothing raises
        lt.stop()  # again: nothing
    del lt, running
    # Before, each stopped uvloop loop stayed unreachable and was never freed, with its
    # epoll and eventfd descriptors open (about 5 descriptors a loop).
    assert _stray_loops() == 0
    assert len(os.listdir("/proc/self/fd")) < fds + 4
