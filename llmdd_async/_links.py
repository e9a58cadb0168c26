"""The engine's links: the listener, link/unlink of clusters, and choosing each link's transport."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np

from ._enums import LLMStatusCode
from ._errors import LLMException
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
        ip, port = address
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind((ip, port))
            lsock.listen(128)
            lsock.setblocking(False)
        except OSError as exc:
            lsock.close()
            raise LLMException(
                f"cannot listen on {ip}:{port}: {exc.strerror or exc}",
                status_code=LLMStatusCode.LLM_LINK_FAILED,
            ) from None
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
                decoder, peer = await server_handshake(self.engine, conn)
            access = self._make_access(peer)
        except (HandshakeFailed, OSError, EOFError, ProtocolError, TimeoutError) as exc:
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
        self.links[link.peer_cluster_id] = link
        link.on_close(self.forget)
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
        if cid == self.engine.cluster_id:
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
        except HandshakeFailed as exc:
            log.info("link.failed", address=f"{ip}:{port}", reason=str(exc))
            if sock is not None:
                sock.close()
            return exc.code
        except (OSError, EOFError, ProtocolError, TimeoutError) as exc:
            log.info("link.failed", address=f"{ip}:{port}", reason=str(exc) or repr(exc))
            if sock is not None:
                sock.close()
            return LLMStatusCode.LLM_LINK_FAILED
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
            if not force and link.alive:
                try:
                    ack = await link.roundtrip(Message(MT.UNLINK), MT.UNLINK_ACK, timeout_s)
                except LinkBroken:
                    ack = None
                if ack is None:
                    code = LLMStatusCode.LLM_NOTIFY_PROMPT_UNLINK_FAILED
            self.forget(link)
            await link.close(notify=False)
            codes.append(code)
        return codes

    async def close_all(self) -> None:
        await self.stop_listening()
        for link in list(self.links.values()):
            self.forget(link)
            with contextlib.suppress(Exception):
                await link.close(notify=True)
