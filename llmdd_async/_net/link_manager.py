"""The engine's links: the listener, link/unlink of clusters and the races between them.

What each link may reach of its peer comes from the same-host side channel (``side_channel``)
or the transport's endpoint (``_transports``); HCCL comm domains are ``comm_domains``.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np

from .._cluster import LLMClusterInfo, host_text
from .._enums import LLMStatusCode
from .._errors import HandshakeFailed, LLMException, ProtocolError
from .._log import get_logger
from .._messages import Identity
from .._protocol import MT, Decoder, Message, MetaBudget
from .._transports import PeerAccess
from .._transports.tcp import configure_socket
from .comm_domains import CommDomains
from .handshake import (
    Binding,
    LinkAuth,
    client_handshake,
    connect_socket,
    new_nonce,
    server_handshake,
)
from .host import LinkHost
from .link import Link
from .listener import BACKLOG, Setup, SetupGate, accept_loop, bind_listener
from .side_channel import SideChannel
from .target import Target

__all__ = ["LinkManager"]

#: an accepted connection's HELLO must be complete within this, and its LINK_REQ within this
#: after the CHALLENGE (a legit client sends each at once): silent or trickling peers go
_HELLO_S = 2.0
#: the whole handshake of a connection, side-channel proof included
_ACCEPT_HANDSHAKE_S = 10.0
_PARALLEL_LINKS = 16
#: how long an existing link may take to answer a PING before a peer linking again with its
#: cluster id replaces it (a half-open connection); a live peer answers in milliseconds
_HALF_OPEN_S = 3.0
#: what a failed connect or handshake may raise: the peer's doing, reported, never raised
_HANDSHAKE_ERRORS = (
    HandshakeFailed,
    OSError,
    EOFError,
    ProtocolError,
    TimeoutError,
    ValueError,
    KeyError,
    TypeError,
)


class LinkManager:
    """Links of one engine, keyed by the peer's cluster id."""

    def __init__(self, engine: LinkHost) -> None:
        self.engine = engine
        #: serves the requests peers start on our links (each link is given it)
        self.server = Target(engine)
        self.log = get_logger("link", cluster_id=engine.cluster_id)
        self.links: dict[int, Link] = {}
        #: our own link_clusters in progress: peer cluster id -> its client nonce
        self._linking: dict[int, str] = {}
        #: the peer's links to us being accepted, by peer cluster id
        self._accepting: set[int] = set()
        #: the same-host side channel (its socket is opened by :meth:`start`)
        self.side = SideChannel(engine, self.log)
        self._uds_scope: anyio.CancelScope | None = None
        #: the engine's comm domains (``LLMDataDist.link``)
        self.comms = CommDomains(self)
        #: peers that unlinked us since: our own unlink_clusters of them succeeds
        self._unlinked_by_peer: set[int] = set()
        #: connections in their handshake right now (capped against floods)
        self.gate = SetupGate(self.log)
        #: peers' tables are made into snapshots one at a time (each in a worker thread:
        #: several at once would fight the loop for the interpreter)
        self.table_builds = anyio.CapacityLimiter(1)
        #: partial frames buffered across all links (``llm.MetaBudget``)
        self.meta_budget = MetaBudget(engine.options.limits.meta_budget_bytes, "llm.MetaBudget")
        #: the last reason a link to each cluster failed (``LLMDataDist.link_failure``)
        self.failures: dict[int, str] = {}
        self._listen_scope: anyio.CancelScope | None = None
        self._listen_closed: anyio.Event | None = None
        self.listen_address: tuple[str, int] | None = None
        #: set (and replaced) whenever a link is registered or an accept ends
        self._link_added = anyio.Event()

    def _changed(self) -> None:
        added, self._link_added = self._link_added, anyio.Event()
        added.set()

    async def changed(self) -> None:
        """Return once a link is registered or an accept ends (after this call)."""
        await self._link_added.wait()

    def note_failure(self, cluster_id: int, reason: str) -> None:
        self.failures[cluster_id] = reason

    # ------------------------------------------------------------------ identity
    def identity(self) -> dict[str, Any]:
        """What this endpoint tells a peer about itself during the handshake: nothing about
        its memory (that goes over the side channel, to a peer the kernel vouches for)."""
        e = self.engine
        return {
            "cluster_id": e.cluster_id,
            "role": int(e.role),
            "remote_accessible": e.options.remote_accessible,
            "payload_auth": e.options.payload_auth,
            "host": self.side.host.fields(),
            "transport": e.options.transport,
            "uds": self.side.name,
        }

    def _endpoint_access(self, peer: Identity) -> PeerAccess | None:
        """The transport endpoint's access to ``peer`` (``llm.Transport=nixl`` on both ends),
        else None: the link moves bytes over its stream."""
        endpoint = self.engine.transport_endpoint
        return endpoint.new_access(peer, self.log) if endpoint is not None else None

    async def _server_prepare(self, peer: Identity, binding: Binding) -> PeerAccess | None:
        """Admit a client's link (never over a live one), then prove both sides' pids on the
        side channel when the client may share this host. Returns the access, or None.

        Raises:
            HandshakeFailed: refused (the client is told why).
        """
        cid = peer.cluster_id
        existing = self.links.get(cid)
        if existing is not None and existing.alive and not await existing.responsive(_HALF_OPEN_S):
            # The peer restarted (or its host died) and our link is half-open: one that does
            # not answer a PING within a few seconds is dead, and may be replaced.
            existing.fail(TimeoutError("no answer to a PING while the peer linked again"))
        self._admit(cid, binding.nonces[0])
        self._accepting.add(cid)
        try:
            access = await self.side.prove(peer, binding)
            self.side.require_direct(peer, access)
            return access if access is not None else self._endpoint_access(peer)
        except BaseException:
            self._accepting.discard(cid)
            self._changed()
            raise

    def _admit(self, cid: int, nonce_c: str) -> None:
        """A live link is never replaced; of two links two endpoints start to each other at
        once, the one whose client nonce is lower wins on both sides.

        Raises:
            HandshakeFailed: LLM_ALREADY_LINK.
        """
        existing = self.links.get(cid)
        if existing is not None and existing.alive:
            raise HandshakeFailed(
                f"cluster {cid} already has a live link to cluster {self.engine.cluster_id}",
                status_code=LLMStatusCode.LLM_ALREADY_LINK,
            )
        if cid in self._accepting:
            raise HandshakeFailed(
                f"cluster {cid} is already linking to cluster {self.engine.cluster_id}",
                status_code=LLMStatusCode.LLM_ALREADY_LINK,
            )
        mine = self._linking.get(cid)
        if mine is not None and not nonce_c < mine:
            raise HandshakeFailed(
                f"cluster {self.engine.cluster_id} is linking to cluster {cid} at the same time; "
                "that link is used",
                status_code=LLMStatusCode.LLM_ALREADY_LINK,
                yielded=True,
            )

    async def start(self) -> None:
        """Open the same-host side channel when this endpoint may move bytes directly."""
        usock = self.side.open()
        if usock is None:
            return
        self._uds_scope = anyio.CancelScope()
        self.engine.spawn(
            accept_loop,
            usock,
            self._uds_scope,
            None,
            self.side.serve,
            self.side.full,
            self.engine.spawn,
            self.log,
        )

    def reachable_by_peer(self, caps: Any, ranges: np.ndarray, nbytes: np.ndarray) -> bool:
        """Can the initiator that sent ``caps`` copy these ranges of ours directly (see
        :meth:`SideChannel.reachable_by_peer`)?"""
        return self.side.reachable_by_peer(caps, ranges, nbytes)

    # ------------------------------------------------------------------ listener
    async def listen(self, address: tuple[str, int]) -> None:
        """Bind exactly ``address`` and accept links in the background.

        Raises:
            LLMException: LLM_LINK_FAILED when the address cannot be bound.
        """
        lsock = bind_listener(address, BACKLOG, "")
        self.listen_address = lsock.getsockname()[:2]
        scope = anyio.CancelScope()
        self._listen_scope = scope
        self._listen_closed = closed = anyio.Event()
        self._accept_on(lsock, scope, closed)
        self.log.info("listen.up", address=f"{self.listen_address[0]}:{self.listen_address[1]}")

    async def stop_listening(self) -> None:
        """Stop accepting; returns once the listening socket is closed."""
        if self._listen_scope is not None:
            self._listen_scope.cancel()
            self._listen_scope = None
            if self._listen_closed is not None:
                await self._listen_closed.wait()
            self.log.info("listen.down")
        self.listen_address = None

    def listen_extra(self, address: tuple[str, int]) -> tuple[anyio.CancelScope, anyio.Event]:
        """A temporary listener (for a comm domain's lower ranks): cancel the scope to stop it,
        closed once the event is set.

        Raises:
            LLMException: LLM_LINK_FAILED when the address cannot be bound.
        """
        lsock = bind_listener(address, 16, " for the comm domain")
        scope, closed = anyio.CancelScope(), anyio.Event()
        self._accept_on(lsock, scope, closed)
        return scope, closed

    def _accept_on(
        self, lsock: socket.socket, scope: anyio.CancelScope, closed: anyio.Event
    ) -> None:
        """Accept links on ``lsock`` in the background, through the handshake gate."""
        gate = self.gate
        self.engine.spawn(
            accept_loop,
            lsock,
            scope,
            closed,
            self._accept_one,
            gate.full,
            self.engine.spawn,
            self.log,
            gate,
        )

    async def _accept_one(self, conn: socket.socket) -> None:
        setup = self.gate.claim(conn)
        link = None
        try:
            with setup.scope:
                link = await self._accept(conn, setup)
        finally:
            self.gate.done(conn, setup)
            if link is None:
                conn.close()
        if link is not None:
            await link.run_reader()

    async def _accept(self, conn: socket.socket, setup: Setup) -> Link | None:
        """The server side of one connection's handshake, under its deadlines: ``_HELLO_S``
        for the HELLO, as long again for the LINK_REQ, ``_ACCEPT_HANDSHAKE_S`` in all."""
        admitted: list[int] = []
        prepared: list[PeerAccess | None] = []
        started = anyio.current_time()
        phase = anyio.CancelScope(deadline=started + _HELLO_S)
        waiting_for = ["its HELLO"]

        def greeted() -> None:
            phase.deadline = anyio.current_time() + _HELLO_S
            waiting_for[0] = "its LINK_REQ"

        async def prepare(peer: Identity, binding: Binding) -> PeerAccess | None:
            # Authenticated (or, without a key, a well-formed request): never evicted now.
            setup.admitted = True
            phase.deadline = started + _ACCEPT_HANDSHAKE_S
            waiting_for[0] = "the rest of its handshake"
            access = await self._server_prepare(peer, binding)
            admitted.append(peer.cluster_id)
            prepared.append(access)
            return access

        try:
            with phase:
                decoder, peer, access, auth = await server_handshake(
                    self.engine, conn, prepare, on_hello=greeted
                )
            if phase.cancelled_caught:
                raise TimeoutError(f"the client did not send {waiting_for[0]} in time")
        except BaseException as exc:
            # Whatever a hostile or broken client sends, it only loses its connection (and
            # whatever was prepared for it).
            conn.close()
            for a in prepared:
                if a is not None:
                    a.close()
            if isinstance(exc, _HANDSHAKE_ERRORS):
                self.log.info("link.refused", reason=str(exc) or repr(exc))
                return None
            if isinstance(exc, Exception):
                self.log.exception("link.refused", reason=repr(exc))  # a bug: keep the trace
                return None
            raise
        finally:
            for cid in admitted:
                self._accepting.discard(cid)
                self._changed()
        return self._register(conn, decoder, peer, access, auth, outbound=False)

    def _register(
        self,
        sock: socket.socket,
        decoder: Decoder,
        peer: Identity,
        access: PeerAccess | None,
        auth: LinkAuth | None,
        outbound: bool,
    ) -> Link:
        # Unset, the heartbeat is the stall timeout: the kernel must not break a link (a
        # receiver slow to read, TCP_USER_TIMEOUT on its zero window) that the link itself
        # would still wait for.
        limits = self.engine.options.limits
        configure_socket(sock, limits.heartbeat_s or self.engine.stall_timeout_s)
        decoder.set_max_meta(self.engine.options.limits.meta_bytes)
        decoder.set_budget(self.meta_budget)
        link = Link(
            self.engine,
            sock,
            decoder,
            peer,
            access,
            auth,
            outbound,
            server=self.server,
            manager=self,
        )
        if access is not None:
            link.view.regions = access.regions
            access.attach(link)  # e.g. NIXL fetches the peer's metadata over the link
        old = self.links.get(link.peer_cluster_id)
        if old is not None:
            # Only a link that is already down is ever replaced (``_admit`` refuses a live one).
            self.engine.spawn(old.close, False)
        # A link that breaks or that the peer drops stays listed (as down) until this side
        # unlinks it, as upstream's link entities do: "on link faults, both sides must call"
        # unlink_clusters(force=True), and that must succeed.
        self.links[link.peer_cluster_id] = link
        self.failures.pop(link.peer_cluster_id, None)
        self._unlinked_by_peer.discard(link.peer_cluster_id)
        self._changed()
        transport = access.name if access is not None else "tcp"
        self.log.info("link.up", peer_cluster_id=link.peer_cluster_id, transport=transport)
        self.engine.observers.link_changed(link.peer_cluster_id, transport, True)
        return link

    def peer_unlinked(self, link: Link) -> None:
        """The peer unlinked ``link``: drop it, remembering that our unlink of it succeeds."""
        self.forget(link)
        self._unlinked_by_peer.add(link.peer_cluster_id)

    def forget(self, link: Link) -> None:
        if self.links.get(link.peer_cluster_id) is link:
            del self.links[link.peer_cluster_id]

    # ------------------------------------------------------------------ link / unlink
    def get(self, cluster_id: int) -> Link:
        """The live link to ``cluster_id``.

        Raises:
            LLMException: LLM_NOT_YET_LINK when there is none (or it was unlinked),
                LLM_LINK_FAILED with the reason when it broke.
        """
        link = self.links.get(cluster_id)
        if link is None:
            raise LLMException(
                f"cluster {self.engine.cluster_id} has no link to cluster {cluster_id}",
                status_code=LLMStatusCode.LLM_NOT_YET_LINK,
            )
        link.check_alive()
        return link

    async def wait_for(self, cluster_id: int, timeout_s: float | None) -> None:
        """Return once a live link to ``cluster_id`` exists (made by either side).

        Raises:
            LLMException: LLM_TIMEOUT when none came within ``timeout_s``.
        """
        with anyio.move_on_after(timeout_s):
            while True:
                link = self.links.get(cluster_id)
                if link is not None and link.alive:
                    return
                await self._link_added.wait()
        raise LLMException(
            f"cluster {cluster_id} did not link to cluster {self.engine.cluster_id} "
            f"within {timeout_s} s",
            status_code=LLMStatusCode.LLM_TIMEOUT,
        )

    async def link_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout_s: float
    ) -> list[LLMStatusCode]:
        codes = [LLMStatusCode.LLM_FAILED] * len(clusters)
        limiter = anyio.CapacityLimiter(_PARALLEL_LINKS)

        async def one(i: int, info: LLMClusterInfo) -> None:
            async with limiter:
                codes[i] = await self.link_one(info, timeout_s)

        async with anyio.create_task_group() as tg:
            for i, info in enumerate(clusters):
                tg.start_soon(one, i, info)
        return codes

    async def link_one(self, info: LLMClusterInfo, timeout_s: float) -> LLMStatusCode:
        """Link to one cluster (``link_clusters``; comm domains retry it). Never raises: the
        peer's doing is a status code, the reason in :attr:`failures` and the log."""
        cid = int(info.remote_cluster_id)  # type: ignore[arg-type]
        log = self.log.bind(peer_cluster_id=cid)
        if cid == self.engine.cluster_id and self.engine.options.cache_manager:
            # Legacy mode allows it (TorchAir's sample links cluster 0 to cluster 0).
            log.info("link.failed", reason="cannot link to own cluster id")
            return LLMStatusCode.LLM_PARAM_INVALID
        remotes = info.remote_ip_info_list
        if len(remotes) != 1:
            log.info("link.failed", reason=f"needs exactly one remote ip info, got {len(remotes)}")
            return LLMStatusCode.LLM_PARAM_INVALID
        if cid in self._linking:
            return LLMStatusCode.LLM_PROCESSING_LINK
        deadline = anyio.current_time() + timeout_s
        if cid in self._accepting:
            # The peer is linking to us right now: that link will do for both sides.
            return await self._adopt(cid, deadline)
        existing = self.links.get(cid)
        if existing is not None and existing.alive:
            return await self._adopt(cid, deadline)
        ip, port = host_text(remotes[0][0]), remotes[0][1]
        sock: socket.socket | None = None
        nonces: list[tuple[str, str]] = []

        def expect(binding: Binding) -> None:
            nonces.append(binding.nonces)
            self.side.expect(binding)

        nonce_c = new_nonce()
        self._linking[cid] = nonce_c  # settles a simultaneous link from the peer (``_admit``)
        try:
            with anyio.fail_after(timeout_s):
                sock = await connect_socket(ip, port)
                decoder, peer, auth = await client_handshake(
                    self.engine, sock, cid, nonce_c, expect
                )
            access = await self.side.proven(nonces[0], deadline)
            self.side.require_direct(peer, access)
            if access is None:
                access = self._endpoint_access(peer)
        except BaseException as exc:
            if sock is not None:
                sock.close()
            if nonces:
                self.side.drop(nonces[0])
            self._linking.pop(cid, None)
            if not isinstance(exc, Exception):
                raise  # cancelled: cleaned up, and the caller's scope goes on
            if not isinstance(exc, _HANDSHAKE_ERRORS):
                self.log.exception("link.failed", address=f"{ip}:{port}")
            if (
                isinstance(exc, HandshakeFailed)
                and exc.status_code == LLMStatusCode.LLM_ALREADY_LINK
            ):
                # The peer keeps a link it already has, or its own simultaneous one: both do.
                return await self._adopt(cid, deadline if exc.yielded else 0.0, str(exc))
            reason = str(exc) or repr(exc)
            self.note_failure(cid, f"{ip}:{port}: {reason}")
            log.warning("link.failed", address=f"{ip}:{port}", reason=reason)
            if isinstance(exc, HandshakeFailed):
                return exc.status_code
            return LLMStatusCode.LLM_LINK_FAILED
        finally:
            self._linking.pop(cid, None)
            for n in nonces:
                self.side.forget(n)
        link = self._register(sock, decoder, peer, access, auth, outbound=True)
        self.engine.spawn(link.run_reader)
        if access is not None:  # e.g. NIXL: the peer's metadata is loaded before we return
            await access.ready(max(0.0, deadline - anyio.current_time()))
        return LLMStatusCode.LLM_SUCCESS

    async def _adopt(
        self,
        cid: int,
        deadline: float,
        refused: str = "the peer keeps another link to us, which did not come up",
    ) -> LLMStatusCode:
        """link_clusters to a peer that links (or linked) to us: SUCCESS once that link is
        up, the first time; ALREADY_LINK for a link this side already made or adopted."""
        with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
            while True:
                link = self.links.get(cid)
                if link is not None and link.alive:
                    break
                if cid not in self._accepting and deadline <= anyio.current_time():
                    break
                await self._link_added.wait()
        link = self.links.get(cid)
        if link is None or not link.alive:
            self.log.warning("link.failed", peer_cluster_id=cid, reason=refused)
            self.note_failure(cid, refused)
            return LLMStatusCode.LLM_ALREADY_LINK
        if link.claimed:
            return LLMStatusCode.LLM_ALREADY_LINK
        link.claimed = True
        return LLMStatusCode.LLM_SUCCESS

    async def unlink_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout_s: float, force: bool
    ) -> list[LLMStatusCode]:
        codes = []
        for info in clusters:
            cid = int(info.remote_cluster_id)  # type: ignore[arg-type]
            link = self.links.get(cid)
            if link is None:
                left = cid in self._unlinked_by_peer  # both sides unlinked at once
                self._unlinked_by_peer.discard(cid)
                codes.append(LLMStatusCode.LLM_SUCCESS if left else LLMStatusCode.LLM_NOT_YET_LINK)
                continue
            code = LLMStatusCode.LLM_SUCCESS
            link.unlinking = True
            if not force:
                ack = None
                if link.alive:
                    # The peer may unlink (or finalize) at the same moment: that closes the
                    # link under our roundtrip, and the peer knows already.
                    with contextlib.suppress(LLMException):
                        ack = await link.roundtrip(Message(MT.UNLINK), MT.UNLINK_ACK, timeout_s)
                if ack is None and not link.peer_left:
                    code = LLMStatusCode.LLM_NOTIFY_PROMPT_UNLINK_FAILED
            self.forget(link)
            await link.close(notify=False)
            codes.append(code)
        return codes

    async def close_all(self) -> None:
        await self.stop_listening()
        if self._uds_scope is not None:
            self._uds_scope.cancel()
            self._uds_scope = None
        self.side.close()
        for link in list(self.links.values()):
            self.forget(link)
            with contextlib.suppress(Exception):
                await link.close(notify=True)
