"""Accessors for tests: an endpoint's links, caches and options seen from inside.

This is the one place that knows the names of the internals tests look at (the engine behind
an ``LLMDataDist``, its link manager, registry and pools): when the internals move, this file
changes and the tests do not. :class:`LinkView` is read-only; :func:`engine_of` and
:attr:`LinkView.raw` are the white-box escape hatches for tests that must patch internals
(hostile-peer and fault-injection tests) and change with them.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

import anyio

if TYPE_CHECKING:
    from llmdd_async._datadist import LLMDataDist
    from llmdd_async._devices import DevicePool
    from llmdd_async._engine import Engine
    from llmdd_async._enums import Placement
    from llmdd_async._net.link import Link
    from llmdd_async._net.requests import LinkStatistics
    from llmdd_async._options import EngineOptions
    from llmdd_async._registry import CacheEntry

__all__ = [
    "LinkView",
    "cache_entries",
    "cache_entry",
    "engine_of",
    "has_link",
    "link_of",
    "links_of",
    "options_of",
    "pool_of",
    "populated",
    "side_channel_name",
    "wait_link_down",
    "wait_link_listed",
]


def engine_of(datadist: LLMDataDist) -> Engine:
    """The running engine behind ``datadist``: for white-box tests that patch internals.

    Raises:
        RuntimeError: ``datadist`` is not running.
    """
    engine = datadist._engine
    if engine is None:
        raise RuntimeError("llm datadist is not initialized")
    return engine


class LinkView:
    """A live, read-only view of one link of an endpoint (what it reads is always current)."""

    __slots__ = ("_link",)

    def __init__(self, link: Link) -> None:
        self._link = link

    def __repr__(self) -> str:
        return f"LinkView(peer={self.peer_cluster_id}, alive={self.alive})"

    def __eq__(self, other: object) -> bool:
        """Views are equal when they look at the same link (a relink makes a new one)."""
        return isinstance(other, LinkView) and other._link is self._link

    def __hash__(self) -> int:
        return id(self._link)

    @property
    def peer_cluster_id(self) -> int:
        return self._link.peer_cluster_id

    @property
    def transport(self) -> str:
        """The transport's name (``tcp`` when only the stream can reach the peer)."""
        access = self._link.access
        return str(access.name) if access is not None else "tcp"

    @property
    def alive(self) -> bool:
        """Neither broken nor closed."""
        return self._link.alive

    @property
    def broken(self) -> BaseException | None:
        """Why the link broke (peer, network or protocol), or None."""
        return self._link.broken

    @property
    def peer_identity(self) -> dict[str, Any]:
        """What the peer said about itself in the handshake, as its typed identity read it
        (a copy; fields this side does not know are not kept)."""
        return self._link.peer.fields()

    @property
    def peer_pid(self) -> int | None:
        """The peer's process id where a same-host transport proved it, else None."""
        pid = getattr(self._link.access, "pid", None)
        return None if pid is None else int(pid)

    @property
    def bytes_moved(self) -> int:
        """Payload bytes this link has carried so far (counted as they move)."""
        return self._link.stats_bytes

    @property
    def serving(self) -> int:
        """Requests of the peer this side is serving now."""
        return len(self._link.serving)

    @property
    def streaming(self) -> bool:
        """Whether a served request is streaming its bytes now (holds the send path)."""
        return any(s.fence is not None for s in self._link.serving.values())

    @property
    def granted(self) -> bool:
        """Whether one of this side's requests on the link was granted (bytes are coming)."""
        return any(r.grant is not None for r in self._link.pending.values())

    @property
    def outbox(self) -> int:
        """Frames queued to send and not yet taken by the socket."""
        return self._link.outbox_frames

    @property
    def replies_left(self) -> int:
        """How many more replies (PONG, TABLE, ...) the peer may be owed before the link
        stops reading from it."""
        return int(self._link.router._replies.value)

    @property
    def reading(self) -> bool:
        """Whether the link's reader reads its socket now (False while it waits for something:
        a reply slot, a worker thread)."""
        return self._link.reader.reading

    @property
    def buffered(self) -> int:
        """Bytes of a partial frame the reader holds."""
        return int(self._link.decoder.buffered)

    @property
    def send_path_free(self) -> bool:
        """Whether nobody holds the link's send lock."""
        return self._link.writer.send_lock.value == 1

    @property
    def threads(self) -> anyio.CapacityLimiter:
        """The limiter of worker threads that serve this link."""
        return self._link.threads

    @property
    def sock(self) -> socket.socket:
        """The link's socket (fault injection: write garbage, hang up, shrink buffers)."""
        return self._link.sock

    def statistics(self) -> LinkStatistics:
        return self._link.statistics()

    @property
    def raw(self) -> Link:
        """The link itself: white-box tests only (it changes with the internals)."""
        return self._link


def links_of(datadist: LLMDataDist) -> dict[int, LinkView]:
    """Every link the endpoint lists, by peer cluster id (dead ones stay listed until
    unlinked), as a snapshot of views.

    Raises:
        RuntimeError: ``datadist`` is not running.
    """
    return {cid: LinkView(lnk) for cid, lnk in engine_of(datadist).links.links.items()}


def has_link(datadist: LLMDataDist, cluster_id: int) -> bool:
    """Whether a link to ``cluster_id`` is listed (alive or not).

    Raises:
        RuntimeError: ``datadist`` is not running.
    """
    return cluster_id in engine_of(datadist).links.links


def link_of(datadist: LLMDataDist, cluster_id: int, *, alive: bool = True) -> LinkView:
    """The link to ``cluster_id``: the live one, or with ``alive=False`` the listed one
    whatever its state.

    Raises:
        RuntimeError: ``datadist`` is not running.
        LLMException: (``alive=True``) LLM_NOT_YET_LINK when there is no link,
            LLM_LINK_FAILED with the reason when it broke.
        KeyError: (``alive=False``) no link to ``cluster_id`` is listed (never made, or
            unlinked).
    """
    links = engine_of(datadist).links
    return LinkView(links.get(cluster_id) if alive else links.links[cluster_id])


def side_channel_name(datadist: LLMDataDist) -> str | None:
    """The abstract name of the endpoint's same-host side channel, or None without one.

    Raises:
        RuntimeError: ``datadist`` is not running.
    """
    return engine_of(datadist).links.side.name


async def wait_link_listed(
    datadist: LLMDataDist, cluster_id: int, timeout_s: float = 5
) -> LinkView:
    """Wait until a link to ``cluster_id`` is listed (the peer linked to this side).

    Raises:
        TimeoutError: none within ``timeout_s``.
    """
    from ._wait import wait_until

    await wait_until(lambda: has_link(datadist, cluster_id), timeout_s)
    return link_of(datadist, cluster_id, alive=False)


async def wait_link_down(datadist: LLMDataDist, cluster_id: int, timeout_s: float = 5) -> None:
    """Wait until the link to ``cluster_id`` is down or gone.

    Raises:
        TimeoutError: still alive after ``timeout_s``.
    """
    from ._wait import wait_until

    links = engine_of(datadist).links.links

    def down() -> bool:
        lnk = links.get(cluster_id)
        return lnk is None or not lnk.alive

    await wait_until(down, timeout_s)


def options_of(datadist: LLMDataDist) -> EngineOptions:
    """The parsed options the endpoint runs with.

    Raises:
        RuntimeError: ``datadist`` is not running.
    """
    return engine_of(datadist).options


def cache_entry(datadist: LLMDataDist, cache_id: int) -> CacheEntry:
    """The registry's entry of cache ``cache_id`` (addresses, pins, remote access).

    Raises:
        RuntimeError: ``datadist`` is not running. KeyError: no such cache.
    """
    return engine_of(datadist).registry.entries[cache_id]


def cache_entries(datadist: LLMDataDist) -> list[CacheEntry]:
    """The registry's entries of every cache the endpoint has, in registration order.

    Raises:
        RuntimeError: ``datadist`` is not running.
    """
    return list(engine_of(datadist).registry.entries.values())


async def populated(datadist: LLMDataDist, cache_id: int) -> None:
    """Wait until registration has faulted in the pages of cache ``cache_id``.

    Raises:
        RuntimeError: ``datadist`` is not running. KeyError: no such cache.
    """
    engine = engine_of(datadist)
    await engine.populated(engine.registry.entries[cache_id].addrs)


def pool_of(datadist: LLMDataDist, placement: Placement) -> DevicePool:
    """The endpoint's memory pool of ``placement``.

    Raises:
        RuntimeError: ``datadist`` is not running. KeyError: no pool there.
    """
    return engine_of(datadist).pools[placement]
