"""A plan's bytes sent as DATA frames (``LinkWriter.send_stream``): a stream of several frames
stops between frames when the scope around it is cancelled (what bounds a layer-wise run's
send and a target's serving budget: neither trips the request's token), while a one-frame
stream (a layer) goes out with no checkpoint before it. A frame sent at once from the loop
(``send_frame_now``, a model's layer as it is signalled) goes out only when the send lock is
free; what the socket does not take a task finishes, fenced like a worker's frame."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from llmdd_async._drivers import Driver
from llmdd_async._net import writer as writer_module
from llmdd_async._net.link import Link
from llmdd_async._net.requests import Serving
from llmdd_async._transports.tcp import StreamPlan
from llmdd_async.testing import DEFAULT_OPTIONS, link_of, linked_pair

pytestmark = pytest.mark.anyio

FRAME = 64 << 10
FRAMES = 16


async def _sent_in_cancelled_scope(
    monkeypatch: pytest.MonkeyPatch, nbytes: int
) -> tuple[int, bool]:
    """Bytes a stream of ``nbytes`` put on the link from a scope cancelled before it began,
    and whether the scope caught the cancel."""
    monkeypatch.setattr(writer_module, "CHUNK_BYTES", FRAME)
    async with linked_pair({**DEFAULT_OPTIONS, "llm.Transport": "tcp"}) as (prompt, _decoder):
        link = link_of(prompt, 2).raw
        memory = np.ones(nbytes, np.uint8)
        stream = StreamPlan(
            np.array([memory.ctypes.data], np.uint64), np.array([nbytes], np.uint64)
        )
        req = Serving(1 << 40, None)  # a request id the peer never made: it discards the bytes
        before = link.stats_bytes
        with anyio.CancelScope() as scope:
            scope.cancel()
            await link.send_stream(req, stream, True, req.token)
        return link.stats_bytes - before, scope.cancelled_caught


async def test_a_stream_of_many_frames_stops_between_frames_when_its_scope_is_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent, caught = await _sent_in_cancelled_scope(monkeypatch, FRAMES * FRAME)
    assert caught
    assert sent == FRAME  # the first frame, then the cancel


async def test_a_one_frame_stream_goes_out_whole_with_no_checkpoint_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent, caught = await _sent_in_cancelled_scope(monkeypatch, FRAME)
    assert sent == FRAME
    assert not caught  # (the cancel is seen at the caller's next await)


def _stream_of(memory: np.ndarray) -> StreamPlan:
    return StreamPlan(
        np.array([memory.ctypes.data], np.uint64), np.array([memory.nbytes], np.uint64)
    )


async def _stop_reading(peer: Link) -> Driver:
    """Pause the peer's reader (its socket then fills up); its driver, to resume it."""
    with anyio.fail_after(5):
        while peer.reader._driver is None:  # (the peer's reader may still be starting)
            await anyio.sleep(0.001)
    driver = peer.reader._driver
    driver.pause()
    return driver


async def test_a_frame_sent_at_once_goes_out_whole_with_no_await() -> None:
    async with linked_pair({**DEFAULT_OPTIONS, "llm.Transport": "tcp"}) as (prompt, _decoder):
        link = link_of(prompt, 2).raw
        memory = np.ones(FRAME, np.uint8)
        req = Serving(1 << 40, None)  # a request id the peer never made: it discards the bytes
        before = link.stats_bytes
        out: list[bool] = []
        assert link.send_frame_now(req, _stream_of(memory), True, (0, FRAME), out.append)
        assert out == [True]  # all out before it returned
        assert link.stats_bytes - before == FRAME
        assert req.fence is None and link.writer.send_lock.value == 1


async def test_a_frame_is_not_sent_at_once_when_that_would_wait_or_its_request_stopped() -> None:
    async with linked_pair({**DEFAULT_OPTIONS, "llm.Transport": "tcp"}) as (prompt, _decoder):
        link = link_of(prompt, 2).raw
        memory = np.ones(2 << 20, np.uint8)
        stream = _stream_of(memory)
        req = Serving(1 << 40, None)
        before = link.stats_bytes
        out: list[bool] = []
        async with link.writer.send_lock:  # another frame is going out
            assert not link.send_frame_now(req, stream, True, (0, FRAME), out.append)
        # A worker's frame (over INLINE_BYTES):
        assert not link.send_frame_now(req, stream, True, (0, 2 << 20), out.append)
        req.token.cancel()
        assert not link.send_frame_now(req, stream, True, (0, FRAME), out.append)
        assert out == []
        assert link.stats_bytes == before
        assert link.writer.send_lock.value == 1


async def _fill_until_a_frame_is_left_to_finish(
    link: Link, req: Serving, stream: StreamPlan
) -> list[bool]:
    """Frames sent at once until one is left to finish; what that one's ``then`` got."""
    for _ in range(10_000):
        out: list[bool] = []
        assert link.send_frame_now(req, stream, True, (0, FRAME), out.append)
        if req.fence is not None:
            assert out == []  # not all out yet
            return out
        assert out == [True]
    pytest.fail("the socket never filled")


async def test_what_the_socket_does_not_take_at_once_a_task_finishes_and_the_link_goes_on() -> None:
    async with linked_pair({**DEFAULT_OPTIONS, "llm.Transport": "tcp"}) as (prompt, decoder):
        link, peer = link_of(prompt, 2).raw, link_of(decoder, 1).raw
        memory = np.ones(FRAME, np.uint8)
        stream = _stream_of(memory)
        req = Serving(1 << 40, None)
        driver = await _stop_reading(peer)  # our socket fills up
        out = await _fill_until_a_frame_is_left_to_finish(link, req, stream)
        fence = req.fence
        assert fence is not None and not fence.released.is_set()
        # The rest holds the send lock: no frame starts in the middle of it.
        assert not link.send_frame_now(req, stream, True, (0, FRAME), out.append)
        await anyio.sleep(0.02)
        assert out == []
        driver.resume()
        with anyio.fail_after(10):
            while not out:
                await anyio.sleep(0.005)
        assert out == [True]  # once its last byte was out
        assert fence.released.is_set() and req.fence is None
        assert link.writer.send_lock.value == 1
        assert link.send_frame_now(req, stream, True, (0, FRAME), out.append)
        assert link.alive and peer.alive


async def test_a_frame_left_to_finish_is_fenced_by_a_release() -> None:
    """A cancel's fence (``Link.release``) waits for the task that finishes such a frame (it
    stops reading the source, padding the rest): nothing reads the memory once it returns."""
    async with linked_pair({**DEFAULT_OPTIONS, "llm.Transport": "tcp"}) as (prompt, decoder):
        link, peer = link_of(prompt, 2).raw, link_of(decoder, 1).raw
        memory = np.ones(FRAME, np.uint8)
        req = Serving(1 << 40, None)
        driver = await _stop_reading(peer)
        out = await _fill_until_a_frame_is_left_to_finish(link, req, _stream_of(memory))
        fence = req.fence
        assert fence is not None
        released: list[bool] = []

        async def release() -> None:
            await link.release(req)
            released.append(fence.released.is_set())

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(release)
                await anyio.sleep(0.05)
                assert released == []  # the rest of the frame is still out there
                driver.resume()
        assert released == [True]
        assert out == [False]  # the rest went as zeros: the layer did not leave
        assert link.alive and peer.alive
