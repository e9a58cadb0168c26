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


def _shuffled_ranges(mem: np.ndarray, size: int, gap: int, rng: np.random.Generator) -> Any:
    """Ranges of ``size`` bytes every ``size + gap`` bytes of ``mem``, in shuffled order."""
    step = size + gap
    starts = np.arange(0, mem.nbytes - size + 1, step, dtype=np.uint64)
    rng.shuffle(starts)
    return starts + np.uint64(mem.ctypes.data), np.full(len(starts), size, dtype=np.uint64)


@pytest.mark.parametrize(
    ("size", "gap", "frame"),
    [
        (8192, 0, 1 << 20),  # blocks of a tensor: staged, rows of 8 KiB
        (4096, 4096, 3 << 16),  # every other page
        (24, 8, 4096),  # words
        (13, 6, 1000),  # odd sizes and cuts: single bytes
        (8192, 0, 12_345),  # whole blocks, frames cut mid-block
        (32768, 0, (1 << 20) + 4097),  # big ranges: straight, frames cut mid-range
        (32768, 8, 1 << 20),  # straight, then staged where a frame's ranges are small
    ],
)
async def test_frames_move_exactly_the_ranges_bytes(size: int, gap: int, frame: int) -> None:
    rng = np.random.default_rng(size + gap + frame)
    src = rng.integers(0, 256, 600 * (size + gap), dtype=np.uint8)
    addrs, nbytes = _shuffled_ranges(src, size, gap, rng)
    if gap == 8:  # (the second half of the stream: ranges of 24 bytes)
        nbytes[len(nbytes) // 2 :] = 24
    base = src.ctypes.data
    pairs = list(zip((addrs - np.uint64(base)).tolist(), nbytes.tolist(), strict=True))
    expected = b"".join(bytes(src[a : a + ln]) for a, ln in pairs)
    staging = LinkStaging(anyio.CapacityLimiter(2))
    token = CancelToken()
    out = ManyRangesStream(addrs, nbytes, staging)
    sent = bytearray()
    for off in range(0, len(expected), frame):
        n = min(frame, len(expected) - off)
        sent += b"".join(bytes(v) for v in await out.prepare(off, n, token))
        out.sent()
    out.close()
    assert sent == expected

    dst = np.zeros_like(src)
    into = ManyRangesStream(addrs - np.uint64(base) + np.uint64(dst.ctypes.data), nbytes, staging)
    for off in range(0, len(expected), frame):
        n = min(frame, len(expected) - off)
        pos = off
        for view in await into.receive_staged(off, n):
            view[:] = expected[pos : pos + view.nbytes]
            pos += view.nbytes
        assert pos == off + n
        await into.commit(off, n, token)
    into.close()
    touched = np.zeros(src.nbytes, dtype=bool)
    for a, ln in pairs:
        touched[a : a + ln] = True
    assert np.array_equal(dst[touched], src[touched])
    assert not dst[~touched].any(), "bytes outside the ranges were written"


async def test_a_frame_of_big_ranges_goes_straight_and_holds_a_send_unit() -> None:
    mem = np.zeros(128 << 15, dtype=np.uint8)
    base = mem.ctypes.data
    addrs = np.arange(base, base + mem.nbytes, 32 << 10, dtype=np.uint64)[::-1].copy()
    big = ManyRangesStream(addrs, np.full(128, 32 << 10, dtype=np.uint64), LinkStaging())
    token = CancelToken()
    views = await big.prepare(0, mem.nbytes, token)
    # Views of the memory itself (no staging copy): a write shows through them.
    mem[-(32 << 10)] = 7
    assert len(views) == 128 and views[0].nbytes == 32 << 10 and views[0][0] == 7
    with anyio.move_on_after(0.2) as waited:
        await big._staging.acquire_send()  # one unit left of two
        await big._staging.acquire_send()
    assert waited.cancelled_caught, "a frame sent straight did not hold a send unit"
    big.sent()
    big._staging.sent()
    with anyio.fail_after(5):
        await big._staging.acquire_send()
    big.close()
