"""A plan's bytes sent as DATA frames (``LinkWriter.send_stream``): a stream of several frames
stops between frames when the scope around it is cancelled (what bounds a layer-wise run's
send and a target's serving budget: neither trips the request's token), while a one-frame
stream (a layer) goes out with no checkpoint before it."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from llmdd_async._net import writer as writer_module
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
