"""How long a worker may spend on one frame: the fence a task shares with the worker that
touches its buffers, and the clock that bounds a frame by stall, deadline and grace."""

from __future__ import annotations

import threading
import time

from .._memory import CancelToken

__all__ = ["GRACE_RATE", "TRIPPED_GRACE_S", "Fence", "FrameClock", "bytes_left", "grace_s"]


class Fence:
    """Shared between a worker and the task that owns the buffers it touches.

    ``token`` asks the worker to stop touching user memory; the worker then keeps the stream in
    step with scratch memory and sets ``released``. The worker gives up on a frame (the link
    is then broken) when the peer moves no byte for ``stall_s``; and once the token has
    tripped (a cancel, or its deadline) or ``give_up_at`` (monotonic; the request's deadline,
    e.g. a serving side's budget) has passed, when the rest of the frame does not move within
    a grace sized to it (:func:`grace_s`); and for a frame with neither a token deadline nor
    ``give_up_at``, when it is not done within ``stall_s``. So a frame still moving at its
    request's deadline is finished and the link lives, while a peer that trickles holds a
    worker no longer than the deadline plus that grace. Past ``give_up_at`` real bytes keep
    moving (never zeros a receiver would take as data): only the token pads or diverts.
    """

    __slots__ = ("give_up_at", "released", "stall_s", "token")

    def __init__(self, token: CancelToken, stall_s: float, give_up_at: float | None = None) -> None:
        self.token = token
        self.stall_s = stall_s
        self.give_up_at = give_up_at
        self.released = threading.Event()


#: once a frame's token has tripped or its request's deadline passed, the rest of it must
#: move within at least this, and more for a large rest (:data:`GRACE_RATE`)
TRIPPED_GRACE_S = 1.0
#: the slowest rate (bytes/s) the rest of such a frame is allowed: 32 MiB get 4 s
GRACE_RATE = 8 << 20


def grace_s(left: int, stall_s: float) -> float:
    """How long the rest of a tripped frame, ``left`` bytes, may take."""
    return min(stall_s, max(TRIPPED_GRACE_S, left / GRACE_RATE))


def _token_deadline(token: CancelToken) -> float | None:
    """The earliest deadline of ``token`` and its parents, or None."""
    found: float | None = None
    t: CancelToken | None = token
    while t is not None:
        if t.deadline is not None and (found is None or t.deadline < found):
            found = t.deadline
        t = t.parent
    return found


def bytes_left(bufs: list[memoryview], idx: int) -> int:
    """The bytes of ``bufs[idx:]`` (1-D byte views: ``len`` is their size)."""
    return sum(map(len, bufs[idx:]))


class FrameClock:
    """When a worker gives up on one frame (see :class:`Fence`)."""

    __slots__ = ("fence", "hard_at", "late_at", "moved_at", "what")

    def __init__(self, fence: Fence, what: str) -> None:
        self.fence = fence
        self.what = what
        self.moved_at = time.monotonic()
        self.late_at = fence.give_up_at
        unbounded = self.late_at is None and _token_deadline(fence.token) is None
        self.hard_at = self.moved_at + fence.stall_s if unbounded else None

    def tripped(self, left: int) -> None:
        """The token tripped (or the request is late) with ``left`` bytes of the frame to go."""
        at = time.monotonic() + grace_s(left, self.fence.stall_s)
        self.hard_at = at if self.hard_at is None else min(self.hard_at, at)

    def late(self, bufs: list[memoryview], idx: int) -> None:
        """Start the grace once the request's own deadline (``give_up_at``) has passed."""
        if self.late_at is not None and time.monotonic() >= self.late_at:
            self.late_at = None
            self.tripped(bytes_left(bufs, idx))

    def check(self, moved: int) -> None:
        """After each syscall (``moved`` bytes; 0 when it would block).

        Raises:
            TimeoutError: the frame ran past its bound.
        """
        now = time.monotonic()
        if moved:
            self.moved_at = now
        elif now - self.moved_at >= self.fence.stall_s:
            raise TimeoutError(f"peer moved no byte of {self.what} for {self.fence.stall_s:g} s")
        if self.hard_at is not None and now >= self.hard_at:
            raise TimeoutError(f"peer did not finish {self.what} in time")
