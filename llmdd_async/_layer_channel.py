"""The layers a layer-wise transfer's producer hands each destination over
(:class:`LayerChannel`): the producer awaits each layer's signal (``_layer_gate``), the
destination's consumer sends what it was handed (``_scheduler``), as many layers a request
as :func:`request_size` says."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._drivers import LoopEvent

__all__ = ["LayerChannel", "request_size"]

#: a layer-wise request takes layers not ready yet only if, at the model's pace, they would
#: be ready within this share of the target's bound on the request and within _LOOKAHEAD_S:
#: it then outlives that bound only if the model stalls, and holds the target's serving slot
#: about as long as a request per layer would, while a fast model's layers go in a few
_LOOKAHEAD_SHARE, _LOOKAHEAD_S = 0.5, 0.1


def request_size(
    layers: list[int],
    pos: int,
    handed: int,
    known_ready: Callable[[int], bool],
    waited: list[float],
    now: float,
    bound_s: Callable[[int], float],
) -> int:
    """How many of a destination's ``layers`` from ``layers[pos]`` its next request carries:
    those ``handed`` over (one at least) or known ready, and as many more as the model's pace
    (``waited``: when the layers waited for became ready; two at least) says will be ready in
    time for the target's bound on a request of that many layers (``bound_s``, taken to be
    this side's own)."""
    left = len(layers) - pos
    n = max(1, min(handed, left))
    while n < left and known_ready(layers[pos + n]):
        n += 1
    if n >= left or len(waited) < 2:
        return n
    # The pace: the mean gap between layers so far, or the wait for the next one if longer.
    gap = max((waited[-1] - waited[0]) / (len(waited) - 1), now - waited[-1])
    more = left - n
    while more:
        bound = _LOOKAHEAD_SHARE * bound_s(n + more)
        if more * gap <= min(bound, _LOOKAHEAD_S):
            break
        more //= 2
    return n + more


class LayerChannel:
    """The layers the producer hands one destination over, in order, as they come. At most
    ``window`` wait unseen by the consumer (:meth:`ready` sees them); the producer then waits.
    A deque and two events: anyio's memory streams take a loop turn per item received (and
    let one layer more through, straight to a waiting consumer)."""

    def __init__(self, window: int, new_event: Callable[[], LoopEvent]) -> None:
        self._window, self._new_event = window, new_event
        #: handed over, not yet seen by the consumer (what the window bounds)
        self._unseen: collections.deque[int] = collections.deque()
        #: seen, not yet taken
        self._layers: collections.deque[int] = collections.deque()
        self._finished = False  # the producer hands over no more
        self._left = False  # the consumer takes no more
        self._arrived: LoopEvent | None = None
        self._room: LoopEvent | None = None
        #: set while the consumer waits and could send a layer at once from where it is
        #: handed over (no wake-up of the consumer for it): True when it took the layer
        self.direct: Callable[[int], bool] | None = None
        self._nudged = False

    # ---------------------------------------------------------------- the producer's side
    def hand_nowait(self, layer: int, at_once: bool = False) -> bool:
        """Hand ``layer`` over unless the window is full (False); dropped once the consumer
        left (it failed: the task group is being cancelled). With ``at_once`` it goes to the
        consumer's :attr:`direct` send first, if it waits with nothing handed over."""
        if len(self._unseen) >= self._window and not self._left:
            return False
        if not self._left:
            direct = self.direct
            if (
                at_once
                and direct is not None
                and not self._unseen
                and not self._layers
                and direct(layer)
            ):
                return True
            self._unseen.append(layer)
            if self._arrived is not None:
                self._arrived.set()
        return True

    async def hand(self, layer: int) -> None:
        """Hand ``layer`` over once the window has room (to be sent with others)."""
        while not self.hand_nowait(layer):
            self._room = self._new_event()
            await self._room.wait()

    def finish(self) -> None:
        """No more layers will come."""
        self._finished = True
        if self._arrived is not None:
            self._arrived.set()

    # ---------------------------------------------------------------- the consumer's side
    def leave(self) -> None:
        """The consumer takes no more: a producer waiting for room goes on."""
        self._left = True
        self._see()

    def _see(self) -> None:
        self._layers.extend(self._unseen)
        self._unseen.clear()
        if self._room is not None:
            self._room.set()

    def nudge(self) -> None:
        """Wake the consumer in :meth:`wait` with no layer handed over (it sent some at once
        meanwhile: :attr:`direct`)."""
        self._nudged = True
        if self._arrived is not None:
            self._arrived.set()

    async def wait(self) -> bool:
        """Wait for the next layer, or a :meth:`nudge`; False when none will come."""
        while not self._layers:
            if self._unseen:
                self._see()
            elif self._finished:
                self._nudged = False
                return False
            elif self._nudged:
                break
            else:
                self._arrived = self._new_event()
                try:
                    await self._arrived.wait()
                finally:
                    self._arrived = None
        self._nudged = False
        return True

    def ready(self) -> int:
        """How many layers are handed over and not taken yet."""
        self._see()
        return len(self._layers)

    async def take(self) -> int | None:
        """The next layer, once handed over; None when none will come."""
        if not await self.wait():
            return None
        return self._layers.popleft()

    def take_nowait(self) -> int:
        """The next layer (one is :meth:`ready`)."""
        return self._layers.popleft()

    def take_through(self, last: int) -> int | None:
        """Take the layers handed over already up to ``last``; the last one taken, or None."""
        self._see()
        taken = None
        while self._layers and self._layers[0] <= last:
            taken = self._layers.popleft()
        return taken
