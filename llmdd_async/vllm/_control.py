"""The connector's side channel: a small, bounded, authenticated control connection.

What it carries (JSON objects, never pickle), between a decode worker (client) and a prefill
worker (server), one connection per remote engine rank, made on first use and kept:

- ``welcome`` (server -> client, once): the prefill's metadata -- engine id, data endpoint
  (llmdd_async cluster id, host, port) and its KV layout, checked by the client before linking;
- ``done`` (client -> server): the decode finished pulling a request; the prefill frees its
  blocks (else the lease frees them);
- ``ids`` (client -> server, layer-wise mode): the decode's block ids for a request, matched by
  request id on the prefill, which then pushes each layer into them;
- ``pushed`` (server -> client, layer-wise mode): every layer of a request landed (or failed).

Why not a message over the llmdd_async link itself: the library's links move cache bytes only
(requests resolved against registered caches); a mailbox cache would need slot allocation
between many decoders and polling. A separate connection with the same trust rules is smaller.

Frames: a 4-byte big-endian length, then the JSON body; at most :data:`MAX_FRAME` bytes.
Authentication (when an auth key is set, on both sides): challenge/response with fresh nonces
from both sides (HMAC-SHA256 of the key), then every frame carries an HMAC of a per-connection
session key over its direction, sequence number and body, so frames cannot be forged, replayed
or reordered. A peer that fails any check is disconnected and learns nothing.
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

__all__ = ["MAX_FRAME", "ControlClient", "ControlError", "ControlServer"]

MAX_FRAME = 1 << 20
MAX_CONNECTIONS = 256
_MAC = 32
_VERSION = 1


class ControlError(Exception):
    """The side channel failed (refused, closed, bad frame, authentication)."""


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
        try:
            (n,) = struct.unpack(">I", await self.reader.readexactly(4))
            if n > MAX_FRAME:
                raise ControlError(f"peer sent a frame of {n} bytes (limit {MAX_FRAME})")
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
        try:
            obj = json.loads(body)
        except ValueError as e:
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

    @property
    def closed(self) -> bool:
        return self._conn.writer.is_closing()


class ControlServer:
    """Accepts decode workers; ``handler`` gets every message after the welcome."""

    def __init__(
        self,
        key: str | None,
        meta: Callable[[], dict[str, Any]],
        handler: Handler,
        timeout_s: float = 10.0,
    ) -> None:
        self._key = key.encode() if key else None
        self._meta = meta
        self._handler = handler
        self._timeout = timeout_s
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[_Conn] = set()
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_FRAME)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            c.close()
        self._conns.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(reader, writer, client=False)
        if len(self._conns) >= MAX_CONNECTIONS:
            conn.close()
            return
        self._conns.add(conn)
        peer = ServerPeer(conn, str(writer.get_extra_info("peername")))
        try:
            sn = os.urandom(16)
            await conn.send(
                {"op": "hello", "v": _VERSION, "nonce": sn.hex(), "auth": self._key is not None}
            )
            auth = await asyncio.wait_for(conn.recv(), self._timeout)
            cn = bytes.fromhex(str(auth.get("nonce", "")))
            if auth["op"] != "auth" or len(cn) != 16:
                return
            reply: dict[str, Any] = {"op": "welcome"}
            if self._key is not None:
                mac = bytes.fromhex(str(auth.get("mac") or ""))
                if not hmac.compare_digest(mac, _mac(self._key, b"C", sn, cn)):
                    return  # learns nothing
                reply["mac"] = _mac(self._key, b"S", sn, cn).hex()
            reply["meta"] = self._meta()
            await conn.send(reply)
            if self._key is not None:
                conn.session = _mac(self._key, b"K", sn, cn)
            while True:
                msg = await conn.recv()
                await self._handler(peer, msg)
        except (ControlError, ValueError, KeyError, TypeError, OSError, asyncio.TimeoutError):
            return
        finally:
            self._conns.discard(conn)
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
        except ControlError:
            conn.close()
            raise
        except (asyncio.TimeoutError, KeyError, ValueError, TypeError) as e:
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
