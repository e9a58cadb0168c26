"""Accepting connections: the listening sockets and the cap on handshakes in progress.

A flood of connections that never finish their handshake must neither exhaust the endpoint nor
keep a legit client out: :class:`SetupGate` holds every connection still in its handshake and
makes room for a new one by evicting older unauthenticated ones (the flooding source's own
first). :func:`accept_loop` runs one listening socket (TCP or the same-host side channel).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from .._enums import LLMStatusCode
from .._errors import LLMException

__all__ = ["BACKLOG", "Setup", "SetupGate", "accept_loop", "bind_listener"]

#: handshakes in progress at once (side-channel exchanges are capped on their own); a new
#: connection to a full listener evicts the oldest one that has not authenticated yet
_MAX_IN_SETUP = 128
#: handshakes of one source address not authenticated yet; its next one evicts its oldest
_MAX_SETUP_PER_SOURCE = 64
#: the listener's accept queue: a flood that fills it makes the kernel drop a legit client's
#: SYN (retried a second later), so it is deep; each connection in it is accepted at once
BACKLOG = 1024


class Setup:
    """A connection in its server handshake (``SetupGate.setups``)."""

    def __init__(self, conn: socket.socket, source: str) -> None:
        self.conn = conn
        #: the client's IP address
        self.source = source
        #: cancelled to evict it
        self.scope = anyio.CancelScope()
        #: the client authenticated (without a key: sent a well-formed LINK_REQ)
        self.admitted = False


class SetupGate:
    """The connections of an endpoint's listeners that are still in their handshake."""

    def __init__(self, log: Any) -> None:
        self.log = log
        #: connections in their handshake right now, oldest first
        self.setups: dict[socket.socket, Setup] = {}

    def full(self, conn: socket.socket, addr: Any) -> bool:
        """Make room for a new connection and note it in :attr:`setups`; True when there is
        none (every handshake in progress has authenticated). Room is made by evicting the
        oldest unauthenticated handshake of the same source address once that source has
        ``_MAX_SETUP_PER_SOURCE`` of them, else the oldest unauthenticated one of all once
        ``_MAX_IN_SETUP`` are in progress: a flood only ever pushes out older connections
        (its own first), never keeps a new one out, and a legit client needs its handshake's
        few milliseconds before that many newer connections arrive."""
        source = str(addr[0]) if isinstance(addr, tuple) and addr else ""
        pending = [s for s in self.setups.values() if not s.admitted]
        own = [s for s in pending if s.source == source]
        if len(own) >= _MAX_SETUP_PER_SOURCE:
            self._evict(own[0], "its source has too many handshakes in progress")
        elif len(self.setups) >= _MAX_IN_SETUP:
            if not pending:
                self.log.info("link.refused", reason="every handshake slot is authenticated")
                return True
            self._evict(pending[0], "the listener is full")
        self.setups[conn] = Setup(conn, source)
        return False

    def _evict(self, setup: Setup, why: str) -> None:
        """Drop a handshake that has not authenticated yet (its task closes the socket)."""
        del self.setups[setup.conn]
        setup.scope.cancel()
        self.log.info("link.evicted", address=setup.source, reason=why)

    def claim(self, conn: socket.socket) -> Setup:
        """The setup of an accepted connection whose handshake starts now; one already
        cancelled when it was evicted before it started (or came from a listener without a
        gate)."""
        setup = self.setups.get(conn)
        if setup is None:
            setup = Setup(conn, "")
            setup.scope.cancel()
        return setup

    def done(self, conn: socket.socket, setup: Setup | None = None) -> None:
        """The handshake of ``conn`` ended (or never started: ``setup`` None)."""
        if setup is None or self.setups.get(conn) is setup:
            self.setups.pop(conn, None)


async def accept_loop(
    lsock: socket.socket,
    scope: anyio.CancelScope,
    closed: anyio.Event | None,
    handle: Callable[[socket.socket], Awaitable[None]],
    full: Callable[[socket.socket, Any], bool],
    spawn: Callable[..., None],
    log: Any,
    gate: SetupGate | None = None,
) -> None:
    """Accept on ``lsock`` (TCP listener or side channel) until ``scope`` is cancelled;
    each connection goes to ``handle`` in a task of its own (``spawn``), unless
    ``full(conn, address)`` says there is no room (a flood: the connection is closed, nothing
    held for it). Closes ``lsock`` and sets ``closed`` when it ends.

    Raises:
        OSError: accepting failed for another reason than running out of descriptors.
        RuntimeError: the engine is stopping (``spawn`` refused).
    """
    try:
        with scope:
            while True:
                await anyio.wait_readable(lsock)
                try:
                    conn, addr = lsock.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS):
                        log.warning("listen.accept_failed", error=str(exc))
                        await anyio.sleep(0.1)
                        continue
                    raise
                conn.setblocking(False)
                if full(conn, addr):
                    conn.close()
                    continue
                try:
                    spawn(handle, conn)
                except RuntimeError:  # the engine is stopping
                    if gate is not None:
                        gate.done(conn)
                    conn.close()
                    raise
    finally:
        lsock.close()
        if closed is not None:
            closed.set()


def bind_listener(address: tuple[str, int], backlog: int, purpose: str) -> socket.socket:
    """A non-blocking socket listening on exactly ``address``.

    Raises:
        LLMException: LLM_LINK_FAILED when the address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    lsock = socket.socket(family, socket.SOCK_STREAM)
    try:
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # exactly this address: never the IPv4 ones too
            lsock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        lsock.bind(address)
        lsock.listen(backlog)
        lsock.setblocking(False)
    except OSError as exc:
        lsock.close()
        raise LLMException(
            f"cannot listen on {_host_port(address)}{purpose}: {exc.strerror or exc}",
            status_code=LLMStatusCode.LLM_LINK_FAILED,
        ) from None
    return lsock


def _host_port(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
