"""The connector's side channel: a small, bounded, authenticated control connection.

What it carries (JSON objects, never pickle), between a decode worker (client) and a prefill
worker (server), one connection per remote engine rank, made on first use and kept:

- ``welcome`` (server -> client, once): the prefill's metadata -- engine id, data endpoint
  (llmdd_async cluster id, host, port) and its KV layout, checked by the client before linking;
- ``done`` (client -> server): the decode finished pulling a request; the prefill frees its
  blocks (else the lease frees them);
- ``ids`` (client -> server, layer-wise mode): the decode's block ids for a request; the
  prefill then pushes each layer into them;
- ``cancel`` (client -> server): stop (or never start) that push; answered by ``pushed``;
- ``pushed`` (server -> client, layer-wise mode): every layer of a request landed (or failed).

``done``, ``ids`` and ``cancel`` name their request by its capability (``cap``, the
``llmdd_capability`` the prefill issued in ``kv_transfer_params``): a request id names nothing.

Why not a message over the llmdd_async link itself: the library's links move cache bytes only
(requests resolved against registered caches); a mailbox cache would need slot allocation
between many decoders and polling. A separate connection with the same trust rules is smaller.

Frames: a 4-byte big-endian length, then the JSON body; at most :data:`MAX_FRAME` bytes.
Authentication (when an auth key is set, on both sides): challenge/response with fresh nonces
from both sides (HMAC-SHA256 of the key), then every frame carries an HMAC of a per-connection
session key over its direction, sequence number and body, so frames cannot be forged, replayed
or reordered. A peer that fails any check is disconnected and learns nothing.

Limits (server): frames before the handshake is done are at most :data:`HANDSHAKE_FRAME`
bytes and must come within :data:`HANDSHAKE_S`; frames nest at most :data:`MAX_NESTING`
brackets; a malformed frame closes that connection (logged ``vllm.side_channel_closed``),
nothing else. When the server is full, the oldest connection that has proven nothing is
closed for a newcomer, so silent connections never lock a decode out.

Why this is not the library's framer (``_protocol.encode`` / ``Decoder`` with ``FrameAuth``,
as ``_net/handshake.py`` uses them), though both are authenticated framings:

- the bytes differ everywhere: here a big-endian u32 length, a JSON body and a 32-byte MAC;
  there a 32-byte little-endian header (magic, version, type, request id), a length-prefixed
  JSON meta with raw arrays, and a tag over header and meta. Reusing it would change every
  byte of the side channel (prefills and decodes of the last release could no longer talk;
  ``hello`` says ``v: 1``), which this redesign keeps as it is;
- the key schedule differs: a session key ``HMAC(key, "K" | server nonce | client nonce)``
  and, per frame, a MAC over direction byte, big-endian sequence number and body; a link
  derives one ``FrameAuth`` key per direction from its whole handshake transcript and tags
  a little-endian sequence number, header and meta. Moving to ``FrameAuth`` is a new
  authentication protocol (its own review, a version bump), not a refactor;
- the admission rules are this channel's own: a keyless connection proves itself only by
  presenting a valid capability (:meth:`ServerPeer.proved`), unproven ones have a 2 s
  deadline and are evicted oldest first; frames are 4 KiB before the handshake and 1 MiB
  after, with brackets counted before parsing. The link ``Decoder``'s limits (256 MiB meta,
  1 MiB of fields, a shared ``MetaBudget``) are sized for cache requests, not for this.

(The two run on different I/O, asyncio streams here on the connector's private loop, anyio
for links; the ``Decoder`` being sans-IO, that alone would not keep them apart.)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from .._errors import ControlError
from .._log import get_logger

__all__ = ["MAX_FRAME", "ControlClient", "ControlServer", "ServerPeer", "quietly"]

MAX_FRAME = 1 << 20
#: largest frame before the peer proved anything (hello / auth are a few hundred bytes)
HANDSHAKE_FRAME = 4096
MAX_CONNECTIONS = 256
#: connections of one source address that have not proven anything yet
MAX_UNPROVEN_PER_SOURCE = 64
#: seconds a connection has to prove itself (finish the handshake; keyless: present a valid
#: capability) before it is closed
HANDSHAKE_S = 2.0
#: most ``[`` / ``{`` in one frame: ours nest two deep; json's recursion is never reached
MAX_NESTING = 256
_MAC = 32
_VERSION = 1

log = get_logger("vllm")


async def quietly(send: Awaitable[None]) -> None:
    """Await a send whose failure only means that the peer is gone (nothing to tell it)."""
    with contextlib.suppress(Exception):
        await send


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


class _Conn:
    """One framed, optionally authenticated, connection."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client: bool
    ) -> None:
        self.reader, self.writer = reader, writer
        self.session: bytes | None = None
        self._out_dir, self._in_dir = (b"c", b"s") if client else (b"s", b"c")
        self._out_seq = self._in_seq = 0
        self._lock = asyncio.Lock()
        self.limit = HANDSHAKE_FRAME  # raised once the handshake is done
        self.proven = False
        self.source = ""

    async def send(self, obj: dict[str, Any]) -> None:
        body = json.dumps(obj, separators=(",", ":")).encode()
        if self.session is not None:
            body += _mac(self.session, self._out_dir, struct.pack(">Q", self._out_seq), body)
            self._out_seq += 1
        if len(body) > MAX_FRAME:
            raise ControlError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
        async with self._lock:
            self.writer.write(struct.pack(">I", len(body)) + body)
            await self.writer.drain()

    async def recv(self) -> dict[str, Any]:
        """The next frame's object.

        Raises:
            ControlError: closed, over the size limit, bad MAC, malformed or too deep JSON.
        """
        try:
            (n,) = struct.unpack(">I", await self.reader.readexactly(4))
            if n > self.limit:
                raise ControlError(f"peer sent a frame of {n} bytes (limit {self.limit})")
            body = await self.reader.readexactly(n)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise ControlError("side channel closed by the peer") from e
        if self.session is not None:
            if len(body) < _MAC:
                raise ControlError("frame without authentication")
            body, mac = body[:-_MAC], body[-_MAC:]
            want = _mac(self.session, self._in_dir, struct.pack(">Q", self._in_seq), body)
            if not hmac.compare_digest(mac, want):
                raise ControlError("frame authentication failed")
            self._in_seq += 1
        # counted before parsing: json recurses per level (a deep frame would raise
        # RecursionError, and costs time before it does)
        if body.count(b"[") + body.count(b"{") > MAX_NESTING:
            raise ControlError("malformed frame (nested too deep)")
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as e:
            raise ControlError("malformed frame") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
            raise ControlError("malformed frame")
        return obj

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


Handler = Callable[["ServerPeer", dict[str, Any]], Awaitable[None]]


class ServerPeer:
    """A connected client, as the server's handler sees it."""

    def __init__(self, conn: _Conn, address: str) -> None:
        self._conn = conn
        self.address = address

    async def send(self, obj: dict[str, Any]) -> None:
        await self._conn.send(obj)

    def proved(self) -> None:
        """The peer showed it is a decode (a valid capability): never evicted for a newcomer,
        no deadline. A keyed peer has proven itself with the handshake already."""
        self._conn.proven = True

    @property
    def closed(self) -> bool:
        return self._conn.writer.is_closing()


class ControlServer:
    """Accepts decode workers; ``handler`` gets every message after the welcome.

    Connections that have not proven anything (keyed: the handshake; keyless: a capability
    the handler accepted, see :meth:`ServerPeer.proved`) get :data:`HANDSHAKE_S` seconds and
    handshake-sized frames; when :data:`MAX_CONNECTIONS` are open, or
    :data:`MAX_UNPROVEN_PER_SOURCE` unproven ones of one address, the oldest unproven one is
    closed for the newcomer (so silent connections never lock a decode out).
    """

    def __init__(
        self,
        key: str | None,
        meta: Callable[[], dict[str, Any]],
        handler: Handler,
        timeout_s: float = 10.0,
        handshake_s: float = HANDSHAKE_S,
    ) -> None:
        """``timeout_s``: the transfer timeout; an unproven connection's deadline is
        ``handshake_s`` or that, whichever is shorter."""
        self._key = key.encode() if key else None
        self._meta = meta
        self._handler = handler
        self._handshake_s = min(handshake_s, timeout_s)
        self._server: asyncio.AbstractServer | None = None
        #: open connections, oldest first
        self._conns: dict[_Conn, None] = {}
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(
            self._serve, host, port, limit=MAX_FRAME, backlog=1024
        )
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            c.close()
        self._conns.clear()

    def _admit(self, conn: _Conn) -> bool:
        """Make room for ``conn``: evict the oldest unproven connection of its source when it
        has too many, then the oldest unproven one when the server is full. False: full of
        proven connections."""
        same = [c for c in self._conns if not c.proven and c.source == conn.source]
        if len(same) >= MAX_UNPROVEN_PER_SOURCE:
            self._evict(same[0])
        if len(self._conns) >= MAX_CONNECTIONS:
            old = next((c for c in self._conns if not c.proven), None)
            if old is None:
                return False
            self._evict(old)
        self._conns[conn] = None
        return True

    def _evict(self, conn: _Conn) -> None:
        self._conns.pop(conn, None)
        conn.close()
        log.info("vllm.side_channel_evicted", peer=conn.source)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(reader, writer, client=False)
        peername = writer.get_extra_info("peername")
        conn.source = str(peername[0]) if isinstance(peername, tuple) else str(peername)
        if not self._admit(conn):
            conn.close()
            log.info("vllm.side_channel_full", peer=conn.source)
            return
        peer = ServerPeer(conn, str(peername))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._handshake_s
        try:
            sn = os.urandom(16)
            await conn.send(
                {"op": "hello", "v": _VERSION, "nonce": sn.hex(), "auth": self._key is not None}
            )
            auth = await asyncio.wait_for(conn.recv(), max(0.0, deadline - loop.time()))
            cn = bytes.fromhex(str(auth.get("nonce", "")))
            if auth["op"] != "auth" or len(cn) != 16:
                raise ControlError("not an auth frame")
            reply: dict[str, Any] = {"op": "welcome"}
            if self._key is not None:
                mac = bytes.fromhex(str(auth.get("mac") or ""))
                if not hmac.compare_digest(mac, _mac(self._key, b"C", sn, cn)):
                    raise ControlError("authentication failed")  # the peer learns nothing
                reply["mac"] = _mac(self._key, b"S", sn, cn).hex()
                conn.proven = True
            reply["meta"] = self._meta()
            await conn.send(reply)
            if self._key is not None:
                conn.session = _mac(self._key, b"K", sn, cn)
            conn.limit = MAX_FRAME
            while True:
                if conn.proven:
                    msg = await conn.recv()
                else:  # keyless, nothing valid yet: the handshake's deadline still runs
                    msg = await asyncio.wait_for(conn.recv(), max(0.0, deadline - loop.time()))
                await self._handler(peer, msg)
        except (
            ControlError,
            ValueError,
            KeyError,
            TypeError,
            OSError,
            RecursionError,
            asyncio.TimeoutError,
        ) as e:
            log.info("vllm.side_channel_closed", peer=conn.source, reason=repr(e))
            return
        finally:
            self._conns.pop(conn, None)
            conn.close()


class ControlClient:
    """A decode worker's connection to one prefill rank."""

    def __init__(self, key: str | None) -> None:
        self._key = key.encode() if key else None
        self._conn: _Conn | None = None
        self.meta: dict[str, Any] = {}

    async def connect(self, host: str, port: int, timeout_s: float) -> dict[str, Any]:
        """Connect, authenticate, and return the server's metadata.

        Raises:
            ControlError: refused, closed, timed out, or authentication failed.
        """
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=MAX_FRAME), timeout_s
            )
        except (OSError, asyncio.TimeoutError) as e:
            raise ControlError(f"cannot reach side channel {host}:{port}: {e!r}") from e
        conn = _Conn(reader, writer, client=True)
        conn.limit = 1 << 16  # the welcome carries the prefill's layout
        try:
            hello = await asyncio.wait_for(conn.recv(), timeout_s)
            sn = bytes.fromhex(str(hello.get("nonce", "")))
            if hello["op"] != "hello" or hello.get("v") != _VERSION or len(sn) != 16:
                raise ControlError(f"{host}:{port} is not an llmdd_async vLLM side channel")
            if bool(hello.get("auth")) != (self._key is not None):
                raise ControlError(
                    f"{host}:{port}: auth_key is set on "
                    f"{'the prefill only' if hello.get('auth') else 'this side only'}"
                )
            cn = os.urandom(16)
            auth: dict[str, Any] = {"op": "auth", "nonce": cn.hex()}
            if self._key is not None:
                auth["mac"] = _mac(self._key, b"C", sn, cn).hex()
            await conn.send(auth)
            welcome = await asyncio.wait_for(conn.recv(), timeout_s)
            if welcome["op"] != "welcome":
                raise ControlError(f"{host}:{port}: refused")
            if self._key is not None:
                mac = bytes.fromhex(str(welcome.get("mac") or ""))
                if not hmac.compare_digest(mac, _mac(self._key, b"S", sn, cn)):
                    raise ControlError(f"{host}:{port}: the prefill failed authentication")
                conn.session = _mac(self._key, b"K", sn, cn)
            conn.limit = MAX_FRAME
        except ControlError:
            conn.close()
            raise
        except (asyncio.TimeoutError, KeyError, ValueError, TypeError, RecursionError) as e:
            conn.close()
            raise ControlError(
                f"side channel {host}:{port} closed the handshake (wrong auth_key?): {e!r}"
            ) from e
        self._conn = conn
        self.meta = dict(welcome.get("meta") or {})
        return self.meta

    async def send(self, obj: dict[str, Any]) -> None:
        if self._conn is None:
            raise ControlError("not connected")
        await self._conn.send(obj)

    async def recv(self) -> dict[str, Any]:
        if self._conn is None:
            raise ControlError("not connected")
        return await self._conn.recv()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
