"""What the link layer needs from the endpoint that runs it, and how a link serves its peer.

The link layer (links, their manager, the handshake, transfers and the transports they drive)
is given a :class:`LinkHost` and never imports the engine: ``Engine`` satisfies the protocol
structurally (mypy checks it where the engine hands itself down). A link is given its
:class:`RequestServer` when it is made, so a request the peer starts is served without a trip
up through the host.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from .._busy_poll import BusyPoll
    from .._devices import DeviceAdapter, DevicePool
    from .._enums import LLMRole, LLMStatusCode, Placement
    from .._memory import EpochPage
    from .._messages import Request as XferRequest
    from .._observe import Observers
    from .._options import EngineOptions
    from .._registry import CacheEntry, Registry
    from .._timers import Timers
    from .._transports import TransportEndpoint
    from .._transports._staging import LinkStaging
    from .._transports.tcp import StreamPlan
    from .link import Link
    from .requests import Serving

__all__ = ["LinkHost", "RequestServer", "ScratchPool", "Served"]


class ScratchPool:
    """Scratch buffers lent for one frame at a time (a link discarding bytes nobody receives):
    memory scales with transfers in progress, not with links."""

    SIZE = 4 << 20

    def __init__(self, keep: int = 2) -> None:
        self._free: list[memoryview] = []
        self._keep = keep

    def acquire(self) -> memoryview:
        return self._free.pop() if self._free else memoryview(bytearray(self.SIZE))

    def release(self, buf: memoryview) -> None:
        if len(self._free) < self._keep:
            self._free.append(buf)


class LinkHost(Protocol):
    """The endpoint a link layer runs in: its identity and options, its memory and caches, its
    time budgets, its task group, and what its peers may see and reach of it."""

    # ---------------------------------------------------------------- identity and settings
    @property
    def cluster_id(self) -> int: ...

    @property
    def role(self) -> LLMRole: ...

    @property
    def options(self) -> EngineOptions: ...

    @property
    def log(self) -> Any:
        """The endpoint's structlog logger (``_log.get_logger`` is untyped)."""
        ...

    # ---------------------------------------------------------------- memory and caches
    @property
    def registry(self) -> Registry: ...

    @property
    def observers(self) -> Observers:
        """Told of links coming up and going down (``llmdd_async.metrics``)."""
        ...

    @property
    def adapter(self) -> DeviceAdapter: ...

    @property
    def pools(self) -> Mapping[Placement, DevicePool]: ...

    @property
    def epoch(self) -> EpochPage | None:
        """The page bumped whenever a cache id is released (None before start / after stop)."""
        ...

    @property
    def transport_endpoint(self) -> TransportEndpoint | None:
        """The transport's endpoint-wide half (NIXL's agent), made when the endpoint starts."""
        ...

    @property
    def scratch(self) -> ScratchPool: ...

    #: set by the link manager once a comm-domain link exists (later registrations then
    #: default to not remote accessible)
    comm_linked: bool

    # ---------------------------------------------------------------- time budgets
    @property
    def stall_timeout_s(self) -> float:
        """How long a worker waits on a silent peer when no request deadline applies."""
        ...

    @property
    def sync_kv_timeout_s(self) -> float: ...

    @property
    def timeout_code(self) -> LLMStatusCode:
        """The status of a transfer that ran out of time."""
        ...

    def serve_budget_s(self, tensors: int) -> float:
        """The most a peer's request over ``tensors`` tensors may run here."""
        ...

    # ---------------------------------------------------------------- tasks
    @property
    def timers(self) -> Timers:
        """Deadlines of transfers that run without a task (from the reader)."""
        ...

    @property
    def busy_poll(self) -> BusyPoll:
        """Kicked on each link's traffic (``llm.BusyPoll``)."""
        ...

    def soon(self, fn: Callable[[], None]) -> bool:
        """On the loop thread: run ``fn()`` in a loop callback once what is ready to run now
        has run; it must not raise. False, with nothing scheduled, where the event loop has no
        cheap way (trio) or the endpoint is not running."""
        ...

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the endpoint's task group; a crash is logged, not raised.

        Raises:
            RuntimeError: the endpoint is not running (any more).
        """
        ...

    # ---------------------------------------------------------------- what peers see and reach
    def identity_for_link(self) -> dict[str, Any]:
        """What the handshake tells a peer about this endpoint."""
        ...

    def published_table(self) -> dict[str, Any]:
        """This endpoint's cache table as a peer snapshots it (a fresh dict: a link adds what
        its access tells only its peer, ``PeerAccess.table_fields``)."""
        ...

    def reachable_by_peer(self, caps: Any, ranges: np.ndarray, nbytes: np.ndarray) -> bool:
        """Whether the initiator that sent ``caps`` may copy these ranges of ours itself."""
        ...

    def request_caps(self, link: Link, entry: CacheEntry) -> dict[str, bool]:
        """The caps sent with a request from/to the local cache ``entry`` over ``link``."""
        ...

    def host_reachable(self, addrs: np.ndarray) -> bool:
        """False for device memory the CPU cannot address directly."""
        ...

    def make_stream(
        self, addrs: np.ndarray, nbytes: np.ndarray, staging: LinkStaging | None = None
    ) -> StreamPlan:
        """The stream view of local ranges (direct for host memory, staged for device)."""
        ...

    async def open_stream(
        self, addrs: np.ndarray, nbytes: np.ndarray, staging: LinkStaging | None = None
    ) -> StreamPlan:
        """:meth:`make_stream`, slow parts in a worker thread."""
        ...

    async def populated(self, addrs: np.ndarray) -> None:
        """Wait until the pages of the cache at ``addrs`` are faulted in."""
        ...


class Served(enum.Enum):
    """What :meth:`RequestServer.serve_now` did with a request."""

    #: served (or being served) from the reader: nothing more to do
    NOW = "now"
    #: nothing was sent: it would be served from the reader, but every serving slot of the
    #: link (``llm.LinkServing``) is taken; asked again when one is freed
    NO_SLOT = "no slot"
    #: nothing was sent: a task must serve it
    TASK = "task"


class RequestServer(Protocol):
    """The target side of transfers: how a link serves the requests its peer starts."""

    def serve_now(self, link: Link, request: XferRequest) -> Served:
        """Serve ``request`` from the link's reader itself, if it is small enough to need no
        task. Never raises for a bad request (the task answers it)."""
        ...

    async def serve_request(self, link: Link, req: Serving, request: XferRequest) -> None:
        """Serve ``request`` (recorded as ``req`` in ``link.serving``) in a task of its
        own: resolve, check, plan, grant, move, finish. It holds a serving slot taken for
        ``req`` (``link.serving_limiter``), and gives it back when it ends. Never raises:
        failures go back to the peer."""
        ...
