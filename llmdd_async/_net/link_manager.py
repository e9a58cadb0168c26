"""The engine's links: the listener, link/unlink of clusters, and choosing each link's transport."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import socket
import zlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import numpy as np

from .._checks import check_isinstance, check_uint32, check_uint64
from .._enums import LLMStatusCode, RegisterMemStatus
from .._errors import LLMException, raise_if_false, raise_param
from .._log import get_logger
from .._messages import regions_of_table
from .._planner import check_within
from .._protocol import MT, Decoder, Message, MetaBudget, ProtocolError
from .._transports.in_process import InProcessAccess
from .._transports.same_host import (
    SameHostAccess,
    close_fds,
    forget_side_channel,
    host_identity,
    is_own_side_channel,
    mac_ok,
    on_same_host,
    peer_pid,
    peer_process,
    peer_uid,
    recv_with_fds,
    same_user,
    send_with_fds,
    side_channel_name,
    side_mac,
    tcp_binding,
    valid_side_channel_name,
)
from .._transports.tcp import configure_socket
from .._types import LLMClusterInfo, int_to_ip
from .handshake import (
    Binding,
    HandshakeFailed,
    LinkAuth,
    client_handshake,
    connect_socket,
    new_nonce,
    send_message,
    server_handshake,
)
from .link import Link, probe_token

__all__ = ["LinkManager"]

#: an accepted connection's HELLO must be complete within this, and its LINK_REQ within this
#: after the CHALLENGE (a legit client sends each at once): silent or trickling peers go
_HELLO_S = 2.0
#: the whole handshake of a connection, side-channel proof included
_ACCEPT_HANDSHAKE_S = 10.0
#: the same-host side channel's exchange (one local round trip)
_PROOF_S = 5.0
#: largest PROVE a client reads (nonces, the TCP binding and a MAC take a few hundred bytes)
_PROVE_META = 64 << 10
_PARALLEL_LINKS = 16
#: handshakes and side-channel exchanges in progress at once (each kind on its own); a new
#: connection to a full listener evicts the oldest one that has not authenticated yet
_MAX_IN_SETUP = 128
#: handshakes of one source address not authenticated yet; its next one evicts its oldest
_MAX_SETUP_PER_SOURCE = 64
#: the listener's accept queue: a flood that fills it makes the kernel drop a legit client's
#: SYN (retried a second later), so it is deep; each connection in it is accepted at once
_BACKLOG = 1024
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

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.log = get_logger("link", cluster_id=engine.cluster_id)
        self.links: dict[int, Link] = {}
        #: our own link_clusters in progress: peer cluster id -> its client nonce
        self._linking: dict[int, str] = {}
        #: the peer's links to us being accepted, by peer cluster id
        self._accepting: set[int] = set()
        #: client handshakes waiting for the server's side-channel proof, by nonces
        self._expect: dict[tuple[str, str], _Expect] = {}
        self._uds: socket.socket | None = None
        self._uds_name: str | None = None
        self._uds_scope: anyio.CancelScope | None = None
        #: peers that unlinked us since: our own unlink_clusters of them succeeds
        self._unlinked_by_peer: set[int] = set()
        #: connections in their handshake right now, oldest first; side-channel exchanges
        #: right now (each capped by ``_MAX_IN_SETUP`` on its own, so one kind of flood cannot
        #: starve the other)
        self._setups: dict[socket.socket, _Setup] = {}
        self._proving = 0
        #: partial frames buffered across all links (``llm.MetaBudget``)
        self.meta_budget = MetaBudget(engine.options.limits.meta_budget_bytes, "llm.MetaBudget")
        #: the last reason a link to each cluster failed (``LLMDataDist.link_failure``)
        self.failures: dict[int, str] = {}
        self._listen_scope: anyio.CancelScope | None = None
        self._listen_closed: anyio.Event | None = None
        self.listen_address: tuple[str, int] | None = None
        self._probe = probe_token()
        self._host = host_identity()
        self._comms: dict[int, _Comm] = {}
        self._comm_ids = 0
        #: set (and replaced) whenever a link is registered or an accept ends
        self._link_added = anyio.Event()

    def _changed(self) -> None:
        added, self._link_added = self._link_added, anyio.Event()
        added.set()

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
            "host": self._host,
            "transport": e.options.transport,
            "uds": self._uds_name,
        }

    def _proof(self) -> dict[str, Any]:
        """What a proven same-host peer learns: pools (``[fd, base, size]``), the probe,
        reachable caches."""
        e = self.engine
        pools = [[p.fd, p.base, p.nbytes] for p in e.pools.values() if hasattr(p, "fd")]
        if e.epoch is not None:  # mapped like a pool: read by one-sided pulls (see _transfer)
            pools.append([e.epoch.fd, e.epoch.base, e.epoch.nbytes])
        return {
            "pools": pools,
            "probe": [int(self._probe.ctypes.data), self._probe.tobytes().hex()],
            "caches": e.published_table()["caches"],
        }

    def _proof_wire(self, to_pid: int) -> tuple[dict[str, Any], list[int]]:
        """:meth:`_proof` as sent: each pool as ``[base, size]``, its descriptor passed with
        the message (same order). This very process gets no descriptors (it has them)."""
        proof = self._proof()
        pools = proof.get("pools") or []
        fds = [int(p[0]) for p in pools] if to_pid != os.getpid() else []
        proof["pools"] = [[p[1], p[2]] for p in pools] if fds else []
        return proof, fds

    @staticmethod
    def _uid_reason(sock: socket.socket) -> str:
        """Why a peer of another uid gets no direct access (``transport.fallback``)."""
        if peer_pid(sock) <= 0:
            return (
                "the peer's process is not visible here (another pid namespace): bytes move "
                "over TCP"
            )
        return (
            f"the peer runs as uid {peer_uid(sock)}, this endpoint as uid {os.geteuid()}: only "
            "processes of one user share memory directly (never the overflow uid of an "
            "unmapped user); bytes move over TCP"
        )

    def _direct_allowed(self) -> bool:
        e = self.engine
        return e.options.transport not in ("tcp", "nixl") and e.adapter.host_addressable

    def _nixl_access(self, peer: dict[str, Any]) -> Any:
        """A NIXL access when both ends asked for ``llm.Transport=nixl``, else None (the link
        moves bytes over its stream, and the log says ``transport.fallback``)."""
        nixl = self.engine.nixl
        if nixl is None:
            return None
        if peer.get("transport") != "nixl":
            self.log.info(
                "transport.fallback",
                peer_cluster_id=peer.get("cluster_id"),
                reason=f"the peer does not use llm.Transport=nixl ({peer.get('transport')!r})",
            )
            return None
        return nixl.new_access()

    def _access_for(
        self,
        pid: int,
        pidfd: int | None,
        proof: dict[str, Any],
        fds: list[int],
        own_name: bool,
    ) -> Any:
        """Direct access to the process the kernel named (of our uid: the caller checked), from
        what it sent; None if there is nothing it lets us reach. ``fds``: the descriptors that
        came with ``proof``, one per pool (they stay the caller's: it closes them). ``own_name``:
        the peer answered on one of this process's own side channels (needed to believe it is
        this very process). Takes ``pidfd``."""
        copy = self.engine.adapter.copy
        if pid <= 0 or (pid == os.getpid() and not own_name):
            if pidfd is not None:
                os.close(pidfd)
            return None
        if pid == os.getpid():
            if pidfd is not None:
                os.close(pidfd)
            access: Any = InProcessAccess(copy)
        else:
            claimed = proof.get("pools")
            pools: list[tuple[int, Any, Any]] = []
            if (
                isinstance(claimed, list)
                and len(claimed) == len(fds)
                and all(isinstance(p, list) and len(p) == 2 for p in claimed)
            ):
                pools = [(fd, p[0], p[1]) for fd, p in zip(fds, claimed, strict=True)]
            elif claimed or fds:
                self.log.info(
                    "side_channel.pools_refused",
                    reason=f"{len(fds)} descriptors for {len(claimed or [])} pools",
                )
            access = SameHostAccess(pid, pidfd, pools, proof.get("probe"), copy)
            if access.refused:
                self.log.info("side_channel.pools_refused", reason="; ".join(access.refused))
            if not access.pools and not access.pvr:
                access.close()
                return None
            if not access.pvr:
                self.log.info(
                    "transport.fallback",
                    reason="process_vm_readv is not permitted here: registered (non-pool) "
                    "memory of this peer moves over TCP; pool memory is still shared",
                )
        access.regions = regions_of_table(proof)
        return access

    def _require_direct(self, peer: dict[str, Any], access: Any) -> None:
        """Raises HandshakeFailed when ``llm.Transport=same-host`` meets a peer on another
        host. (A peer on this host that nothing could be proven about moves bytes over TCP,
        and the log says ``transport.fallback``.)"""
        if access is not None or self.engine.options.transport != "same-host":
            return
        host = peer.get("host")
        if not on_same_host(self._host, host):
            where = host.get("hostname") if isinstance(host, dict) else "unknown"
            raise HandshakeFailed(
                f"llm.Transport=same-host, but cluster {peer.get('cluster_id')} runs on "
                f"another host ({where})"
            )

    async def _server_prepare(self, peer: dict[str, Any], binding: Binding) -> Any:
        """Admit a client's link (never over a live one), then prove both sides' pids on the
        side channel when the client may share this host. Returns the access, or None.

        Raises:
            HandshakeFailed: refused (the client is told why).
        """
        cid = int(peer["cluster_id"])
        existing = self.links.get(cid)
        if existing is not None and existing.alive and not await existing.responsive(_HALF_OPEN_S):
            # The peer restarted (or its host died) and our link is half-open: one that does
            # not answer a PING within a few seconds is dead, and may be replaced.
            existing.fail(TimeoutError("no answer to a PING while the peer linked again"))
        self._admit(cid, binding.nonces[0])
        self._accepting.add(cid)
        try:
            access = None
            name = peer.get("uds")
            if (
                self._direct_allowed()
                and isinstance(name, str)
                and peer.get("transport") != "tcp"
                and on_same_host(self._host, peer.get("host"))
            ):
                try:
                    with anyio.fail_after(_PROOF_S):
                        access = await self._prove_to(name, binding)
                except (OSError, EOFError, ProtocolError, TimeoutError, ValueError) as exc:
                    self.log.info("transport.fallback", peer_cluster_id=cid, reason=str(exc))
            self._require_direct(peer, access)
            return access if access is not None else self._nixl_access(peer)
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
                LLMStatusCode.LLM_ALREADY_LINK,
            )
        if cid in self._accepting:
            raise HandshakeFailed(
                f"cluster {cid} is already linking to cluster {self.engine.cluster_id}",
                LLMStatusCode.LLM_ALREADY_LINK,
            )
        mine = self._linking.get(cid)
        if mine is not None and not nonce_c < mine:
            raise HandshakeFailed(
                f"cluster {self.engine.cluster_id} is linking to cluster {cid} at the same time; "
                "that link is used",
                LLMStatusCode.LLM_ALREADY_LINK,
                yielded=True,
            )

    async def _prove_to(self, name: str, binding: Binding) -> Any:
        """Server side of the side channel: connect to the client's socket, learn its
        process from the kernel, show it which TCP connection we mean (with a MAC under the
        link's side-channel key when keyed), and only once it confirmed that connection (and
        the key) exchange what each lets the other reach. Only a process of our uid gets
        anything.

        Raises:
            ValueError: not a side channel of ours, a peer of another uid, or a confirmation
                without the key's MAC. OSError / EOFError / ProtocolError: it failed.
        """
        if not valid_side_channel_name(name):
            raise ValueError(f"not a side channel of ours: {name!r}")
        u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        pidfd: int | None = None
        fds: list[int] = []
        try:
            u.setblocking(False)
            u.connect("\0" + name)
            if not same_user(u):
                raise ValueError(self._uid_reason(u))  # logged as transport.fallback
            pid, pidfd = peer_process(u)
            nonces, tcp = list(binding.nonces), tcp_binding(binding.sock)
            fields: dict[str, Any] = {"nonces": nonces, "tcp": tcp}
            if binding.side_key is not None:
                fields["mac"] = side_mac(binding.side_key, b"prove", nonces, tcp)
            await send_message(u, Message(MT.PROVE, 0, fields))
            ack, fds = await recv_with_fds(u, Decoder(16 << 20), MT.PROVE_ACK)
            if ack.fields.get("status") != 0:
                return None
            if binding.side_key is not None and not mac_ok(
                side_mac(binding.side_key, b"ack", nonces, tcp), ack.fields.get("mac")
            ):
                raise ValueError("the side channel's answer lacks the link key's MAC")
            own = is_own_side_channel(name)
            usable = pid > 0 and (pid != os.getpid() or own)
            proof, ours = self._proof_wire(pid) if usable else ({}, [])
            await send_with_fds(u, Message(MT.PROVE_FIN, 0, proof), ours)
            access = self._access_for(pid, pidfd, ack.fields, fds, own)
            pidfd = None  # taken
            return access
        finally:
            u.close()
            close_fds(fds)  # a mapped pool holds its own reference
            if pidfd is not None:
                os.close(pidfd)

    async def _serve_proof(self, conn: socket.socket) -> None:
        """Client side of the side channel: answer a server of our uid that names one of our
        handshakes in progress, from the other end of that very TCP connection (and, on a
        keyed link, proves the key), with what we let it reach."""
        pidfd: int | None = None
        claimed: _Expect | None = None
        fds: list[int] = []
        try:
            if not same_user(conn):
                # Another user's process gets nothing from us, so it is not read at all: it can
                # neither fill the exchanges in progress nor make us buffer its frames.
                self.log.info("transport.fallback", reason=self._uid_reason(conn))
                conn.close()
                return
        except OSError:
            conn.close()
            return
        self._proving += 1
        try:
            with anyio.fail_after(_PROOF_S):
                # The connecting process is alive (it called connect() just now) and, if it
                # is this process, one of our own endpoints.
                pid, pidfd = peer_process(conn)
                # PROVE is small (nonces, addresses, a MAC); only the server's FIN carries a
                # cache table.
                decoder = Decoder(_PROVE_META)
                msg, stray = await recv_with_fds(conn, decoder, MT.PROVE)
                close_fds(stray)  # a server passes nothing before we answered
                decoder.set_max_meta(16 << 20)
                nonces = msg.fields.get("nonces")
                exp = (
                    self._expect.get((str(nonces[0]), str(nonces[1])))
                    if isinstance(nonces, list) and len(nonces) == 2
                    else None
                )
                tcp = tcp_binding(exp.sock, mirrored=True) if exp is not None else None
                if (
                    exp is None
                    or exp.done
                    or msg.fields.get("tcp") != tcp
                    or (
                        exp.side_key is not None
                        and not mac_ok(
                            side_mac(exp.side_key, b"prove", nonces, tcp), msg.fields.get("mac")
                        )
                    )
                ):
                    await send_message(conn, Message(MT.PROVE_ACK, 0, {"status": 1}))
                    return
                if pid <= 0:  # nothing the kernel vouches for: describe nothing
                    await send_message(conn, Message(MT.PROVE_ACK, 0, {"status": 1}))
                    return
                if not same_user(conn):
                    self.log.info("transport.fallback", reason=self._uid_reason(conn))
                    await send_message(conn, Message(MT.PROVE_ACK, 0, {"status": 1}))
                    return
                exp.done = True
                claimed = exp
                proof, ours = self._proof_wire(pid)
                if exp.side_key is not None:
                    proof["mac"] = side_mac(exp.side_key, b"ack", nonces, tcp)
                await send_with_fds(conn, Message(MT.PROVE_ACK, 0, {"status": 0, **proof}), ours)
                # (the server's LINK_ACK may overtake what follows: the handshake waits for
                # ``finished``)
                fin, fds = await recv_with_fds(conn, decoder, MT.PROVE_FIN)
                access = self._access_for(pid, pidfd, fin.fields, fds, True)
                pidfd = None  # taken
                if exp.abandoned:
                    if access is not None:
                        access.close()
                else:
                    exp.access = access
        except (OSError, EOFError, ProtocolError, TimeoutError, ValueError, TypeError) as exc:
            self.log.info("side_channel.refused", reason=str(exc))
        finally:
            conn.close()
            close_fds(fds)  # a mapped pool holds its own reference
            if pidfd is not None:
                os.close(pidfd)
            if claimed is not None:
                claimed.finished.set()
            self._proving -= 1

    async def start(self) -> None:
        """Open the same-host side channel (an abstract ``AF_UNIX`` socket: no file, gone
        with the process) when this endpoint may move bytes directly."""
        if not self._direct_allowed() or not hasattr(socket, "AF_UNIX"):
            return
        usock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = side_channel_name()
        try:
            usock.bind("\0" + name)
            usock.listen(128)
            usock.setblocking(False)
        except OSError as exc:
            usock.close()
            forget_side_channel(name)
            self.log.info("transport.fallback", reason=f"no side channel: {exc}")
            return
        self._uds, self._uds_name = usock, name
        self._uds_scope = anyio.CancelScope()
        self.engine.spawn(
            self._accept_loop,
            usock,
            self._uds_scope,
            None,
            self._serve_proof,
            lambda *_: self._proving >= _MAX_IN_SETUP,
        )

    def reachable_by_peer(self, caps: Any, ranges: np.ndarray, nbytes: np.ndarray) -> bool:
        """Can the initiator that sent ``caps`` copy these ranges of ours directly? Only
        memory of remote-accessible caches is ever reached directly."""
        if not isinstance(caps, dict):
            return False
        starts, ends = self.engine.registry.reachable_regions()
        if not check_within(ranges, nbytes, starts, ends):
            return False
        if caps.get("inproc") or caps.get("pvr"):
            return True
        if caps.get("pools"):
            pools = [p for p in self.engine.pools.values() if hasattr(p, "fd")]
            if not pools:
                return False
            order = sorted(pools, key=lambda p: p.base)
            starts = np.array([p.base for p in order], dtype=np.uint64)
            ends = starts + np.array([p.nbytes for p in order], dtype=np.uint64)
            return check_within(ranges, nbytes, starts, ends)
        return False

    # ------------------------------------------------------------------ listener
    async def listen(self, address: tuple[str, int]) -> None:
        """Bind exactly ``address`` and accept links in the background.

        Raises:
            LLMException: LLM_LINK_FAILED when the address cannot be bound.
        """
        lsock = _bind_listener(address, _BACKLOG, "")
        self.listen_address = lsock.getsockname()[:2]
        scope = anyio.CancelScope()
        self._listen_scope = scope
        self._listen_closed = closed = anyio.Event()
        self.engine.spawn(
            self._accept_loop, lsock, scope, closed, self._accept_one, self._handshakes_full
        )
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

    async def _accept_loop(
        self,
        lsock: socket.socket,
        scope: anyio.CancelScope,
        closed: anyio.Event | None,
        handle: Callable[[socket.socket], Awaitable[None]],
        full: Callable[[socket.socket, Any], bool],
    ) -> None:
        """Accept on ``lsock`` (TCP listener or side channel) until ``scope`` is cancelled;
        each connection goes to ``handle`` in a task of its own, unless ``full(conn, address)``
        says there is no room (a flood: the connection is closed, nothing held for it)."""
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
                            self.log.warning("listen.accept_failed", error=str(exc))
                            await anyio.sleep(0.1)
                            continue
                        raise
                    conn.setblocking(False)
                    if full(conn, addr):
                        conn.close()
                        continue
                    try:
                        self.engine.spawn(handle, conn)
                    except RuntimeError:  # the engine is stopping
                        self._setups.pop(conn, None)
                        conn.close()
                        raise
        finally:
            lsock.close()
            if closed is not None:
                closed.set()

    def _handshakes_full(self, conn: socket.socket, addr: Any) -> bool:
        """Make room for a new connection and note it in ``_setups``; True when there is none
        (every handshake in progress has authenticated). Room is made by evicting the oldest
        unauthenticated handshake of the same source address once that source has
        ``_MAX_SETUP_PER_SOURCE`` of them, else the oldest unauthenticated one of all once
        ``_MAX_IN_SETUP`` are in progress: a flood only ever pushes out older connections
        (its own first), never keeps a new one out, and a legit client needs its handshake's
        few milliseconds before that many newer connections arrive."""
        source = str(addr[0]) if isinstance(addr, tuple) and addr else ""
        pending = [s for s in self._setups.values() if not s.admitted]
        own = [s for s in pending if s.source == source]
        if len(own) >= _MAX_SETUP_PER_SOURCE:
            self._evict(own[0], "its source has too many handshakes in progress")
        elif len(self._setups) >= _MAX_IN_SETUP:
            if not pending:
                self.log.info("link.refused", reason="every handshake slot is authenticated")
                return True
            self._evict(pending[0], "the listener is full")
        self._setups[conn] = _Setup(conn, source)
        return False

    def _evict(self, setup: _Setup, why: str) -> None:
        """Drop a handshake that has not authenticated yet (its task closes the socket)."""
        del self._setups[setup.conn]
        setup.scope.cancel()
        self.log.info("link.evicted", address=setup.source, reason=why)

    async def _accept_one(self, conn: socket.socket) -> None:
        setup = self._setups.get(conn)
        if setup is None:  # evicted before it started (or a listener without a table)
            setup = _Setup(conn, "")
            setup.scope.cancel()
        link = None
        try:
            with setup.scope:
                link = await self._accept(conn, setup)
        finally:
            if self._setups.get(conn) is setup:
                del self._setups[conn]
            if link is None:
                conn.close()
        if link is not None:
            await link.run_reader()

    async def _accept(self, conn: socket.socket, setup: _Setup) -> Link | None:
        """The server side of one connection's handshake, under its deadlines: ``_HELLO_S``
        for the HELLO, as long again for the LINK_REQ, ``_ACCEPT_HANDSHAKE_S`` in all."""
        admitted: list[int] = []
        prepared: list[Any] = []
        started = anyio.current_time()
        phase = anyio.CancelScope(deadline=started + _HELLO_S)
        waiting_for = ["its HELLO"]

        def greeted() -> None:
            phase.deadline = anyio.current_time() + _HELLO_S
            waiting_for[0] = "its LINK_REQ"

        async def prepare(peer: dict[str, Any], binding: Binding) -> Any:
            # Authenticated (or, without a key, a well-formed request): never evicted now.
            setup.admitted = True
            phase.deadline = started + _ACCEPT_HANDSHAKE_S
            waiting_for[0] = "the rest of its handshake"
            access = await self._server_prepare(peer, binding)
            admitted.append(int(peer["cluster_id"]))
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
        decoder: Any,
        peer: dict[str, Any],
        access: Any,
        auth: LinkAuth | None,
        outbound: bool,
    ) -> Link:
        configure_socket(sock)
        decoder.set_max_meta(self.engine.options.limits.meta_bytes)
        decoder.set_budget(self.meta_budget)
        link = Link(self.engine, sock, decoder, peer, access, auth, outbound)
        if access is not None:
            link.peer_regions = access.regions
            if hasattr(access, "attach"):
                access.attach(link)  # NIXL: fetches the peer's metadata over the link
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
        self.log.info(
            "link.up",
            peer_cluster_id=link.peer_cluster_id,
            transport=access.name if access is not None else "tcp",
        )
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
                codes[i] = await self._link_one(info, timeout_s)

        async with anyio.create_task_group() as tg:
            for i, info in enumerate(clusters):
                tg.start_soon(one, i, info)
        return codes

    async def _link_one(self, info: LLMClusterInfo, timeout_s: float) -> LLMStatusCode:
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
        ip, port = int_to_ip(remotes[0][0]), remotes[0][1]
        sock: socket.socket | None = None
        nonces: list[tuple[str, str]] = []

        def expect(binding: Binding) -> None:
            nonces.append(binding.nonces)
            self._expect[binding.nonces] = _Expect(binding.sock, binding.side_key)

        nonce_c = new_nonce()
        self._linking[cid] = nonce_c  # settles a simultaneous link from the peer (``_admit``)
        try:
            with anyio.fail_after(timeout_s):
                sock = await connect_socket(ip, port)
                decoder, peer, auth = await client_handshake(
                    self.engine, sock, cid, nonce_c, expect
                )
            exp = self._expect.get(nonces[0])
            if exp is not None and exp.done:
                with anyio.move_on_after(min(_PROOF_S, deadline - anyio.current_time())):
                    await exp.finished.wait()
            access = exp.access if exp is not None else None
            self._require_direct(peer, access)
            if access is None:
                access = self._nixl_access(peer)
        except BaseException as exc:
            if sock is not None:
                sock.close()
            if nonces and (exp := self._expect.get(nonces[0])) and exp.access is not None:
                exp.access.close()
            self._linking.pop(cid, None)
            if not isinstance(exc, Exception):
                raise  # cancelled: cleaned up, and the caller's scope goes on
            if not isinstance(exc, _HANDSHAKE_ERRORS):
                self.log.exception("link.failed", address=f"{ip}:{port}")
            if isinstance(exc, HandshakeFailed) and exc.code == LLMStatusCode.LLM_ALREADY_LINK:
                # The peer keeps a link it already has, or its own simultaneous one: both do.
                return await self._adopt(cid, deadline if exc.yielded else 0.0, str(exc))
            reason = str(exc) or repr(exc)
            self.note_failure(cid, f"{ip}:{port}: {reason}")
            log.warning("link.failed", address=f"{ip}:{port}", reason=reason)
            return exc.code if isinstance(exc, HandshakeFailed) else LLMStatusCode.LLM_LINK_FAILED
        finally:
            self._linking.pop(cid, None)
            for n in nonces:
                gone = self._expect.pop(n, None)
                if gone is not None:
                    gone.abandoned = True
        link = self._register(sock, decoder, peer, access, auth, outbound=True)
        self.engine.spawn(link.run_reader)
        if hasattr(access, "ready"):  # NIXL: the peer's metadata is loaded before we return
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

    # ------------------------------------------------------------------ comm domains
    async def comm_link(self, comm_name: Any, cluster_rank_info: Any, rank_table: Any) -> int:
        """Validate, then set the domain's links up in the background; returns its id.

        Raises:
            TypeError / ValueError / LLMException(LLM_PARAM_INVALID): as ``LLMDataDist.link``.
        """
        check_isinstance("comm_name", comm_name, str)
        check_isinstance("cluster_rank_info", cluster_rank_info, dict)
        check_isinstance("rank_table", rank_table, str)
        raise_if_false(0 < len(comm_name) < 128, "comm_name must have 1 to 127 characters")
        raise_if_false(2 <= len(cluster_rank_info) <= 4, "a comm domain has 2 to 4 members")
        ranks = []
        for cid, rank in cluster_rank_info.items():
            check_uint64("cluster id", cid)
            check_uint32("rank", rank)
            ranks.append(int(rank))
        raise_if_false(ranks == sorted(set(ranks)), "ranks must be unique and ascending")
        me = self.engine.cluster_id
        raise_if_false(me in cluster_rank_info, f"this endpoint ({me}) is not in the rank map")
        addresses = _rank_addresses(comm_name, rank_table, self.engine.options.raw)
        for rank in ranks:
            raise_if_false(rank in addresses, f"rank {rank} has no device in the rank table")
        self._comm_ids += 1
        comm_id = self._comm_ids
        members = {int(c): (int(r), addresses[int(r)]) for c, r in cluster_rank_info.items()}
        self._comms[comm_id] = _Comm(members, RegisterMemStatus.PREPARING)
        self.engine.spawn(self._comm_job, comm_id)
        self.log.info("comm.link", comm_id=comm_id, comm_name=comm_name, members=len(members))
        return comm_id

    async def _comm_job(self, comm_id: int) -> None:
        comm = self._comms[comm_id]
        me = self.engine.cluster_id
        my_rank, my_addr = comm.members[me]
        budget = self.engine.options.link_total_time_s or 120
        listener: tuple[anyio.CancelScope, anyio.Event] | None = None
        try:
            with anyio.fail_after(budget):
                if any(r > my_rank for r, _ in comm.members.values()):
                    listener = await self._listen_extra(my_addr)
                for cid, (rank, addr) in sorted(comm.members.items(), key=lambda kv: kv[1][0]):
                    if rank >= my_rank or (cid in self.links and self.links[cid].alive):
                        continue
                    info = LLMClusterInfo()
                    info.remote_cluster_id = cid
                    info.append_local_ip_info(my_addr[0], 0)
                    info.append_remote_ip_info(addr[0], addr[1])
                    # Retry: the peer may not be listening yet.
                    ok = (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK)
                    while await self._link_one(info, 2.0) not in ok:  # noqa: ASYNC110
                        await anyio.sleep(0.05)
                while not all(
                    cid in self.links and self.links[cid].alive for cid in comm.members if cid != me
                ):
                    await self._link_added.wait()
            comm.status = RegisterMemStatus.OK
            self.engine.comm_linked = True
            self.log.info("comm.up", comm_id=comm_id)
        except TimeoutError:
            comm.status = RegisterMemStatus.FAILED
            self.log.warning("comm.failed", comm_id=comm_id, reason=f"not linked in {budget} s")
        except LLMException as exc:
            comm.status = RegisterMemStatus.FAILED
            self.log.warning("comm.failed", comm_id=comm_id, reason=str(exc))
        finally:
            if listener is not None:
                listener[0].cancel()
                await listener[1].wait()

    async def _listen_extra(
        self, address: tuple[str, int]
    ) -> tuple[anyio.CancelScope, anyio.Event]:
        """A temporary listener (for a comm domain's lower ranks)."""
        lsock = _bind_listener(address, 16, " for the comm domain")
        scope, closed = anyio.CancelScope(), anyio.Event()
        self.engine.spawn(
            self._accept_loop, lsock, scope, closed, self._accept_one, self._handshakes_full
        )
        return scope, closed

    def comm_status(self, comm_id: int) -> RegisterMemStatus:
        comm = self._comms.get(comm_id)
        raise_if_false(comm is not None, f"unknown comm_id {comm_id}")
        assert comm is not None
        return comm.status

    async def comm_unlink(self, comm_id: int) -> None:
        comm = self._comms.pop(comm_id, None)
        raise_if_false(comm is not None, f"unknown comm_id {comm_id}")
        assert comm is not None
        for cid in comm.members:
            link = self.links.get(cid)
            if link is not None and cid != self.engine.cluster_id:
                self.forget(link)
                await link.close(notify=True)

    async def close_all(self) -> None:
        await self.stop_listening()
        if self._uds_scope is not None:
            self._uds_scope.cancel()
            self._uds_scope = None
        if self._uds_name is not None:
            forget_side_channel(self._uds_name)
            self._uds_name = None
        for link in list(self.links.values()):
            self.forget(link)
            with contextlib.suppress(Exception):
                await link.close(notify=True)


class _Setup:
    """A connection in its server handshake (``LinkManager._setups``)."""

    def __init__(self, conn: socket.socket, source: str) -> None:
        self.conn = conn
        #: the client's IP address
        self.source = source
        #: cancelled to evict it
        self.scope = anyio.CancelScope()
        #: the client authenticated (without a key: sent a well-formed LINK_REQ)
        self.admitted = False


class _Expect:
    """A client handshake in progress, waiting for the server's side-channel proof."""

    def __init__(self, sock: socket.socket, side_key: bytes | None = None) -> None:
        self.sock = sock
        #: the link's side-channel key (keyed links): the server's PROVE must carry its MAC
        self.side_key = side_key
        self.done = False
        self.access: Any = None
        #: set once the exchange that claimed this handshake ended, either way
        self.finished = anyio.Event()
        #: the handshake is over: an access the exchange makes now has nobody to take it
        self.abandoned = False


def _bind_listener(address: tuple[str, int], backlog: int, purpose: str) -> socket.socket:
    """A non-blocking socket listening on exactly ``address``.

    Raises:
        LLMException: LLM_LINK_FAILED when the address cannot be bound.
    """
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind(address)
        lsock.listen(backlog)
        lsock.setblocking(False)
    except OSError as exc:
        lsock.close()
        raise LLMException(
            f"cannot listen on {address[0]}:{address[1]}{purpose}: {exc.strerror or exc}",
            status_code=LLMStatusCode.LLM_LINK_FAILED,
        ) from None
    return lsock


@dataclasses.dataclass
class _Comm:
    members: dict[int, tuple[int, tuple[str, int]]]  # cluster id -> (rank, address)
    status: RegisterMemStatus


def _rank_addresses(comm_name: str, rank_table: str, options: Any) -> dict[int, tuple[str, int]]:
    """Rank -> (ip, port) from an HCCL rank table (see ``LLMDataDist.link``).

    Raises:
        LLMException: LLM_PARAM_INVALID for a rank table without devices, IPs or ranks.
    """
    try:
        table = json.loads(rank_table)
    except json.JSONDecodeError as exc:
        raise_param(f"rank_table is not JSON: {exc}")
    raise_if_false(isinstance(table, dict), "rank_table must be a JSON object")
    base = options.get("llm.CommPortBase", "30000")
    raise_if_false(base.isdigit(), f"llm.CommPortBase must be a port number, got {base!r}")
    salt = 4 * (zlib.crc32(comm_name.encode()) % 8192)
    out: dict[int, tuple[str, int]] = {}
    for server in table.get("server_list") or []:
        for dev in (server or {}).get("device") or []:
            try:
                rank = int(dev["rank_id"])
                ip = str(dev.get("device_ip") or server.get("server_id"))
                socket.inet_aton(ip)
            except (KeyError, TypeError, ValueError, OSError):
                raise_param(f"rank table device entry without a usable rank_id/device_ip: {dev}")
            port = int(dev.get("llmdd_port") or int(base) + salt + rank)
            raise_if_false(0 < port < 65536, f"port {port} for rank {rank} is out of range")
            out[rank] = (ip, port)
    raise_if_false(out, "rank_table lists no devices (server_list[].device[])")
    return out
