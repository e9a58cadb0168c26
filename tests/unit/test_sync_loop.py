"""The loop thread of the blocking facade and the vLLM connector: a private one, once
stopped, is closed and freed (its descriptors too), whatever still ran on it cancelled."""

from __future__ import annotations

import asyncio
import gc
import os
import threading

import pytest
from helpers import cyclic_garbage

from llmdd_async._sync_loop import LoopThread


def _stray_loops(ids: set[int]) -> int:
    """Of the event loops ``ids`` names, those the garbage collector finds unreachable now
    (and cannot free). Only those: an earlier test's are not this test's business."""
    gc.collect()
    garbage = cyclic_garbage()
    return sum(isinstance(o, asyncio.AbstractEventLoop) and id(o) in ids for o in garbage)


@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_a_stopped_loop_thread_is_closed_and_freed(use_uvloop: bool) -> None:
    if use_uvloop:
        pytest.importorskip("uvloop")
    LoopThread(use_uvloop=use_uvloop).stop()  # (the first may open what a library keeps)
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    ids: set[int] = set()  # this test's loops
    for _ in range(4):
        lt = LoopThread(name="test-loop", use_uvloop=use_uvloop)
        ids.add(id(lt.loop))
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
    assert _stray_loops(ids) == 0
    assert len(os.listdir("/proc/self/fd")) < fds + 4


@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_a_second_stop_does_not_cut_the_unwinding_short(use_uvloop: bool) -> None:
    """What a stop cancels gets its time to unwind even when another stop comes meanwhile
    (a second ``loop.stop`` used to end the close early: the unwinding never finished and
    the caller's future was never resolved)."""
    if use_uvloop:
        pytest.importorskip("uvloop")
    unwound: list[str] = []
    started = threading.Event()

    async def slow_to_unwind() -> None:
        try:
            started.set()
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.3)
            unwound.append("done")

    lt = LoopThread(name="test-loop", use_uvloop=use_uvloop)
    running = lt.submit(slow_to_unwind())
    assert started.wait(5)
    lt.stop(timeout=0.05)  # returns while the task unwinds
    lt.stop()
    assert unwound == ["done"]
    assert running.cancelled()
    assert lt.loop.is_closed()
