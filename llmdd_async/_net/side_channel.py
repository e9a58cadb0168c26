"""The same-host side channel: proving that a linked peer is a process of this host (and of our
user) before either side lets the other reach its memory directly.

After the TCP handshake the server connects to the client's abstract ``AF_UNIX`` socket (named
in the handshake) and each side learns the other's process from the kernel (``local_peer``).
The exchange is bound to the TCP link by the handshake's nonces *and* the TCP connection's two
addresses seen mirrored from the other end, and, with ``llm.AuthKey``, by MACs under a key
derived from the handshake transcript, so a relay can neither make one honest endpoint act on
the other's memory nor win the exchange itself::

    server (accepted the link)                       client (its handshake waits)
    PROVE {nonces, tcp, mac}                  ->     (checks the binding and the MAC)
                                              <-     PROVE_ACK {status, pools, probe, caches,
                                                                mac} + pool descriptors
    PROVE_FIN {pools, probe, caches}          ->
      + pool descriptors

Only a process of this endpoint's effective uid gets anything; the accesses each side makes
of what the other sent come from the transport registry (``_transports.direct_access``).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import anyio
import numpy as np

from .._errors import HandshakeFailed, ProtocolError
from .._messages import (
    CacheInfo,
    Cap,
    Identity,
    Proof,
    Prove,
    ProveAck,
    ProveFin,
    tcp_binding_of,
)
from .._planner import check_within
from .._protocol import MT, Decoder
from .._transports import PeerAccess, direct_access, transport
from .handshake import Binding, send_message
from .host import LinkHost
from .local_peer import (
    close_fds,
    forget_side_channel,
    host_identity,
    is_own_side_channel,
    mac_ok,
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

__all__ = ["SideChannel", "probe_token"]

#: the same-host side channel's exchange (one local round trip)
_PROOF_S = 5.0
#: largest PROVE a client reads (nonces, the TCP binding and a MAC take a few hundred bytes)
_PROVE_META = 64 << 10
#: side-channel exchanges in progress at once (capped apart from the listener's handshakes,
#: so one kind of flood cannot starve the other); more connections are closed at once
_MAX_PROVING = 128


def probe_token() -> np.ndarray:
    """Random bytes a peer reads with process_vm_readv to prove it may reach our memory."""
    return np.frombuffer(os.urandom(16), dtype=np.uint8).copy()


class _Expect:
    """A client handshake in progress, waiting for the server's side-channel proof."""

    def __init__(self, sock: socket.socket, side_key: bytes | None = None) -> None:
        self.sock = sock
        #: the link's side-channel key (keyed links): the server's PROVE must carry its MAC
        self.side_key = side_key
        self.done = False
        self.access: PeerAccess | None = None
        #: set once the exchange that claimed this handshake ended, either way
        self.finished = anyio.Event()
        #: the handshake is over: an access the exchange makes now has nobody to take it
        self.abandoned = False


class SideChannel:
    """One engine's side channel: its socket, both sides of the exchange, and what a proven
    peer may reach of ours."""

    def __init__(self, engine: LinkHost, log: Any) -> None:
        self.engine = engine
        self.log = log
        #: what the handshake tells a peer about this host (a hint: proof comes from here)
        self.host = host_identity()
        self._probe = probe_token()
        #: client handshakes waiting for the server's proof, by nonces
        self._expect: dict[tuple[str, str], _Expect] = {}
        #: the abstract socket's name (in the handshake identity), None when closed
        self.name: str | None = None
        self._proving = 0

    # ------------------------------------------------------------------ the socket
    def allowed(self) -> bool:
        """This endpoint's ``llm.Transport`` lets it reach host memory directly."""
        e = self.engine
        spec = transport(e.options.transport)
        return spec is not None and spec.direct and e.adapter.host_addressable

    def open(self) -> socket.socket | None:
        """Bind the side channel (an abstract ``AF_UNIX`` socket: no file, gone with the
        process) when this endpoint may move bytes directly; the caller accepts on it with
        :meth:`serve` and :meth:`full`. None when it may not, or binding failed (logged)."""
        if not self.allowed() or not hasattr(socket, "AF_UNIX"):
            return None
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
            return None
        self.name = name
        return usock

    def close(self) -> None:
        """Forget the socket's name (the accept loop closes the socket)."""
        if self.name is not None:
            forget_side_channel(self.name)
            self.name = None

    def full(self, conn: socket.socket, addr: Any) -> bool:
        """True when ``_MAX_PROVING`` exchanges are in progress (the connection is closed)."""
        return self._proving >= _MAX_PROVING

    # ------------------------------------------------------------------ what a peer learns
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

    def _proof_wire(self, to_pid: int) -> tuple[Proof, list[int]]:
        """:meth:`_proof` as sent: each pool as ``(base, size)``, its descriptor passed with
        the message (same order). This very process gets no descriptors (it has them)."""
        proof = self._proof()
        pools = proof.get("pools") or []
        fds = [int(p[0]) for p in pools] if to_pid != os.getpid() else []
        probe = proof["probe"]
        caches = (CacheInfo.decode(c) for c in proof.get("caches") or [])
        typed = Proof(
            tuple((int(p[1]), int(p[2])) for p in pools) if fds else (),
            (int(probe[0]), str(probe[1])),
            tuple(c for c in caches if c is not None),
        )
        return typed, fds

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

    def _access_for(
        self,
        pid: int,
        pidfd: int | None,
        proof: Proof,
        fds: list[int],
        own_name: bool,
    ) -> PeerAccess | None:
        """:func:`direct_access` with this engine's memmove and log. Takes ``pidfd``."""
        return direct_access(pid, pidfd, proof, fds, own_name, self.engine.adapter.copy, self.log)

    def reachable_by_peer(self, caps: Any, ranges: np.ndarray, nbytes: np.ndarray) -> bool:
        """Can the initiator that sent ``caps`` copy these ranges of ours directly? Only
        memory of remote-accessible caches is reached directly this way (a pull by key of
        another cache: see ``grants._reads_itself``)."""
        # (a dict lookup by the wire's word: this runs for every request served; most claim
        # nothing, and then no range is looked at)
        if not isinstance(caps, dict) or not (
            caps.get(Cap.INPROC) or caps.get(Cap.PVR) or caps.get(Cap.POOLS)
        ):
            return False
        starts, ends = self.engine.registry.reachable_regions()
        if not check_within(ranges, nbytes, starts, ends):
            return False
        if caps.get(Cap.INPROC) or caps.get(Cap.PVR):
            return True
        pools = [p for p in self.engine.pools.values() if hasattr(p, "fd")]
        if not pools:
            return False
        order = sorted(pools, key=lambda p: p.base)
        starts = np.array([p.base for p in order], dtype=np.uint64)
        ends = starts + np.array([p.nbytes for p in order], dtype=np.uint64)
        return check_within(ranges, nbytes, starts, ends)

    def require_direct(self, peer: Identity, access: PeerAccess | None) -> None:
        """Raises HandshakeFailed when ``llm.Transport=same-host`` (direct only) meets a peer
        on another host. (A peer on this host that nothing could be proven about moves bytes
        over TCP, and the log says ``transport.fallback``.)"""
        spec = transport(self.engine.options.transport)
        if access is not None or spec is None or not spec.direct_only:
            return
        if not self.host.shares(peer.host):
            raise HandshakeFailed(
                f"llm.Transport={self.engine.options.transport} needs a peer on this host, but "
                f"cluster {peer.cluster_id} cannot share it: {self.host.difference(peer.host)}"
            )

    # ------------------------------------------------------------------ server side
    async def prove(self, peer: Identity, binding: Binding) -> PeerAccess | None:
        """The server side, when the client may share this host (its handshake named a side
        channel and did not ask for the stream only): the access to it, or None (logged as
        ``transport.fallback`` when the exchange failed)."""
        name = peer.uds
        spec = transport(peer.transport)
        if (
            not self.allowed()
            or name is None
            or (spec is not None and spec.stream_only)
            or not self.host.shares(peer.host)
        ):
            return None
        try:
            with anyio.fail_after(_PROOF_S):
                return await self._prove_to(name, binding)
        except (OSError, EOFError, ProtocolError, TimeoutError, ValueError) as exc:
            self.log.info("transport.fallback", peer_cluster_id=peer.cluster_id, reason=str(exc))
            return None

    async def _prove_to(self, name: str, binding: Binding) -> PeerAccess | None:
        """Connect to the client's socket, learn its process from the kernel, show it which
        TCP connection we mean (with a MAC under the link's side-channel key when keyed), and
        only once it confirmed that connection (and the key) exchange what each lets the other
        reach. Only a process of our uid gets anything.

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
            mac = None
            if binding.side_key is not None:
                mac = side_mac(binding.side_key, b"prove", nonces, tcp)
            prove = Prove((nonces[0], nonces[1]), tcp_binding_of(tcp), mac)
            await send_message(u, prove.encode())
            raw, fds = await recv_with_fds(u, Decoder(16 << 20), MT.PROVE_ACK)
            ack = ProveAck.decode(raw)
            if not ack.ok:
                return None
            if binding.side_key is not None and not mac_ok(
                side_mac(binding.side_key, b"ack", nonces, tcp), ack.mac
            ):
                raise ValueError("the side channel's answer lacks the link key's MAC")
            own = is_own_side_channel(name)
            usable = pid > 0 and (pid != os.getpid() or own)
            proof, ours = self._proof_wire(pid) if usable else (None, [])
            await send_with_fds(u, ProveFin(proof).encode(), ours)
            access = self._access_for(pid, pidfd, ack.proof or Proof(), fds, own)
            pidfd = None  # taken
            return access
        finally:
            u.close()
            close_fds(fds)  # a mapped pool holds its own reference
            if pidfd is not None:
                os.close(pidfd)

    # ------------------------------------------------------------------ client side
    def expect(self, binding: Binding) -> None:
        """A client handshake is about to tell the server our side channel: let the server's
        PROVE naming it in."""
        self._expect[binding.nonces] = _Expect(binding.sock, binding.side_key)

    async def proven(self, nonces: tuple[str, str], deadline: float) -> PeerAccess | None:
        """After the handshake: the access the server's exchange made for it (waiting, until
        ``deadline`` at most, for an exchange that claimed it to end), or None."""
        exp = self._expect.get(nonces)
        if exp is not None and exp.done:
            with anyio.move_on_after(min(_PROOF_S, deadline - anyio.current_time())):
                await exp.finished.wait()
        return exp.access if exp is not None else None

    def drop(self, nonces: tuple[str, str]) -> None:
        """The link did not come up: close the access its exchange made, if any."""
        exp = self._expect.get(nonces)
        if exp is not None and exp.access is not None:
            exp.access.close()

    def forget(self, nonces: tuple[str, str]) -> None:
        """The handshake is over: an exchange that ends later keeps nothing."""
        gone = self._expect.pop(nonces, None)
        if gone is not None:
            gone.abandoned = True

    async def serve(self, conn: socket.socket) -> None:
        """Answer a server of our uid that names one of our handshakes in progress, from the
        other end of that very TCP connection (and, on a keyed link, proves the key), with
        what we let it reach."""
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
                try:
                    prove: Prove | None = Prove.decode(msg)
                except ProtocolError:  # names no handshake of ours: refused like one
                    prove = None
                exp = self._expect.get(prove.nonces) if prove is not None else None
                tcp = tcp_binding(exp.sock, mirrored=True) if exp is not None else None
                if (
                    prove is None
                    or exp is None
                    or tcp is None
                    or exp.done
                    or prove.tcp != tcp_binding_of(tcp)
                    or (
                        exp.side_key is not None
                        and not mac_ok(
                            side_mac(exp.side_key, b"prove", prove.nonces, tcp), prove.mac
                        )
                    )
                ):
                    await send_message(conn, ProveAck(False).encode())
                    return
                if pid <= 0:  # nothing the kernel vouches for: describe nothing
                    await send_message(conn, ProveAck(False).encode())
                    return
                if not same_user(conn):
                    self.log.info("transport.fallback", reason=self._uid_reason(conn))
                    await send_message(conn, ProveAck(False).encode())
                    return
                exp.done = True
                claimed = exp
                proof, ours = self._proof_wire(pid)
                mac = None
                if exp.side_key is not None:
                    mac = side_mac(exp.side_key, b"ack", prove.nonces, tcp)
                await send_with_fds(conn, ProveAck(True, proof, mac).encode(), ours)
                # (the server's LINK_ACK may overtake what follows: the handshake waits for
                # ``finished``)
                raw, fds = await recv_with_fds(conn, decoder, MT.PROVE_FIN)
                fin = ProveFin.decode(raw)
                access = self._access_for(pid, pidfd, fin.proof or Proof(), fds, True)
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
