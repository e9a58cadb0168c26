"""What a layer-wise push's request takes its layers from (:class:`LayerFeed`): the
scheduler's side of the transfer (``_scheduler``) feeds the :class:`~.exchange.Exchange`,
which sends each layer as it comes (:func:`send_layers`)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio

from .._errors import CopyCancelled
from .._timers import Timers

__all__ = ["LayerFeed", "send_layers"]


class LayerFeed(Protocol):
    """The layers of a layer-wise push that one request carries (:class:`Exchange` with a
    feed): the request is granted once for every layer, and each layer's bytes leave when
    the feed says so (the layer is ready and the link is this request's for it)."""

    #: each layer's bound from when it may be sent, and the RESULT's after the last (seconds)
    timeout_s: float
    #: the bound on the wait for the GRANT (seconds): a peer that never answers must not hold
    #: the transfer (nothing holds the link meanwhile)
    grant_timeout_s: float

    async def next(self, now: Callable[[int], bool] | None = None) -> range | None:
        """The next layers to send (indices from 0, in order: every layer that is ready, one
        at least), once they may be sent; None when no more will come (the transfer failed
        elsewhere: the request is aborted). With ``now``: a layer that becomes ready while
        it waits may leave at once instead, ``now(i)`` (True: it is on its way, and is
        reported :meth:`sent` once it is all out), with the link this request's for it until
        then; it returns an empty range once the request's last layer left that way."""
        ...

    def sent(self, layers: range, nbytes: int | None) -> None:
        """``layers`` left (``nbytes`` each), or failed to (None): the link is free for others
        again."""
        ...


async def send_layers(
    feed: LayerFeed,
    spans: list[int],
    per: int,
    timers: Timers,
    send: Callable[[int, int], Awaitable[None]],
    record: Callable[[float, int], None],
    send_now: Callable[[int, int, Callable[[bool], None]], bool] | None = None,
) -> None:
    """Send each run of layers the feed hands over, ``send(spans[first], spans[stop])``
    (range indices of the grant: layer ``i`` is ``spans[i]:spans[i + 1]``), each layer within
    the feed's timeout from when it may be sent (on ``timers``, the endpoint's); ``per``
    bytes a layer; ``record(started, layers)`` once a run left (``time.monotonic()``).
    ``send_now(a, b, then)``, if given, sends a layer that becomes ready while none is due
    from where it is handed over, when that needs no wait (False: it did not, nothing left),
    running ``then(ok)`` once its last byte is out: a model's layers then leave with no
    wake-up of this task each (the feed's ``now``); such a layer is recorded and reported
    sent when it is all out.

    Raises:
        CopyCancelled: the feed ended early (the request is aborted). TimeoutError: a
            layer took longer. RuntimeError: the feed handed over layers out of order. What
            ``send`` raises.
    """
    # One scope bounds each run's send in turn, cancelled by a timer of the endpoint's that
    # is cancelled once the run left: a scope per layer, or moving a scope's deadline (a loop
    # timer each time), costs as much again as a layer's sendmsg. A bound that passed while a
    # send was shielded (a frame once started is finished) leaves the scope cancelled for
    # good: that run did leave, so the rest goes on under a fresh scope.
    due = 0

    def at_once(i: int) -> bool:
        nonlocal due
        if send_now is None or i != due:
            return False
        started = time.monotonic()

        def then(ok: bool) -> None:
            if ok:
                record(started, 1)
            feed.sent(range(i, i + 1), per if ok else None)

        if not send_now(spans[i], spans[i + 1], then):
            return False
        due = i + 1
        return True

    now = at_once if send_now is not None else None
    while due < len(spans) - 1:
        with anyio.CancelScope() as bound:
            while due < len(spans) - 1 and not bound.cancel_called:
                run = await feed.next(now)
                if run is None:
                    raise CopyCancelled()
                if not run:
                    continue  # the layers due left at once (at_once)
                if run.start != due or not 0 < len(run) <= len(spans) - 1 - due:
                    raise RuntimeError(f"layers {run} handed over where layer {due} was due")
                moved: int | None = None
                started = time.monotonic()
                timer = timers.call_at(timers.now() + feed.timeout_s * len(run), bound.cancel)
                try:
                    # Layers that are ready together leave together (their bytes are
                    # adjacent in the stream): a frame and a syscall for many when the link
                    # lags.
                    await send(spans[run.start], spans[run.stop])
                    moved = per
                    record(started, len(run))
                finally:
                    timers.cancel(timer)
                    feed.sent(run, moved)
                due = run.stop
        if bound.cancelled_caught:
            raise TimeoutError
