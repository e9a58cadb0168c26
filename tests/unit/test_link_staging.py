"""A link's staging buffers for streams over many ranges (``streams.LinkStaging``): at most
``SENDS`` frames hold one for sending at once, and no failure loses a send unit."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

from llmdd_async._memory import CancelToken
from llmdd_async._net import streams
from llmdd_async._net.streams import VIEWS_INLINE, LinkStaging, ManyRangesStream

pytestmark = pytest.mark.anyio


def _stream(staging: LinkStaging, mem: np.ndarray) -> ManyRangesStream:
    """A stream over every other 8 bytes of ``mem``: more ranges than VIEWS_INLINE."""
    base = mem.ctypes.data
    addrs = np.arange(base, base + mem.nbytes, 16, dtype=np.uint64)
    assert len(addrs) > VIEWS_INLINE
    return ManyRangesStream(addrs, np.full(len(addrs), 8, dtype=np.uint64), staging)


async def test_at_most_two_frames_hold_a_send_buffer_and_they_carry_the_ranges() -> None:
    mem = np.arange(8192 * 16, dtype=np.uint8)
    staging = LinkStaging(anyio.CapacityLimiter(4))
    a, b, c = (_stream(staging, mem) for _ in range(3))
    token = CancelToken()
    va = await a.prepare(0, 8192, token)
    await b.prepare(0, 8192, token)
    with anyio.move_on_after(0.3) as waited:
        await c.prepare(0, 8192, token)
    assert waited.cancelled_caught, "a third frame got a buffer while two held theirs"
    # Every other 8 bytes of mem, in order.
    assert bytes(va[0]) == mem.reshape(-1, 16)[:, :8].tobytes()[:8192]
    a.sent()
    with anyio.fail_after(5):
        await c.prepare(0, 8192, token)
    b.sent()
    c.sent()
    for s in (a, b, c):
        s.close()


async def test_a_failed_allocation_does_not_lose_a_send_unit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    staging = LinkStaging(anyio.CapacityLimiter(4))
    stream = _stream(staging, np.zeros(8192 * 16, dtype=np.uint8))
    real_empty = np.empty
    fails = [2]

    def empty(*args: Any, **kwargs: Any) -> np.ndarray:
        if fails[0]:
            fails[0] -= 1
            raise MemoryError("32 MiB not available")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(streams.np, "empty", empty)
    token = CancelToken()
    for _ in range(LinkStaging.SENDS):
        with pytest.raises(MemoryError):
            await stream.prepare(0, 4096, token)
    with anyio.fail_after(5):  # memory is there again: the frame goes
        await stream.prepare(0, 4096, token)
    stream.sent()
    stream.close()
