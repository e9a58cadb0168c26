"""What a layer-wise push's request takes its layers from (:class:`LayerFeed`): the
scheduler's side of the transfer (``_scheduler``) feeds the :class:`~.exchange.Exchange`."""

from __future__ import annotations

from typing import Protocol

__all__ = ["LayerFeed"]


class LayerFeed(Protocol):
    """The layers of a layer-wise push that one request carries (:class:`Exchange` with a
    feed): the request is granted once for every layer, and each layer's bytes leave when
    the feed says so (the layer is ready and the link is this request's for it)."""

    #: each layer's bound from when it may be sent, and the RESULT's after the last (seconds)
    timeout_s: float
    #: the bound on the wait for the GRANT (seconds): a peer that never answers must not hold
    #: the transfer (nothing holds the link meanwhile)
    grant_timeout_s: float

    async def next(self) -> range | None:
        """The next layers to send (indices from 0, in order: every layer that is ready, one
        at least), once they may be sent; None when no more will come (the transfer failed
        elsewhere: the request is aborted)."""
        ...

    def sent(self, layers: range, nbytes: int | None) -> None:
        """``layers`` left (``nbytes`` each), or failed to (None): the link is free for others
        again."""
        ...
