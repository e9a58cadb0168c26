"""The records of one link: the requests in flight on it, and the transfers it carried.

Requests this side starts are :class:`Pending` (this side is the initiator); requests the
peer starts are :class:`Serving` (this side is the target). The link's reader sets their
signals as frames arrive; a failure of the link or the peer fails them all at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel

from .._errors import LinkBroken, LLMException
from .._memory import CancelToken
from .._protocol import Message
from .._transports.tcp import Fence, StreamPlan

if TYPE_CHECKING:
    from .host import LinkHost

__all__ = [
    "LinkStatistics",
    "Pending",
    "Request",
    "Serving",
    "Signal",
    "TransferRecord",
    "nothing",
    "past_budget",
]


def nothing() -> None:
    """A callback that does nothing (a frame sent with nothing to let go of once it is out)."""


def past_budget(host: LinkHost) -> LLMException:
    """Why this side stopped serving a peer's request: it ran past the budget this side gives
    it (its status: the transfer timeout's)."""
    return LLMException(
        f"cluster {host.cluster_id} stopped serving the request: it ran past its budget",
        status_code=host.timeout_code,
    )


@dataclasses.dataclass(frozen=True)
class TransferRecord:
    """One transfer this side ran on a link (``time.monotonic()`` seconds)."""

    op: str
    started: float
    finished: float
    nbytes: int
    mode: str


@dataclasses.dataclass(frozen=True)
class LinkStatistics:
    """What a link has carried so far."""

    peer_cluster_id: int
    transport: str
    transfers: int
    bytes: int
    up_since: float
    recent: tuple[TransferRecord, ...]


class Signal:
    """A one-shot event whose ``anyio.Event`` is made only if someone waits before it is set
    (most of a request's signals never are), and whose wait on a set signal takes no loop
    turn. ``callback``, if given, runs (once) where it is set: the link's reader drives a
    request that no task waits for (:class:`~.exchange.Exchange`)."""

    __slots__ = ("_event", "_set", "callback")

    def __init__(self) -> None:
        self._set = False
        self._event: anyio.Event | None = None
        self.callback: Callable[[], None] | None = None

    def set(self) -> None:
        self._set = True
        if self._event is not None:
            self._event.set()
        callback = self.callback
        if callback is not None:
            self.callback = None
            callback()

    def is_set(self) -> bool:
        return self._set

    async def wait(self) -> None:
        if self._set:
            await anyio.lowlevel.checkpoint_if_cancelled()
            return
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()


class Request:
    """State shared by both kinds of request."""

    def __init__(self, req_id: int, deadline: float | None) -> None:
        self.req_id = req_id
        self.deadline = deadline
        self.token = CancelToken()
        self.stream: StreamPlan | None = None
        #: its DATA is what followed its request, before any GRANT (flagged ``FLAG_EAGER``):
        #: only such DATA lands in it, and only in it
        self.eager = False
        self.received = 0
        self.data_event = Signal()
        self.fence: Fence | None = None
        self.error: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.token.cancel(exc)
        self.wake()

    def wake(self) -> None:
        self.data_event.set()


class Pending(Request):
    """A request this side started (this side is the initiator)."""

    def __init__(self, req_id: int, deadline: float | None) -> None:
        super().__init__(req_id, deadline)
        self.grant: Message | None = None
        self.grant_event = Signal()
        #: run by the reader when the GRANT arrives, before any DATA of this request is read
        self.on_grant: Callable[[Message], None] | None = None
        #: ``on_grant`` runs in a worker thread, whatever the grant's size (it costs more)
        self.check_in_worker = False
        self.result: Message | None = None
        self.result_event = Signal()

    def wake(self) -> None:
        super().wake()
        self.grant_event.set()
        self.result_event.set()

    async def wait_grant(self) -> Message:
        """Raises the link's or the peer's failure."""
        await self.grant_event.wait()
        if self.grant is None:
            raise self.error or LinkBroken("link closed before the peer answered")
        return self.grant

    async def wait_result(self) -> Message:
        await self.result_event.wait()
        if self.result is None:
            raise self.error or LinkBroken("link closed before the peer answered")
        return self.result

    async def wait_data(self) -> None:
        await self.data_event.wait()
        if self.error is not None:
            raise self.error


class Serving(Request):
    """A request the peer started (this side is the target)."""

    def __init__(self, req_id: int, deadline: float | None) -> None:
        super().__init__(req_id, deadline)
        self.done_event = Signal()
        #: bytes of the request's arrays, held while it is queued or served, and how many of
        #: them are charged to the endpoint's meta budget (``llm.MetaBudget``)
        self.meta_bytes = 0
        self.charged = 0
        #: run by the reader when DONE arrives, so its effect (consuming a key) happens before
        #: any later request on the link is looked at
        self.on_done: Callable[[Message], None] | None = None

    def wake(self) -> None:
        super().wake()
        self.done_event.set()
