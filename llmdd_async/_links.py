"""The engine's links: the listener, link/unlink of clusters, and choosing each link's transport."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import hmac
import json
import os
import socket
import zlib
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np

from ._checks import check_isinstance, check_uint32, check_uint64
from ._enums import LLMStatusCode, RegisterMemStatus
from ._errors import LLMException, raise_if_false, raise_param
from ._handshake import HandshakeFailed, client_handshake, connect_socket, server_handshake
from ._link import Link, LinkBroken, probe_token
from ._log import get_logger
from ._planner import check_within
from ._protocol import MAX_META, MT, Message, ProtocolError
from ._transports.in_process import InProcessAccess
from ._transports.same_host import SameHostAccess, host_identity, on_same_host, pvr_probe
from ._transports.tcp import configure_socket
from ._types import LLMClusterInfo, int_to_ip

__all__ = ["LinkManager"]

_ACCEPT_HANDSHAKE_S = 10.0
_PARALLEL_LINKS = 16
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
        self._linking: set[int] = set()
        self._listen_scope: anyio.CancelScope | None = None
        self._listen_closed: anyio.Event | None = None
        self.listen_address: tuple[str, int] | None = None
        self._probe = probe_token()
        self._host = host_identity()
        self._comms: dict[int, _Comm] = {}
        self._comm_ids = 0
        #: set (and replaced) whenever a link is registered
        self._link_added = anyio.Event()

    # ------------------------------------------------------------------ identity
    def identity(self) -> dict[str, Any]:
        """What this endpoint tells a peer about itself during the handshake."""
        e = self.engine
        pools = [
            {"fd": p.fd, "base": p.base, "size": p.nbytes}
            for p in e.pools.values()
            if hasattr(p, "fd")
        ]
        return {
            "cluster_id": e.cluster_id,
            "role": int(e.role),
            "remote_accessible": e.options.remote_accessible,
            "host": self._host,
            "pools": pools,
            "probe": [int(self._probe.ctypes.data), self._probe.tobytes().hex()],
            "transport": e.options.transport,
            "inproc": in_process_proof({"cluster_id": e.cluster_id, "host": self._host}),
        }

    def _make_access(self, peer: dict[str, Any]) -> Any:
        """How this side reaches the peer's memory directly, or None (stream only).

        Raises:
            HandshakeFailed: ``llm.Transport=same-host`` but the peer is elsewhere.
        """
        e = self.engine
        transport = e.options.transport
        if transport == "tcp" or not e.adapter.host_addressable:
            return None
        host = peer.get("host") or {}
        if not on_same_host(self._host, host):
            if transport == "same-host":
                raise HandshakeFailed(
                    f"llm.Transport=same-host, but cluster {peer.get('cluster_id')} runs on "
                    f"another host ({host.get('hostname')})"
                )
            return None
        pid = int(host["pid"])
        if pid == os.getpid():
            # Anyone on this host can claim our pid; only an endpoint of this very process
            # knows the process secret behind this proof.
            if not hmac.compare_digest(str(peer.get("inproc", "")), in_process_proof(peer)):
                raise HandshakeFailed("the peer claims to run in this process but cannot prove it")
            return InProcessAccess(e.adapter.copy)
        probe = peer.get("probe") or [0, ""]
        pvr = pvr_probe(pid, int(probe[0]), bytes.fromhex(str(probe[1])))
        access = SameHostAccess(pid, list(peer.get("pools") or []), pvr, e.adapter.copy)
        if not pvr:
            self.log.info(
                "transport.fallback",
                peer_cluster_id=peer.get("cluster_id"),
                reason="process_vm_readv is not permitted here: registered (non-pool) memory "
                "of this peer moves over TCP; pool memory is still shared",
            )
        return access

    def reachable_by_peer(self, caps: Any, ranges: np.ndarray, nbytes: np.ndarray) -> bool:
        """Can the initiator that sent ``caps`` copy these ranges of ours directly?"""
        if not isinstance(caps, dict):
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
        lsock = _bind_listener(address, 128, "")
        self.listen_address = lsock.getsockname()[:2]
        scope = anyio.CancelScope()
        self._listen_scope = scope
        self._listen_closed = closed = anyio.Event()
        self.engine.spawn(self._accept_loop, lsock, scope, closed)
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
        self, lsock: socket.socket, scope: anyio.CancelScope, closed: anyio.Event
    ) -> None:
        try:
            with scope:
                while True:
                    await anyio.wait_readable(lsock)
                    try:
                        conn, _ = lsock.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as exc:
                        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS):
                            self.log.warning("listen.accept_failed", error=str(exc))
                            await anyio.sleep(0.1)
                            continue
                        raise
                    self.engine.spawn(self._accept_one, conn)
        finally:
            lsock.close()
            closed.set()

    async def _accept_one(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        try:
            with anyio.fail_after(_ACCEPT_HANDSHAKE_S):
                decoder, peer, access = await server_handshake(self.engine, conn, self._make_access)
        except _HANDSHAKE_ERRORS as exc:
            # Whatever a hostile or broken client sends, it only loses its connection.
            self.log.info("link.refused", reason=str(exc))
            conn.close()
            return
        link = self._register(conn, decoder, peer, access)
        await link.run_reader()

    def _register(
        self, sock: socket.socket, decoder: Any, peer: dict[str, Any], access: Any
    ) -> Link:
        configure_socket(sock)
        decoder.set_max_meta(MAX_META)
        link = Link(self.engine, sock, decoder, peer, access)
        old = self.links.get(link.peer_cluster_id)
        if old is not None:
            # The peer linked again although we still had a link: ours is stale (upstream's
            # "force link"), e.g. the peer restarted. Its transfers fail with NOT_YET_LINK.
            self.engine.spawn(old.close, False)
        # A link that breaks or that the peer drops stays listed (as down) until this side
        # unlinks it, as upstream's link entities do: "on link faults, both sides must call"
        # unlink_clusters(force=True), and that must succeed.
        self.links[link.peer_cluster_id] = link
        added, self._link_added = self._link_added, anyio.Event()
        added.set()
        self.log.info(
            "link.up",
            peer_cluster_id=link.peer_cluster_id,
            transport=access.name if access is not None else "tcp",
        )
        return link

    def forget(self, link: Link) -> None:
        if self.links.get(link.peer_cluster_id) is link:
            del self.links[link.peer_cluster_id]

    # ------------------------------------------------------------------ link / unlink
    def get(self, cluster_id: int) -> Link:
        """The live link to ``cluster_id``.

        Raises:
            LLMException: LLM_NOT_YET_LINK when there is none.
        """
        link = self.links.get(cluster_id)
        if link is None or not link.alive:
            raise LLMException(
                f"cluster {self.engine.cluster_id} has no link to cluster {cluster_id}",
                status_code=LLMStatusCode.LLM_NOT_YET_LINK,
            )
        return link

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
        existing = self.links.get(cid)
        if existing is not None and existing.alive:
            return LLMStatusCode.LLM_ALREADY_LINK
        ip, port = int_to_ip(remotes[0][0]), remotes[0][1]
        self._linking.add(cid)
        sock: socket.socket | None = None
        try:
            with anyio.fail_after(timeout_s):
                sock = await connect_socket(ip, port)
                decoder, peer = await client_handshake(self.engine, sock, cid)
            access = self._make_access(peer)
        except _HANDSHAKE_ERRORS as exc:  # link_clusters reports, never raises
            log.info("link.failed", address=f"{ip}:{port}", reason=str(exc) or repr(exc))
            if sock is not None:
                sock.close()
            return exc.code if isinstance(exc, HandshakeFailed) else LLMStatusCode.LLM_LINK_FAILED
        finally:
            self._linking.discard(cid)
        link = self._register(sock, decoder, peer, access)
        self.engine.spawn(link.run_reader)
        return LLMStatusCode.LLM_SUCCESS

    async def unlink_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout_s: float, force: bool
    ) -> list[LLMStatusCode]:
        codes = []
        for info in clusters:
            cid = int(info.remote_cluster_id)  # type: ignore[arg-type]
            link = self.links.get(cid)
            if link is None:
                codes.append(LLMStatusCode.LLM_NOT_YET_LINK)
                continue
            code = LLMStatusCode.LLM_SUCCESS
            if not force:
                ack = None
                if link.alive:
                    with contextlib.suppress(LinkBroken):
                        ack = await link.roundtrip(Message(MT.UNLINK), MT.UNLINK_ACK, timeout_s)
                if ack is None:  # the peer could not be told; our side goes anyway
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
        self.engine.spawn(self._accept_loop, lsock, scope, closed)
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
        for link in list(self.links.values()):
            self.forget(link)
            with contextlib.suppress(Exception):
                await link.close(notify=True)


#: never leaves this process: proves that a peer claiming our pid really shares it
_PROCESS_SECRET = os.urandom(32)


def in_process_proof(identity: dict[str, Any]) -> str:
    """HMAC of an endpoint's identity under this process's secret."""
    host = identity.get("host") or {}
    text = f"{identity.get('cluster_id')}|{host.get('boot_id')}|{host.get('pid')}"
    return hmac.new(_PROCESS_SECRET, text.encode(), hashlib.sha256).hexdigest()


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
